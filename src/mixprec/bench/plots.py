"""PNG plots of a bench: time bars, memory bars by category, loss curves, the task's main metric. Drawn with
``matplotlib.figure.Figure`` and its Agg canvas, never ``pyplot`` (no display, no global backend); without the
optional matplotlib :func:`write_plots` says so and writes nothing."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from ..jsonio import write_figure
from .aggregate import as_results
from .parity import default_window, fp32_band, smooth
from .report import MEMORY_CATEGORIES, as_rows
from .results import RunResult, SummaryRow, number

__all__ = ["write_plots", "PLOT_FILES"]

PLOT_FILES = ("time.png", "memory.png", "loss.png", "metric.png")

_METRIC_LABELS = {"test_accuracy": "test accuracy", "test_f1": "test F1", "test_r2": "test R²",
                  "test_loss": "test loss"}


def _figure(w: float = 8.0, h: float = 4.0):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w, h), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _time_plot(rows: list[SummaryRow], path: str, title: str) -> None:
    fig = _figure()
    ax = fig.add_subplot()
    names = [r.recipe for r in rows]
    times = [r.epoch_time_s for r in rows]
    med = [(number(t.median) if t else None) or 0.0 for t in times]
    lo = [max(0.0, m - (number(t.min) or m)) if t else 0.0 for m, t in zip(med, times)]
    hi = [max(0.0, (number(t.max) or m) - m) if t else 0.0 for m, t in zip(med, times)]
    bars = ax.bar(names, med, yerr=[lo, hi], capsize=4, color="#4C72B0")
    for b, r, m in zip(bars, rows, med):
        s = number(r.speedup_vs_fp32)
        text = f"{s:.2f}x" if s else ("failed" if not m else "")
        ax.annotate(text, (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom",
                    xytext=(0, 3), textcoords="offset points", fontsize=8)
    ax.set_ylabel("epoch time (s), median, min..max over repeats")
    ax.set_title(title, fontsize=9)
    write_figure(fig, path)


def _memory_plot(rows: list[SummaryRow], path: str, title: str) -> None:
    fig = _figure()
    ax = fig.add_subplot()
    names = [r.recipe for r in rows]
    mems = [r.memory or {} for r in rows]
    bottom = [0.0] * len(rows)
    mib = 2.0**20
    for cat in MEMORY_CATEGORIES:
        vals = [(number(m.get(cat)) or 0) / mib for m in mems]
        ax.bar(names, vals, bottom=bottom, label=cat.replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, vals)]
    measured_x, measured_y = [], []
    for n, r, m in zip(names, rows, mems):
        total = _measured_total(r)
        if total is not None:
            measured_x.append(n)
            measured_y.append(total / mib)
    if measured_x:
        ax.scatter(measured_x, measured_y, marker="D", color="black", zorder=3,
                   label="measured (static + measured step peak)")
    ax.set_ylabel("MiB (exact accounting of a sampled step)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    write_figure(fig, path)


def _measured_total(row: SummaryRow) -> float | None:
    """The memory plot's measured point: the static state + the measured step peak; None without both."""
    step, mem = number(row.measured_step_peak_bytes), row.memory
    if not step or not mem:
        return None
    return sum(number(mem.get(k)) or 0 for k in ("parameters", "optimizer_state", "master_weights")) + step


def _loss_plot(rows: list[SummaryRow], results: list[RunResult], path: str, title: str) -> None:
    fig = _figure()
    ax = fig.add_subplot()
    curves_by = {r.recipe: [c for x in results if x.recipe == r.recipe for c in [x.loss_curve()] if c] for r in rows}
    n_all = [len(c) for cs in curves_by.values() for c in cs]
    window = default_window(min(n_all)) if n_all else 1
    fp32 = curves_by.get("fp32") or []
    if len(fp32) >= 2:
        lo, hi, _ = fp32_band(fp32, window=window)
        ax.fill_between(range(len(lo)), lo, hi, color="gray", alpha=0.3, label="fp32 band across seeds")
    for name, cs in curves_by.items():
        if not cs:
            continue
        n = min(len(c) for c in cs)
        mean = sum(smooth(c[:n], window) for c in cs) / len(cs)
        ax.plot(range(n), mean, label=f"{name} (mean of {len(cs)})", linewidth=1.2)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(f"training loss (moving average of {window})")
    ax.set_title(title, fontsize=9)
    if ax.get_legend_handles_labels()[0]:  # no successful run: no curves, and no empty-legend warning
        ax.legend(fontsize=7)
    write_figure(fig, path)


def _metric_plot(rows: list[SummaryRow], path: str, title: str) -> None:
    fig = _figure()
    ax = fig.add_subplot()
    names = [r.recipe for r in rows]
    spreads = [r.test_metric for r in rows]
    med = [(number(t.median) if t else None) for t in spreads]
    lo = [max(0.0, m - (number(t.min) or m)) if t and m is not None else 0.0 for m, t in zip(med, spreads)]
    hi = [max(0.0, (number(t.max) or m) - m) if t and m is not None else 0.0 for m, t in zip(med, spreads)]
    ax.bar(names, [m or 0.0 for m in med], yerr=[lo, hi], capsize=4, color="#55A868")
    for i, m in enumerate(med):
        ax.annotate("—" if m is None else f"{m:.4g}", (i, m or 0.0), ha="center", va="bottom", xytext=(0, 3),
                    textcoords="offset points", fontsize=8)
    metric = next((r.metric for r in rows if r.metric), "test_accuracy")
    ax.set_ylabel(f"{_METRIC_LABELS.get(metric, metric)}, median, min..max over repeats")
    ax.set_title(title, fontsize=9)
    write_figure(fig, path)


def write_plots(rows: Iterable[SummaryRow | dict[str, Any]], results: Iterable[RunResult | dict[str, Any]],
                out_dir: str, *, title: str) -> list[str]:
    """Write :data:`PLOT_FILES` into ``out_dir`` from rows and results as records or dicts; returns the names."""
    rows = as_rows(r for r in rows if isinstance(r, (SummaryRow, dict)))
    results = as_results(results)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("mixprec bench: matplotlib is not installed, so no plots (pip install 'mixprec[plots]')")
        return []
    _time_plot(rows, os.path.join(out_dir, PLOT_FILES[0]), title)
    _memory_plot(rows, os.path.join(out_dir, PLOT_FILES[1]), title)
    _loss_plot(rows, results, os.path.join(out_dir, PLOT_FILES[2]), title)
    _metric_plot(rows, os.path.join(out_dir, PLOT_FILES[3]), title)
    return list(PLOT_FILES)
