"""Loss-scale history: per step, the scale its backward used, whether the step was skipped, and why.

A step's cause is its :class:`~.replay.FaultAnalysis`, short (a ``scale overflow`` is finite at a smaller scale:
the scaler's backoff handles it; anything else is a fault the scaler can only hide by skipping).
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from typing import Any

__all__ = ["StepRecord", "ScaleHistory", "KEEP_FIRST", "MAX_KEPT"]

KEEP_FIRST = 100
MAX_KEPT = 5000


@dataclasses.dataclass
class StepRecord:
    step: int
    loss: float
    scale: float
    """Loss scale this step's backward used (1 without loss scaling)."""
    next_scale: float
    skipped: bool
    cause: str | None = None
    """Why the loss or a gradient was non-finite (None when all was finite)."""
    stopped: bool = False
    """The recipe raised (non-finite loss without a scaler): training would stop here."""


@dataclasses.dataclass
class ScaleHistory:
    """Every step's record; with ``sparse`` (a long run), every step of the first :data:`KEEP_FIRST`, then those
    with an event (skipped, a cause, a scale change) and the sampled ones, at most :data:`MAX_KEPT`. The summary
    counts every step either way."""

    records: list[StepRecord] = dataclasses.field(default_factory=list)
    sparse: bool = False
    total: int = 0
    skipped_total: int = 0
    cause_counts: Counter = dataclasses.field(default_factory=Counter)
    first_scale: float = math.nan
    final_scale: float = math.nan
    min_scale: float = math.inf
    max_scale: float = -math.inf
    stopped: bool = False

    def add(self, rec: StepRecord, sampled: bool = False) -> None:
        if self.total == 0:
            self.first_scale = rec.scale
        self.total += 1
        self.skipped_total += rec.skipped
        if rec.cause:
            self.cause_counts[rec.cause.split(":")[0]] += 1
        self.final_scale = rec.next_scale
        self.min_scale, self.max_scale = min(self.min_scale, rec.scale), max(self.max_scale, rec.scale)
        self.stopped = self.stopped or rec.stopped
        event = rec.skipped or rec.cause or rec.next_scale != rec.scale
        if not self.sparse or (len(self.records) < MAX_KEPT and (self.total <= KEEP_FIRST or event or sampled)):
            self.records.append(rec)

    @property
    def skipped(self) -> int:
        return self.skipped_total

    def causes(self) -> dict[str, int]:
        return dict(self.cause_counts)

    def summary(self) -> dict[str, Any]:
        none = self.total == 0
        out = {"steps": self.total, "skipped": self.skipped_total, "causes": self.causes(),
               "first_scale": self.first_scale, "final_scale": self.final_scale,
               "min_scale": math.nan if none else self.min_scale, "max_scale": math.nan if none else self.max_scale,
               "stopped": self.stopped}
        if self.sparse:
            out["kept_steps"] = len(self.records)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"summary": self.summary(), "steps": [dataclasses.asdict(r) for r in self.records]}
