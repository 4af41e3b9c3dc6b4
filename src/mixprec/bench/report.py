"""Aggregate the matrix per recipe and write it: the stdout table, ``results.md`` and ``results.json``.

Per recipe, over its successful repeats: the median (and min..max) of the steady epoch time, step time
and samples/s (:func:`mixprec.bench.measure.timing_from_history`); the exact memory accounting of the
sampled step, by category, and the measured step peak; MFU = model FLOPs per step / median step time /
measured peak matmul rate of the dtype the recipe's matmuls run in; final train loss, test accuracy,
skipped steps and final loss scale (medians); and, against fp32: speedup (fp32 epoch time / recipe epoch
time), memory saving (1 - recipe total / fp32 total), accuracy delta in percentage points, and the
convergence-parity verdict (:mod:`mixprec.bench.parity`).

The table starts with the tutorial's columns (recipe | memory | avg epoch time) and adds the rest after.

**Any run result is reportable.** A run that diverged finishes with nulls where numbers would be (JSON has
no NaN: a NaN loss is written as ``null``), a run that crashed has no summary at all, and a result file
is whatever the worker managed to write. So every result passes through :func:`clean_result` first
(non-finite numbers become ``None``, fields that should hold a dict or a list hold one), every
computation treats ``None`` as "not measured" (:func:`number`, :func:`ratio`), and every cell is
formatted by :func:`fmt`, which prints a dash for a missing number. A missing number is a dash in its
cell, never a crash of the report that would lose the other rows.
"""

from __future__ import annotations

import math
import numbers
import statistics
from typing import Any

from ..errors import UsageError
from ..precision import resolve_recipe
from ..train.report import format_bytes
from .measure import spread
from .parity import convergence_parity

__all__ = ["COLUMNS", "columns", "aggregate", "table", "markdown_report", "loss_curve", "clean_result", "number",
           "ratio", "fmt", "DASH"]

COLUMNS = [
    "recipe", "memory", "avg epoch time", "speedup vs fp32", "memory saving vs fp32", "step peak (measured)",
    "samples/s", "MFU", "train loss", "test accuracy", "Δ accuracy vs fp32", "skipped steps", "loss scale",
    "parity vs fp32", "runs",
]
"""Columns of the stdout table and results.md, in order."""

MEMORY_CATEGORIES = ("parameters", "gradients", "optimizer_state", "master_weights", "activations")


DASH = "—"


def number(x: Any) -> float | int | None:
    """``x`` if it is a finite real number (not a bool), else None: the one test of "was it measured"."""
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        return None
    return x if math.isfinite(x) else None


def ratio(a: Any, b: Any) -> float | None:
    """``a / b`` when both are numbers and ``b`` is not 0, else None."""
    a, b = number(a), number(b)
    return a / b if a is not None and b else None


def fmt(x: Any, spec: str, *, scale: float = 1.0, suffix: str = "") -> str:
    """``format(x * scale, spec) + suffix``, or a dash when ``x`` is not a finite number."""
    x = number(x)
    return DASH if x is None else format(x * scale if scale != 1 else x, spec) + suffix


def _dict(x: Any) -> dict:
    return x if isinstance(x, dict) else {}


