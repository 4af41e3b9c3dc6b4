"""What one epoch measured: losses, step times, skipped steps and one memory sample.

Nothing here reads a tensor on the host per step: losses are summed on the device and read once per epoch; step
times are CUDA events on CUDA (read with the record or a checkpoint), wall-clock on the CPU.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from .. import hardware
from ..guard import StepGuard
from ..memory import MemoryReport, SavedTensorTracker, static_memory
from ..precision import StepResult
from . import distributed
from .results import METRIC_KEYS, EpochRecord

if TYPE_CHECKING:
    from .build import Run

__all__ = ["EpochMeter", "test_metrics"]


def test_metrics(task: Any, metrics: dict[str, float | None], loss: float) -> dict[str, Any]:
    """The :class:`EpochRecord` fields of an evaluation (task, main metric, ``test_loss``, the task's metrics)."""
    fields = {"task": task.name, "metric": METRIC_KEYS[task.main], "test_loss": loss, "test_accuracy": None}
    for name, value in metrics.items():
        if name != "loss":
            fields[METRIC_KEYS[name]] = value
    return fields


class EpochMeter:
    """Per-step accounting of one epoch; :meth:`record` turns it into the epoch's :class:`EpochRecord`.
    ``sample_at``: the batch whose step is watched for saved activations."""

    def __init__(self, run: Run, *, sample_at: int, first_batch: int, partial: dict[str, Any] | None = None,
                 guard: StepGuard | None = None) -> None:
        self.run = run
        self.sample_at = sample_at
        self.pos = first_batch
        """Next batch of the loader: where a checkpoint taken now resumes."""
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=run.device)
        self.losses: list[torch.Tensor] = []
        self._times: list[float] = []
        self._skipped = 0  # before a resume, and (without a guard) counted from the steps' results
        self.guard = guard
        self._guard_base = 0 if guard is None else guard.last.skipped
        self.n_steps = 0
        self.memory: MemoryReport | dict | None = None
        self.elapsed_before = 0.0
        """Wall time the epoch had already run before a resume."""
        self._starts: list[int] = []
        """The first batch of each step taken by this meter (not those before a resume)."""
        if partial:
            self._load_state_dict(partial)
        hardware.synchronize(run.device)
        self.t_start = self.t_prev = time.perf_counter()
        self._events: list[tuple[Any, Any]] = []  # CUDA: (after the previous step, after this one) per unread step
        self._mark = self._event()

    def _event(self):
        """A CUDA timing event recorded now on the current stream (None on other devices)."""
        if self.run.device.type != "cuda":
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    @property
    def step_times(self) -> list[float]:
        """Seconds per step (on CUDA read from the events: waits for the device)."""
        if self._events:
            self._events[-1][1].synchronize()
            self._times += [a.elapsed_time(b) / 1000 for a, b in self._events]
            self._events = []
        return self._times

    @property
    def skipped(self) -> int:
        """Steps of the epoch the loss scaler skipped, as of the guard's last read (the loop reads it at every
        log line, evaluation, checkpoint and the epoch's end)."""
        if self.guard is None:
            return self._skipped
        return self._skipped + self.guard.last.skipped - self._guard_base

    @property
    def last_start(self) -> int:
        """The first batch of the last step this meter took."""
        return self._starts[-1]

    def rewind(self, n_steps: int) -> None:
        """Keep the epoch's first ``n_steps`` steps only (those before a halted run's halt, :mod:`mixprec.guard`):
        its losses, times and position; skips past the halt were never counted."""
        drop = self.n_steps - n_steps
        if drop <= 0:
            return
        assert drop <= len(self._starts), "rewind past the steps this meter took"
        times = self.step_times
        self.pos = self._starts[len(self._starts) - drop]
        del self._starts[len(self._starts) - drop:], self.losses[n_steps:], times[n_steps:]
        self.n_steps = n_steps
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=self.run.device)
        for loss in self.losses:
            self.loss_sum += loss

    def state_dict(self) -> dict[str, Any]:
        """The running sums a mid-epoch checkpoint keeps, one row per rank (a collective: every rank calls it)."""
        losses = torch.stack(self.losses).detach().float() if self.losses else torch.zeros(0, device=self.run.device)
        return {
            "n_steps": self.n_steps, "skipped": self.skipped, "step_times": list(self.step_times),
            "loss_sum": distributed.rows_over_ranks(self.loss_sum.detach()).cpu(),
            "losses": distributed.rows_over_ranks(losses).cpu(),
            "memory": self.memory.to_dict() if isinstance(self.memory, MemoryReport) else self.memory,
            "elapsed": self.elapsed_before + time.perf_counter() - self.t_start,
        }

    def _load_state_dict(self, d: dict[str, Any]) -> None:
        dev = self.run.device
        self.n_steps, self._skipped = int(d["n_steps"]), int(d["skipped"])
        self._times = [float(t) for t in d["step_times"]]
        loss_sum, losses = d["loss_sum"], d["losses"]
        if loss_sum.dim() == 1:  # one row per rank (several processes): this rank's
            loss_sum, losses = loss_sum[self.run.rank], losses[self.run.rank]
        self.loss_sum = loss_sum.to(device=dev, dtype=torch.float64)
        self.losses = list(losses.to(dev).unbind(0))
        self.memory = d.get("memory")
        self.elapsed_before = float(d["elapsed"])

    def tracker_for(self, batch_idx: int) -> SavedTensorTracker | None:
        """A saved-tensor tracker when this step is the sampled one (CUDA peak stats reset too)."""
        if batch_idx != self.sample_at:
            return None
        if self.run.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.run.device)
        return SavedTensorTracker(exclude=self.run.model.parameters())

    def step_done(self, loss: torch.Tensor, result: StepResult, next_pos: int,
                  tracker: SavedTensorTracker | None, *, start: int | None = None) -> None:
        """Account for a step (``start``: its first batch); reads nothing on the host with a guard."""
        if tracker is not None:
            self.memory = self._memory_sample(tracker)
        self.n_steps += 1
        self._starts.append(self.pos if start is None else start)
        self.pos = next_pos
        self.loss_sum += loss
        self.losses.append(loss)
        if self.guard is None:
            self._skipped += int(result.skipped)
        if self._mark is not None:
            end = self._event()
            self._events.append((self._mark, end))
            self._mark = end
        else:
            now = time.perf_counter()
            self._times.append(now - self.t_prev)
            self.t_prev = now

    def _memory_sample(self, tracker: SavedTensorTracker) -> MemoryReport:
        run = self.run
        rep = static_memory(run.model, run.optimizer, run.recipe.master)
        rep.add_saved(tracker)  # activations, autocast weight copies, FP8 buffers
        if run.device.type == "cuda":
            rep.cuda_peak_allocated = torch.cuda.max_memory_allocated(run.device)
            rep.cuda_peak_reserved = torch.cuda.max_memory_reserved(run.device)
        return rep

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Leave what runs inside (a mid-epoch evaluation) out of the epoch's time and the next step's time."""
        hardware.synchronize(self.run.device)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            hardware.synchronize(self.run.device)
            pause = time.perf_counter() - t0
            self.t_start += pause
            self.t_prev += pause
            if self._mark is not None:
                self._mark = self._event()

    def elapsed(self) -> float:
        """Wall time of the epoch's steps (synchronized; the slowest rank's under torchrun)."""
        hardware.synchronize(self.run.device)
        return distributed.max_over_ranks(self.elapsed_before + time.perf_counter() - self.t_start,
                                          self.run.device)

    def record(self, epoch: int, epoch_time: float, metrics: dict[str, float | None], test_loss: float) -> EpochRecord:
        """The epoch's record from the evaluation's metrics and loss (reads the losses on the host, once)."""
        run, cfg = self.run, self.run.config.optim
        samples_per_step = cfg.batch_size * cfg.grad_accum * run.world_size
        curve = distributed.mean_over_ranks(torch.stack(self.losses).float()).cpu().tolist()
        return EpochRecord(
            epoch=epoch,
            steps=self.n_steps,
            train_loss=distributed.mean_over_ranks(self.loss_sum).item() / self.n_steps,
            **test_metrics(run.task, metrics, test_loss),
            epoch_time_s=epoch_time,
            samples_per_s=self.n_steps * samples_per_step / epoch_time,
            step_times_s=list(self.step_times),
            loss_curve=curve,
            skipped_steps=self.skipped,
            loss_scale=run.recipe.loss_scale(),
            memory=self.memory.to_dict() if isinstance(self.memory, MemoryReport) else self.memory,
        )
