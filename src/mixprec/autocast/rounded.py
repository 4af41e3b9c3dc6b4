"""Emulation's rounding, and not rounding a value twice.

``x.to(low).to(float32)`` rounds bit-exactly as a real cast (RNE, fp16's overflow and subnormals included); the
casts are autograd ops, so gradients are rounded too. :func:`round_result` marks low ops' rounded results (low
dtype, version counter), :func:`call_exact` carries the mark through :data:`EXACT_OPS` (no arithmetic), and the
emulating ``to_low`` passes a marked operand through unless its version moved. ``relu`` is left out so that
doctor's precision map, which follows low-format values through views and copies only, still sees the next linear.

Gradients: a skipped rounding moves the gradient's from "round per use, then sum" to "sum, then round once"; the
two agree when the uses read disjoint parts of the value (q, k, v slicing one projection), as in every built-in
model (tests check whole steps bit for bit); otherwise it is within emulation's documented difference.
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
#: Functions (by ``__name__``) whose output holds low-format values when their input does (no arithmetic).
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
    # .bfloat16()/.half() run the same aten::_to_copy as .to(dtype), without Tensor.to's overload resolution
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
