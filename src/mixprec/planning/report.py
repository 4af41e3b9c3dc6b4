"""The plan as people read it: a table per recipe, a verdict, ``--json``, and a PNG of memory by category."""

from __future__ import annotations

from typing import Any

from ..jsonio import write_figure
from ..jsonio import write_json as _write_json
from .trace import AT_PEAK_CATEGORIES

__all__ = ["format_plan", "verdict", "write_json", "plot_memory", "gib", "DEVICE_BRANCH_LIMIT"]

_SHORT = {"parameters": "params", "gradients": "grads", "optimizer_state": "optim", "master_weights": "masters",
          "activations": "acts", "autocast_weight_copies": "ac copies", "fp8_buffers": "fp8", "buffers": "buffers",
          "temporary": "temp"}


DEVICE_BRANCH_LIMIT = ("the step is traced on fake CPU tensors, so model code that branches on the device type "
                       "(x.is_cuda, x.device.type == 'cuda', a CUDA-only kernel) takes its CPU branch (the built-in "
                       "models' attention is told the target's device)")
"""What a plan for a GPU target cannot see (also in the README's "Plan before you run")."""


def gib(n: float) -> str:
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= k:
            return f"{n / k:.2f} {unit}"
    return f"{int(n)} B"


def _flops(f: dict[str, int]) -> str:
    total = sum(f.values())
    if not total:
        return "0"
    parts = ", ".join(f"{k} {v / total:.0%}" for k, v in sorted(f.items(), key=lambda kv: -kv[1]))
    return f"{total / 1e12:.3g} TFLOP ({parts})" if total >= 1e10 else f"{total / 1e6:.3g} MFLOP ({parts})"


