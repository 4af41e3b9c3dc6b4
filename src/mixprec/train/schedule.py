"""The learning-rate schedule: ``--lr-schedule constant|cosine|linear``, ``--lr-warmup-steps``, ``--min-lr``.

A pure function of ``global_step`` (skipped steps count), so a resumed run sets exactly the uninterrupted run's
rates. For step ``s`` over ``T`` steps, ``W`` warmup steps, base ``lr`` and floor ``min``: warmup ``lr * s / W``;
then with ``p = (s - W) / (T - W)`` clamped to 1, ``constant`` ``lr``, ``linear`` ``min + (lr - min) * (1 - p)``,
``cosine`` ``min + (lr - min) * (1 + cos(pi * p)) / 2``. ``T`` (``--lr-total-steps``) defaults to the run's
planned optimizer steps, fixed at the first build and kept on resume. Several parameter groups keep their ratios.
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
