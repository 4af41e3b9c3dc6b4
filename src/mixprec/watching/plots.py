"""The watch's PNGs (matplotlib's Agg canvas, no global backend), each written to a temporary file and renamed.

* ``scale_history.png``: log2 loss scale per step, skipped steps marked by cause (a loss-scale overflow that
  the scaler's backoff handles, a fault, other), the loss on a second axis;
* ``underflow_over_time.png``: per layer (the worst few), the share of gradient values that underflow the
  run's low format at the current loss scale, at each sampled step;
* ``lost_updates_over_time.png``: the share of non-zero updates rounded away, per sampled step;
* ``ranges_activations.png`` / ``ranges_gradients.png``: the doctor's per-layer heatmaps of the samples.
"""

from __future__ import annotations

import io
import math
import os
from typing import Any

from ..jsonio import write_bytes

__all__ = ["write_plots"]

_TOP_LAYERS = 8


def _figure(w: float, h: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w, h), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Any, path: str) -> str:
    """Render to memory, then write atomically (:func:`mixprec.jsonio.write_bytes`), as the doctor's plots are."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    write_bytes(path, buf.getvalue())
    return path


def write_plots(report: Any, out_dir: str) -> list[str]:
    """Write the PNGs into ``out_dir``; returns their paths (none without matplotlib)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return []
    head = f"{report.doctor.title.get('recipe')} on {report.doctor.title.get('model')}"
    paths = [_scale_history(report, os.path.join(out_dir, "scale_history.png"), head),
             _underflow(report, os.path.join(out_dir, "underflow_over_time.png"), head),
             _lost(report, os.path.join(out_dir, "lost_updates_over_time.png"), head)]
    paths += _doctor_heatmaps(report, out_dir)
    return [p for p in paths if p]


def _cause_kind(cause: str | None) -> str:
    if not cause:
        return "other"
    return "loss-scale overflow" if cause.startswith("scale overflow") else "fault"


def _scale_history(report: Any, path: str, head: str) -> str | None:
    recs = report.doctor.history.records
    if not recs:
        return None
    fig = _figure(7.5, 3.4)
    ax = fig.add_subplot(1, 1, 1)
    steps = [r.step for r in recs]
    ax.step(steps, [math.log2(max(r.scale, 1e-30)) for r in recs], where="post", label="log2 loss scale")
    colors = {"loss-scale overflow": "tab:orange", "fault": "tab:red", "other": "tab:purple"}
    for kind, color in colors.items():
        sk = [r for r in recs if r.skipped and _cause_kind(r.cause) == kind]
        if sk:
            ax.scatter([r.step for r in sk], [math.log2(max(r.scale, 1e-30)) for r in sk], color=color, marker="x",
                       zorder=3, label=f"skipped: {kind}")
    ax.set_xlabel("step")
    ax.set_ylabel("log2 loss scale")
    ax2 = ax.twinx()
    ax2.plot(steps, [r.loss for r in recs], color="tab:gray", alpha=0.6, label="loss")
    ax2.set_ylabel("loss")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="upper right", fontsize=7)
    ax.set_title(f"{head}: loss scale, skipped steps by cause", fontsize=9)
    fig.tight_layout()
    return _save(fig, path)


def _underflow(report: Any, path: str, head: str) -> str | None:
    series = report.series
    if not series:
        return None
    layers: dict[str, list[tuple[int, float]]] = {}
    for s in series:
        for layer, v in s["gradient_underflow"].items():
            layers.setdefault(layer, []).append((s["step"], v))
    worst = sorted(layers, key=lambda k: -max(v for _, v in layers[k]))[:_TOP_LAYERS]
    fig = _figure(7.5, 3.4)
    ax = fig.add_subplot(1, 1, 1)
    for layer in worst:
        pts = layers[layer]
        ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker="o", ms=3, label=layer or "(model)")
    ax.set_xlabel("sampled step")
    ax.set_ylabel(f"gradients underflowing {series[-1]['format']} (%)")
    ax.legend(fontsize=6, loc="upper right")
    ax.set_title(f"{head}: per-layer gradient underflow at the current loss scale", fontsize=9)
    fig.tight_layout()
    return _save(fig, path)


def _lost(report: Any, path: str, head: str) -> str | None:
    pts = [(s["step"], s["lost_fraction"]) for s in report.series if s["lost_fraction"] is not None]
    if not pts:
        return None
    fig = _figure(7.5, 3.0)
    ax = fig.add_subplot(1, 1, 1)
    ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker="o", ms=3, color="tab:orange")
    ax.set_ylim(0, 100)
    ax.set_xlabel("sampled step")
    ax.set_ylabel("updates rounded away (%)")
    ax.set_title(f"{head}: lost updates (low(w + d) == w) per sampled step", fontsize=9)
    fig.tight_layout()
    return _save(fig, path)


def _doctor_heatmaps(report: Any, out_dir: str) -> list[str]:
    """The doctor's range heatmaps of the samples (only those: the doctor's other plots are the watch's own)."""
    if not report.doctor.ranges.layers:
        return []
    from ..doctor.plots import range_heatmaps

    head = f"{report.doctor.title.get('recipe')} on {report.doctor.title.get('model')}"
    return [p for draw in range_heatmaps(report.doctor, out_dir, head) if (p := draw())]
