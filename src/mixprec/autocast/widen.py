"""Emulation's fp32 carriers meeting real low-precision tensors: widen the low ones, exactly.

Under ``emulate=True`` a model may also hold real fp16/bf16 tensors (``*-master`` parameters and buffers), which
many kernels refuse to mix with fp32 (CPU norms raise "mixed dtype"). In an emulating frame, an op on no list
whose floating tensors mix fp32 with fp16/bf16 gets the low ones widened to fp32 first: exact, so the op computes
in fp32 on the same values, and an autograd op, so the gradient reaching an fp16 parameter is rounded to fp16 as
in real fp16. Ops whose tensors are all low, and attribute accesses, are left alone. Values written into a widened
tensor (an in-place method; a norm's running statistics) are copied back into the original, rounded to its dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .casts import F32, map_tensors

__all__ = ["call_widened"]

_NARROW = frozenset({torch.float16, torch.bfloat16})
_Tensor = torch.Tensor
_SEQUENCES = (list, tuple)
# ops that update running statistics passed in as arguments, without bumping their version
_UPDATES_ARGUMENTS = frozenset({"batch_norm", "instance_norm"})


def _dtypes(values: Any, found: set[torch.dtype]) -> None:
    for a in values:
        if isinstance(a, _Tensor):
            found.add(a.dtype)
        elif type(a) in _SEQUENCES:
            for x in a:
                if isinstance(x, _Tensor):
                    found.add(x.dtype)


def _has_narrow(values: Any) -> bool:
    for a in values:
        if isinstance(a, _Tensor):
            if a.dtype in _NARROW:
                return True
        elif type(a) in _SEQUENCES:
            for x in a:
                if isinstance(x, _Tensor) and x.dtype in _NARROW:
                    return True
    return False


def call_widened(func: Callable, args: tuple, kwargs: dict,
                 eligible: Callable[[torch.Tensor], bool]) -> Any:
    """``func(*args, **kwargs)``, with fp16/bf16 tensors widened where they meet an fp32 tensor."""
    if not (_has_narrow(args) or (kwargs and _has_narrow(kwargs.values()))):
        return func(*args, **kwargs)  # the common case under emulation: fp32 carriers only
    found: set[torch.dtype] = set()
    _dtypes(args, found)
    _dtypes(kwargs.values(), found)
    if F32 not in found:
        return func(*args, **kwargs)
    widened: list[tuple[torch.Tensor, torch.Tensor, int]] = []

    def widen(t: torch.Tensor) -> torch.Tensor:
        if t.dtype not in _NARROW or not eligible(t):
            return t
        w = t.float()
        widened.append((t, w, w._version))
        return w

    args, kwargs = map_tensors(args, kwargs, widen)
    out = func(*args, **kwargs)
    updates = getattr(func, "__name__", None) in _UPDATES_ARGUMENTS
    for original, wide, version in widened:
        if wide._version != version or (updates and not original.requires_grad):
            _write_back(original, wide)
            if out is wide:
                out = original
    return out


def _write_back(original: torch.Tensor, wide: torch.Tensor) -> None:
    """Copy ``wide`` into ``original`` (rounding); differentiably if it requires grad."""
    if original.requires_grad:
        original.copy_(wide)  # a leaf raises here, as the in-place op on it would have
    else:
        with torch.no_grad():
            original.copy_(wide)
