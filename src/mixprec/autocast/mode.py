"""The TorchFunctionMode that applies the top frame's policy to every torch-API call.

``__torch_function__`` maps the function to an ATen op name (:mod:`.ops`), looks it up in the top frame's table,
casts the arguments (:mod:`.casts`) and calls. Casting above autograd makes the casts differentiable and lets
autograd save the low-precision copies for backward. Every torch call in the context makes this Python round
trip, so it is written for speed: the common cases first, no dicts built, no helpers called.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from .policy import CastKind

from . import composites
from .casts import F32, iter_tensors, map_args, map_tensors
from .frame import EXACT, RESOLVE, STATE, UNSEEN, WIDEN
from .ops import BANNED_MESSAGE, RENAME
from .rounded import call_exact, round_result
from .widen import call_widened

__all__ = ["PolicyMode"]

_LOW, _FP32, _FP32_OUT, _PROMOTE, _BANNED, _COMPOSITE = (
    CastKind.LOW, CastKind.FP32, CastKind.FP32_OUT, CastKind.PROMOTE, CastKind.BANNED,
    CastKind.COMPOSITE,
)
_state = STATE
_UNSEEN = UNSEEN
_RESOLVE = RESOLVE
_WIDEN = WIDEN
_EXACT = EXACT
_F32 = F32
_map_args = map_args
_map_tensors = map_tensors
_round_result = round_result


class PolicyMode(TorchFunctionMode):
    """Applies the top frame of the thread's frame stack to every torch-API call."""

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        # The hot path: every torch call in the context comes through here, so the common cases
        # (an op left alone; a low-list op called without keywords, e.g. F.linear) come first
        # and build no dicts.
        frames = _state.frames
        if not frames:
            return func(*args, **kwargs) if kwargs else func(*args)
        frame = frames[-1]
        kind = frame.by_func.get(func, _UNSEEN)
        if kind is _UNSEEN:
            kind = frame.kind_of(func)  # None for every function while the frame is disabled
        if kind is None:
            return func(*args, **kwargs) if kwargs else func(*args)
        if not kwargs:
            if kind is _LOW:
                args = _map_args(args, frame.to_low)
                if frame.emulate:
                    return _round_result(func(*args), frame.dtype)
                return func(*args)
            kwargs = {}
        elif kwargs.get("out") is not None:  # out= overloads: not autocast, as in torch
            return func(*args, **kwargs)
        if kind is _WIDEN:  # an unlisted op in an emulating or kept-fp32 frame
            return call_widened(func, args, kwargs, frame.eligible)
        if kind is _EXACT:  # emulating: a view of a value already in the low format stays so
            return call_exact(func, args, kwargs, frame.dtype)
        if kind is _RESOLVE:
            kind = frame.kinds.get(RENAME[func.__name__](args, kwargs))
            if kind is None:
                if frame.widen:
                    return call_widened(func, args, kwargs, frame.eligible)
                return func(*args, **kwargs)

        if kind is _LOW:
            args, kwargs = _map_tensors(args, kwargs, frame.to_low)
            if frame.emulate:
                return _round_result(func(*args, **kwargs), frame.dtype)
            return func(*args, **kwargs)

        if kind is _FP32:
            args, kwargs = _map_tensors(args, kwargs, frame.to_fp32)
            return func(*args, **kwargs)

        if kind is _FP32_OUT:
            first = args[0] if args else kwargs.get("input")
            if (isinstance(first, torch.Tensor) and first.dtype is not _F32
                    and frame.eligible(first) and kwargs.get("dtype") is None
                    and not any(isinstance(a, torch.dtype) for a in args)):
                kwargs = {**kwargs, "dtype": _F32}
            return func(*args, **kwargs)

        if kind is _PROMOTE:
            widest = None
            for t in iter_tensors(args, kwargs):
                if frame.eligible(t):
                    if widest is None:
                        widest = t.dtype
                    elif t.dtype is not widest:
                        widest = _F32  # fp32 wins; fp16 mixed with bf16 also goes to fp32
            if widest is not None:
                eligible = frame.eligible
                args, kwargs = _map_tensors(
                    args, kwargs,
                    lambda t: t.to(widest) if t.dtype is not widest and eligible(t) else t)
            return func(*args, **kwargs)

        if kind is _COMPOSITE:
            body = composites.body(func, args, kwargs, frame.eligible)
            if body is None:
                return func(*args, **kwargs)
            with self:  # re-enter: the body's inner calls come back through this mode
                return body(*args, **kwargs)

        if kind is _BANNED and any(frame.eligible(t) for t in iter_tensors(args, kwargs)):
            raise RuntimeError(
                f"{func.__name__} is banned inside mixprec autocast({frame.dtype}, device_type="
                f"{frame.device_type!r}): "
                + BANNED_MESSAGE.get(func.__name__, "the policy lists it as unsafe.")
            )
        return func(*args, **kwargs)
