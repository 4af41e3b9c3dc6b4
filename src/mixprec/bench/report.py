"""The comparison as text: the stdout table and ``results.md``. Every cell goes through :func:`fmt`, which prints
a dash for a number a run did not produce, so a damaged field never costs the other rows. Rows from several
invocations (``--resume``) get an ``invocation`` column and a note that they were not timed side by side."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..errors import UsageError
from ..precision import LAYERS_SUFFIX, resolve_recipe
from ..train.report import format_bytes
from .results import HOST_BOUND_BELOW, Spread, SummaryRow, number, ratio

__all__ = ["COLUMNS", "PLAN_COLUMNS", "INVOCATION_COLUMN", "BUSY_COLUMN", "columns", "table", "markdown_report", "fmt",
           "DASH", "MEMORY_CATEGORIES"]

PLAN_COLUMNS = ["step peak (plan)", "step time", "step time (plan)", "measured / plan"]
"""The plan's prediction (:mod:`mixprec.bench.predict`); left out when no row has one."""

COLUMNS = [
    "recipe", "memory", "avg epoch time", "speedup vs fp32", "memory saving vs fp32", "step peak (measured)",
    *PLAN_COLUMNS, "samples/s", "MFU", "train loss", "test accuracy", "Δ accuracy vs fp32", "skipped steps",
    "loss scale", "parity vs fp32", "runs",
]

INVOCATION_COLUMN = "invocation"

BUSY_COLUMN = "device busy"
"""CUDA: the device's busy time per step and its share of the median step time, beside the step time; left out
when no row has it (a CPU bench)."""

LM_COLUMNS = {"test accuracy": "test loss / bits per char", "Δ accuracy vs fp32": "Δ test loss vs fp32"}

METRIC_COLUMNS = {
    "test_f1": {"test accuracy": "test F1", "Δ accuracy vs fp32": "Δ F1 vs fp32"},
    "test_r2": {"test accuracy": "test R²", "Δ accuracy vs fp32": "Δ R² vs fp32"},
    "test_loss": {"test accuracy": "test loss", "Δ accuracy vs fp32": "Δ test loss vs fp32"},
}
"""Other tasks' main metric in the accuracy columns."""

MEMORY_CATEGORIES = ("parameters", "gradients", "optimizer_state", "master_weights", "activations")

DASH = "—"


def fmt(x: Any, spec: str, *, scale: float = 1.0, suffix: str = "") -> str:
    """``format(x * scale, spec) + suffix``, or a dash when ``x`` is not a finite number."""
    x = number(x)
    return DASH if x is None else format(x * scale if scale != 1 else x, spec) + suffix


def as_rows(rows: Iterable[SummaryRow | dict[str, Any]]) -> list[SummaryRow]:
    return [r if isinstance(r, SummaryRow) else SummaryRow.from_dict(r) for r in rows]


def _pct_spread(s: Spread | None) -> str:
    if s is None:
        return ""
    half = ratio(ratio((number(s.max) or 0) - (number(s.min) or 0), 2), s.median)
    return f" ±{100 * half:.0f}%" if half is not None and s.n > 1 else ""


def _label(row: SummaryRow) -> str:
    try:  # fp32 has no autocast, so no mechanism to name
        scratch = row.impl == "scratch" and resolve_recipe(row.recipe.removesuffix(LAYERS_SUFFIX)).autocast
    except UsageError:
        scratch = False
    return row.recipe + (" (scratch)" if scratch else "")


def _time(s: Any) -> str:
    s = number(s)
    return DASH if s is None else f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


def _plan_cells(row: SummaryRow) -> list[str]:
    """Predicted step peak, measured and predicted step time, measured / predicted."""
    pred = row.prediction
    if pred is None or pred.reason:
        return [DASH, _time(row.median("step_time_s")), DASH, DASH]
    peak = pred.compared_peak
    ratios = [f"{what} {fmt(r, '.2f', suffix='x')}" for what, r in (("peak", pred.peak_ratio),
                                                                     ("time", pred.step_time_ratio))]
    return [format_bytes(peak) if number(peak) is not None else DASH, _time(row.median("step_time_s")),
            _time(pred.step_time_s), ", ".join(ratios)]


