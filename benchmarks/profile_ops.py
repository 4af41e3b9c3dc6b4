"""Where a training step's time goes: torch.profiler's costliest ops per recipe, on mixprec's own step.

For each recipe, the model is built by ``build_run`` and stepped by ``train_step`` (the trainer's step, as in
benchmarks/recipes.py) on synthetic Fashion-MNIST-shaped batches (the values do not change the ops). After
``--warmup`` steps, ``--steps`` steps run under ``torch.profiler`` (CPU activity, and CUDA's on a GPU); the table
is ``key_averages()`` sorted by self device time (self CPU time on a CPU), its ``--top`` rows, with the profiled
steps' wall time per step above it. Eager unless ``--compile``.

    PYTHONPATH=src python benchmarks/profile_ops.py --device cuda --batch-size 512 \\
        --flags d_model=512,n_layers=6,n_heads=8,patch_size=4 --out runs/profile
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from mixprec import hardware
from mixprec.train.build import build_run
from mixprec.train.config import TrainConfig
from mixprec.train.step import compile_warmup, train_step


def parse_flags(text: str) -> dict:
    """``"width=4096,depth=4"`` -> ``{"width": 4096, "depth": 4}``: TrainConfig flag names, ints and floats parsed."""
    flags = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        for kind in (int, float):
            try:
                value = kind(value)
                break
            except ValueError:
                pass
        flags[key.strip()] = value
    return flags


def profile_recipe(recipe: str, args) -> tuple[str, float]:
    """(the profiler's table, wall seconds per profiled step) of ``recipe``."""
    config = TrainConfig.from_flags(precision=recipe, model=args.model, dataset="synthetic",
                                    synthetic_train=args.batch_size * 2, synthetic_test=16,
                                    batch_size=args.batch_size, log_every=0, progress="off", seed=0,
                                    device=args.device, compile=args.compile, **parse_flags(args.flags))
    run = build_run(config)
    run.train_loader.set_epoch(0)
    batches = list(run.train_loader)
    cuda = run.device.type == "cuda"
    with run.recipe.run_context():
        if args.compile:
            compile_warmup(run.ctx, batches[:1])
        for i in range(args.warmup):
            train_step(run.ctx, *batches[i % len(batches)])
        hardware.synchronize(run.device)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            t0 = time.perf_counter()
            for i in range(args.steps):
                train_step(run.ctx, *batches[i % len(batches)])
            hardware.synchronize(run.device)
            wall = (time.perf_counter() - t0) / args.steps
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=sort, row_limit=args.top, max_name_column_width=60), wall


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipes", default="fp32,bf16-mixed,fp16-mixed,fp8-mixed")
    p.add_argument("--model", default="transformer")
    p.add_argument("--flags", default="", help="model settings as TrainConfig flags, e.g. d_model=512,n_layers=6")
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--device", default="auto")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--top", type=int, default=10, help="rows of each table")
    p.add_argument("--out", default=None, metavar="DIR", help="also write each table to DIR/profile-RECIPE.txt")
    args = p.parse_args(argv)
    device = hardware.resolve_device(args.device)
    args.device = device.type
    print(f"# profile_ops: {args.model} {args.flags} batch {args.batch_size} on {hardware.device_name(device)}, "
          f"torch {torch.__version__}, {'compiled' if args.compile else 'eager'}, {args.steps} steps profiled after "
          f"{args.warmup}, {time.strftime('%Y-%m-%d')}", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    for recipe in args.recipes.split(","):
        table, wall = profile_recipe(recipe, args)
        text = f"## {recipe}: {1e3 * wall:.2f} ms/step under the profiler\n\n{table}\n"
        print(text, flush=True)
        if args.out:
            with open(os.path.join(args.out, f"profile-{recipe}.txt"), "w", encoding="utf-8") as f:
                f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
