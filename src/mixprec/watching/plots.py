"""The watch's PNGs (:mod:`mixprec.probes.plots`; written atomically).

* ``scale_history.png``: the loss scale per step, skipped steps by cause, the loss (the doctor's loss_scale.png);
* ``underflow_over_time.png``: per layer (the worst few), the share of gradient values that underflow the run's
  low format at the current loss scale, at each sampled step;
* ``lost_updates_over_time.png``: the share of non-zero updates rounded away, per sampled step;
* ``ranges_activations.png`` / ``ranges_gradients.png``: the per-layer range heatmaps of the samples.
"""

from __future__ import annotations

import os

from ..jsonio import write_figure
from ..probes.plots import figure, loss_scale_plot, range_heatmaps
from .report import WatchReport

__all__ = ["write_plots"]

_TOP_LAYERS = 8


def write_plots(report: WatchReport, out_dir: str) -> list[str]:
    """Write the PNGs into ``out_dir``; returns their paths (none without matplotlib)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return []
    findings = report.findings
    head = f"{findings.title.get('recipe')} on {findings.title.get('model')}"
    draws = [lambda: loss_scale_plot(os.path.join(out_dir, "scale_history.png"), findings, head),
             lambda: _underflow(report, os.path.join(out_dir, "underflow_over_time.png"), head),
             lambda: _lost(report, os.path.join(out_dir, "lost_updates_over_time.png"), head)]
    if findings.ranges.layers:
        draws += range_heatmaps(findings, out_dir, head)
    return [p for draw in draws if (p := draw())]


def _underflow(report: WatchReport, path: str, head: str) -> str | None:
    series = report.series
    if not series:
        return None
    layers: dict[str, list[tuple[int, float]]] = {}
    for s in series:
        for layer, v in s["gradient_underflow"].items():
            layers.setdefault(layer, []).append((s["step"], v))
    worst = sorted(layers, key=lambda k: -max(v for _, v in layers[k]))[:_TOP_LAYERS]
    fig = figure(7.5, 3.4)
    ax = fig.add_subplot(1, 1, 1)
    for layer in worst:
        pts = layers[layer]
        ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker="o", ms=3, label=layer or "(model)")
    ax.set_xlabel("sampled step")
    ax.set_ylabel(f"gradients underflowing {series[-1]['format']} (%)")
    ax.legend(fontsize=6, loc="upper right")
    ax.set_title(f"{head}: per-layer gradient underflow at the current loss scale", fontsize=9)
    fig.tight_layout()
    write_figure(fig, path)
    return path


def _lost(report: WatchReport, path: str, head: str) -> str | None:
    pts = [(s["step"], s["lost_fraction"]) for s in report.series if s["lost_fraction"] is not None]
    if not pts:
        return None
    fig = figure(7.5, 3.0)
    ax = fig.add_subplot(1, 1, 1)
    ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker="o", ms=3, color="tab:orange")
    ax.set_ylim(0, 100)
    ax.set_xlabel("sampled step")
    ax.set_ylabel("updates rounded away (%)")
    ax.set_title(f"{head}: lost updates (low(w + d) == w) per sampled step", fontsize=9)
    fig.tight_layout()
    write_figure(fig, path)
    return path
