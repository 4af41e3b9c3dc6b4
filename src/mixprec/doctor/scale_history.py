"""Loss-scale history: per step, the scale its backward used, whether the step was skipped, and why.

The cause of a skipped step is the first non-finite op of that step (from
:class:`~mixprec.doctor.nonfinite.NonFiniteWatch`), classified by replaying it at lower scales: a
*scale overflow* is finite at some smaller scale (the dynamic scaler's backoff is doing its job); any
other non-finite value is a real fault that the scaler can only hide by skipping.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from typing import Any

__all__ = ["StepRecord", "ScaleHistory"]


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
    records: list[StepRecord] = dataclasses.field(default_factory=list)

    def add(self, rec: StepRecord) -> None:
        self.records.append(rec)

    @property
    def skipped(self) -> int:
        return sum(r.skipped for r in self.records)

    def causes(self) -> dict[str, int]:
        return dict(Counter(r.cause.split(":")[0] for r in self.records if r.cause))

    def summary(self) -> dict[str, Any]:
        scales = [r.scale for r in self.records]
        return {
            "steps": len(self.records),
            "skipped": self.skipped,
            "causes": self.causes(),
            "first_scale": scales[0] if scales else math.nan,
            "final_scale": self.records[-1].next_scale if self.records else math.nan,
            "min_scale": min(scales) if scales else math.nan,
            "max_scale": max(scales) if scales else math.nan,
            "stopped": any(r.stopped for r in self.records),
        }

    def to_dict(self) -> dict[str, Any]:
        return {"summary": self.summary(), "steps": [dataclasses.asdict(r) for r in self.records]}
