"""Predicted (``mixprec plan --target cpu``) vs measured on this CPU: the proof table of issue 20.

    PYTHONPATH=src python benchmarks/plan_vs_measured.py                  # memory only (any machine)
    PYTHONPATH=src python benchmarks/plan_vs_measured.py --timing         # + step times (a quiet machine)
    PYTHONPATH=src python benchmarks/plan_vs_measured.py --calibrate      # fit the CPU efficiency factors
    PYTHONPATH=src python benchmarks/plan_vs_measured.py --timing --calibrate   # fit, then check with the fit
    PYTHONPATH=src python benchmarks/plan_vs_measured.py --timing --calibrate --quick   # a smoke test (minutes)

For the built-in models (mlp, cnn, transformer) and two user models (tests/userpkg/factories.py: a CNN and an
``nn.TransformerEncoder``) at batch 64 and 256, fp32 and bf16-mixed, on digits with AdamW:

- parameters, gradients, optimizer state, masters: the plan vs bench's exact accounting of a real
  steady-state step (:mod:`mixprec.memory`) -- must be equal;
- activations (+ autocast weight copies + FP8 buffers): within 10%;
- the step's peak above the resident state: the plan's ``peak - (parameters + buffers + optimizer state +
  masters)`` vs bench's measured probe (:func:`mixprec.bench.measure.probe_step_memory`: the CPU allocator's
  peak over a real step, from torch.profiler's memory events) -- within 25%; beside it the resident set's rise
  (VmHWM after clear_refs, glibc in mmap mode), the physical check, coarse on steps of a few MiB;
- ``--timing``: the bf16-mixed / fp32 step-time ratio, predicted vs measured (fp32 and bf16-mixed taking turns, median of per-round ratios), within
  25%. Timing needs a quiet machine; a loaded one gives meaningless times.

``--calibrate`` measures real step times of *other* models (:data:`CALIBRATION`: SimpleNet, residual CNNs with batch norm,
a GRU, an MLP-Mixer, an LSTM and two GPTs on the fortunes text -- benchmarks/calibration_models.py and
tests/userpkg; fp32 and bf16-mixed), traces the same steps, and fits the cpu target's
factors: the planner times the step's ops with FLOPs on this CPU (:mod:`mixprec.planning.kernels`), so the fit
is of what is left -- the bandwidth efficiency of the other ops, the host time every op adds and the step's
own host time -- by non-negative least squares of the relative errors on ``measured = timed calls + bytes /
(bandwidth x factor) + ops x overhead + per-step host time``; the GEMM efficiency per dtype (used for calls too
large to time, and their low-precision overhead) is fitted on the timed calls themselves. It prints the
``CPU_EFFICIENCY = ...`` line to paste
into ``src/mixprec/planning/roofline.py`` (replacing the starting guess), and uses the fit for the
comparison that follows in the same run. ``--quick`` checks the whole path on one small model, one batch
and few steps (its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests.userpkg, from anywhere

CHECKED = ["mlp", "cnn", "transformer", "tests.userpkg.factories:cnn", "tests.userpkg.factories:transformer"]
FLAGS = dict(dataset="digits", optimizer="adamw", lr=1e-3)


ROUNDS, STEPS = 9, 4
"""Timing: rounds of ``STEPS`` steps per recipe, fp32 and bf16-mixed taking turns (the order swapped every round)
after warm-up; a recipe's step time is the median over rounds, the measured ratio the median of per-round
ratios (as benchmarks/overhead.py measures). ``--quick`` lowers them."""


def _build(model: str, precision: str, batch: int, **flags):
    from mixprec.train.build import build_run
    from mixprec.train.config import TrainConfig
    from mixprec.train.step import train_step

    run = build_run(TrainConfig.from_flags(model=model, precision=precision, batch_size=batch, device="cpu",
                                           **{**FLAGS, **flags}))
    batch0 = next(iter(run.train_loader))
    train_step(run.ctx, *batch0)
    return run, batch0


def _memory(run, batch0):
    """bench's exact accounting of a steady-state step and its measured step peak."""
    from mixprec.bench.measure import probe_step_memory
    from mixprec.memory import SavedTensorTracker, static_memory
    from mixprec.train.step import train_step

    tracker = SavedTensorTracker(exclude=run.model.parameters())
    train_step(run.ctx, *batch0, tracker=tracker)
    exact = static_memory(run.model, run.optimizer, run.recipe.master).add_saved(tracker)
    probe = probe_step_memory(run, *batch0)
    return exact, probe.step_peak_bytes, probe.rss_step_peak_bytes


