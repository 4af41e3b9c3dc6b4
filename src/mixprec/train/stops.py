"""Rules that end a run early, each deciding on values equal on every rank, so all ranks stop at the same step.

- Too many skipped steps in a row (``--max-consecutive-skips``): counted on the device
  (:class:`~mixprec.guard.StepGuard`), which halts the run; :meth:`StopRules.too_many_skips` words it.
- Ranks that diverged (``--check-consistency N``): nothing is saved; the last checkpoint stays.
- After an epoch: most of its steps were skipped, or its mean training loss is not finite — a failure with its
  reason, never a success with ``final_train_loss: null``.

A stop for non-finite values names the batch when the batch already held them (:mod:`.baddata`).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from . import distributed
from .checkpoint import LAST
from .checkpointer import TrainState
from .results import EpochRecord

if TYPE_CHECKING:
    from .build import Run

__all__ = ["Stop", "StopRules"]


@dataclasses.dataclass(frozen=True)
class Stop:
    """Why a run stops after a step, and whether the state it stops in is worth saving."""

    reason: str
    """The message: what happened, at which step, what to do."""
    save: bool = True
    """Save the state (a skipped step changes nothing, so it is the last good one); False when it is suspect."""


class StopRules:
    def __init__(self, run: Run) -> None:
        self.run = run
        self.check_every = run.config.run.check_consistency

    def too_many_skips(self, state: TrainState, data: Callable[[], str | None] = lambda: None) -> Stop:
        """The stop at the consecutive-skip limit (``state`` rewound to the step that reached it). ``data``: what
        that step's batch holds when it is at fault (:func:`~mixprec.train.baddata.data_fault`)."""
        head = (f"stopped at step {state.global_step}: {state.consecutive_skips} optimizer steps in a row were "
                f"skipped for inf/nan gradients (loss scale now {self.run.recipe.loss_scale():g})")
        bad = data()
        if bad:
            return Stop(f"{head}; the last one's batch {bad}")
        return Stop(f"{head}; the loss itself is likely non-finite — lower --lr, add --clip-grad-norm, or run "
                    "`mixprec doctor` to find the layer")

    def due(self, step: int) -> bool:
        """Whether :meth:`after_step` checks the ranks after optimizer step count ``step`` (a host read)."""
        return bool(self.check_every) and step % self.check_every == 0

    def after_step(self, state: TrainState, skipped_this_epoch: int) -> Stop | None:
        """Why the run must stop after this step (ranks that diverged), or None."""
        recipe = self.run.recipe
        if self.due(state.global_step):
            try:
                distributed.check_consistency(self.run.model, step=state.global_step, scale=recipe.loss_scale(),
                                              skipped=state.skipped_total + skipped_this_epoch,
                                              device=self.run.device)
            except distributed.RankDivergenceError as e:
                out = self.run.config.run.out
                return Stop(str(e) + (f"; {os.path.join(out, LAST)} was not updated, since the ranks' states differ"
                                      if out else ""), save=False)
        return None

    @staticmethod
    def after_epoch(record: EpochRecord, data: Callable[[int], str | None] = lambda j: None,
                    first_step: int = 0) -> str | None:
        """Why an epoch that ran must count as a failure, or None. ``data(j)``: the fault of the batch of the
        epoch's ``j``-th step, asked for the first non-finite one."""
        steps, skipped = record.steps, record.skipped_steps
        remedy = "lower --lr, add --clip-grad-norm, or run `mixprec doctor` to find the layer"
        if skipped >= MIN_SKIPPED and 2 * skipped > steps:
            head = (f"epoch {record.epoch}: {skipped} of {steps} optimizer steps were skipped for inf/nan gradients, "
                    "so the model barely trained")
            return f"{head}; {_first_bad(record, data, first_step, 'the loss is likely non-finite — ' + remedy)}"
        if not math.isfinite(record.train_loss):
            head = f"epoch {record.epoch}: the mean training loss is {record.train_loss}"
            return f"{head}; {_first_bad(record, data, first_step, 'the run diverged; ' + remedy)}"
        return None


def _first_bad(record: EpochRecord, data: Callable[[int], str | None], first_step: int, otherwise: str) -> str:
    """The clause on the epoch's first step with a non-finite loss: its batch when it is at fault, else its step
    and ``otherwise``."""
    j = next((j for j, v in enumerate(record.loss_curve or []) if not math.isfinite(v)), None)
    if j is None:
        return otherwise
    bad = data(j)
    head = f"step {first_step + j} was the first with a non-finite loss"
    return f"{head}, and its batch {bad}" if bad else f"{head}; {otherwise}"


MIN_SKIPPED = 3
"""An epoch fails on skips only from this many on: a loss scaler calibrating its first steps may skip a few."""
