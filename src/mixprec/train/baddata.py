"""A non-finite step caused by its batch: named as data, not as numerics.

A NaN or inf in an input batch (a corrupt record, a division by zero in the user's preprocessing) makes the
loss non-finite exactly as weights gone bad do. The stop that follows (a non-finite loss without a loss
scaler, too many skipped steps, an epoch whose mean loss is not finite) looks at the step's batch and, when
the batch already held inf/nan, says so: the step, the batch's position in the epoch and which tensor, with
its counts (:meth:`~mixprec.train.contract.Batch.nonfinite`). The check runs only where a run stops, never
per step.

A stop reported after its step (the epoch's mean loss) no longer holds the batch: it is fetched again by its
position, ``loader.set_epoch(epoch)`` then ``loader.iter_from(position)`` — the loaders are seeded by
``(seed, epoch)``, so the same position gives the same samples (:func:`batch_at`). A dataset whose
``__getitem__`` draws random augmentations from the global RNG is the exception: its refetched batch is
not the one the step saw.

Under torchrun every rank calls :func:`data_fault` at the same stop (the stop rules decide on values equal on
every rank); one all-gather tells every rank whose batch was bad.
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
    """What the batch of a non-finite step holds, when it is the data's fault (a phrase that follows "the
    batch": ``holds inf/nan (batch 3 input 0: 2 nan, 0 inf of 4096 values): the data is at fault ...``), or None
    when the step's batches are finite on every rank.

    ``position``: the step's first batch in the epoch; ``batches``: the step's micro-batches as the loader gave
    them (None: fetched again by position, :func:`batch_at`). A collective under torchrun: every rank calls it.
    """
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
