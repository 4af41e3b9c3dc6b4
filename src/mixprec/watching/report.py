"""The watch's report: the probes' findings (:class:`~mixprec.probes.report.Findings`) plus the watch's own.

``watch.json`` holds doctor.json's keys for the shared sections (``title``, ``recipe``, ``ranges``,
``nonfinite``, ``lost_updates``, ``loss_scale_history``, ``recommendations``) and adds ``watch`` (settings,
counters, host reads), ``triggers`` (with their captures), ``samples`` (per sampled step: per-layer ranges,
gradient norms, lost updates) and ``series``. ``report.txt`` renders the shared sections 2-5 as the doctor does,
with the watch's triggers first and its per-layer gradient norms after.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..probes.attribution import display_path
from ..probes.report import Findings, text_table

__all__ = ["WatchReport", "SAMPLES_IN_JSON"]

SAMPLES_IN_JSON = 200
"""watch.json keeps the per-layer rows of the last this many samples (the time series keep all)."""


@dataclasses.dataclass
class WatchReport:
    findings: Findings
    """The shared sections (its precision map is None: the watch does not record one)."""
    watch: dict[str, Any]
    triggers: list[dict[str, Any]]
    samples: list[dict[str, Any]]
    series: list[dict[str, Any]]
    """Per sample: step, loss scale, lost-update fraction, per-layer gradient underflow (for the plots)."""

    def to_dict(self) -> dict[str, Any]:
        d = self.findings.to_dict()
        del d["precision_map"]
        d["watch"] = self.watch
        d["triggers"] = self.triggers
        d["samples"] = self.samples[-SAMPLES_IN_JSON:]
        d["series"] = self.series
        return d

    def render(self) -> str:
        t, w, doc = self.findings.title, self.watch, self.findings
        lines = [f"mixprec watch: {t.get('recipe')} [{t.get('impl')}] on {t.get('model', '?')}, {w['steps']} steps "
                 f"({w['samples']} sampled, every {w['every']}), {t.get('params', 0):,} params, {t.get('device')}",
                 f"  {t.get('describe', '')}", ""]
        source = f"the real step's values on each of {doc.ranges.steps} sampled steps, gradients unscaled"
        for section in (self._render_triggers(), doc.render_ranges(source), doc.render_nonfinite(),
                        doc.render_lost(), doc.render_history(), self._render_norms()):
            lines += section + [""]
        return "\n".join(lines + doc.render_recommendations())

    def _render_triggers(self) -> list[str]:
        w = self.watch
        reads = w["host_reads"]
        by = ", ".join(f"{k} {v}" for k, v in sorted(reads["by_reason"].items())) or "none"
        dropped = w.get("dropped", 0)
        by_loop = f" ({dropped} ended by the loop without an optimizer step)" if dropped else ""
        lines = [f"1. Watch: {w['skipped']} skipped{by_loop}, {w['nonfinite_steps']} non-finite of {w['steps']} steps",
                 f"  host reads of its own per unsampled step: {reads['per_unsampled_step']}; {reads['unsampled']} "
                 f"on {reads['unsampled_steps']} unsampled steps; all reads: {by}"]
        if not self.triggers:
            lines.append("  no trigger fired (non-finite loss or gradients, loss-scale collapse, a run of skipped "
                         "steps)")
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
        rows = [[display_path(r["layer"]), f"{r['grad_norm']:.3e}"] for r in last["layers"]
                if r["grad_norm"] is not None]
        return [f"6. Gradient norms per layer (unscaled ||g||_2 at sampled step {last['step']})"] + text_table(
            ["layer", "grad norm"], rows)