def _has_plan(rows: list[SummaryRow]) -> bool:
    return any(r.prediction is not None for r in rows)


def _has_busy(rows: list[SummaryRow]) -> bool:
    return any(number(r.device_busy_s) is not None for r in rows)


def _busy_cell(row: SummaryRow) -> str:
    """``4.1 ms (17%)``: the device's busy time per step and its share of the median step time."""
    share = fmt(row.device_busy_fraction, ".0f", scale=100, suffix="%")
    return DASH if number(row.device_busy_s) is None else f"{_time(row.device_busy_s)} ({share})"


def _cells(row: SummaryRow) -> dict[str, str]:
    """Every cell of the row, by (base) column name."""
    et, sps = row.epoch_time_s, row.samples_per_s
    measured = number(row.measured_step_peak_bytes)
    return {
        "recipe": _label(row),
        "memory": format_bytes(row.memory_total_bytes) if number(row.memory_total_bytes) else DASH,
        "avg epoch time": fmt(row.median("epoch_time_s"), ".3f", suffix=" s" + _pct_spread(et)),
        "speedup vs fp32": fmt(row.speedup_vs_fp32, ".2f", suffix="x") if number(row.speedup_vs_fp32) else DASH,
        "memory saving vs fp32": fmt(row.memory_saving_vs_fp32, ".0f", scale=100, suffix="%"),
        "step peak (measured)": format_bytes(measured) if measured else DASH,
        **dict(zip(PLAN_COLUMNS, _plan_cells(row))),
        BUSY_COLUMN: _busy_cell(row),
        "samples/s": fmt(sps.median, ",.0f", suffix=_pct_spread(sps)) if sps and number(sps.median) else DASH,
        "MFU": fmt(row.mfu, ".1f", scale=100, suffix=f"% of {row.matmul_dtype}") if number(row.mfu) else DASH,
        "train loss": fmt(row.final_train_loss, ".4f"),
        **dict(zip(("test accuracy", "Δ accuracy vs fp32"), _quality_cells(row))),
        "skipped steps": fmt(row.skipped_steps, "d" if isinstance(row.skipped_steps, int) else "g"),
        "loss scale": fmt(row.final_loss_scale, "g"),
        "parity vs fp32": row.parity.verdict if row.parity is not None else DASH,
        "runs": f"{row.runs_ok}/{row.runs_total}" + ("" if row.runs_ok == row.runs_total else " FAILED"),
        INVOCATION_COLUMN: "+".join(map(str, row.invocations)) or DASH,
    }


def _quality_cells(row: SummaryRow) -> list[str]:
    if row.language_model:
        return [f"{fmt(row.median('test_loss'), '.4f')} / {fmt(row.median('bits_per_char'), '.3f')}",
                fmt(row.test_loss_delta_vs_fp32, "+.4f")]
    if row.metric in METRIC_COLUMNS:
        return [fmt(row.median("test_metric"), ".4f"), fmt(row.metric_delta_vs_fp32, "+.4f")]
    return [fmt(row.median("test_accuracy"), ".2f", scale=100, suffix="%"),
            fmt(row.accuracy_delta_vs_fp32_pp, "+.2f", suffix=" pp")]


def _invocations(rows: list[SummaryRow]) -> list[int]:
    return sorted({i for r in rows for i in r.invocations})


def _base_columns(rows: list[SummaryRow]) -> list[str]:
    """The columns these rows fill, by their base names: the plan's where a row has a prediction, the device's
    busy time beside the step time where a row has it (with the step time where no plan shows it)."""
    plan = _has_plan(rows)
    cols = list(COLUMNS) if plan else [c for c in COLUMNS if c not in PLAN_COLUMNS]
    if _has_busy(rows):
        at = cols.index("step time" if plan else "step peak (measured)") + 1
        cols[at:at] = [BUSY_COLUMN] if plan else ["step time", BUSY_COLUMN]
    return cols + [INVOCATION_COLUMN] if len(_invocations(rows)) > 1 else cols


