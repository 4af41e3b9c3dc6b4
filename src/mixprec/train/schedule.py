"""The learning-rate schedule: ``--lr-schedule constant|cosine|linear``, ``--lr-warmup-steps``, ``--min-lr``.

The schedule is a pure function of the optimizer-step counter (``global_step``, the number of optimizer steps
taken before this one), so a resumed run, which restores the counter, sets exactly the learning rates the
uninterrupted run set; nothing else is saved. Before every optimizer step the loop sets each parameter group's
``lr`` to :meth:`LRSchedule.rate` of that step. For a step ``s`` of a schedule over ``T`` steps with ``W``
warmup steps, base rate ``lr`` (``--lr``, or the group's own rate for a user optimizer) and floor ``min``:

- warmup, ``s < W``: ``lr * s / W`` — linear from 0 (step 0 runs at 0, as Hugging Face's schedules do);
- then, with ``p = (s - W) / (T - W)`` (clamped to 1): ``constant`` ``lr``; ``linear`` ``min + (lr - min) *
  (1 - p)``; ``cosine`` ``min + (lr - min) * (1 + cos(pi * p)) / 2``. Both reach ``min`` at step ``T`` and
  stay there (the last step of a run of ``T`` steps is ``T - 1``, just above the floor).

**T, the schedule's total** (``--lr-total-steps``, default: the run's planned optimizer steps): ``min(epochs x
ceil(batches per epoch / grad_accum), --max-steps)`` — the steps the loop will take, computed when the run is
first built and stored in its config (checkpoints, ``--metrics-json``). A resume keeps it, so extending a run
with ``--epochs`` or ``--max-steps`` trains the extra steps at the floor instead of re-shaping the steps
already taken.

**Skipped steps count.** A step the loss scaler skips (inf/nan gradients) advances ``global_step`` like any
other, so the schedule follows the step counter, ends where the run ends, and a skipped step's rate is simply
not used. (PyTorch's ``LambdaLR`` stepped every iteration does the same.)

A user optimizer with several parameter groups keeps their ratios: each group's rate is its own base rate
(what the factory gave it) times the schedule's shape, and its floor ``min * base / lr``.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..errors import ConfigError

__all__ = ["SCHEDULES", "LRSchedule", "planned_steps"]

SCHEDULES = ("constant", "cosine", "linear")


def planned_steps(epochs: int, batches_per_epoch: int, grad_accum: int, max_steps: int | None) -> int:
    """The optimizer steps a run takes: ``min(epochs x ceil(batches / grad_accum), max_steps)``."""
    total = math.ceil(batches_per_epoch / grad_accum) * epochs
    return total if max_steps is None else min(total, max_steps)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LRSchedule:
    """A schedule bound to the base rates of an optimizer's parameter groups (see the module docstring)."""

    kind: str
    """constant, cosine or linear."""
    lr: float
    """``--lr``: the rate the schedule's ``min_lr`` is relative to."""
    warmup_steps: int = 0
    """Steps of linear warmup from 0."""
    min_lr: float = 0.0
    """Floor of the cosine/linear decay (0 for constant)."""
    total_steps: int | None = None
    """Step at which cosine/linear reach ``min_lr`` (None for constant)."""
    base_lrs: tuple[float, ...] = ()
    """Each parameter group's rate as the optimizer was built (the schedule's 1.0)."""

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise ConfigError(f"unknown --lr-schedule {self.kind!r}; choose one of: {', '.join(SCHEDULES)}")
        if self.kind != "constant":
            if self.total_steps is None:
                raise ConfigError(f"--lr-schedule {self.kind} needs the schedule's total steps")
            if self.warmup_steps >= self.total_steps:
                raise ConfigError(f"--lr-warmup-steps {self.warmup_steps} leaves no steps to decay over: the "
                                  f"{self.kind} schedule spans {self.total_steps} optimizer steps (the run's "
                                  "planned steps, or --lr-total-steps); use fewer warmup steps or more steps")

    @classmethod
    def for_optimizer(cls, optimizer: torch.optim.Optimizer, **fields) -> LRSchedule:
        """The schedule over ``optimizer``'s groups, their current rates taken as the base rates."""
        return cls(**fields, base_lrs=tuple(_value(g["lr"]) for g in optimizer.param_groups))

    def rate(self, step: int, base: float | None = None) -> float:
        """The rate of optimizer step ``step`` (0-based) for a group whose base rate is ``base`` (default
        ``lr``)."""
        base = self.lr if base is None else base
        if step < self.warmup_steps:
            return base * step / self.warmup_steps
        if self.kind == "constant":
            return base
        floor = self.min_lr if base == self.lr else self.min_lr * base / self.lr
        progress = min(1.0, (step - self.warmup_steps) / (self.total_steps - self.warmup_steps))
        if progress >= 1.0:
            return floor
        shape = 1.0 - progress if self.kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return floor + (base - floor) * shape

    def apply(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        """Set every group's rate for optimizer step ``step`` (a tensor ``lr`` is filled in place)."""
        for group, base in zip(optimizer.param_groups, self.base_lrs, strict=True):
            value = self.rate(step, base)
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(value)
            else:
                group["lr"] = value

    def describe(self) -> str:
        """One line for the run's announcement."""
        warm = f"{self.warmup_steps} warmup steps from 0, then " if self.warmup_steps else ""
        if self.kind == "constant":
            return f"lr schedule: {warm}constant {self.lr:g}"
        return (f"lr schedule: {warm}{self.kind} from {self.lr:g} to {self.min_lr:g} at step {self.total_steps} "
                "(skipped steps count)")


def _value(lr: float | torch.Tensor) -> float:
    return float(lr.item()) if isinstance(lr, torch.Tensor) else float(lr)
