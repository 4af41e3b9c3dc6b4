"""Exact memory accounting by category, and measured peaks where the platform gives them.

Mixed precision saves memory in specific places, so a single "peak memory" number hides what happened.
This module counts bytes exactly, per category:

- **parameters** — the model's parameters (fp32 or the recipe's low dtype);
- **gradients** — their ``.grad`` tensors (and the fp32 master grads, when master weights exist);
- **optimizer state** — every tensor in ``optimizer.state`` (momentum, Adam moments, step counters);
- **master weights** — fp32 copies kept by :class:`mixprec.master.MasterWeights` (shared fp32 params are
  not counted twice);
- **saved activations** — every tensor autograd saves for backward during one forward, captured with
  ``torch.autograd.graph.saved_tensors_hooks`` and deduplicated by storage, so a tensor saved by three
  ops counts once and views count their base storage once. Storages that belong to parameters are
  excluded (they are already counted); the low-precision weight copies autocast makes *are* counted,
  because they are real extra memory held until backward.

Counting is exact (bytes of distinct storages), cheap (no copies), and done on a sampled step, never on
every step. On CUDA, ``torch.cuda.max_memory_allocated`` is reported beside it as the allocator's view
(it also includes temporaries that are never saved, workspace, and fragmentation effects).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator

import torch
from torch import nn

__all__ = ["MemoryReport", "SavedTensorTracker", "storage_bytes", "static_memory", "local_tensor", "MIB"]

MIB = 1024.0 * 1024.0


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this rank holds: a DTensor's (FSDP2 shard's) local tensor, any other tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    t = local_tensor(t)
    s = t.untyped_storage()
    return (str(t.device), s.data_ptr())


def storage_bytes(tensors: Iterable[torch.Tensor], *, exclude: set[tuple[str, int]] | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views share their base's storage)."""
    seen: set[tuple[str, int]] = set(exclude or ())
    total = 0
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor) or t.device.type == "meta":
            continue
        key = _storage_key(t)
        if key in seen or key[1] == 0:
            continue
        seen.add(key)
        total += local_tensor(t).untyped_storage().nbytes()
    return total


@dataclasses.dataclass
class MemoryReport:
    """Bytes by category for one sampled training step."""

    parameters: int = 0
    gradients: int = 0
    optimizer_state: int = 0
    master_weights: int = 0
    activations: int = 0
    cuda_peak_allocated: int | None = None
    """``torch.cuda.max_memory_allocated`` over the sampled step (None off CUDA)."""
    cuda_peak_reserved: int | None = None

    @property
    def total(self) -> int:
        """Sum of the exact categories: what training must hold at its peak (end of forward)."""
        return self.parameters + self.gradients + self.optimizer_state + self.master_weights + self.activations

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
    param_keys = {_storage_key(p) for p in params}
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
        self._exclude = {_storage_key(t) for t in exclude}
        self._seen: dict[tuple[str, int], int] = {}
        self._ctx: contextlib.AbstractContextManager | None = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "meta":
            key = _storage_key(t)
            if key[1] != 0 and key not in self._exclude and key not in self._seen:
                self._seen[key] = t.untyped_storage().nbytes()
        return t

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    @property
    def nbytes(self) -> int:
        return sum(self._seen.values())

    @property
    def count(self) -> int:
        return len(self._seen)

    def __enter__(self) -> SavedTensorTracker:
        self._seen.clear()
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        assert self._ctx is not None
        self._ctx.__exit__(*exc)
        self._ctx = None