def columns(rows: Iterable[SummaryRow | dict[str, Any]]) -> list[str]:
    """The table's columns for these rows (the task's main metric in the accuracy columns)."""
    rows = as_rows(rows)
    metric = next((r.metric for r in rows if r.metric), None)
    base = _base_columns(rows)
    if any(r.language_model for r in rows):
        return [LM_COLUMNS.get(c, c) for c in base]
    if metric in METRIC_COLUMNS:
        return [METRIC_COLUMNS[metric].get(c, c) for c in base]
    return base


def table(rows: Iterable[SummaryRow | dict[str, Any]]) -> str:
    """The comparison as a markdown table, failures and caveats listed under it."""
    rows = as_rows(rows)
    cols, base = columns(rows), _base_columns(rows)
    several = INVOCATION_COLUMN in cols
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(_cells(r)[c] for c in base) + " |" for r in rows]
    notes = [f"- {r.recipe} seed {f.seed}: FAILED — {f.reason}" for r in rows for f in r.failures]
    notes += _plan_notes(rows)
    notes += _busy_notes(rows)
    if several:
        *first, last = map(str, _invocations(rows))
        notes.append(f"- the rows come from invocations {', '.join(first)} and {last} of this bench (--resume; "
                     "last column): their timings, speedups and MFU were not measured side by side")
    if any((number(r.mfu) or 0) > 1 for r in rows):
        notes.append("- MFU above 100% means the peak matmul rate was under-measured (a busy machine while the "
                     "micro-benchmark ran?); rerun on a quiet machine or raise --peak-seconds")
    return "\n".join(lines + ([""] + notes if notes else []))


def _busy_notes(rows: list[SummaryRow]) -> list[str]:
    """The recipes whose step is host-bound, with the device's share of the step."""
    bound = [r for r in rows if r.host_bound]
    if not bound:
        return []
    shares = ", ".join(f"{r.recipe} {fmt(r.device_busy_fraction, '.0f', scale=100, suffix='%')}" for r in bound)
    return [f"- host-bound (device busy under {HOST_BOUND_BELOW:.0%} of the step: the GPU waits on the host's Python, "
            f"kernel launches and host reads): {shares}"]


def _plan_notes(rows: list[SummaryRow]) -> list[str]:
    missing: dict[str, list[str]] = {}
    for r in rows:
        if r.prediction is not None and r.prediction.reason:
            missing.setdefault(r.prediction.reason, []).append(r.recipe)
    out = [f"- plan: no prediction for {', '.join(names)}: {why}" for why, names in missing.items()]
    shown = next((r.prediction for r in rows if r.prediction is not None and not r.prediction.reason), None)
    if shown is not None:
        cuda = any(str(r.measured_step_peak_method).startswith("cuda") for r in rows)
        how = "CUDA max allocated less the step's start" if cuda else "the CPU allocator's"
        what = (f"the step's peak above the resident state ({how})"
                if shown.peak_compared_with == "measured_step_peak_bytes" else "CUDA max allocated")  # an older doc
        out.append(f"- plan: mixprec plan's prediction for target {shown.target} (traced under fake tensors before "
                   f"the runs); measured / plan compares {what} and the median step time")
    return out


def _fmt_rate(x: float | None) -> str:
    return fmt(x, ",.1f", scale=1e-9, suffix=" GFLOP/s") if number(x) else DASH


def _state_lines(doc: dict[str, Any]) -> list[str]:
    """What the report does not cover: runs not finished, failed plots."""
    progress, out = doc.get("progress") or {}, []
    if progress and progress.get("state") != "complete":
        state = str(progress.get("state"))
        out += [f"**{state[:1].upper() + state[1:]}: {progress.get('finished')} of "
                f"{progress.get('planned')} runs finished; the table covers those only.**", ""]
    if doc.get("plots_error"):
        out += [f"Plots failed: {doc['plots_error']}", ""]
    return out


