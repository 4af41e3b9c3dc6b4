"""Does mixed precision pay on this machine? Step time and MFU of every recipe, eager and compiled, side by side.

For each model (built-in, Fashion-MNIST shapes, ``--batch-size``), every variant — a recipe, eager or with
``--compile`` — is built by mixprec's own ``build_run`` and stepped with its ``train_step`` (the trainer's
step). Variants take turns in rounds (rotated each round); each turn times ``--steps`` steps between clock
reads with no ``.item()`` inside; a variant's result is the median over rounds of its time per step divided by
fp32-eager's in the same round — a ratio measured side by side. MFU is the model's FLOPs per step
(``FlopCounterMode``) over the median step time, against the peak matmul rate of the dtype its GEMMs run in,
measured in the same invocation.

Run on a quiet machine (``uptime`` load well under 1): ``python benchmarks/recipes.py`` (a few minutes),
``--quick`` for a smoke run. ``--json PATH`` keeps the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

from mixprec import hardware
from mixprec.bench.flops import count_step_flops
from mixprec.hardware import measure_matmul_peak
from mixprec.train.build import build_run
from mixprec.train.config import TrainConfig
from mixprec.train.step import compile_warmup, train_step

DEFAULT_VARIANTS = "fp32,bf16-mixed,fp32+compile,bf16-mixed+compile,fp16-mixed,fp8-mixed"


def _variant(name: str) -> tuple[str, bool]:
    recipe, _, extra = name.partition("+")
    return recipe, extra == "compile"


def _build(model: str, variant: str, args):
    recipe, compiled = _variant(variant)
    config = TrainConfig.from_flags(precision=recipe, model=model, dataset="fashion-mnist",
                                    limit_train=args.batch_size * args.batches, limit_test=100,
                                    batch_size=args.batch_size, log_every=0, progress="off", seed=0,
                                    compile=compiled)
    run = build_run(config)
    run.train_loader.set_epoch(0)
    batches = list(run.train_loader)
    if compiled:
        with run.recipe.run_context():
            compile_warmup(run.ctx, batches[:1])
    return run, batches


def _turn(run, batches, steps: int, start: int) -> float:
    with run.recipe.run_context():
        hardware.synchronize(run.device)
        t0 = time.perf_counter()
        for i in range(steps):
            xb, yb = batches[(start + i) % len(batches)]
            train_step(run.ctx, xb, yb)
        hardware.synchronize(run.device)
    return (time.perf_counter() - t0) / steps


def measure_model(model: str, variants: list[str], peaks: dict, args) -> list[dict]:
    built = {v: _build(model, v, args) for v in variants}
    ref_run, ref_batches = built[variants[0]]
    xb, yb = ref_batches[0]
    flops = count_step_flops(build_run(TrainConfig.from_flags(model=model, dataset="fashion-mnist",
                                                              limit_train=args.batch_size, limit_test=10)).model,
                             xb, yb, ref_run.loss_fn).total
    for v in variants:  # warm-up turns
        _turn(*built[v], args.warmup, 0)
    per_round: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(args.rounds):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for v in order:
            per_round[v].append(_turn(*built[v], args.steps, r * args.steps))
    rows = []
    for v in variants:
        ratios = [a / b for a, b in zip(per_round[v], per_round[variants[0]])]
        step = statistics.median(per_round[v])
        facts = built[v][0].recipe.hardware_facts()
        peak = peaks[facts.matmul_dtype]["flops_per_s"]
        rows.append({"model": model, "variant": v, "step_time_s": step, "time_vs_fp32": statistics.median(ratios),
                     "ratio_min": min(ratios), "ratio_max": max(ratios), "speedup_vs_fp32": 1 / statistics.median(ratios),
                     "flops_per_step": flops, "mfu": flops / step / peak, "mfu_peak_dtype": facts.matmul_dtype})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="mlp,cnn,transformer")
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help="recipes, '+compile' for compiled ones; first is "
                                                                 "the reference")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.warmup = 2, 2, 1
    load = os.getloadavg()[0]
    peaks = {dt: measure_matmul_peak(d, "cpu", budget_s=1.0) for dt, d in (("fp32", torch.float32),
                                                                          ("bf16", torch.bfloat16))}
    rows = []
    for model in args.models.split(","):
        rows += measure_model(model, args.variants.split(","), peaks, args)
    print(f"# recipes: {hardware.cpu_name()}, torch {torch.__version__}, {torch.get_num_threads()} threads, batch "
          f"{args.batch_size}, {args.rounds} rounds x {args.steps} steps, load {load:.2f} -> {os.getloadavg()[0]:.2f}")
    print(f"peaks: fp32 {peaks['fp32']['flops_per_s'] / 1e9:.0f} GFLOP/s, bf16 {peaks['bf16']['flops_per_s'] / 1e9:.0f}"
          " GFLOP/s")
    print("| model | variant | step time | speedup vs fp32 (median) | min..max | MFU |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['variant']} | {r['step_time_s'] * 1e3:.2f} ms | {r['speedup_vs_fp32']:.2f}x | "
              f"{1 / r['ratio_max']:.2f}..{1 / r['ratio_min']:.2f} | {100 * r['mfu']:.0f}% of {r['mfu_peak_dtype']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "peaks": peaks, "platform": platform.platform(), "load": load,
                       "argv": sys.argv[1:]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
