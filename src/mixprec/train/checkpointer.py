"""A run's checkpoints: what :class:`Checkpointer` saves, when, and how a run resumes from it.

The file format (atomic write, validated load) is :mod:`.checkpoint`'s; whether a checkpoint continues the
current config is :mod:`.resume`'s, checked before the run was built. Here the built run is restored from
the file — weights, optimizer, recipe state (loss scaler, master weights), RNG, position, history — so a
resumed run is bit-identical to one that never stopped.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any

import torch

from ..errors import CheckpointError, one_line
from ..memory import local_tensor
from . import distributed
from .checkpoint import (LAST, load_checkpoint, mechanism, remove_stale_temporaries, rng_state, save_checkpoint,
                         set_rng_state)
from .results import EpochRecord

if TYPE_CHECKING:
    from .build import Run

__all__ = ["TrainState", "Checkpointer"]



@dataclasses.dataclass
class TrainState:
    """Where a run is: what a checkpoint restores besides the tensors."""

    epoch: int = 0
    batch: int = 0
    """Next batch of the loader in ``epoch`` (0 once the resumed epoch is under way)."""
    global_step: int = 0
    history: list[EpochRecord] = dataclasses.field(default_factory=list)
    skipped_total: int = 0
    consecutive_skips: int = 0
    partial: dict[str, Any] | None = None
    """The running sums of the epoch a mid-epoch checkpoint interrupted (see EpochMeter.state_dict)."""

    def counters(self) -> dict[str, int]:
        return {"skipped_total": self.skipped_total, "consecutive_skips": self.consecutive_skips}


class Checkpointer:
    """Resume, cadence and save of one run's ``last.pt`` (``--out``, ``--checkpoint-every``, ``--resume``).

    Nothing non-finite is ever written: :meth:`save` checks parameters, optimizer state and master weights
    first (one pass over them, at save points only) and returns the reason to stop instead. A checkpoint
    taken mid-epoch also holds the epoch's running sums, so the resumed epoch's metrics cover all its steps;
    one taken after the epoch's last step resumes into the evaluation of that epoch, then the next epoch.
    Under torchrun every rank calls :meth:`save` (gathering FSDP state is a collective); rank 0 writes.
    """

    def __init__(self, run: Run) -> None:
        self.run = run
        self.out = run.config.run.out
        self.every = run.config.run.checkpoint_every
        if self.out is not None and run.rank == 0 and os.path.isdir(self.out):
            remove_stale_temporaries(self.out)

    def resume(self) -> tuple[TrainState, str | None]:
        """The state to start from, and a line saying where it came from (None for a fresh run)."""
        run, path = self.run, self.run.config.run.resume
        if path is None:
            return TrainState(), None
        ck = load_checkpoint(path, world_size=run.world_size)
        if ck["batch"] > len(run.train_loader):
            raise CheckpointError(f"--resume {path}: the checkpoint's position (epoch {ck['epoch']}, batch "
                                  f"{ck['batch']}) is past the end of an epoch of {len(run.train_loader)} batches; "
                                  "it was edited or is from another data set")
        try:
            distributed.load_state_dicts(run.model, run.optimizer, ck["model"], ck["optimizer"])
            run.recipe.load_state_dict(ck["recipe"])
        except (RuntimeError, KeyError, ValueError, TypeError, AssertionError) as e:
            raise CheckpointError(f"--resume {path}: checkpoint does not fit this model: {one_line(e)}") from None
        try:
            history = [EpochRecord.from_dict(h) for h in ck.get("history") or []]
        except TypeError as e:
            raise CheckpointError(f"--resume {path}: field 'history' holds a record this version cannot read "
                                  f"({e}); the file is corrupt or was edited") from None
        set_rng_state(ck["rng"])
        counters = ck.get("counters") or {}
        state = TrainState(epoch=ck["epoch"], batch=ck["batch"], global_step=ck["global_step"],
                           history=history, partial=ck.get("partial"),
                           skipped_total=counters.get("skipped_total", 0),
                           consecutive_skips=counters.get("consecutive_skips", 0))
        if state.partial is not None and state.history and state.history[-1].epoch == state.epoch:
            state.history.pop()  # the interrupted epoch's record: the resumed epoch records all its steps again
        return state, (f"resumed from {path} at epoch {state.epoch}, batch {state.batch} "
                       f"(step {state.global_step})")

    def save(self, state: TrainState, epoch: int, batch: int, meter: Any = None) -> str | None:
        """Write ``last.pt`` for position (epoch, batch) — no file without ``--out``.

        Returns None, or why the run must stop: the state is not finite (then nothing is written, and the
        previous ``last.pt`` stays). ``meter``: the interrupted epoch's EpochMeter, for a mid-epoch position.
        """
        run = self.run
        if not _state_finite(run):
            return (f"the weights or optimizer state became non-finite by step {state.global_step} (epoch {epoch})"
                    + (f"; {self.out}/{LAST} keeps the last finite state saved before" if self.out else "")
                    + f". Remedies: {run.recipe.nonfinite_remedies()}")
        if self.out is None:
            return None
        model_state, optimizer_state = distributed.state_dicts(run.model, run.optimizer)
        payload = {
            "model": model_state, "optimizer": optimizer_state, "recipe": run.recipe.state_dict(),
            "world_size": run.world_size, "rng": rng_state(), "epoch": epoch, "batch": batch,
            "global_step": state.global_step, "config": run.config.to_dict(),
            "history": [h.to_dict() for h in state.history], "counters": state.counters(),
            "partial": None if meter is None else meter.state_dict(), "mechanism": mechanism(run.recipe),
        }
        if run.rank == 0:
            save_checkpoint(os.path.join(self.out, LAST), payload)
        return None

    def after_step(self, state: TrainState, epoch: int, meter: Any) -> str | None:
        """Save on the ``--checkpoint-every`` cadence (the epoch's running sums with it)."""
        if self.every and state.global_step % self.every == 0:
            return self.save(state, epoch, meter.pos, meter)
        return None

    def after_epoch(self, state: TrainState, epoch: int, meter: Any) -> str | None:
        """Save once an epoch's steps and evaluation are done: into the next epoch when the loader is
        exhausted, else (``--max-steps`` ended it) where it stopped."""
        if meter.pos >= len(self.run.train_loader):
            return self.save(state, epoch + 1, 0)
        return self.save(state, epoch, meter.pos, meter)

    def keep_last_good(self, state: TrainState, epoch: int, batch: int, step: int | None, meter: Any) -> str:
        """After a non-finite stop: save the state before the failed step if it is still finite.
        Returns the clause that says what was kept."""
        if self.out is None:
            return ""
        if self.save(state, epoch, batch, meter) is None:
            return f"; the last good state (before step {step}) is saved in {self.out}/{LAST}"
        return f"; parameters are already non-finite, so {self.out}/{LAST} was left as it was"


def _state_finite(run: Run) -> bool:
    """Parameters, optimizer state and master weights all finite, on every rank (one all-reduce)."""
    tensors = [p for p in run.model.parameters()]
    tensors += [p for g in run.optimizer.param_groups for p in g["params"]]  # fp32 masters where they exist
    tensors += [t for st in run.optimizer.state.values() for t in st.values()
                if isinstance(t, torch.Tensor) and t.is_floating_point()]
    bad = torch.zeros((), dtype=torch.float64, device=run.device)
    for t in tensors:
        bad += (~torch.isfinite(local_tensor(t))).sum().to(bad.device)
    return distributed.all_reduce_sum(bad).item() == 0