def _clean(o: Any) -> Any:
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, dict):
        return {k: _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    return o


def clean_result(r: Any) -> dict[str, Any]:
    """A run result the report can always read: non-finite numbers become None, ``summary``, ``timing``
    and ``memory_probe`` are dicts, ``history`` is a list of dicts, ``status`` is "ok" or "failed"."""
    r = _clean(_dict(r))
    r["status"] = "ok" if r.get("status") == "ok" else "failed"
    for key in ("summary", "timing", "memory_probe"):
        r[key] = _dict(r.get(key))
    history = r.get("history")
    r["history"] = [h for h in history if isinstance(h, dict)] if isinstance(history, list) else []
    return r


def loss_curve(run: dict[str, Any]) -> list[float]:
    """A run's per-step training losses over all its epochs (a missing or non-finite loss is NaN)."""
    curves = [h.get("loss_curve") for h in clean_result(run)["history"]]
    return [math.nan if number(v) is None else float(v) for c in curves if isinstance(c, list) for v in c]


def _median(vals) -> float | None:
    vals = [v for v in map(number, vals) if v is not None]
    return statistics.median(vals) if vals else None


def _spread(vals) -> dict[str, float] | None:
    return spread([number(v) for v in vals])


def aggregate(
    recipes: list[str],
    results: list[dict[str, Any]],
    *,
    flops_per_step: int | None,
    peaks: dict[str, dict[str, Any]],
    matmul_dtype: dict[str, str],
    impl: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """One summary row per recipe (in ``recipes`` order), plus comparisons with fp32 when it ran.

    Any result is accepted (see :func:`clean_result`); a number a run did not produce is None in its row.
    """
    results = [clean_result(r) for r in results]
    rows = []
    for name in recipes:
        mine = [r for r in results if r.get("recipe") == name]
        peak = number(_dict(_dict(peaks).get(_dict(matmul_dtype).get(name, ""))).get("flops_per_s"))
        rows.append(_row(name, mine, flops_per_step=flops_per_step, peak=peak,
                         matmul_dtype=_dict(matmul_dtype).get(name), impl=_dict(impl).get(name)))
    _compare_with_fp32(rows, results)
    return rows


def _row(name: str, mine: list[dict[str, Any]], *, flops_per_step, peak, matmul_dtype, impl) -> dict[str, Any]:
    ok = [r for r in mine if r["status"] == "ok"]
    timing = [r["timing"] for r in ok]
    summaries = [r["summary"] for r in ok]
    mem = next((s["memory"] for s in summaries if isinstance(s.get("memory"), dict)), None)
    probes = [r["memory_probe"] for r in ok]
    step = _spread(t.get("step_time_s") for t in timing)
    mfu = ratio(ratio(flops_per_step, _dict(step).get("median")), peak)
    return {
        "recipe": name,
        "impl": next((r["impl"] for r in mine if r.get("impl")), impl),
        "runs_ok": len(ok),
        "runs_total": len(mine),
        "failures": [{"repeat": r.get("repeat"), "seed": r.get("seed"), "reason": r.get("reason")}
                     for r in mine if r["status"] != "ok"],
        "epoch_time_s": _spread(t.get("epoch_time_s") for t in timing),
        "raw_epoch_time_s": _spread(t.get("raw_epoch_time_s") for t in timing),
        "step_time_s": step,
        "samples_per_s": _spread(t.get("samples_per_s") for t in timing),
        "memory": mem,
        "memory_total_bytes": number(_dict(mem).get("total")),
        "cuda_peak_allocated_bytes": _median(s.get("cuda_peak_allocated_bytes") for s in summaries),
        "cuda_peak_reserved_bytes": _median(p.get("cuda_peak_reserved_bytes") for p in probes),
        "measured_step_peak_bytes": _median(p.get("step_peak_bytes") for p in probes),
        "measured_step_peak_method": next((p.get("method") or p.get("reason") for p in probes), None),
        "exact_activations_plus_gradients_bytes": _median(
            _dict(p.get("exact_activations_plus_gradients")).get("total") for p in probes),
        "matmul_dtype": matmul_dtype,
        "peak_flops_per_s": peak,
        "mfu": mfu,
        "final_train_loss": _median(s.get("final_train_loss") for s in summaries),
        "test_accuracy": _spread(s.get("test_accuracy") for s in summaries),
        "test_loss": _spread(s.get("test_loss") for s in summaries),
        "bits_per_char": _spread(s.get("bits_per_char") for s in summaries),
        "language_model": any(s.get("bits_per_char") is not None for s in summaries) or None,
        "skipped_steps": max((number(s.get("skipped_steps")) or 0 for s in summaries), default=None),
        "final_loss_scale": _median(s.get("final_loss_scale") for s in summaries),
        "speedup_vs_fp32": None,
        "memory_saving_vs_fp32": None,
        "accuracy_delta_vs_fp32_pp": None,
        "test_loss_delta_vs_fp32": None,
        "parity": None,
    }


def _compare_with_fp32(rows: list[dict[str, Any]], results: list[dict[str, Any]]) -> None:
    ref = next((r for r in rows if r["recipe"] == "fp32"), None)
    fp32_curves = [loss_curve(r) for r in results if r.get("recipe") == "fp32" and r["status"] == "ok"]
    for row in rows:
        if ref is None:
            row["parity"] = {"verdict": "n/a", "reason": "fp32 was not run: add fp32 to --precisions"}
            continue
        median = (lambda k: _dict(row[k]).get("median")), (lambda k: _dict(ref[k]).get("median"))
        row["speedup_vs_fp32"] = ratio(median[1]("epoch_time_s"), median[0]("epoch_time_s"))
        saving = ratio(row["memory_total_bytes"], ref["memory_total_bytes"])
        row["memory_saving_vs_fp32"] = None if saving is None else 1.0 - saving
        a, a0 = median[0]("test_accuracy"), median[1]("test_accuracy")
        row["accuracy_delta_vs_fp32_pp"] = 100.0 * (a - a0) if a is not None and a0 is not None else None
        l, l0 = median[0]("test_loss"), median[1]("test_loss")
        row["test_loss_delta_vs_fp32"] = l - l0 if l is not None and l0 is not None else None
        mine = [r for r in results if r.get("recipe") == row["recipe"]]
        curves = [loss_curve(r) for r in mine if r["status"] == "ok"]
        stopped = any(r["summary"].get("stopped") for r in mine)
        row["parity"] = convergence_parity(curves, fp32_curves, stopped=stopped).to_dict()


# ------------------------------------------------------------------------------------------ formatting


def _pct_spread(s: Any) -> str:
    s = _dict(s)
    half = ratio(ratio((number(s.get("max")) or 0) - (number(s.get("min")) or 0), 2), s.get("median"))
    return f" ±{100 * half:.0f}%" if half is not None and (number(s.get("n")) or 0) > 1 else ""


def _label(row: dict[str, Any]) -> str:
    name = str(row.get("recipe"))
    try:  # fp32 has no autocast, so no mechanism to name
        scratch = row.get("impl") == "scratch" and resolve_recipe(name).autocast
    except UsageError:
        scratch = False
    return name + (" (scratch)" if scratch else "")


def _cells(row: dict[str, Any]) -> list[str]:
    row = {k: _clean(v) for k, v in _dict(row).items()}
    get = row.get
    et, sps, acc = _dict(get("epoch_time_s")), _dict(get("samples_per_s")), _dict(get("test_accuracy"))
    measured = number(get("cuda_peak_allocated_bytes")) or number(get("measured_step_peak_bytes"))
    runs_ok, runs_total = get("runs_ok"), get("runs_total")
    return [
        _label(row),
        format_bytes(number(get("memory_total_bytes"))) if number(get("memory_total_bytes")) else DASH,
        fmt(et.get("median"), ".3f", suffix=" s" + _pct_spread(et)),
        fmt(get("speedup_vs_fp32"), ".2f", suffix="x") if number(get("speedup_vs_fp32")) else DASH,
        fmt(get("memory_saving_vs_fp32"), ".0f", scale=100, suffix="%"),
        format_bytes(measured) if measured else DASH,
        fmt(sps.get("median"), ",.0f", suffix=_pct_spread(sps)) if number(sps.get("median")) else DASH,
        fmt(get("mfu"), ".1f", scale=100, suffix=f"% of {get('matmul_dtype')}") if number(get("mfu")) else DASH,
        fmt(get("final_train_loss"), ".4f"),
        *_quality_cells(row, acc),
        fmt(get("skipped_steps"), "d" if isinstance(get("skipped_steps"), int) else "g"),
        fmt(get("final_loss_scale"), "g"),
        str(_dict(get("parity")).get("verdict") or DASH),
        f"{runs_ok}/{runs_total}" + ("" if runs_ok == runs_total else " FAILED"),
    ]


LM_COLUMNS = {"test accuracy": "test loss / bits per char", "Δ accuracy vs fp32": "Δ test loss vs fp32"}
"""Language models are judged by test loss (and bits per character), not accuracy."""


def _is_lm(rows: list[dict[str, Any]]) -> bool:
    return any(_dict(r).get("language_model") for r in rows)


def columns(rows: list[dict[str, Any]]) -> list[str]:
    """The table's columns for these rows (language models show test loss where classifiers show accuracy)."""
    return [LM_COLUMNS.get(c, c) for c in COLUMNS] if _is_lm(rows) else list(COLUMNS)


def _quality_cells(row: dict[str, Any], acc: dict) -> list[str]:
    if row.get("language_model"):
        loss, bpc = _dict(row.get("test_loss")).get("median"), _dict(row.get("bits_per_char")).get("median")
        return [f"{fmt(loss, '.4f')} / {fmt(bpc, '.3f')}", fmt(row.get("test_loss_delta_vs_fp32"), "+.4f")]
    return [fmt(acc.get("median"), ".2f", scale=100, suffix="%"),
            fmt(row.get("accuracy_delta_vs_fp32_pp"), "+.2f", suffix=" pp")]


def table(rows: list[dict[str, Any]]) -> str:
    """The comparison as a markdown table, failures listed under it with their reasons."""
    rows = [_dict(r) for r in rows]
    cols = columns(rows)
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in rows]
    notes = [f"- {r.get('recipe')} seed {_dict(f).get('seed')}: FAILED — {_dict(f).get('reason')}"
             for r in rows for f in (r.get("failures") if isinstance(r.get("failures"), list) else [])]
    if any((number(r.get("mfu")) or 0) > 1 for r in rows):
        notes.append("- MFU above 100% means the peak matmul rate was under-measured (a busy machine while the "
                     "micro-benchmark ran?); rerun on a quiet machine or raise --peak-seconds")
    return "\n".join(lines + ([""] + notes if notes else []))


def _fmt_rate(x: float | None) -> str:
    return fmt(x, ",.1f", scale=1e-9, suffix=" GFLOP/s") if number(x) else DASH


def _state_lines(doc: dict[str, Any]) -> list[str]:
    """What the report does not cover: runs not finished (interrupted, or still running), failed plots."""
    progress, out = _dict(doc.get("progress")), []
    if progress and progress.get("state") != "complete":
        state = str(progress.get("state"))
        out += [f"**{state[:1].upper() + state[1:]}: {progress.get('finished')} of "
                f"{progress.get('planned')} runs finished; the table covers those only.**", ""]
    if doc.get("plots_error"):
        out += [f"Plots failed: {doc['plots_error']}", ""]
    return out


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
        *_state_lines(doc),
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
        f"{fmt(fl.get('forward'), ',')}, backward {fmt(fl.get('backward'), ',')}, total {fmt(fl.get('total'), ',')}"
        + (f"; x{fl['micro_batches_per_step']} micro-batches = {fmt(fl.get('per_step'), ',')} per optimizer step"
           if (number(fl.get("micro_batches_per_step")) or 1) > 1 else "") + ".",
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