def _time(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


def format_plan(p) -> str:
    t = p.target
    lines = [f"mixprec plan: {p.model}, batch {p.batch_size}, on {t.name} ({t.description}: {gib(t.memory_bytes)}, "
             f"{t.bandwidth / 1e9:.0f} GB/s; peaks " + ", ".join(f"{k} {v / 1e12:.3g}" for k, v in t.peak_flops.items())
             + " TFLOP/s)",
             f"  traced: {'under fake tensors' if p.traced == 'fake' else 'for real on a small batch, scaled'}; "
             f"efficiency: {p.efficiency_source}"]
    if t.kind != "cpu":
        lines.append(f"  limit: {DEVICE_BRANCH_LIMIT}")
    lines.append("")
    cats = [c for c in AT_PEAK_CATEGORIES if any(r.memory.get(c) for r in p.recipes)]
    w = max([22] + [len(r.label) + 2 for r in p.recipes])
    head = (f"{'recipe':{w}s}" + "".join(f"{_SHORT[c]:>11s}" for c in cats)
            + f"{'peak':>11s}{'max batch':>10s}{'step':>10s}")
    lines.append(head)
    for r in p.recipes:
        fit = "" if r.fits else "  DOES NOT FIT"
        lines.append(f"{r.label:{w}s}" + "".join(f"{gib(r.memory.get(c, 0)):>11s}" for c in cats)
                     + f"{gib(r.peak_bytes):>11s}{r.max_batch_size:>10,d}{_time(r.step_time_s):>10s}{fit}")
    lines.append("")
    for r in p.recipes:
        timed = (f"GEMMs/convolutions/attention timed on this CPU {_time(r.time.timed_s)} in {r.time.timed_ops} "
                 "calls, " if r.time.timed_ops else "")
        host = (f"host overhead {_time(r.time.overhead_s)} over {r.time.ops} ops" if t.kind == "cpu" else
                f"host dispatch {_time(r.time.host_s)}, the GPU waiting {_time(r.time.overhead_s)}, "
                f"{r.time.ops} kernels")
        lines.append(f"  {r.recipe}: FLOPs {_flops(r.flops)}; {timed}GEMMs {_time(r.time.gemm_s)}, other ops "
                     f"{_time(r.time.memory_s)}, {host}")
        for n in r.notes:
            lines.append(f"    note: {n}")
    lines += ["", verdict(p)]
    lines.append("  (categories: exact bytes over the step; temp = alive at the peak in no category; peak = the "
                 "most alive at once)")
    return "\n".join(lines)


def verdict(p) -> str:
    fits = [r for r in p.recipes if r.fits]
    name = p.target.name
    if not fits:
        best = max(p.recipes, key=lambda r: r.max_batch_size)
        return (f"verdict: no recipe fits batch {p.batch_size} on {name}; the largest batch that fits is "
                f"{best.max_batch_size} with {best.recipe}" + ("" if best.max_batch_size else
                                                              " -- none: even the weights and optimizer state do "
                                                              "not fit; shard them or use a larger device"))
    fastest = min(fits, key=lambda r: r.step_time_s)
    smallest = min(fits, key=lambda r: r.peak_bytes)
    ref = next((r for r in p.recipes if r.recipe == "fp32"), None)
    out = [f"verdict on {name}: fastest {fastest.recipe} ({_time(fastest.step_time_s)}"]
    if ref is not None and ref is not fastest and ref.fits:
        out[-1] += f", {ref.step_time_s / fastest.step_time_s:.2f}x fp32"
    out[-1] += f": {_why_fast(fastest)}); smallest {smallest.recipe} ({gib(smallest.peak_bytes)}"
    if ref is not None and ref is not smallest:
        out[-1] += f", {1 - smallest.peak_bytes / ref.peak_bytes:+.0%} vs fp32".replace("+-", "-").replace("+", "-")
    out[-1] += f": {_why_small(smallest)})."
    no = [r.recipe for r in p.recipes if not r.fits]
    if no:
        out.append(" Does not fit at this batch: " + ", ".join(
            f"{r.recipe} (largest {r.max_batch_size})" for r in p.recipes if not r.fits) + ".")
    return "".join(out)


def _why_fast(r) -> str:
    t = r.time
    # the timed calls are GEMMs, convolutions and attention: they count with the GEMMs
    gemm_share = (t.gemm_s + t.timed_s) / r.step_time_s if r.step_time_s else 0
    main = max(r.flops.items(), key=lambda kv: kv[1])[0] if r.flops else "fp32"
    if gemm_share >= 0.5:
        return f"its GEMMs run in {main}" + (" (timed on this CPU)" if t.timed_ops else "")
    if t.overhead_s >= t.memory_s:
        return f"the step is {t.overhead_s / r.step_time_s:.0%} host overhead (dispatch) and it runs the fewest ops"
    return f"the step is {t.memory_s / r.step_time_s:.0%} bandwidth/launch-bound and it moves the fewest bytes"


def _why_small(r) -> str:
    top = max(r.at_peak.items(), key=lambda kv: kv[1])
    return f"{_SHORT[top[0]]} dominate its peak ({top[1] / max(r.peak_bytes, 1):.0%})"


def write_json(p, path: str) -> None:
    _write_json(path, p.to_dict())


def plot_memory(p, path: str) -> str | None:
    """A stacked bar per recipe of the memory alive at its peak, by category; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(p.recipes) + 3.5), 4.2))
    names = [r.recipe for r in p.recipes]
    top = max(r.peak_bytes for r in p.recipes)
    unit, k = ("GiB", 2**30) if top >= 2**30 else ("MiB", 2**20)
    bottom = [0.0] * len(names)
    for c in AT_PEAK_CATEGORIES:
        vals = [r.at_peak.get(c, 0) / k for r in p.recipes]
        if any(vals):
            ax.bar(names, vals, bottom=bottom, label=_SHORT[c])
            bottom = [b + v for b, v in zip(bottom, vals)]
    cap = p.target.memory_bytes / k
    if cap <= 2 * top / k:  # the target's memory, where it is on the same scale as the bars
        ax.axhline(cap, color="k", linestyle="--", linewidth=1)
        ax.text(len(names) - 0.5, cap, f" {p.target.name} memory", va="bottom", ha="right", fontsize=8)
    ax.set_ylabel(f"{unit} alive at the peak")
    ax.set_title(f"{p.model}, batch {p.batch_size}, on {p.target.name} ({gib(p.target.memory_bytes)})", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    write_figure(fig, path, dpi=110)
    plt.close(fig)
    return path


