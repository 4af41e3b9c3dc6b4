"""What one traced training step allocates and computes: a ``TorchDispatchMode`` over fake tensors.

Every aten op of the step passes through :class:`StepRecorder` (it sits above ``FakeTensorMode``, so the
ops compute nothing and allocate nothing). For each op it records:

- **memory**: each output storage it has not seen is an allocation, alive until Python drops the storage
  (a weak reference's callback marks the free). The live total after every op gives the peak and the
  moment of the peak; storages that exist before the step (parameters, buffers, optimizer state, fp32
  masters, the batch) are registered as resident. This is the bookkeeping of PyTorch's
  ``torch.distributed._tools.mem_tracker.MemTracker`` (storages held by weak reference, the peak after
  each op), and a test checks that both find the same peak. It is ours because MemTracker's categories are
  wrong for mixed precision -- autocast's weight copies and FP8 buffers count as activations, the
  optimizer's foreach temporaries as optimizer state, fp32 masters as "other" -- and because it walks every
  tracked module after every op, which makes a Llama-8B step several times slower. Here the category of
  each storage is decided after the step, from what it turned out to be (see :mod:`.trace`).
- **work**: the op's FLOPs by :func:`mixprec.flops.op_flops` (PyTorch's formulas and mixprec's for CPU
  attention and fused RNNs), the dtype of its first floating input (``fp8`` for ``_scaled_mm``), and the
  bytes it moves (inputs read plus outputs written; view ops move nothing). The roofline
  (:mod:`.roofline`) turns these into time on a target; for the cpu target the GEMM, convolution and
  attention calls are kept too, to be timed for real (:mod:`.kernels`).

A step dispatches tens of thousands of ops of a few dozen overloads, so what the recorder needs of an
overload (its name, whether it is a view or mutates, whether a FLOP formula knows it) is worked out once
(:func:`_op_info`) and the arguments are flattened once per op; the rest of a trace's time is
``FakeTensorMode``'s own dispatch.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from ..flops import op_flops
from .kernels import TIMED_OPS, KernelSpec, kernel_spec

__all__ = ["Alloc", "OpRecord", "StepRecorder", "dtype_bucket"]

_DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
                torch.float8_e4m3fn: "fp8", torch.float8_e5m2: "fp8"}


@dataclasses.dataclass
class Alloc:
    """One storage: its size, when it appeared and disappeared (op counters), and what it turned out to be."""

    nbytes: int
    born: int
    died: int | None = None
    category: str | None = None
    op: str = ""
    """The op that made it (empty for resident storages)."""
    phase: str = ""


@dataclasses.dataclass(frozen=True)
class OpRecord:
    """One aten op of the step."""

    name: str
    flops: int
    dtype: str
    """``fp32``, ``bf16``, ``fp16``, ``fp8``... of the first floating input (``other`` when none)."""
    nbytes: int
    """Bytes read and written (0 for views)."""
    phase: str
    kernel: KernelSpec | None = None
    """The call, to be timed for real (:mod:`.kernels`: the GEMMs, convolutions and attention, when the
    recorder keeps them)."""


def dtype_bucket(func: Any, args: tuple) -> str:
    """The dtype an op computes in, for the roofline: FP8 for ``_scaled_mm``, else the first floating input's."""
    name = getattr(getattr(func, "overloadpacket", func), "__name__", str(func))
    if name.startswith("_scaled_mm"):
        return "fp8"
    for a in tree_leaves(args):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return _DTYPE_NAMES.get(a.dtype, str(a.dtype).replace("torch.", ""))
    return "other"


