"""Exact memory accounting by category (:data:`CATEGORIES`; bench and ``mixprec plan`` share the names).

Bytes of distinct storages, counted on a sampled step: parameters, gradients (fp32 master grads included),
optimizer state, master weights (shared fp32 params not counted twice), and what autograd saves for backward
during one forward (``saved_tensors_hooks``, deduplicated by storage, parameters excluded), split into:

- **activations**;
- **autocast weight copies**: low-precision copies of fp32 parameters, i.e. a saved tensor whose autograd
  history is a cast (``ToCopyBackward0``, through views) of a parameter; they do not grow with the batch;
- **FP8 buffers**: what an FP8 linear layer saves besides its quantized input (the quantized weight and the
  scales), marked with ``FP8_ROLE_ATTR``.

On CUDA ``torch.cuda.max_memory_allocated`` is reported beside it (it includes temporaries and workspace).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator

import torch
from torch import nn

__all__ = ["MemoryReport", "SavedTensorTracker", "storage_bytes", "static_memory", "local_tensor", "MIB",
           "CATEGORIES", "SAVED_CATEGORIES", "FP8_ROLE_ATTR", "saved_category", "storage_key"]

MIB = 1024.0 * 1024.0

CATEGORIES = ("parameters", "gradients", "optimizer_state", "master_weights", "activations",
              "autocast_weight_copies", "fp8_buffers")
"""The exact categories, in the order reports print them (fields of :class:`MemoryReport`)."""
SAVED_CATEGORIES = ("activations", "autocast_weight_copies", "fp8_buffers")
"""The categories of tensors saved for backward (:func:`saved_category`)."""
FP8_ROLE_ATTR = "_mixprec_fp8_role"
"""Attribute an FP8 layer sets on what it saves: ``"activation"`` (quantized input), ``"weight"``, ``"scale"``."""

_VIEW_NODES = frozenset({"TBackward0", "TransposeBackward0", "ViewBackward0", "PermuteBackward0",
                         "ExpandBackward0", "AliasBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0",
                         "SliceBackward0", "SelectBackward0", "AsStridedBackward0"})
_CAST_NODES = frozenset({"ToCopyBackward0", "_ToCopyBackward0"})


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this rank holds: a DTensor's (FSDP2 shard's) local tensor, any other tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    """``(device, address)`` of ``t``'s storage (views share it); a fake tensor's storage identity stands in."""
    t = local_tensor(t)
    s = t.untyped_storage()
    if _is_fake(t):
        return ("fake", s._cdata)
    return (str(t.device), s.data_ptr())


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def saved_category(t: torch.Tensor, param_keys: set[tuple[str, int]]) -> str:
    """Which of :data:`SAVED_CATEGORIES` a saved tensor belongs to; ``param_keys``: the params' storage_key."""
    role = getattr(t, FP8_ROLE_ATTR, None)
    if role is not None:
        return "activations" if role == "activation" else "fp8_buffers"
    fn = t.grad_fn
    while fn is not None and fn.name() in _VIEW_NODES:
        fn = fn.next_functions[0][0] if fn.next_functions else None
    casts = 0
    while fn is not None and fn.name() in _CAST_NODES:  # emulation rounds with two casts in a row
        fn = fn.next_functions[0][0] if fn.next_functions else None
        casts += 1
    var = getattr(fn, "variable", None) if casts and fn is not None else None
    if isinstance(var, torch.Tensor) and storage_key(var) in param_keys:
        return "autocast_weight_copies"
    return "activations"


def storage_bytes(tensors: Iterable[torch.Tensor], *, exclude: set[tuple[str, int]] | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views share their base's storage)."""
    seen: set[tuple[str, int]] = set(exclude or ())
    total = 0
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor) or t.device.type == "meta":
            continue
        key = storage_key(t)
        if key in seen or key[1] == 0:
            continue
        seen.add(key)
        total += local_tensor(t).untyped_storage().nbytes()
    return total


@dataclasses.dataclass
class MemoryReport:
    """Bytes by category (:data:`CATEGORIES`) for one sampled training step."""

    parameters: int = 0
    gradients: int = 0
    optimizer_state: int = 0
    master_weights: int = 0
    activations: int = 0
    autocast_weight_copies: int = 0
    fp8_buffers: int = 0
    cuda_peak_allocated: int | None = None
    """``torch.cuda.max_memory_allocated`` over the sampled step (None off CUDA)."""
    cuda_peak_reserved: int | None = None

    @property
    def total(self) -> int:
        """Sum of the exact categories: what training holds at its peak (end of forward)."""
        return sum(getattr(self, c) for c in CATEGORIES)

    def add_saved(self, tracker: SavedTensorTracker) -> MemoryReport:
        """Fill the saved-tensor categories from ``tracker``; returns self."""
        for c in SAVED_CATEGORIES:
            setattr(self, c, tracker.by_category.get(c, 0))
        return self

    def to_dict(self) -> dict[str, int | None]:
        d = dataclasses.asdict(self)
        d["total"] = self.total
        return d


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                yield v


def static_memory(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, master=None) -> MemoryReport:
    """Parameters, gradients, optimizer state and master copies, in exact bytes (no activations)."""
    params = list(model.parameters())
    param_keys = {storage_key(p) for p in params}
    rep = MemoryReport()
    rep.parameters = storage_bytes(params)
    grads = [p.grad for p in params if p.grad is not None]
    master_params = list(master.master_params) if master is not None else []
    grads += [m.grad for m in master_params if m.grad is not None]
    rep.gradients = storage_bytes(grads)
    if optimizer is not None:
        rep.optimizer_state = storage_bytes(_optimizer_tensors(optimizer), exclude=param_keys)
    if master_params:
        rep.master_weights = storage_bytes(master_params, exclude=param_keys)
    return rep


class SavedTensorTracker:
    """Records the distinct storages autograd saves for backward while active.

    Use around one forward pass::

        tracker = SavedTensorTracker(exclude=model.parameters())
        with tracker:
            loss = loss_fn(model(x), y)
        tracker.nbytes   # bytes held for backward
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._exclude = {storage_key(t) for t in exclude}
        self._seen: dict[tuple[str, int], int] = {}
        self._category: dict[tuple[str, int], str] = {}
        self.on_save = None
        """Optional ``(tensor, category)`` callback for each newly saved storage (``mixprec plan`` uses it)."""
        self._ctx: contextlib.AbstractContextManager | None = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "meta":
            key = storage_key(t)
            if key[1] != 0 and key not in self._exclude and key not in self._seen:
                self._seen[key] = t.untyped_storage().nbytes()
                category = self._category[key] = saved_category(t, self._exclude)
                if self.on_save is not None:
                    self.on_save(t, category)
        return t

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    @property
    def nbytes(self) -> int:
        """Everything saved for backward (all SAVED_CATEGORIES)."""
        return sum(self._seen.values())

    @property
    def by_category(self) -> dict[str, int]:
        """Bytes per :data:`SAVED_CATEGORIES` entry (every one present)."""
        out = dict.fromkeys(SAVED_CATEGORIES, 0)
        for key, n in self._seen.items():
            out[self._category[key]] += n
        return out

    @property
    def count(self) -> int:
        return len(self._seen)

    def __enter__(self) -> SavedTensorTracker:
        self._seen.clear()
        self._category.clear()
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        assert self._ctx is not None
        self._ctx.__exit__(*exc)
        self._ctx = None
