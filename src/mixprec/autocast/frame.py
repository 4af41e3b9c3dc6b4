"""Frames, the per-thread state, and the weight-cast cache.

A *frame* is what the mode does while it is on top of the thread's frame stack: the policy's
``{op name: CastKind}`` table, the low dtype, emulation, and the per-tensor casts built from them (closures:
the hot path). Nested contexts push frames and the mode obeys the top one, as with ``torch.autocast``; a
``keep_fp32`` module pushes :meth:`Frame.forced_fp32` while it runs.

Weight-cast cache: the low-precision copy of a parameter (a leaf that requires grad) is made once and reused
until the outermost context exits, as in ``torch.autocast``. It is keyed by ``(low dtype, emulate, grad mode)``:
a cast made under ``no_grad`` has no autograd history and is never reused with grad enabled.
"""

from __future__ import annotations

import functools
import threading
import types
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .policy import CastKind, CastPolicy

from . import rounded
from .casts import F32
from .ops import RENAME

__all__ = ["Frame", "STATE", "frame_for", "clear_cache", "is_autocast_active", "autocast_dtype",
           "RESOLVE", "WIDEN", "EXACT", "UNSEEN"]

MAX_MEMO = 4096  # bound on memo tables keyed by objects the user may create per step
RESOLVE = object()  # a kind: the op name depends on the call's arguments (see ops.RENAME)
WIDEN = object()  # a kind: an unlisted op in a widening frame (see widen.py)
EXACT = object()  # a kind: an unlisted op whose output keeps its input's low-format values (rounded.py)
UNSEEN = object()  # Frame.by_func's default
_STABLE_FUNCTION_TYPES = (
    types.BuiltinFunctionType, types.FunctionType, types.MethodDescriptorType,
    types.WrapperDescriptorType,
)

# like at::autocast::is_eligible: floating but not fp64 (and on the autocast's device type)
_ELIGIBLE_DTYPES = frozenset(
    d for d in vars(torch).values()
    if isinstance(d, torch.dtype) and d.is_floating_point and d is not torch.float64
)


