"""A non-finite step caused by its batch: named as data, not as numerics.

Where a run stops for non-finite values (never per step), the step's batch is checked; when it already held
inf/nan, the stop names the step, the batch's position and the tensor with its counts. A batch reported after its
step is fetched again by position (:func:`batch_at`), which gives the same samples except for datasets that
augment from the global RNG. Under torchrun :func:`data_fault` is a collective.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from . import distributed
from .contract import Batch, as_batch

if TYPE_CHECKING:
    from .build import Run
    from .data.protocol import Loader

__all__ = ["batch_at", "data_fault"]


def batch_at(loader: Loader, epoch: int, position: int, count: int = 1) -> list[Batch]:
    """The ``count`` batches from ``position`` of ``epoch`` (fewer at the epoch's end), fetched again. Selects
    ``epoch`` on the loader: call it where the run stops, or set the epoch back."""
    loader.set_epoch(epoch)
    out: list[Batch] = []
    for raw in loader.iter_from(position):
        out.append(as_batch(raw))
        if len(out) == count:
            break
    return out


def data_fault(run: Run, *, epoch: int, position: int, batches: Sequence[Any] | None = None) -> str | None:
    """A phrase following "the batch" (``holds inf/nan (...): the data is at fault ...``) when the step's batch
    was non-finite on any rank, else None. ``batches`` None: fetched again by ``position``. A collective."""
    if batches is None:
        batches = batch_at(run.train_loader, epoch, position, run.config.optim.grad_accum)
    found = [f"batch {position + i} {what}" for i, raw in enumerate(batches) for what in as_batch(raw).nonfinite()]
    flags = distributed.rows_over_ranks(torch.tensor([float(bool(found))], device=run.device))
    bad_ranks = [r for r, v in enumerate(flags.reshape(-1).tolist()) if v]
    if not bad_ranks:
        return None
    where = "" if run.world_size == 1 else f"on rank {run.rank if found else ', '.join(map(str, bad_ranks))} "
    what = f" ({'; '.join(found)})" if found else ""
    return (f"{where}holds inf/nan{what}: the data is at fault, not the model — a corrupt record, or a division by "
            "zero in preprocessing? Fix or filter those samples; the loader is seeded, so --seed "
            f"{run.config.run.seed} gives the same batch at epoch {epoch}, batch {position} again")
