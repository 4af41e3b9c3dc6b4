"""A run's checkpoints: what :class:`Checkpointer` saves, when, and how a run resumes from it, bit-identical to
one that never stopped. File format: :mod:`.checkpoint`; same-run checks: :mod:`.resume`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any

import torch

from ..errors import CheckpointError
from ..memory import local_tensor
from . import distributed
from .checkpoint import (LAST, load_checkpoint, mechanism, remove_stale_temporaries, resolve_checkpoint_path, rng_state,
                         save_checkpoint, set_rng_state)
from .results import EpochRecord, EvalRecord

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
    evals: list[EvalRecord] = dataclasses.field(default_factory=list)
    """The ``--eval-every`` evaluations so far."""
    last_eval: tuple[dict, float] | None = None
    """What the latest of them returned (the task's metrics, loss), so an epoch ending on that step is not evaluated
    again (not saved: a resumed run evaluates again, to the same numbers)."""

    def counters(self) -> dict[str, int]:
        return {"skipped_total": self.skipped_total, "consecutive_skips": self.consecutive_skips}


class Checkpointer:
    """Resume, cadence and save of one run's ``last.pt`` (``--out``, ``--checkpoint-every``, ``--resume``).

    Nothing non-finite is ever written. Under torchrun every rank calls :meth:`save` (a collective); rank 0
    writes.
    """

    def __init__(self, run: Run) -> None:
        self.run = run
        self.out = run.config.run.out
        self.every = run.config.run.checkpoint_every
        self.saved_step: int | None = None
        """The step of the state this run's ``last.pt`` holds (saved by it, or the one it resumed from there)."""
        self.resumed: tuple[str, int] | None = None
        """A checkpoint elsewhere that this run resumed from, and its step."""
        self.earlier = self.out is not None and os.path.exists(os.path.join(self.out, LAST))
        """``--out`` held a ``last.pt`` when the run started (its own, resumed, or one --overwrite replaces)."""
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
        misfit = _misfit(distributed.unwrap(run.model).state_dict(), ck["model"])
        if misfit:
            raise CheckpointError(f"--resume {path}: checkpoint does not fit this model: {misfit}")
        try:
            distributed.load_state_dicts(run.model, run.optimizer, ck["model"], ck["optimizer"])
            run.recipe.load_state_dict(ck["recipe"])
        except (RuntimeError, KeyError, ValueError, TypeError, AssertionError) as e:
            raise CheckpointError(f"--resume {path}: checkpoint does not fit this model: {_flat(e)}") from None
        try:
            history = [EpochRecord.from_dict(h) for h in ck.get("history") or []]
            evals = [EvalRecord.from_dict(h) for h in ck.get("evals") or []]
        except TypeError as e:
            raise CheckpointError(f"--resume {path}: field 'history' or 'evals' holds a record this version cannot "
                                  f"read ({e}); the file is corrupt or was edited") from None
        set_rng_state(ck["rng"])
        counters = ck.get("counters") or {}
        state = TrainState(epoch=ck["epoch"], batch=ck["batch"], global_step=ck["global_step"],
                           history=history, partial=ck.get("partial"), evals=evals,
                           skipped_total=counters.get("skipped_total", 0),
                           consecutive_skips=counters.get("consecutive_skips", 0))
        if state.partial is not None and state.history and state.history[-1].epoch == state.epoch:
            state.history.pop()  # the interrupted epoch's record: the resumed epoch records all its steps again
        here = self.out is not None and os.path.realpath(resolve_checkpoint_path(path)) == os.path.realpath(
            os.path.join(self.out, LAST))
        if here:
            self.saved_step = state.global_step
        else:
            self.resumed = (str(path), state.global_step)
        return state, (f"resumed from {path} at epoch {state.epoch}, batch {state.batch} "
                       f"(step {state.global_step})")

    def save(self, state: TrainState, epoch: int, batch: int, meter: Any = None) -> str | None:
        """Write ``last.pt`` for position (epoch, batch) (no file without ``--out``). Returns None, or why the run
        must stop when the state is not finite (then nothing is written)."""
        run = self.run
        if not _state_finite(run):
            return (f"the weights or optimizer state became non-finite by step {state.global_step} (epoch {epoch})"
                    + self.on_disk() + f". Remedies: {run.recipe.nonfinite_remedies()}")
        if self.out is None:
            return None
        model_state, optimizer_state = distributed.state_dicts(run.model, run.optimizer)
        payload = {
            "model": model_state, "optimizer": optimizer_state, "recipe": run.recipe.state_dict(),
            "world_size": run.world_size, "rng": rng_state(), "epoch": epoch, "batch": batch,
            "global_step": state.global_step, "config": run.config.to_dict(),
            "history": [h.to_dict() for h in state.history], "evals": [e.to_dict() for e in state.evals],
            "counters": state.counters(),
            "partial": None if meter is None else meter.state_dict(), "mechanism": mechanism(run.recipe),
        }
        if run.rank == 0:
            save_checkpoint(os.path.join(self.out, LAST), payload)
        self.saved_step = state.global_step
        return None

    def due(self, step: int) -> bool:
        """Whether :meth:`after_step` saves after optimizer step count ``step``."""
        return bool(self.every) and step % self.every == 0

    def after_step(self, state: TrainState, epoch: int, meter: Any) -> str | None:
        """Save on the ``--checkpoint-every`` cadence (the epoch's running sums with it)."""
        if self.due(state.global_step):
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
        return "; the parameters are already non-finite, so nothing was saved" + self.on_disk()

    def intact(self) -> str:
        """The clause that names the last checkpoint, left as it was by a stop that writes nothing."""
        if self.out is None:
            return "no checkpoint is written without --out"
        last = os.path.join(self.out, LAST)
        if self.saved_step is not None:
            return f"the last checkpoint, {last} (step {self.saved_step}), is intact"
        if self.resumed is not None:
            where, step = self.resumed
            return f"nothing was saved to {self.out} yet; the checkpoint resumed from, {where} (step {step}), is intact"
        return "no checkpoint of this run had been written yet" + (
            f" ({last} is still the earlier run's file that --overwrite was to replace)" if self.earlier else "")

    def on_disk(self) -> str:
        """The clause that says where the run's last good state is, if anywhere (never a file that is not there)."""
        if self.out is None:
            return ""
        last = os.path.join(self.out, LAST)
        if self.saved_step is not None:
            return f"; {last} keeps the last finite state, from step {self.saved_step}"
        if self.resumed is not None:
            where, step = self.resumed
            return (f"; nothing was saved to {self.out} yet: the last good state is the checkpoint this run resumed "
                    f"from, {where} (step {step})")
        return ("; no state of this run is on disk (none had been saved yet"
                + (f"; {last} is still the earlier run's file that --overwrite was to replace)" if self.earlier else ")"))


def _misfit(mine: dict[str, Any], saved: dict[str, Any], shown: int = 4) -> str:
    """The tensors of a saved model state that do not fit this model's (names and both shapes), or ""."""
    problems = [f"{k} is {list(saved[k].shape)} in the checkpoint, {list(v.shape)} in this model"
                for k, v in mine.items() if k in saved and isinstance(v, torch.Tensor)
                and isinstance(saved[k], torch.Tensor) and tuple(saved[k].shape) != tuple(v.shape)]
    missing = [k for k in mine if k not in saved]
    extra = [k for k in saved if k not in mine]
    if missing:
        problems.append("this model's " + _names(missing, shown) + " not in the checkpoint")
    if extra:
        problems.append("the checkpoint's " + _names(extra, shown) + " not in this model")
    if not problems:
        return ""
    more = len(problems) - shown
    return "; ".join(problems[:shown]) + (f"; and {more} more" if more > 0 else "") + (
        " (was it written with other model flags: --model, --width, --depth, --channels, --d-model?)")


def _names(keys: list[str], shown: int) -> str:
    head = ", ".join(keys[:shown]) + (f" and {len(keys) - shown} more" if len(keys) > shown else "")
    return head + (" is" if len(keys) == 1 else " are")


def _flat(e: BaseException, limit: int = 600) -> str:
    """The whole message on one line (torch's load_state_dict puts the reasons on the lines after the first)."""
    text = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
    return f"{type(e).__name__}: {text[:limit]}" if text else type(e).__name__


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
