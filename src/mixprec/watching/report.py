"""The watch's report: the doctor's report for the sections both have, plus the watch's own.

``watch.json`` holds doctor.json's keys for the shared sections (``title``, ``recipe``, ``ranges``,
``nonfinite``, ``lost_updates``, ``loss_scale_history``, ``recommendations``; built by the same
:class:`~mixprec.doctor.report.DoctorReport`, so they cannot drift apart) and adds ``watch`` (settings,
counters, host reads), ``triggers`` (with their captures) and ``samples`` (per sampled step: per-layer
ranges, gradient norms, lost updates). ``report.txt`` renders the doctor's sections 2-5 in the doctor's
format, with the watch's triggers first and its per-layer gradient norms after.

The loss-scale history keeps every step of the first :data:`KEEP_FIRST`, then the steps with an event
(skipped, a cause, a scale change) and the sampled ones, at most :data:`MAX_KEPT`; its summary counts all.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from typing import Any

from ..doctor.attribution import display_path
from ..doctor.report import DoctorReport
from ..doctor.scale_history import ScaleHistory, StepRecord

__all__ = ["WatchReport", "WatchHistory", "KEEP_FIRST", "MAX_KEPT", "SAMPLES_IN_JSON"]

KEEP_FIRST = 100
MAX_KEPT = 5000
SAMPLES_IN_JSON = 200
"""watch.json keeps the per-layer rows of the last this many samples (the time series keep all)."""


@dataclasses.dataclass
class WatchHistory(ScaleHistory):
    """A :class:`ScaleHistory` that keeps the interesting steps of a long run and counts all of them."""

    total: int = 0
    skipped_total: int = 0
    cause_counts: Counter = dataclasses.field(default_factory=Counter)
    first_scale: float = math.nan
    final_scale: float = math.nan
    min_scale: float = math.inf
    max_scale: float = -math.inf

    def add_step(self, rec: StepRecord, sampled: bool) -> None:
        if self.total == 0:
            self.first_scale = rec.scale
        self.total += 1
        self.skipped_total += rec.skipped
        if rec.cause:
            self.cause_counts[rec.cause.split(":")[0]] += 1
        self.final_scale = rec.next_scale
        self.min_scale, self.max_scale = min(self.min_scale, rec.scale), max(self.max_scale, rec.scale)
        event = rec.skipped or rec.cause or rec.next_scale != rec.scale
        if len(self.records) < MAX_KEPT and (self.total <= KEEP_FIRST or event or sampled):
            self.records.append(rec)

    @property
    def skipped(self) -> int:
        return self.skipped_total

    def causes(self) -> dict[str, int]:
        return dict(self.cause_counts)

    def summary(self) -> dict[str, Any]:
        none = self.total == 0
        return {"steps": self.total, "skipped": self.skipped_total, "causes": self.causes(),
                "first_scale": self.first_scale, "final_scale": self.final_scale,
                "min_scale": math.nan if none else self.min_scale, "max_scale": math.nan if none else self.max_scale,
                "stopped": False, "kept_steps": len(self.records)}


@dataclasses.dataclass
class WatchReport:
    doctor: DoctorReport
    """The shared sections (its precision map is None: the watch does not record one)."""
    watch: dict[str, Any]
    triggers: list[dict[str, Any]]
    samples: list[dict[str, Any]]
    series: list[dict[str, Any]]
    """Per sample: step, loss scale, lost-update fraction, per-layer gradient underflow (for the plots)."""

    def to_dict(self) -> dict[str, Any]:
        d = self.doctor.to_dict()
        del d["precision_map"]
        d["watch"] = self.watch
        d["triggers"] = self.triggers
        d["samples"] = self.samples[-SAMPLES_IN_JSON:]
        d["series"] = self.series
        return d

    def render(self) -> str:
        t, w, doc = self.doctor.title, self.watch, self.doctor
        lines = [f"mixprec watch: {t.get('recipe')} [{t.get('impl')}] on {t.get('model', '?')}, {w['steps']} steps "
                 f"({w['samples']} sampled, every {w['every']}), {t.get('params', 0):,} params, {t.get('device')}",
                 f"  {t.get('describe', '')}", ""]
        lines += self._render_triggers() + [""]
        ranges = doc.render_ranges()
        ranges[0] = (f"2. Range profile (the real step's values on each of {doc.ranges.steps} sampled steps, gradients "
                     "unscaled; binade e holds |x| in [2^e, 2^(e+1)); fp16 fits e <= 15, normal from e = -14, zero "
                     "below e = -26)")
        lines += ranges + [""]
        lines += doc.render_nonfinite() + [""]
        lines += doc.render_lost() + [""]
        lines += doc.render_history() + [""]
        lines += self._render_norms() + [""]
        lines.append("Recommendations")
        lines += [f"  - {r['text']}" for r in doc.recommendations()]
        return "\n".join(lines)

    def _render_triggers(self) -> list[str]:
        w = self.watch
        reads = w["host_reads"]
        by = ", ".join(f"{k} {v}" for k, v in sorted(reads["by_reason"].items())) or "none"
        lines = [f"1. Watch: {w['skipped']} skipped, {w['nonfinite_steps']} non-finite of {w['steps']} steps",
                 f"  host reads of its own per unsampled step: {reads['per_unsampled_step']}; {reads['unsampled']} "
                 f"on {reads['unsampled_steps']} unsampled steps; all reads: {by}"]
        if not self.triggers:
            lines.append("  no trigger fired (non-finite loss or gradients, loss-scale collapse, a run of skipped steps)")
        for tr in self.triggers:
            where = f" (rank {tr['rank']})" if tr.get("rank") else ""
            lines.append(f"  trigger at step {tr['step']}{where}: {tr['kind']}: {tr['description']}")
            if tr.get("capture"):
                lines.append(f"    captured to {tr['capture']} ({tr['capture_bytes'] / 2**20:.2f} MiB; rerun with "
                             "mixprec.watching.analyze_capture(path, model))")
        return lines

    def _render_norms(self) -> list[str]:
        last = next((s for s in reversed(self.samples) if any(r["grad_norm"] is not None for r in s["layers"])), None)
        if last is None:
            return ["6. Gradient norms per layer: no sampled step reached the optimizer"]
        rows = [[display_path(r["layer"]), f"{r['grad_norm']:.3e}"] for r in last["layers"] if r["grad_norm"] is not None]
        from ..doctor.report import text_table

        return [f"6. Gradient norms per layer (unscaled ||g||_2 at sampled step {last['step']})"] + text_table(
            ["layer", "grad norm"], rows)
