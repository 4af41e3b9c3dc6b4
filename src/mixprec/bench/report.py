"""Aggregate the matrix per recipe and write it: the stdout table, ``results.md`` and ``results.json``.

Per recipe, over its successful repeats: the median (and min..max) of the steady epoch time, step time
and samples/s (:func:`mixprec.bench.measure.timing_from_history`); the exact memory accounting of the
sampled step, by category, and the measured step peak; MFU = model FLOPs per step / median step time /
measured peak matmul rate of the dtype the recipe's matmuls run in; final train loss, test accuracy,
skipped steps and final loss scale (medians); and, against fp32: speedup (fp32 epoch time / recipe epoch
time), memory saving (1 - recipe total / fp32 total), accuracy delta in percentage points, and the
convergence-parity verdict (:mod:`mixprec.bench.parity`).

The table starts with the tutorial's columns (recipe | memory | avg epoch time) and adds the rest after.
"""

from __future__ import annotations

import statistics
from typing import Any

from ..precision import resolve_recipe
from ..train.report import format_bytes
from .measure import spread
from .parity import convergence_parity

__all__ = ["COLUMNS", "aggregate", "table", "markdown_report", "loss_curve"]

COLUMNS = [
    "recipe", "memory", "avg epoch time", "speedup vs fp32", "memory saving vs fp32", "step peak (measured)",
    "samples/s", "MFU", "train loss", "test accuracy", "Δ accuracy vs fp32", "skipped steps", "loss scale",
    "parity vs fp32", "runs",
]
"""Columns of the stdout table and results.md, in order."""

MEMORY_CATEGORIES = ("parameters", "gradients", "optimizer_state", "master_weights", "activations")


def loss_curve(run: dict[str, Any]) -> list[float]:
    """A run's per-step training losses over all its epochs."""
    return [v for h in run.get("history") or [] for v in h.get("loss_curve") or []]


def _median(vals) -> float | None:
    vals = [v for v in vals if v is not None]
    return statistics.median(vals) if vals else None


