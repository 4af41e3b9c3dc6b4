"""What one traced training step allocates and computes: a ``TorchDispatchMode`` over fake tensors.

Every aten op of the step passes through :class:`StepRecorder`, above ``FakeTensorMode``. Memory: each output
storage not seen before is an allocation, alive until Python drops it (a weak reference's callback marks the
free); the live total after every op gives the peak and its moment (the bookkeeping of PyTorch's ``MemTracker``,
which a test checks agrees; categories are decided after the step, :mod:`.trace`). Work: each op's FLOPs
(:func:`mixprec.flops.op_flops`), the dtype it computes in, the bytes it moves (views move nothing), whether an
eager run dispatches it at all and whether a low-precision linear layer issued it (:mod:`.roofline` prices the
host's side from these), and on the cpu target the calls :mod:`.kernels` times.
"""

from __future__ import annotations

import dataclasses
import sys
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from ..flops import op_flops
from .kernels import TIMED_OPS, KernelSpec, kernel_spec

__all__ = ["Alloc", "OpRecord", "StepRecorder", "LOWP_MODULES"]

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
    """The first floating input's (``fp8`` for ``_scaled_mm``, ``other`` when none)."""
    nbytes: int
    phase: str
    kernel: KernelSpec | None = None
    """The call, to be timed for real (:mod:`.kernels`)."""
    dispatched: bool = True
    """False for what only tracing records: fake tensors' metadata queries (``prim::device``) and the ``detach``
    autograd adds after the planner's saved-tensor unpack hook (:meth:`StepRecorder.note_unpack`)."""
    lowp: bool = False
    """Issued by a low-precision linear layer (its quantisers, casts and GEMMs; :data:`LOWP_MODULES`)."""


LOWP_MODULES = ("mixprec.lowp.", "mixprec.formats", "torchao.")
"""Python modules whose code is a low-precision linear layer's: an op with one of them on the stack is ``lowp``."""


class StepRecorder(TorchDispatchMode):
    """Records allocations, frees, the peak and every op's work while active.

    Set :attr:`phase` (``forward``, ``backward``, ``optimizer``) as the step moves on; each phase's peak is kept
    apart (:attr:`phase_peak`): they scale differently with the batch.
    """

    def __init__(self, workspace=None, time_kernels: bool = False, mark_lowp: bool = False) -> None:
        super().__init__()
        self._time_kernels = time_kernels
        self._mark_lowp = mark_lowp
        self.unpacked = 0
        """Saved inputs unpacked by a hook since the last op (:meth:`note_unpack`)."""
        self.saved_outputs = 0
        """Saved outputs unpacked by a hook: each a forward ``detach`` an unhooked run dispatches."""
        self.module_calls: list[int] = []
        """For each ``nn.Module`` call, the number of ops recorded before it (:meth:`note_module_call`)."""
        self._workspace = workspace
        """``(op name, positional args, outputs) -> bytes`` a kernel allocates and frees inside the op."""
        self.phase = "setup"
        self.seq = 0
        self.live = 0
        self.peak = 0
        self.peak_seq = -1
        self.phase_peak: dict[str, int] = {}
        self.phase_peak_seq: dict[str, int] = {}
        self.peak_workspace = 0
        """Kernel workspace alive at the peak (counted as temporary)."""
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
        """Mark tensors that exist before the step (resident)."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                a = self._storage_alloc(t, category)
                if a is not None and a.category is None:
                    a.category = category
        self._note_peak()

    def alloc_of(self, t: torch.Tensor) -> Alloc | None:
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
    def note_unpack(self, t: torch.Tensor) -> None:
        """Call from a saved-tensor unpack hook. Hooked, autograd detaches each unpacked tensor that requires grad;
        unhooked, only saved outputs, once when saved and once when unpacked. So the ``detach`` after a saved input
        is the hook's (not dispatched), and a saved output is a forward ``detach`` the trace lacks."""
        current = getattr(torch._C, "_current_autograd_node", lambda: None)()
        if current is not None and t.grad_fn is current:
            self.saved_outputs += 1
        else:
            self.unpacked += 1

    def note_module_call(self) -> None:
        """Call from a module forward pre-hook: a module call's Python comes before the next op."""
        self.module_calls.append(len(self.ops))

    def _artefact(self, info: _OpInfo) -> bool:
        if not self.unpacked:
            return False
        if info.name == "detach":
            self.unpacked -= 1
            return True
        self.unpacked = 0
        return False

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
        dispatched = not info.query and not self._artefact(info)
        self.ops.append(OpRecord(name=info.name, flops=flops, dtype=_bucket(info, positional), nbytes=nbytes,
                                 phase=self.phase, kernel=kernel, dispatched=bool(dispatched),
                                 lowp=self._mark_lowp and _in_lowp_code()))
        return out


@dataclasses.dataclass(frozen=True)
class _OpInfo:
    name: str
    is_view: bool
    mutable: bool
    scaled_mm: bool
    query: bool
    """A ``prim`` op (``prim::device``): a tensor's metadata, which only a Python tensor subclass dispatches."""
    may_have_flops: bool
    """Whether a FLOP formula knows the op; the others count 0 without asking."""


_OP_INFO: dict[Any, _OpInfo] = {}

_ALIASING = frozenset({"_unsafe_view"})
"""Ops that return their input's storage under a new tensor without being views in their schema (``reshape``
of a non-viewable tensor is ``clone`` + ``_unsafe_view``): no kernel, no bytes moved."""


def _op_info(func) -> _OpInfo:
    info = _OP_INFO.get(func)
    if info is None:
        from torch.utils import flop_counter as _fc

        from ..flops import CUSTOM_FORMULAS

        packet = func.overloadpacket
        name = packet.__name__
        info = _OP_INFO[func] = _OpInfo(name=name, is_view=func.is_view or name in _ALIASING,
                                        mutable=func._schema.is_mutable,
                                        scaled_mm=name.startswith("_scaled_mm"), query=func.namespace == "prim",
                                        may_have_flops=packet in CUSTOM_FORMULAS or packet in _fc.flop_registry)
    return info


def _in_lowp_code() -> bool:
    f = sys._getframe(2)
    while f is not None:
        if f.f_globals.get("__name__", "").startswith(LOWP_MODULES):
            return True
        f = f.f_back
    return False


def _leaves(args: tuple, kwargs: dict) -> tuple[list, list]:
    if any(isinstance(a, (list, tuple, dict)) for a in args):
        positional = tree_leaves(args)
    else:
        positional = list(args)
    return positional, (tree_leaves(kwargs) if kwargs else [])


def _bucket(info: _OpInfo, leaves: list) -> str:
    """The dtype an op computes in, for the roofline, from its flattened positional arguments."""
    if info.scaled_mm:
        return "fp8"
    for a in leaves:
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return _DTYPE_NAMES.get(a.dtype, str(a.dtype).replace("torch.", ""))
    return "other"