def _invocation_lines(invocations: list[Any]) -> list[str]:
    if len(invocations) < 2:
        return []
    out = ["## Invocations", ""]
    for inv in invocations:
        inv = inv if isinstance(inv, dict) else {}
        peaks = inv.get("peaks") if isinstance(inv.get("peaks"), dict) else {}
        rates = ", ".join(f"{k} {_fmt_rate(v.get('flops_per_s') if isinstance(v, dict) else None)}"
                          for k, v in peaks.items())
        runs = inv.get("runs") if isinstance(inv.get("runs"), list) else []
        out.append(f"- {inv.get('number')}: {inv.get('created')}, ran {', '.join(map(str, runs)) or 'nothing'}; "
                   f"peaks {rates or DASH}")
    return out + ["", "Rows from different invocations were not measured side by side: compare their ratios "
                      "with care (or rerun the bench whole).", ""]


def markdown_report(doc: dict[str, Any]) -> str:
    """``results.md``: the table, what ran where, how it was measured."""
    env, bench = doc["environment"], doc["bench"]
    train = bench["train"]
    fl = doc.get("flops_per_step") or {}
    out = [
        f"# mixprec bench — {train['model']['name']} on {train['data']['name']}",
        "",
        f"{doc['created']} · {env['device_name']} · torch {env['torch']} · {env['threads']} threads · "
        f"{bench['repeats']} repeat(s) per recipe (seeds {', '.join(map(str, doc['seeds']))})",
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
        "## Peak matmul rates measured in this invocation",
        "",
        *[f"- {k}: {_fmt_rate(v.get('flops_per_s'))} (n={v.get('n')})" for k, v in doc["peaks"].items()],
        "",
        f"Model FLOPs per step (FlopCounterMode with mixprec.flops' formulas, batch {train['optim']['batch_size']}): forward "
        f"{fmt(fl.get('forward'), ',')}, backward {fmt(fl.get('backward'), ',')}, total {fmt(fl.get('total'), ',')}"
        + (f"; x{fl['micro_batches_per_step']} micro-batches = {fmt(fl.get('per_step'), ',')} per optimizer step"
           if (number(fl.get("micro_batches_per_step")) or 1) > 1 else "") + "."
        + (f" FLOPs unknown (not counted, MFU is low by their share) for: {', '.join(fl['uncounted'])}."
           if fl.get("uncounted") else ""),
        "",
        *_invocation_lines(doc.get("invocations") or []),
        "## Method",
        "",
        "- Each (recipe, repeat) ran in its own fresh process; repeat r used seed base+r for every recipe.",
        f"- Times exclude the first {bench['warmup_steps']} steps of every epoch; epoch time is the steady "
        "epoch (mean timed step x steps per epoch); ± is half the min..max range over repeats.",
        "- memory: exact accounting (params + grads + optimizer state + master copies + saved activations) "
        "of a sampled step. step peak (measured): "
        + ("CUDA max allocated over one step less what was allocated before it (params/optimizer state "
           "excluded; compare with activations + gradients)." if env["device"].startswith("cuda") else
           "the CPU allocator's peak over one step (torch.profiler memory events; params/optimizer state "
           "excluded; compare with activations + gradients); results.json also holds the VmHWM rise "
           "(glibc's mmap threshold at 64 KiB, malloc_trim, clear_refs)."),
        "- MFU: model FLOPs per step / median step time / peak of the dtype the matmuls run in (above).",
        *(["- device busy (CUDA): after the timed run, a few steps under torch.profiler: the time the GPU ran "
           "kernels, copies or memsets (their union) per step, and its share of the median step time; under "
           f"{HOST_BOUND_BELOW:.0%} the step is host-bound."] if _has_busy(as_rows(doc["summary"])) else []),
        "- parity: the recipe's mean loss curve (same seeds) inside fp32's band across seeds "
        "(moving average, band widened 1%, >= 90% of steps).",
    ]
    if doc.get("plots"):
        out += ["", "## Plots", ""] + [f"![{p}]({p})" for p in doc["plots"]]
    return "\n".join(out) + "\n"