def aggregate(
    recipes: list[str],
    results: list[dict[str, Any]],
    *,
    flops_per_step: int | None,
    peaks: dict[str, dict[str, Any]],
    matmul_dtype: dict[str, str],
    impl: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """One summary row per recipe (in ``recipes`` order), plus comparisons with fp32 when it ran."""
    rows = []
    for name in recipes:
        mine = [r for r in results if r["recipe"] == name]
        ok = [r for r in mine if r["status"] == "ok"]
        failed = [r for r in mine if r["status"] != "ok"]
        timing = [r["timing"] or {} for r in ok]
        summaries = [r["summary"] or {} for r in ok]
        mem = next((s["memory"] for s in summaries if s.get("memory")), None)
        probes = [r.get("memory_probe") or {} for r in ok]
        step = spread([t.get("step_time_s") for t in timing])
        peak = (peaks.get(matmul_dtype.get(name, "")) or {}).get("flops_per_s")
        mfu = (flops_per_step / step["median"] / peak) if (flops_per_step and step and peak) else None
        rows.append({
            "recipe": name,
            "impl": next((r["impl"] for r in mine if r.get("impl")), (impl or {}).get(name)),
            "runs_ok": len(ok),
            "runs_total": len(mine),
            "failures": [{"repeat": r["repeat"], "seed": r["seed"], "reason": r.get("reason")} for r in failed],
            "epoch_time_s": spread([t.get("epoch_time_s") for t in timing]),
            "raw_epoch_time_s": spread([t.get("raw_epoch_time_s") for t in timing]),
            "step_time_s": step,
            "samples_per_s": spread([t.get("samples_per_s") for t in timing]),
            "memory": mem,
            "memory_total_bytes": mem["total"] if mem else None,
            "cuda_peak_allocated_bytes": _median(s.get("cuda_peak_allocated_bytes") for s in summaries),
            "cuda_peak_reserved_bytes": _median(p.get("cuda_peak_reserved_bytes") for p in probes),
            "measured_step_peak_bytes": _median(p.get("step_peak_bytes") for p in probes),
            "measured_step_peak_method": next((p.get("method") or p.get("reason") for p in probes), None),
            "exact_activations_plus_gradients_bytes": _median(
                (p.get("exact_activations_plus_gradients") or {}).get("total") for p in probes),
            "matmul_dtype": matmul_dtype.get(name),
            "peak_flops_per_s": peak,
            "mfu": mfu,
            "final_train_loss": _median(s.get("final_train_loss") for s in summaries),
            "test_accuracy": spread([s.get("test_accuracy") for s in summaries]),
            "skipped_steps": max((s.get("skipped_steps") or 0 for s in summaries), default=None),
            "final_loss_scale": _median(s.get("final_loss_scale") for s in summaries),
            "speedup_vs_fp32": None,
            "memory_saving_vs_fp32": None,
            "accuracy_delta_vs_fp32_pp": None,
            "parity": None,
        })
    _compare_with_fp32(rows, results)
    return rows


def _compare_with_fp32(rows: list[dict[str, Any]], results: list[dict[str, Any]]) -> None:
    ref = next((r for r in rows if r["recipe"] == "fp32"), None)
    fp32_curves = [loss_curve(r) for r in results if r["recipe"] == "fp32" and r["status"] == "ok"]
    for row in rows:
        if ref is None:
            row["parity"] = {"verdict": "n/a", "reason": "fp32 was not run: add fp32 to --precisions"}
            continue
        t, t0 = row["epoch_time_s"], ref["epoch_time_s"]
        if t and t0:
            row["speedup_vs_fp32"] = t0["median"] / t["median"]
        m, m0 = row["memory_total_bytes"], ref["memory_total_bytes"]
        if m and m0:
            row["memory_saving_vs_fp32"] = 1.0 - m / m0
        a, a0 = row["test_accuracy"], ref["test_accuracy"]
        if a and a0:
            row["accuracy_delta_vs_fp32_pp"] = 100.0 * (a["median"] - a0["median"])
        mine = [r for r in results if r["recipe"] == row["recipe"]]
        curves = [loss_curve(r) for r in mine if r["status"] == "ok"]
        stopped = any((r.get("summary") or {}).get("stopped") for r in mine)
        row["parity"] = convergence_parity(curves, fp32_curves, stopped=stopped).to_dict()


# ------------------------------------------------------------------------------------------ formatting


def _pct_spread(s: dict | None) -> str:
    if not s or not s["median"]:
        return ""
    half = (s["max"] - s["min"]) / 2 / s["median"]
    return f" ±{100 * half:.0f}%" if s["n"] > 1 else ""


def _cells(row: dict[str, Any]) -> list[str]:
    dash = "—"
    et, sps, acc = row["epoch_time_s"], row["samples_per_s"], row["test_accuracy"]
    mem = format_bytes(row["memory_total_bytes"]) if row["memory_total_bytes"] else dash
    measured = row["cuda_peak_allocated_bytes"] or row["measured_step_peak_bytes"]
    scratch = row["impl"] == "scratch" and resolve_recipe(row["recipe"]).autocast  # fp32 has no mechanism
    label = row["recipe"] + (" (scratch)" if scratch else "")
    parity = row["parity"] or {}
    return [
        label,
        mem,
        f"{et['median']:.3f} s{_pct_spread(et)}" if et else dash,
        f"{row['speedup_vs_fp32']:.2f}x" if row["speedup_vs_fp32"] else dash,
        f"{100 * row['memory_saving_vs_fp32']:.0f}%" if row["memory_saving_vs_fp32"] is not None else dash,
        format_bytes(measured) if measured else dash,
        f"{sps['median']:,.0f}{_pct_spread(sps)}" if sps else dash,
        f"{100 * row['mfu']:.1f}% of {row['matmul_dtype']}" if row["mfu"] else dash,
        f"{row['final_train_loss']:.4f}" if row["final_train_loss"] is not None else dash,
        f"{100 * acc['median']:.2f}%" if acc else dash,
        f"{row['accuracy_delta_vs_fp32_pp']:+.2f} pp" if row["accuracy_delta_vs_fp32_pp"] is not None else dash,
        str(row["skipped_steps"]) if row["skipped_steps"] is not None else dash,
        f"{row['final_loss_scale']:g}" if row["final_loss_scale"] is not None else dash,
        parity.get("verdict") or dash,
        f"{row['runs_ok']}/{row['runs_total']}" + ("" if row["runs_ok"] == row["runs_total"] else " FAILED"),
    ]


def table(rows: list[dict[str, Any]]) -> str:
    """The comparison as a markdown table, failures listed under it with their reasons."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in rows]
    notes = [f"- {r['recipe']} seed {f['seed']}: FAILED — {f['reason']}" for r in rows for f in r["failures"]]
    if any((r["mfu"] or 0) > 1 for r in rows):
        notes.append("- MFU above 100% means the peak matmul rate was under-measured (a busy machine while the "
                     "micro-benchmark ran?); rerun on a quiet machine or raise --peak-seconds")
    return "\n".join(lines + ([""] + notes if notes else []))


def _fmt_rate(x: float | None) -> str:
    return f"{x / 1e9:,.1f} GFLOP/s" if x else "—"


def markdown_report(doc: dict[str, Any]) -> str:
    """``results.md``: the table, what ran where, how it was measured."""
    env = doc["environment"]
    fl = doc.get("flops_per_step") or {}
    out = [
        f"# mixprec bench — {doc['config']['model']['name']} on {doc['config']['data']['name']}",
        "",
        f"{doc['created']} · {env['device_name']} · torch {env['torch']} · {env['threads']} threads · "
        f"{doc['repeats']} repeat(s) per recipe (seeds {', '.join(map(str, doc['seeds']))})",
        "",
        f"`{doc['command']}`",
        "",
        table(doc["summary"]),
        "",
        "## Hardware preflight",
        "",
        *[f"- {p['line']}" for p in doc["preflight"]],
        "",
        "## Peak matmul rates measured in this run",
        "",
        *[f"- {k}: {_fmt_rate(v.get('flops_per_s'))} (n={v.get('n')})" for k, v in doc["peaks"].items()],
        "",
        f"Model FLOPs per step (FlopCounterMode, batch {doc['config']['optim']['batch_size']}): forward "
        f"{fl.get('forward', 0):,}, backward {fl.get('backward', 0):,}, total {fl.get('total', 0):,}"
        + (f"; x{fl['micro_batches_per_step']} micro-batches = {fl['per_step']:,} per optimizer step"
           if fl.get("micro_batches_per_step", 1) > 1 else "") + ".",
        "",
        "## Method",
        "",
        "- Each (recipe, repeat) ran in its own fresh process; repeat r used seed base+r for every recipe.",
        f"- Times exclude the first {doc['warmup_steps']} steps of every epoch; epoch time is the steady "
        "epoch (mean timed step x steps per epoch); ± is half the min..max range over repeats.",
        "- memory: exact accounting (params + grads + optimizer state + master copies + saved activations) "
        "of a sampled step. step peak (measured): "
        + ("CUDA max allocated over one step." if env["device"].startswith("cuda") else
           "VmHWM rise over one step after clear_refs, with glibc's mmap threshold at 64 KiB and "
           "malloc_trim (params/optimizer state excluded; compare with activations + gradients)."),
        "- MFU: model FLOPs per step / median step time / peak of the dtype the matmuls run in (above).",
        "- parity: the recipe's mean loss curve (same seeds) inside fp32's band across seeds "
        "(moving average, band widened 1%, >= 90% of steps).",
    ]
    if doc.get("plots"):
        out += ["", "## Plots", ""] + [f"![{p}]({p})" for p in doc["plots"]]
    return "\n".join(out) + "\n"
