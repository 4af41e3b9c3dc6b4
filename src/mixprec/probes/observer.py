"""Observe every ATen op of a step at the dispatcher level (:class:`OpObserver`, a ``TorchDispatchMode``).

The Python dispatch key sits below Autocast and Autograd, so the observer sees the ops that really run -- the
casts autocast inserts, the low-precision kernels after them, every backward kernel, the optimizer's foreach ops
-- for ``torch.autocast`` and mixprec's scratch autocast alike. Each op becomes an :class:`OpCall` (name, phase,
module path from :class:`~.attribution.ModuleTracker`, arguments, outputs) handed to the sinks (the precision
map, the non-finite watch). Per tensor, in weak dictionaries, it keeps the op that produced it and, for emulated
low precision (fp32 arithmetic on values rounded to fp16/bf16), the low dtype an fp32 tensor carries: set on the
upcast of a low-precision tensor, followed through views.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from ..autocast import is_autocast_active
from .attribution import ModuleTracker

__all__ = ["OpCall", "OpObserver", "LOW_DTYPES", "dtype_name", "is_data_movement"]

LOW_DTYPES = (torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)

_NAMES = {
    torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
    torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2",
}

# ops that move or alias data without arithmetic (listed apart from the compute ops in the map)
_MOVEMENT = frozenset({
    "_to_copy", "to", "clone", "copy_", "detach", "_unsafe_view", "alias", "lift_fresh", "contiguous",
    "empty_like", "zeros_like", "ones_like", "full_like", "empty", "zeros", "ones", "fill_", "zero_",
    "new_empty", "new_zeros", "new_ones", "full", "new_full", "empty_strided", "new_empty_strided", "scalar_tensor",
    "_local_scalar_dense", "lift", "set_", "resize_", "_reshape_alias",
})


def _autocast_on() -> bool:
    return torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda") or is_autocast_active()


def dtype_name(dt: torch.dtype | None) -> str:
    if dt is None:
        return "-"
    return _NAMES.get(dt, str(dt).removeprefix("torch."))


def is_data_movement(func: Any) -> bool:
    """True for views, copies, casts and allocations: ops that do no arithmetic."""
    name = func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else str(func)
    return name in _MOVEMENT or bool(getattr(func, "is_view", False))


@dataclasses.dataclass
class OpCall:
    """One dispatched ATen op."""

    func: Any
    name: str
    """ATen op name without namespace or overload (``addmm``, ``_to_copy``)."""
    phase: str
    """``forward``, ``backward`` or ``step``."""
    module: str | None
    """Qualified name of the module it ran in (``""`` the model itself, None outside the model)."""
    node: str | None
    """Name of the autograd node running it (backward only), e.g. ``AddmmBackward0``."""
    args: tuple
    kwargs: dict
    out: Any
    in_tensors: list[torch.Tensor]
    out_tensors: list[torch.Tensor]
    emulated: torch.dtype | None
    """The low dtype whose values every floating input carries, when the op runs emulated in fp32."""
    in_autocast: bool = False
    """The op ran inside an enabled autocast region (torch.autocast or mixprec's scratch autocast)."""

    @property
    def in_dtypes(self) -> tuple[torch.dtype, ...]:
        return tuple(t.dtype for t in self.in_tensors if t.is_floating_point())

    @property
    def out_dtypes(self) -> tuple[torch.dtype, ...]:
        return tuple(t.dtype for t in self.out_tensors if t.is_floating_point())

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The dtype the op computes in: its first floating output's (type promotion decides it), else the
        widest floating input's (comparisons, in-place ops without a floating result)."""
        if self.out_dtypes:
            return self.out_dtypes[0]
        if not self.in_dtypes:
            return None
        return max(self.in_dtypes, key=lambda d: torch.finfo(d).bits)


class _AutocastProbe(TorchFunctionMode):
    """Notes whether autocast is on at the torch-API level, for the dispatch-level ops a call runs.

    Below the Autocast dispatch key ``torch.is_autocast_enabled()`` always reads False, so the observer
    asks one level up, where the answer is still true inside ``with torch.autocast(...)``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.active = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        prev, self.active = self.active, _autocast_on()
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.active = prev


class OpObserver(TorchDispatchMode):
    """Dispatch mode calling each sink's ``on_op(call, observer)`` after every op runs.

    Args:
        tracker: supplies phase and module path; must be entered around the same code.
        sinks: objects with ``on_op(call: OpCall, observer: OpObserver) -> None``.
    """

    def __init__(self, tracker: ModuleTracker, sinks: Sequence[Any]) -> None:
        super().__init__()
        self.tracker = tracker
        self.sinks = list(sinks)
        self.producer: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._carries: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._probe = _AutocastProbe()

    def __enter__(self) -> OpObserver:
        self._probe.__enter__()
        try:
            return super().__enter__()
        except BaseException:
            self._probe.__exit__(None, None, None)
            raise

    def __exit__(self, *exc) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._probe.__exit__(*exc)

    def producer_of(self, t: torch.Tensor) -> str | None:
        return self.producer.get(t)

    def carries(self, t: torch.Tensor) -> torch.dtype | None:
        """The low dtype whose values the fp32 tensor ``t`` holds (an upcast, or a view of one), else None."""
        return self._carries.get(t)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        phase, module, node = self.tracker.where()
        ins = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        outs = [o for o in tree_leaves(out) if isinstance(o, torch.Tensor)]
        emulated = self._emulated(ins)
        call = OpCall(func=func, name=name, phase=phase, module=module, node=node, args=args, kwargs=kwargs,
                      out=out, in_tensors=ins, out_tensors=outs, emulated=emulated,
                      in_autocast=self._probe.active)
        for sink in self.sinks:
            sink.on_op(call, self)
        self._mark(func, name, ins, outs, emulated)
        return out

    # -- per-tensor facts ----------------------------------------------------------------------------
    def _emulated(self, ins: list[torch.Tensor]) -> torch.dtype | None:
        floats = [t for t in ins if t.is_floating_point()]
        if not floats or any(t.dtype != torch.float32 for t in floats):
            return None
        marks = {self._carries.get(t) for t in floats}
        if len(marks) == 1:
            return marks.pop()
        return None

    def _mark(self, func: Callable, name: str, ins: list[torch.Tensor], outs: list[torch.Tensor],
              emulated: torch.dtype | None) -> None:
        for o in outs:
            self.producer[o] = name
        if not outs or outs[0].dtype != torch.float32:
            return
        if name == "_to_copy" and ins and ins[0].dtype in LOW_DTYPES:
            self._carries[outs[0]] = ins[0].dtype  # an upcast of low-precision values
        elif emulated is not None and (getattr(func, "is_view", False) or name in ("clone", "_unsafe_view",
                                                                                     "detach", "t")):
            for o in outs:
                self._carries[o] = emulated
