"""PNG plots of the probes' findings (matplotlib's Agg canvas, no global backend; written atomically).

* :func:`range_heatmaps`: one row per layer, one column per binade, colour = share of the layer's non-zero values
  there, with each format's limits (max, smallest normal, smallest subnormal) drawn in;
* :func:`loss_scale_plot`: log2 loss scale per step, skipped steps marked by cause, the loss on a second axis;
* :func:`lost_updates_plot`: the lost-update fraction per layer;
* :func:`block_formats_plot`: the block-format what-if table as a heatmap of SQNR per dot product.
"""

from __future__ import annotations

import math
import os

import numpy as np

from ..jsonio import write_figure
from .attribution import display_path
from .block_formats import SHORT
from .ranges import BIN_MIN, Log2Histogram
from .report import Findings

__all__ = ["figure", "range_heatmaps", "loss_scale_plot", "lost_updates_plot", "block_formats_plot"]

_LIMITS = {  # format: (color, log2 max, log2 smallest normal, log2 smallest subnormal)
    "fp16": ("tab:red", math.log2(65504), -14, -24),
    "bf16": ("tab:blue", math.log2(3.39e38), -126, -133),
    "fp8 e4m3": ("tab:green", math.log2(448), -6, -9),
    "fp8 e5m2": ("tab:purple", math.log2(57344), -14, -16),
}
_STYLES = (("-", "max"), ("-.", "smallest normal"), (":", "smallest subnormal"))


def figure(w: float, h: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w, h), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def _heatmap(path: str, names: list[str], hists: list[Log2Histogram], shift: int, title: str) -> str | None:
    ranges = [h.binade_range() for h in hists]
    occupied = [r for r in ranges if r]
    if not occupied:
        return None
    lo = min(r[0] for r in occupied) + shift - 3
    hi = max(r[1] for r in occupied) + shift + 3
    lo, hi = min(lo, -26), max(hi, 17)  # always show fp16's whole range
    cols = np.arange(lo, hi + 1)
    grid = np.zeros((len(hists), len(cols)))
    for i, h in enumerate(hists):
        c = h.counts.numpy().astype(float)
        tot = c.sum()
        if tot == 0:
            continue
        for j, e in enumerate(cols):
            idx = e - shift - BIN_MIN
            if 0 <= idx < len(c):
                grid[i, j] = c[idx] / tot
    fig = figure(max(8.0, 0.11 * len(cols) + 3), max(3.2, 0.32 * len(hists) + 2.4))
    ax = fig.add_subplot(1, 1, 1)
    masked = np.ma.masked_where(grid == 0, grid)
    from matplotlib.colors import LogNorm

    im = ax.imshow(masked, aspect="auto", cmap="viridis", norm=LogNorm(vmin=max(masked.min(), 1e-6), vmax=1.0),
                   extent=(lo - 0.5, hi + 0.5, len(hists) - 0.5, -0.5), interpolation="nearest")
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels(names, fontsize=7)
    ax.set_xlabel("binade e: |x| in [2^e, 2^(e+1))")
    from matplotlib.lines import Line2D

    handles = []
    for fmt, (color, *edges) in _LIMITS.items():
        shown = False
        for x, (style, _) in zip(edges, _STYLES):
            if lo - 0.5 <= x <= hi + 0.5:
                ax.axvline(x, color=color, lw=1.2, ls=style, alpha=0.9)
                shown = True
        if shown:
            handles.append(Line2D([], [], color=color, lw=2, label=fmt))
    handles += [Line2D([], [], color="black", lw=1.2, ls=style, label=what) for style, what in _STYLES]
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, label="share of the layer's non-zero values")
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.45 / fig.get_figheight(), 1, 1))  # leave the bottom 0.45 in for the legend
    write_figure(fig, path)
    return path


def range_heatmaps(findings: Findings, out_dir: str, head: str) -> list:
    """The two range heatmaps (activations; gradients as stored, at the loss scale) as deferred draws, each
    returning its path or None."""
    layers = findings.ranges.layers
    names = [f"{display_path(lr.name)} ({lr.kind})" for lr in layers]
    k = findings.log2_scale
    return [
        lambda: _heatmap(os.path.join(out_dir, "ranges_activations.png"), names, [lr.activations for lr in layers],
                         0, f"{head}: activation magnitudes per layer vs format limits"),
        lambda: _heatmap(os.path.join(out_dir, "ranges_gradients.png"), names, [lr.gradients() for lr in layers],
                         k, f"{head}: gradient magnitudes x loss scale 2^{k} (as stored) vs format limits"),
    ]


_SKIPS = {"loss-scale overflow": "tab:orange", "fault": "tab:red", "other": "tab:purple"}


