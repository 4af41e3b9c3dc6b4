"""The matrix per recipe: one :class:`~mixprec.bench.results.SummaryRow` from its repeats.

Over a recipe's successful repeats: medians (and min..max) of the timings, the exact memory accounting,
MFU = model FLOPs per step / median step time / measured peak of the dtype its matmuls run in, the device's busy
time per step and its share of the median step (CUDA), the task's metrics; against fp32: speedup (epoch time
ratio), memory saving (1 - total ratio), metric deltas and the convergence-parity verdict
(:mod:`mixprec.bench.parity`). A number a run did not produce is None.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Iterable
from typing import Any

from .parity import ParityResult, convergence_parity
from .results import Failure, Prediction, RunResult, Spread, SummaryRow, number, ratio

__all__ = ["aggregate", "as_results"]


def as_results(results: Iterable[RunResult | dict[str, Any]]) -> list[RunResult]:
    return [r if isinstance(r, RunResult) else RunResult.from_dict(r) for r in results]


def _median(vals: Iterable[Any]) -> float | None:
    vals = [v for v in map(number, vals) if v is not None]
    return statistics.median(vals) if vals else None


def aggregate(
    recipes: Iterable[str],
    results: Iterable[RunResult | dict[str, Any]],
    *,
    flops_per_step: int | None,
    peaks: dict[str, dict[str, Any]],
    matmul_dtype: dict[str, str],
    impl: dict[str, str] | None = None,
    predictions: dict[str, Prediction] | None = None,
) -> list[SummaryRow]:
    """One row per recipe, in ``recipes`` order, compared with fp32 and the plan's ``predictions`` where given."""
    results = as_results(results)
    peaks = peaks if isinstance(peaks, dict) else {}
    rows = []
    for name in recipes:
        peak = peaks.get(matmul_dtype.get(name, ""))
        rows.append(_row(name, [r for r in results if r.recipe == name], flops_per_step=flops_per_step,
                         peak=number(peak.get("flops_per_s")) if isinstance(peak, dict) else None,
                         matmul_dtype=matmul_dtype.get(name), impl=(impl or {}).get(name)))
    rows = [_with_prediction(row, (predictions or {}).get(row.recipe)) for row in rows]
    return _compare_with_fp32(rows, results)


def _with_prediction(row: SummaryRow, pred: Prediction | None) -> SummaryRow:
    if pred is None:
        return row
    measured = getattr(row, pred.peak_compared_with) if pred.peak_compared_with else None
    pred = dataclasses.replace(pred, peak_ratio=ratio(measured, pred.compared_peak),
                               step_time_ratio=ratio(row.median("step_time_s"), pred.step_time_s))
    return dataclasses.replace(row, prediction=pred)


def _row(name: str, mine: list[RunResult], *, flops_per_step, peak, matmul_dtype, impl) -> SummaryRow:
    ok = [r for r in mine if r.ok]
    timing = [r.timing for r in ok]
    summaries = [r.summary for r in ok]
    probes = [r.memory_probe for r in ok]
    mem = next((s["memory"] for s in summaries if isinstance(s.get("memory"), dict)), None)
    step = Spread.of(t.step_time_s for t in timing)
    busy = _median(r.device_busy.busy_s for r in ok)
    metric = _metric(summaries)
    return SummaryRow(
        recipe=name,
        impl=next((r.impl for r in mine if r.impl), impl),
        runs_ok=len(ok),
        runs_total=len(mine),
        failures=[Failure(repeat=r.repeat, seed=r.seed, reason=r.reason) for r in mine if not r.ok],
        invocations=sorted({r.invocation for r in mine if r.invocation is not None}),
        epoch_time_s=Spread.of(t.epoch_time_s for t in timing),
        raw_epoch_time_s=Spread.of(t.raw_epoch_time_s for t in timing),
        step_time_s=step,
        samples_per_s=Spread.of(t.samples_per_s for t in timing),
        memory=mem,
        memory_total_bytes=number(mem.get("total")) if mem else None,
        cuda_peak_allocated_bytes=_median(s.get("cuda_peak_allocated_bytes") for s in summaries),
        cuda_peak_reserved_bytes=_median(p.cuda_peak_reserved_bytes for p in probes),
        measured_step_peak_bytes=_median(p.step_peak_bytes for p in probes),
        measured_step_rss_peak_bytes=_median(p.rss_step_peak_bytes for p in probes),
        measured_step_peak_method=next((p.method or p.reason for p in probes if p.method or p.reason), None),
        exact_activations_plus_gradients_bytes=_median(p.exact_total for p in probes),
        matmul_dtype=matmul_dtype,
        peak_flops_per_s=peak,
        mfu=ratio(ratio(flops_per_step, step.median if step else None), peak),
        device_busy_s=busy,
        device_busy_fraction=ratio(busy, step.median if step else None),
        kernels_per_step=_median(r.device_busy.kernels_per_step for r in ok),
        final_train_loss=_median(s.get("final_train_loss") for s in summaries),
        task=next((s["task"] for s in summaries if isinstance(s.get("task"), str)), None),
        metric=metric,
        test_metric=Spread.of(s.get(metric) for s in summaries) if metric else None,
        test_accuracy=Spread.of(s.get("test_accuracy") for s in summaries),
        test_loss=Spread.of(s.get("test_loss") for s in summaries),
        bits_per_char=Spread.of(s.get("bits_per_char") for s in summaries),
        language_model=any(s.get("bits_per_char") is not None for s in summaries) or None,
        skipped_steps=max((number(s.get("skipped_steps")) or 0 for s in summaries), default=None),
        final_loss_scale=_median(s.get("final_loss_scale") for s in summaries),
    )


def _metric(summaries: list[dict[str, Any]]) -> str | None:
    """The summaries' main-metric key (a summary that names none: accuracy, or a language model's test loss)."""
    named = next((s["metric"] for s in summaries if isinstance(s.get("metric"), str)), None)
    if named or not summaries:
        return named
    return "test_loss" if any(s.get("bits_per_char") is not None for s in summaries) else "test_accuracy"


def _delta(a: float | None, b: float | None, scale: float = 1.0) -> float | None:
    return scale * (a - b) if a is not None and b is not None else None


def _compare_with_fp32(rows: list[SummaryRow], results: list[RunResult]) -> list[SummaryRow]:
    ref = next((r for r in rows if r.recipe == "fp32"), None)
    if ref is None:
        no_ref = ParityResult("n/a", None, None, 0, "fp32 was not run: add fp32 to --precisions")
        return [dataclasses.replace(row, parity=no_ref) for row in rows]
    fp32_curves = [r.loss_curve() for r in results if r.recipe == "fp32" and r.ok]
    out = []
    for row in rows:
        mine = [r for r in results if r.recipe == row.recipe]
        saving = ratio(row.memory_total_bytes, ref.memory_total_bytes)
        out.append(dataclasses.replace(
            row,
            speedup_vs_fp32=ratio(ref.median("epoch_time_s"), row.median("epoch_time_s")),
            memory_saving_vs_fp32=None if saving is None else 1.0 - saving,
            accuracy_delta_vs_fp32_pp=_delta(row.median("test_accuracy"), ref.median("test_accuracy"), 100.0),
            test_loss_delta_vs_fp32=_delta(row.median("test_loss"), ref.median("test_loss")),
            metric_delta_vs_fp32=(_delta(row.median("test_metric"), ref.median("test_metric"))
                                  if row.metric == ref.metric else None),
            parity=convergence_parity([r.loss_curve() for r in mine if r.ok], fp32_curves,
                                      stopped=any(r.summary.get("stopped") for r in mine)),
        ))
    return out
