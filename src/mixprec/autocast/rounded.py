"""Emulation's rounding, and not rounding a value twice.

Rounding (``emulate=True``): ``x.to(low).to(float32)`` rounds an fp32 value to the nearest value of
the low format with round-to-nearest-even, bit-exactly as a real cast would, and widens it back;
fp16's overflow to inf above 65504 and its subnormals come with it. It costs two cast kernels
forward and, because the casts are autograd ops, two more on the gradient in backward (which is how
the gradient gets fp16's rounding and range too).

A low op's operand is often a value that is already in the low format: attention's q/k/v are views
of the rounded in-projection, the out-projection's input is a permuted copy of attention's rounded
result. Rounding those again changes no value, so :func:`round_result` *marks* the rounded results
of low ops (a tensor attribute: the low dtype and the tensor's version counter), :func:`call_exact`
carries the mark through ops that select or move values without arithmetic (views, reshapes,
permutations, basic indexing, contiguous copies), and the emulating ``to_low`` passes a marked
operand through whose version counter has not moved since (an in-place op bumps it, so ``h += 1``
un-marks ``h``). On the transformer this saves 32 of 190 casts per training step.

``relu`` also maps low-format values onto low-format values (the MLP's hidden layers would save 8 of
46 casts), but it is left out: ``mixprec doctor``'s precision map recognises an emulated matmul by
following low-format values through views and copies only, and would report the next linear as fp32.

Gradients: skipping an operand's rounding moves its gradient's rounding from "per use, then sum the
uses" to "sum the uses, then round once" at the op that made the value. The two agree when the value
has one use, or uses that read disjoint parts of it (q, k and v slicing one projection), as in every
built-in model (tests check whole training steps bit for bit). A value that also has another,
overlapping use (a residual on a view that feeds a linear) gets a gradient rounded once instead of
twice -- within emulation's documented difference from native fp16 (ops off the low
list run in fp32, so emulation is slightly more accurate than the real thing).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["TAG", "SKIP_ROUNDED_OPERANDS", "EXACT_OPS", "round_to", "round_result", "call_exact"]

#: Tensor attribute marking a value already in a low format: ``(low dtype, version counter)``.
TAG = "_mixprec_rounded"
#: Whether emulating frames built from now on pass marked operands through (tests turn it off to
#: compare both ways).
SKIP_ROUNDED_OPERANDS = True
#: Functions (by ``__name__``) whose output holds low-format values when their input does, and
#: that do no arithmetic (see the module docstring on relu).
EXACT_OPS = frozenset({
    "view", "view_as", "reshape", "reshape_as", "flatten", "unflatten",
    "transpose", "permute", "t", "unsqueeze", "squeeze", "contiguous", "clone", "detach",
    "select", "narrow", "unbind", "chunk", "split", "__getitem__",
})

_F32 = torch.float32
_Tensor = torch.Tensor
_SEQUENCES = (list, tuple)
_BASIC_INDEX = (int, slice, type(None), type(Ellipsis))


def round_to(t: torch.Tensor, low: torch.dtype) -> torch.Tensor:
    """Round to the nearest value of the ``low`` format (RNE), returned as float32."""
    if t.dtype is low:
        return t.float()
    # .bfloat16()/.half()/.float() run the same aten::_to_copy as .to(dtype) but skip the
    # overload resolution of Tensor.to in the Python binding (about 3 us less per cast)
    return (t.bfloat16() if low is torch.bfloat16 else t.half()).float()


def round_result(out: Any, low: torch.dtype) -> Any:
    """``out`` (a tensor or a list/tuple of them) with every fp32 tensor rounded to ``low``, marked."""
    if isinstance(out, _Tensor):
        if out.dtype is not _F32:
            return out
        r = round_to(out, low)
        setattr(r, TAG, (low, r._version))
        return r
    if type(out) in _SEQUENCES:
        return type(out)(round_result(o, low) for o in out)
    return out


def _mark(out: Any, low: torch.dtype) -> None:
    if isinstance(out, _Tensor):
        if out.dtype is _F32:
            setattr(out, TAG, (low, out._version))
    elif type(out) in _SEQUENCES:
        for o in out:
            _mark(o, low)


def _basic_index(index: Any) -> bool:
    """Indexing that selects without repeating elements (no tensors or lists of indices)."""
    if type(index) is tuple:
        return all(isinstance(i, _BASIC_INDEX) for i in index)
    return isinstance(index, _BASIC_INDEX)


def call_exact(func: Callable, args: tuple, kwargs: dict, low: torch.dtype) -> Any:
    """``func(*args, **kwargs)`` for an :data:`EXACT_OPS` function; the mark carries over."""
    src = args[0] if args else None
    tag = getattr(src, TAG, None)
    marked = (tag is not None and tag[0] is low and tag[1] == src._version
              and (len(args) < 2 or func.__name__ != "__getitem__" or _basic_index(args[1])))
    out = func(*args, **kwargs)
    if marked:
        _mark(out, low)
    return out