def _cause_kind(cause: str | None) -> str:
    if not cause:
        return "other"
    return "loss-scale overflow" if cause.startswith("scale overflow") else "fault"


def loss_scale_plot(path: str, findings: Findings, head: str) -> str | None:
    recs = findings.history.records
    if not recs:
        return None
    fig = figure(7.5, 3.4)
    ax = fig.add_subplot(1, 1, 1)
    steps = [r.step for r in recs]
    ax.step(steps, [math.log2(max(r.scale, 1e-30)) for r in recs], where="post", label="log2 loss scale")
    for kind, color in _SKIPS.items():
        sk = [r for r in recs if r.skipped and _cause_kind(r.cause) == kind]
        if sk:
            ax.scatter([r.step for r in sk], [math.log2(max(r.scale, 1e-30)) for r in sk], color=color, marker="x",
                       zorder=3, label=f"skipped: {kind}")
    ax.set_xlabel("step")
    scaled = findings.recipe_spec.get("loss_scaling", False)
    ax.set_ylabel("log2 loss scale" + ("" if scaled else " (no loss scaling: 0)"))
    ax2 = ax.twinx()
    ax2.plot(steps, [r.loss for r in recs], color="tab:gray", alpha=0.6, label="loss")
    ax2.set_ylabel("loss")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="upper right", fontsize=7)
    ax.set_title(f"{head}: loss scale, skipped steps by cause", fontsize=9)
    fig.tight_layout()
    write_figure(fig, path)
    return path


def lost_updates_plot(path: str, findings: Findings, head: str) -> str | None:
    lu = findings.lost_updates.layers
    if not lu:
        return None
    fig = figure(7, max(2.5, 0.3 * len(lu) + 1.2))
    ax = fig.add_subplot(1, 1, 1)
    ax.barh([f"{display_path(x.name)} [{x.dtype}]" for x in lu], [x.lost_fraction for x in lu], color="tab:orange")
    ax.set_xlim(0, 1)
    ax.invert_yaxis()
    ax.set_xlabel("share of non-zero updates rounded away (low(w + d) == w)")
    ax.tick_params(axis="y", labelsize=7)
    ax.set_title(f"{head}: lost updates per layer", fontsize=9)
    fig.tight_layout()
    write_figure(fig, path)
    return path


def block_formats_plot(path: str, findings: Findings, head: str) -> str | None:
    bf = findings.block_formats
    if bf is None or not bf.layers:
        return None
    import matplotlib
    from matplotlib.patches import Rectangle

    fmts, layers = bf.config.formats, bf.worst_first()
    flagged = {(d["layer"], d["format"], d["tensor"]) for d in bf.flagged()}
    rows = [(lr, t) for lr in layers for t in ("x", "w", "dy")]
    cells = [[lr.tensor_cell(t, f) for f in fmts] for lr, t in rows]
    grid = np.array([[c.sqnr_db if c.status == "ok" else np.nan for c in r] for r in cells], dtype=float)
    top = np.nanmax(grid) if np.isfinite(grid).any() else 40.0
    grid = np.where([[c.status == "exact" for c in r] for r in cells], top, grid)  # exact: as good as the best
    fig = figure(max(6.0, 0.9 * len(fmts) + 2.5), max(2.5, 0.24 * len(rows) + 1.4))
    ax = fig.add_subplot(1, 1, 1)
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="lightgrey")
    im = ax.imshow(np.ma.masked_invalid(grid), aspect="auto", cmap=cmap, interpolation="nearest")
    for i, r in enumerate(cells):
        for j, c in enumerate(r):
            label = {"ok": f"{c.sqnr_db:.0f}" if c.sqnr_db is not None else "", "exact": "exact"}.get(c.status, "n/a")
            dark = c.status == "ok" and grid[i, j] < np.nanmin(grid) + 0.6 * (top - np.nanmin(grid))
            ax.text(j, i, label, ha="center", va="center", fontsize=6, color="white" if dark else "black")
            if (rows[i][0].name, fmts[j], rows[i][1]) in flagged:
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="tab:red", lw=1.5))
    ax.set_xticks(range(len(fmts)))
    ax.set_xticklabels([SHORT[f] for f in fmts], fontsize=7, rotation=30)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{display_path(lr.name)} {t}" for lr, t in rows], fontsize=7)
    fig.colorbar(im, ax=ax, label="SQNR per dot product (dB)")
    ax.set_title(f"{head}: GEMM operands in each format (red: > {bf.config.flag_db:g} dB below the median)",
                 fontsize=9)
    fig.tight_layout()
    write_figure(fig, path)
    return path