class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.frames: list[Frame] = []
        # weight-cast cache: {(low dtype, emulate, grad enabled): {id(param): (param, cast)}};
        # the inner dicts are emptied when the outermost context exits
        self.cache: dict[tuple, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.mode: Any = None  # the mode (mode.PolicyMode), while it is on the torch-function stack
        self.frame_cache: dict[tuple, Frame] = {}  # frames are reused across context entries


#: This thread's frames, cache and mode.
STATE = _ThreadState()


def is_autocast_active() -> bool:
    """True inside an enabled mixprec autocast in this thread."""
    frames = STATE.frames
    return bool(frames) and frames[-1].enabled


def autocast_dtype() -> torch.dtype | None:
    """The low dtype of the innermost enabled mixprec autocast in this thread, else None."""
    return STATE.frames[-1].dtype if is_autocast_active() else None


def clear_cache() -> None:
    for entries in STATE.cache.values():
        if entries:
            entries.clear()


def frame_for(enabled: bool, policy: CastPolicy, kinds: Mapping[str, CastKind], dtype: torch.dtype,
              emulate: bool, cache_enabled: bool) -> Frame:
    """The thread's frame for this configuration (built once: its closures are the hot path)."""
    key = (enabled, id(policy), id(kinds), dtype, emulate, cache_enabled)
    frames = STATE.frame_cache
    frame = frames.get(key)
    if frame is None or frame.kinds is not kinds or frame.policy is not policy:
        if len(frames) >= MAX_MEMO:  # e.g. a new policy object per step: do not grow forever
            frames.clear()
        frame = frames[key] = Frame(enabled, policy, kinds, dtype, emulate, cache_enabled)
    return frame


@functools.lru_cache(maxsize=16)
def _fp32_table(policy: CastPolicy) -> Mapping[str, CastKind]:
    keep = (CastKind.FP32_OUT, CastKind.COMPOSITE)
    return {op: (kind if kind in keep else CastKind.FP32) for op, kind in policy.table.items()}


Cast = Callable[[torch.Tensor], torch.Tensor]


def _weight_cache(dtype: torch.dtype, emulate: bool) -> tuple[dict, dict]:
    """(with grad, without grad) cast caches for the frame's dtype and mode."""
    cache = STATE.cache
    return (cache.setdefault((dtype, emulate, True), {}),
            cache.setdefault((dtype, emulate, False), {}))


def _make_casts(dtype: torch.dtype, device_type: str, emulate: bool, cache_enabled: bool
                ) -> tuple[Callable[[torch.Tensor], bool], Cast, Cast]:
    """``(eligible, to_fp32, to_low)`` for a frame: closures over its settings (the hot path)."""
    eligible_dtypes = _ELIGIBLE_DTYPES
    dev = device_type
    on_cpu = dev == "cpu"

    def eligible(t: torch.Tensor) -> bool:
        return t.dtype in eligible_dtypes and (t.is_cpu if on_cpu else t.device.type == dev)

    def to_fp32(t: torch.Tensor) -> torch.Tensor:
        dt = t.dtype
        if dt is F32 or dt not in eligible_dtypes or not (
                t.is_cpu if on_cpu else t.device.type == dev):
            return t
        return t.float()

    make = _emulated_to_low if emulate else _to_low
    return eligible, to_fp32, make(dtype, dev, cache_enabled)


def _to_low(low: torch.dtype, dev: str, cache_enabled: bool) -> Cast:
    eligible_dtypes = _ELIGIBLE_DTYPES
    on_cpu = dev == "cpu"
    bf16 = low is torch.bfloat16
    if cache_enabled:
        with_grad, without_grad = _weight_cache(low, False)
    is_grad_enabled = torch.is_grad_enabled

    def to_low(t: torch.Tensor) -> torch.Tensor:
        dt = t.dtype
        if dt is F32:  # the common case first: fp32 is always eligible
            if not (t.is_cpu if on_cpu else t.device.type == dev):
                return t
            # like torch.autocast, cache the casts of fp32 leaves that require grad (parameters)
            if cache_enabled and t.requires_grad and t.is_leaf and not t._is_view():
                entries = with_grad if is_grad_enabled() else without_grad
                hit = entries.get(id(t))
                if hit is not None and hit[0] is t:
                    return hit[1]
                out = entries[id(t)] = (t, t.bfloat16() if bf16 else t.half())
                return out[1]  # holding t keeps id(t) unique while cached
            return t.bfloat16() if bf16 else t.half()
        if dt is low or dt not in eligible_dtypes or not (
                t.is_cpu if on_cpu else t.device.type == dev):
            return t
        return t.bfloat16() if bf16 else t.half()

    return to_low


def _emulated_to_low(low: torch.dtype, dev: str, cache_enabled: bool) -> Cast:
    eligible_dtypes = _ELIGIBLE_DTYPES
    on_cpu = dev == "cpu"
    bf16 = low is torch.bfloat16
    if cache_enabled:
        with_grad, without_grad = _weight_cache(low, True)
    is_grad_enabled = torch.is_grad_enabled
    skip_rounded = rounded.SKIP_ROUNDED_OPERANDS
    tag = rounded.TAG

    def to_low(t: torch.Tensor) -> torch.Tensor:
        """``t`` rounded to the low dtype and kept fp32 (a real low tensor widened)."""
        dt = t.dtype
        if dt is not F32 and dt not in eligible_dtypes:
            return t
        if not (t.is_cpu if on_cpu else t.device.type == dev):
            return t
        # parameters (fp32 leaves; low ones under the *-master recipes): once per context
        if cache_enabled and t.requires_grad and t.is_leaf and not t._is_view():
            entries = with_grad if is_grad_enabled() else without_grad
            hit = entries.get(id(t))
            if hit is not None and hit[0] is t:
                return hit[1]
            out = entries[id(t)] = (t, rounded.round_to(t, low))
            return out[1]  # holding t keeps id(t) unique while cached
        if dt is F32 and skip_rounded:
            mark = getattr(t, tag, None)  # already a low-format value (see rounded.py)?
            if mark is not None and mark[0] is low and mark[1] == t._version:
                return t
        if dt is low:
            return t.float()
        return (t.bfloat16() if bf16 else t.half()).float()

    return to_low


class Frame:
    """What the mode does while this frame is on top of the thread's frame stack.

    ``by_func`` memoizes :meth:`kind_of` per torch function. A *widening* frame (emulating, or a keep_fp32
    module) computes in fp32 the ops that mix fp32 with real fp16/bf16 tensors (:mod:`.widen`).
    """

    __slots__ = ("enabled", "kinds", "dtype", "device_type", "emulate", "cache_enabled", "policy",
                 "widen", "skip_rounded", "eligible", "to_low", "to_fp32", "by_func", "_forced")

    def __init__(self, enabled: bool, policy: CastPolicy, kinds: Mapping[str, CastKind],
                 dtype: torch.dtype, emulate: bool, cache_enabled: bool,
                 widen: bool | None = None) -> None:
        self.enabled = enabled
        self.policy = policy
        self.kinds = kinds
        self.dtype = dtype
        self.device_type = policy.device_type
        self.emulate = emulate
        self.cache_enabled = cache_enabled
        self.widen = enabled and (emulate if widen is None else widen)
        self.skip_rounded = rounded.SKIP_ROUNDED_OPERANDS
        self.by_func: dict[Any, Any] = {}
        self._forced: Frame | None = None
        self.eligible, self.to_fp32, self.to_low = _make_casts(
            dtype, policy.device_type, emulate, cache_enabled)

    def forced_fp32(self) -> Frame:
        """This frame with every listed op run in fp32 (for keep_fp32 modules)."""
        if not self.enabled:
            return self
        if self._forced is None:
            self._forced = Frame(True, self.policy, _fp32_table(self.policy), self.dtype, False,
                                 False, widen=True)
        return self._forced

    def kind_of(self, func: Any) -> Any:
        """func's CastKind, None (leave alone), RESOLVE (depends on the call's arguments), WIDEN or
        EXACT (unlisted, in a widening frame)."""
        name = getattr(func, "__name__", None)
        rename = RENAME.get(name)
        if not self.enabled:  # a disabled frame leaves every function alone
            kind = None
        elif rename is None:
            kind = self.kinds.get(name)
        elif isinstance(rename, str):
            kind = self.kinds.get(rename)
        else:
            kind = RESOLVE
        if type(func) in _STABLE_FUNCTION_TYPES:  # not e.g. the fresh method-wrapper of a getter
            if kind is None and self.widen:  # never an attribute access: those are unstable
                kind = EXACT if self.emulate and self.skip_rounded and name in rounded.EXACT_OPS \
                    else WIDEN
            if len(self.by_func) >= MAX_MEMO:
                self.by_func.clear()
            self.by_func[func] = kind
        return kind