class StepRecorder(TorchDispatchMode):
    """Records allocations, frees, the peak and every op's work while active (see the module docstring).

    Set :attr:`phase` (``forward``, ``backward``, ``optimizer``) as the step moves on; the peak of each phase
    is kept apart (:attr:`phase_peak`) because they scale differently with the batch.
    """

    def __init__(self, workspace=None, time_kernels: bool = False) -> None:
        super().__init__()
        self._time_kernels = time_kernels
        """Keep each call of :data:`.kernels.TIMED_OPS` as a :class:`~.kernels.KernelSpec`, to be timed (the cpu
        target)."""
        self._workspace = workspace
        """``(op name, positional args, outputs) -> bytes`` a kernel allocates and frees inside the op
        (:func:`.workspace.cpu_workspace` for the cpu target; None: no workspace term)."""
        self.phase = "setup"
        self.seq = 0
        self.live = 0
        self.peak = 0
        self.peak_seq = -1
        self.phase_peak: dict[str, int] = {}
        self.phase_peak_seq: dict[str, int] = {}
        self.peak_workspace = 0
        """Kernel workspace alive at the peak (in no storage: counted as temporary)."""
        self.phase_peak_workspace: dict[str, int] = {}
        self.allocs: list[Alloc] = []
        self.ops: list[OpRecord] = []
        self._by_storage: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._refs: dict[int, weakref.ref] = {}
        self._op_name = ""

    # -- storages --------------------------------------------------------------------------------------
    def _storage_alloc(self, t: torch.Tensor, category: str | None = None) -> Alloc | None:
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse and other storage-less tensors
            return None
        known = self._by_storage.get(st)
        if known is not None:
            return known
        a = Alloc(nbytes=st.nbytes(), born=self.seq, category=category, op=self._op_name, phase=self.phase)
        self.allocs.append(a)
        self._by_storage[st] = a
        self.live += a.nbytes
        ref = weakref.ref(st, lambda r, a=a: self._freed(r, a))
        self._refs[id(ref)] = ref
        return a

    def _freed(self, ref: weakref.ref, a: Alloc) -> None:
        self._refs.pop(id(ref), None)
        self.seq += 1  # every event gets its own number, so a free right after the peak is not before it
        a.died = self.seq
        self.live -= a.nbytes

    def register(self, tensors, category: str) -> None:
        """Mark tensors that exist before the step (resident: parameters, optimizer state, masters...)."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                a = self._storage_alloc(t, category)
                if a is not None and a.category is None:
                    a.category = category
        self._note_peak()

    def alloc_of(self, t: torch.Tensor) -> Alloc | None:
        """The record of ``t``'s storage, if the recorder has seen it."""
        try:
            return self._by_storage.get(t.untyped_storage())
        except (RuntimeError, NotImplementedError):
            return None

    def _note_peak(self, workspace: int = 0) -> None:
        live = self.live + workspace
        if live > self.peak:
            self.peak, self.peak_seq, self.peak_workspace = live, self.seq, workspace
        if live > self.phase_peak.get(self.phase, -1):
            self.phase_peak[self.phase] = live
            self.phase_peak_seq[self.phase] = self.seq
            self.phase_peak_workspace[self.phase] = workspace

    def live_at(self, seq: int) -> list[Alloc]:
        """Storages alive at event ``seq`` (the counter moves on at every op and every free)."""
        return [a for a in self.allocs if a.born <= seq and (a.died is None or a.died > seq)]

    # -- ops -------------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.seq += 1
        info = _op_info(func)
        self._op_name = info.name
        positional, keyword = _leaves(args, kwargs)
        outputs = [out] if isinstance(out, torch.Tensor) else [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        moves = not info.is_view and (outputs or info.mutable)  # queries (prim::device) move nothing
        nbytes = 0
        if moves:
            seen = set()
            for a in (*positional, *keyword):
                if isinstance(a, torch.Tensor) and id(a) not in seen:
                    seen.add(id(a))
                    nbytes += a.numel() * a.element_size()
        for t in outputs:
            self._storage_alloc(t)
            if moves:
                nbytes += t.numel() * t.element_size()
        self._note_peak(self._workspace(info.name, positional, outputs) if self._workspace is not None else 0)
        flops = op_flops(func, args, kwargs, out) if info.may_have_flops else 0
        kernel = None
        if flops and self._time_kernels and info.name in TIMED_OPS:
            kernel = kernel_spec(func, args, kwargs, out_bytes=sum(t.numel() * t.element_size() for t in outputs))
        self.ops.append(OpRecord(name=info.name, flops=flops, dtype=_bucket(info, positional), nbytes=nbytes,
                                 phase=self.phase, kernel=kernel))
        return out


@dataclasses.dataclass(frozen=True)
class _OpInfo:
    name: str
    is_view: bool
    mutable: bool
    scaled_mm: bool
    may_have_flops: bool
    """Whether a FLOP formula (PyTorch's or mixprec's) knows the op; the others count 0 without asking."""


_OP_INFO: dict[Any, _OpInfo] = {}

_ALIASING = frozenset({"_unsafe_view"})
"""Ops that return their input's storage under a new tensor without being views in their schema (``reshape``
of a non-viewable tensor is ``clone`` + ``_unsafe_view``): no kernel, no bytes moved."""


def _op_info(func) -> _OpInfo:
    """What the recorder needs of an op overload, worked out once per overload (a step dispatches thousands
    of ops of a few dozen kinds)."""
    info = _OP_INFO.get(func)
    if info is None:
        from torch.utils import flop_counter as _fc

        from ..flops import CUSTOM_FORMULAS

        packet = func.overloadpacket
        name = packet.__name__
        info = _OP_INFO[func] = _OpInfo(name=name, is_view=func.is_view or name in _ALIASING,
                                        mutable=func._schema.is_mutable,
                                        scaled_mm=name.startswith("_scaled_mm"),
                                        may_have_flops=packet in CUSTOM_FORMULAS or packet in _fc.flop_registry)
    return info


def _leaves(args: tuple, kwargs: dict) -> tuple[list, list]:
    """The leaves of an op's positional and keyword arguments (the common flat case without pytree's walk)."""
    if any(isinstance(a, (list, tuple, dict)) for a in args):
        positional = tree_leaves(args)
    else:
        positional = list(args)
    return positional, (tree_leaves(kwargs) if kwargs else [])


def _bucket(info: _OpInfo, leaves: list) -> str:
    """:func:`dtype_bucket` from the already flattened positional arguments."""
    if info.scaled_mm:
        return "fp8"
    for a in leaves:
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return _DTYPE_NAMES.get(a.dtype, str(a.dtype).replace("torch.", ""))
    return "other"