def _time_turn(run, batch0, steps: int) -> float:
    from mixprec.train.step import train_step

    with run.recipe.run_context():
        t0 = time.perf_counter()
        for _ in range(steps):
            train_step(run.ctx, *batch0)
        return (time.perf_counter() - t0) / steps


def _time_pair(built: dict, rounds: int | None = None, steps: int | None = None) -> tuple[dict, float]:
    """``({recipe: median step time}, median of per-round bf16-mixed/fp32 ratios)`` of the runs in ``built``
    (``{recipe: (run, batch)}``, fp32 and bf16-mixed), taking turns."""
    rounds, steps = rounds or ROUNDS, steps or STEPS
    names = list(built)
    for name in names:  # warm-up
        _time_turn(*built[name], steps)
    per = {n: [] for n in names}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            per[name].append(_time_turn(*built[name], steps))
    ratios = [b / f for f, b in zip(per["fp32"], per["bf16-mixed"])]
    return {n: statistics.median(v) for n, v in per.items()}, statistics.median(ratios)


def _plan(model, precisions, batch, target, **flags):
    from mixprec.planning import plan

    return plan(precisions=precisions, target=target, model=model, batch_size=batch, **{**FLAGS, **flags})


def compare(timing: bool, batches=(64, 256), models=CHECKED) -> list[dict]:
    """The proof table's rows. Every step time is taken before any memory probe: the probe switches glibc to a
    fixed 64 KiB mmap threshold for the rest of the process (``mallopt`` also ends its dynamic threshold), and
    steps timed after it page-fault every tensor of 64 KiB or more afresh -- measured ratios moved by up to 0.5
    when the probes and the timing were interleaved."""
    from mixprec.planning import get_target

    target = get_target("cpu")
    cases = [(model, b) for model in models for b in batches]
    plans, times = {}, {}
    for model, b in cases:
        plans[model, b] = p = _plan(model, "fp32,bf16-mixed", b, target)
        if timing:
            built = {r.recipe: _build(model, r.recipe, b) for r in p.recipes}
            times[model, b] = _time_pair(built)
            del built
    rows = []
    for model, b in cases:
        p = plans[model, b]
        measured, ratio = times.get((model, b), ({}, None))
        for r in p.recipes:
            exact, step_peak, rss_peak = _memory(*_build(model, r.recipe, b))
            resident = sum(r.memory[c] for c in ("parameters", "buffers", "optimizer_state", "master_weights"))
            saved_p = sum(r.memory[c] for c in ("activations", "autocast_weight_copies", "fp8_buffers"))
            saved_m = exact.activations + exact.autocast_weight_copies + exact.fp8_buffers
            rows.append(dict(
                model=model, batch=b, recipe=r.recipe,
                static_exact=all(r.memory[c] == getattr(exact, c) for c in
                                 ("parameters", "gradients", "optimizer_state", "master_weights")),
                saved_pred=saved_p, saved_meas=saved_m, peak_pred=r.peak_bytes - resident, peak_meas=step_peak,
                peak_rss=rss_peak, time_pred=r.step_time_s, time_meas=measured.get(r.recipe)))
        if timing:
            pred = {r.recipe: r.step_time_s for r in p.recipes}
            rows[-1]["ratio_pred"], rows[-1]["ratio_meas"] = pred["bf16-mixed"] / pred["fp32"], ratio
    return rows


def _pct(a, b):
    return "n/a" if not a or not b else f"{(a - b) / b:+.1%}"


