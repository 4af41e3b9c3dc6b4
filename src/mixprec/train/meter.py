"""What one epoch measured: losses, step times, skipped steps and one memory sample.

Nothing here reads a tensor on the host per step: losses are kept as device tensors and summed there; the
epoch record reads them once at the end. Step times are wall-clock differences between consecutive steps
(every recipe syncs the host once per step, so they cannot drift ahead of the device by more than a step).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from .. import hardware
from ..memory import MemoryReport, SavedTensorTracker, static_memory
from ..precision import StepResult
from . import distributed
from .results import METRIC_KEYS, EpochRecord

if TYPE_CHECKING:
    from .build import Run

__all__ = ["EpochMeter", "test_metrics"]


def test_metrics(task: Any, metrics: dict[str, float | None], loss: float) -> dict[str, Any]:
    """The :class:`EpochRecord` fields of an evaluation: the task's name and main metric (as a record key),
    ``test_loss``, ``test_accuracy`` (None for tasks without one) and the task's other metrics by their
    record keys (``test_f1``, ``test_r2``, ``bits_per_char``...)."""
    fields = {"task": task.name, "metric": METRIC_KEYS[task.main], "test_loss": loss, "test_accuracy": None}
    for name, value in metrics.items():
        if name != "loss":
            fields[METRIC_KEYS[name]] = value
    return fields


class EpochMeter:
    """Per-step accounting of one epoch; :meth:`record` turns it into the epoch's :class:`EpochRecord`.

    Args:
        sample_at: the batch index whose step is watched for saved activations (the first step after
            warm-up, when optimizer state exists).
    """

    def __init__(self, run: Run, *, sample_at: int, first_batch: int, partial: dict[str, Any] | None = None) -> None:
        self.run = run
        self.sample_at = sample_at
        self.pos = first_batch
        """Next batch of the loader: where a checkpoint taken now resumes."""
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=run.device)
        self.losses: list[torch.Tensor] = []
        self.step_times: list[float] = []
        self.skipped = 0
        self.n_steps = 0
        self.memory: MemoryReport | dict | None = None
        self.elapsed_before = 0.0
        """Wall time the epoch had already run before a resume."""
        if partial:
            self._load_state_dict(partial)
        hardware.synchronize(run.device)
        self.t_start = self.t_prev = time.perf_counter()

    def state_dict(self) -> dict[str, Any]:
        """The running sums a mid-epoch checkpoint keeps, so a resumed epoch reports all its steps.

        Under torchrun the losses are each rank's own (the record averages them over ranks), so every rank's
        are kept, one row per rank (a collective: every rank calls this, as it calls ``Checkpointer.save``)."""
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
        self.n_steps, self.skipped = int(d["n_steps"]), int(d["skipped"])
        self.step_times = [float(t) for t in d["step_times"]]
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
                  tracker: SavedTensorTracker | None) -> None:
        if tracker is not None:
            self.memory = self._memory_sample(tracker)
        self.n_steps += 1
        self.pos = next_pos
        self.loss_sum += loss
        self.losses.append(loss)
        self.skipped += int(result.skipped)
        now = time.perf_counter()
        self.step_times.append(now - self.t_prev)
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