def table(rows: list[dict]) -> str:
    out = ["| model | batch | recipe | params/grads/optim/masters | saved pred / meas (MiB) | Δ | step peak pred / "
           "meas (MiB) | Δ | VmHWM rise (MiB) | step time pred / meas (ms) | bf16/fp32 time ratio pred / meas | Δ |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    within = []
    for r in rows:
        ratio = delta = ""
        if r.get("ratio_meas"):
            ratio, delta = f"{r['ratio_pred']:.2f} / {r['ratio_meas']:.2f}", _pct(r["ratio_pred"], r["ratio_meas"])
            within.append(abs(r["ratio_pred"] - r["ratio_meas"]) <= 0.25 * r["ratio_meas"])
        times = f"{r['time_pred'] * 1e3:.1f} / {r['time_meas'] * 1e3:.1f}" if r.get("time_meas") else ""
        peak_meas = f"{r['peak_meas'] / 2**20:.2f}" if r["peak_meas"] else "n/a"
        rss = f"{r['peak_rss'] / 2**20:.2f} ({_pct(r['peak_pred'], r['peak_rss'])})" if r.get("peak_rss") else "n/a"
        out.append(f"| {r['model']} | {r['batch']} | {r['recipe']} | {'exact' if r['static_exact'] else 'DIFFER'} | "
                   f"{r['saved_pred'] / 2**20:.2f} / {r['saved_meas'] / 2**20:.2f} | {_pct(r['saved_pred'], r['saved_meas'])} | "
                   f"{r['peak_pred'] / 2**20:.2f} / {peak_meas} | {_pct(r['peak_pred'], r['peak_meas'])} | {rss} | "
                   f"{times} | "
                   f"{ratio} | {delta} |")
    if within:
        out.append(f"\nbf16-mixed/fp32 step-time ratio within 25% of the measured one: {sum(within)} of {len(within)}")
    return "\n".join(out)


FORTUNES = "/usr/share/games/fortunes/fortunes"
CALIBRATION = [
    ("simplenet", 128, {}),
    ("simplenet", 512, {}),
    ("benchmarks.calibration_models:resnet", 128, {}),
    ("benchmarks.calibration_models:wide_resnet", 128, {}),
    ("benchmarks.calibration_models:gru", 32, {}),
    ("benchmarks.calibration_models:gru", 128, {}),
    ("benchmarks.calibration_models:mixer", 128, {}),
    ("tests.userpkg.lstm:model", 32, dict(dataset="tests.userpkg.lstm:data")),
    ("tests.userpkg.lstm:model", 128, dict(dataset="tests.userpkg.lstm:data")),
    ("gpt", 32, dict(dataset="text", data_path=FORTUNES, d_model=128, n_layers=2, n_heads=4, block_size=64)),
    ("gpt", 32, dict(dataset="text", data_path=FORTUNES, d_model=256, n_layers=4, n_heads=4, block_size=128)),
]
"""Calibration steps (model, batch, flags): families other than the checked ones -- the tutorial's one-layer
SimpleNet, residual CNNs with batch norm, a GRU, an MLP-Mixer, an LSTM, two GPTs on the fortunes text -- from
sub-millisecond dispatch-bound steps to GEMM-bound ones."""


def calibrate(quick: bool = False) -> dict:
    """Fit CPU_EFFICIENCY on calibration models (not the checked ones). The cpu target times its ops with FLOPs
    (:mod:`mixprec.planning.kernels`), so a step is ``measured = timed + M/e_m + n*t_op + t_step`` (timed: those
    calls, a known term; M: the other ops' bytes over the bandwidth; n: the ops, each adding host time; t_step:
    the step's own host time), fitted by non-negative least squares of the relative errors. The GEMM factors,
    which price the calls too large to time (and the low-precision GEMM overhead), come from the timed calls
    themselves: ``t = FLOPs / (peak x e_d) + c_d`` per dtype. The fit replaces CPU_EFFICIENCY in this process
    and the line to paste is printed."""
    import numpy as np
    from scipy.optimize import nnls

    import mixprec.planning.api as api
    import mixprec.planning.roofline as roofline
    from mixprec.planning import get_target
    from mixprec.planning.kernels import KernelTimes
    from mixprec.planning.roofline import LOWP_DTYPES, Efficiency

    target = get_target("cpu")
    configs = CALIBRATION[:3] if quick else CALIBRATION
    rows, ys, known = [], [], []
    kernels = KernelTimes()
    calls = {"fp32": {}, "bf16": {}}  # dtype -> {timed call: (FLOPs / peak, measured s)}
    captured = {}
    real = api.trace_step

    def spy(**kw):
        out = real(**kw)
        captured[out.recipe] = out
        return out

    api.trace_step = spy
    try:
        for model, batch, flags in configs:
            captured.clear()
            _plan(model, "fp32,bf16-mixed", batch, target, **flags)
            built = {name: _build(model, name, batch, **flags) for name in captured}
            measured, _ = _time_pair(built)
            del built
            for name, tr in captured.items():
                moved = n = 0
                timed = kernels.measure(op.kernel for op in tr.ops)
                for op in tr.ops:
                    if op.nbytes == 0 and op.flops == 0:
                        continue  # views: no kernel, as step_time counts them
                    n += 1
                    if op.kernel in timed:  # timed on this CPU (planning.kernels): a known term, not fitted
                        d = "bf16" if op.dtype in LOWP_DTYPES else "fp32"
                        calls[d][op.kernel] = (op.flops / target.peak(d), timed[op.kernel])
                    elif op.flops:
                        print(f"note: {op.name} ({op.dtype}) could not be timed; left out of the fit", flush=True)
                    else:
                        moved += op.nbytes / target.bandwidth
                rows.append([moved, n, 1.0])
                ys.append(measured[name])
                known.append(sum(timed[op.kernel] for op in tr.ops if op.kernel in timed))
                print(f"calibration: {model} batch {batch} {name}: {measured[name] * 1e3:.2f} ms, "
                      f"{n} ops, {known[-1] * 1e3:.2f} ms in timed kernels", flush=True)
    finally:
        api.trace_step = real
    # the step: relative errors (each step's row divided by its measured time), so the dispatch-bound small
    # steps weigh as much as the GEMM-bound large ones
    a, y, k = np.array(rows), np.array(ys), np.array(known)
    w, _ = nnls(a / y[:, None], (y - k) / y)
    # the GEMM factors, for the calls too large to time: each timed call's time = FLOPs / (peak x e_d) + c_d,
    # in absolute terms (the large calls, where e_d matters, weigh most)
    gemm_fit, fixed = {}, {}
    for d, got in calls.items():
        if got:
            x = np.array([[f, 1.0] for f, _ in got.values()])
            g, _ = nnls(x, np.array([t for _, t in got.values()]))
            gemm_fit[d], fixed[d] = (float(1 / g[0]) if g[0] else None), float(g[1])
    fit = {"fp32": gemm_fit.get("fp32"), "bf16": gemm_fit.get("bf16"),
           "memory": float(1 / w[0]) if w[0] else None, "op_overhead_s": float(w[1]),
           "lowp_gemm_overhead_s": max(0.0, fixed.get("bf16", 0.0) - fixed.get("fp32", 0.0)),
           "step_overhead_s": float(w[2])}
    print("fitted efficiency factors:", fit)
    for k, v in fit.items():
        if v is None:
            print(f"warning: {k} could not be fitted (its term got weight 0); the line below keeps the old value")
    old = roofline.CPU_EFFICIENCY
    gemm = {"fp32": fit["fp32"] or old.gemm["fp32"], "bf16": fit["bf16"] or old.gemm["bf16"]}
    gemm["fp16"] = gemm["bf16"]
    memory = fit["memory"] or old.memory
    source = (f"fitted by benchmarks/plan_vs_measured.py --calibrate on {target.description}, "
              f"{time.strftime('%Y-%m-%d')} (fp32 and bf16-mixed steps of SimpleNet, residual CNNs, a GRU, an "
              "MLP-Mixer, an LSTM and two GPTs: other families than the checked models)")
    roofline.CPU_EFFICIENCY = Efficiency(gemm=gemm, memory=memory, op_overhead_s=fit["op_overhead_s"],
                                         lowp_gemm_overhead_s=fit["lowp_gemm_overhead_s"],
                                         step_overhead_s=fit["step_overhead_s"], source=source)
    print("paste into src/mixprec/planning/roofline.py (replacing CPU_EFFICIENCY = ...):")
    print(f"CPU_EFFICIENCY = Efficiency(gemm={{\"fp32\": {gemm['fp32']:.3g}, \"bf16\": {gemm['bf16']:.3g}, "
          f"\"fp16\": {gemm['fp16']:.3g}}}, memory={memory:.3g},\n"
          f"                            op_overhead_s={fit['op_overhead_s']:.3g}, "
          f"lowp_gemm_overhead_s={fit['lowp_gemm_overhead_s']:.3g},\n"
          f"                            step_overhead_s={fit['step_overhead_s']:.3g},\n"
          f"                            source={source!r})")
    return fit


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--timing", action="store_true", help="also time steps (needs a quiet machine)")
    ap.add_argument("--calibrate", action="store_true", help="fit the CPU efficiency factors")
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--models", default=",".join(CHECKED), help="the checked models (comma-separated)")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke test of the whole path: mlp only, batch 64, 3 rounds of 2 steps, 2 calibration models")
    args = ap.parse_args(argv)
    global ROUNDS, STEPS
    batches, models = tuple(int(b) for b in args.batches.split(",")), args.models.split(",")
    if args.quick:
        ROUNDS, STEPS, batches, models = 3, 2, (64,), ["mlp"]
    torch.manual_seed(0)
    if args.calibrate:
        calibrate(args.quick)
    if args.timing or not args.calibrate:
        print(table(compare(args.timing, batches, models)))


if __name__ == "__main__":
    main()
