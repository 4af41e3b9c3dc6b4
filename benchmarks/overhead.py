"""Step-time overhead of mixprec's training loop against the tutorial's plain PyTorch loop.

What is compared, per (model, recipe), on the same model (same initial weights), the same batches and
the same optimizer:

- ``plain``: the tutorial's loop written out — ``torch.autocast`` + ``torch.amp.GradScaler`` (enabled only
  for fp16, a no-op otherwise), nothing else::

      opt.zero_grad(set_to_none=True)
      with torch.autocast(device, dtype=..., enabled=...):
          loss = F.cross_entropy(model(x), y)
      scaler.scale(loss).backward()
      scaler.step(opt)
      scaler.update()

- ``mixprec``: :func:`mixprec.train.step.train_step` on a :func:`~mixprec.train.build.build_run` run with
  ``--amp-impl native`` (the recipe hooks around the same torch.autocast / GradScaler).
- ``fabric`` (Lightning Fabric) and ``accelerate`` (Hugging Face), when importable: their documented loops
  with the same precision (``bf16-mixed`` / ``mixed_precision="bf16"``; fp32 as ``32-true`` / ``"no"``).

Method: every loop warms up, then the loops take turns in rounds (``plain, mixprec, fabric, accelerate``,
rotated every round so none always runs first after another's cache effects); each turn times ``--steps``
steps between synchronised clock reads with no ``.item()`` inside. The result per loop is the median over
rounds of (its time per step / plain's time per step in the same round): a ratio measured side by side,
robust to the machine getting slower or faster between rounds. Target: mixprec / plain <= 1.03.

Run it on a quiet machine: ``python benchmarks/overhead.py`` (about a minute), ``--quick`` for a smoke run;
``--flags mlp:width=4096,depth=4,batch_size=1024`` sizes a model and its batch (gpu_check.sh's GPU configs).
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from mixprec import hardware
from mixprec.precision import resolve_recipe
from mixprec.train.config import TrainConfig
from mixprec.train.build import build_run
from mixprec.train.step import train_step
from profile_ops import parse_flags  # benchmarks/, on the path when this script runs

LOOPS = ("plain", "mixprec", "fabric", "accelerate")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plain_loop(model, opt, recipe_name: str, device: torch.device):
    """The tutorial's loop as a step function."""
    spec = resolve_recipe(recipe_name)
    scaler = torch.amp.GradScaler(device.type, enabled=spec.loss_scaling)

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=spec.compute_dtype, enabled=spec.autocast):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    return step


def fabric_loop(model, opt, recipe_name: str, device: torch.device):
    from lightning.fabric import Fabric

    # Note: Fabric turns "16-mixed" on a CPU into "bf16-mixed" (with a warning); fp16 rows of Fabric on a CPU
    # therefore measure bf16.
    precision = {"fp32": "32-true", "bf16-mixed": "bf16-mixed", "fp16-mixed": "16-mixed"}[recipe_name]
    for name in ("lightning.fabric", "lightning.pytorch"):  # quiet: no "Using bfloat16 AMP" line in the table
        logging.getLogger(name).setLevel(logging.WARNING)
    fabric = Fabric(accelerator=device.type, devices=1, precision=precision)
    model, opt = fabric.setup(model, opt)

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)  # Fabric's wrapper runs the forward under its autocast
        fabric.backward(loss)
        opt.step()

    return step


def accelerate_loop(model, opt, recipe_name: str, device: torch.device):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)  # one Accelerator per (model, recipe) in this process
    mp = {"fp32": "no", "bf16-mixed": "bf16", "fp16-mixed": "fp16"}[recipe_name]
    acc = Accelerator(cpu=device.type == "cpu", mixed_precision=mp)
    model, opt = acc.prepare(model, opt)

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)  # the prepared model's forward runs under autocast
        acc.backward(loss)
        opt.step()

    return step


def _available(name: str) -> bool:
    try:
        __import__({"fabric": "lightning.fabric", "accelerate": "accelerate"}[name])
        return True
    except ImportError:
        return False


def measure(model_name: str, recipe: str, args) -> dict:
    flags = parse_flags(args.flags.get(model_name, ""))
    batch_size = flags.pop("batch_size", args.batch_size)
    config = TrainConfig.from_flags(precision=recipe, amp_impl="native", model=model_name, dataset="synthetic",
                         synthetic_train=batch_size * args.batches, synthetic_test=64,
                         batch_size=batch_size, lr=0.01, log_every=0, progress="off", device=args.device,
                         seed=0, **flags)
    run = build_run(config)
    device = run.device
    fp32_init = copy.deepcopy(run.model).float()  # same initial weights for every loop
    batches = [(x.to(device), y.to(device)) for x, y in run.train_loader]

    def make_opt(m):
        return torch.optim.SGD(m.parameters(), lr=config.optim.lr)

    steps = {"mixprec": lambda x, y: train_step(run.ctx, x, y)}
    builders = {"plain": plain_loop, "fabric": fabric_loop, "accelerate": accelerate_loop}
    skipped = {}
    for name in LOOPS:
        if name == "mixprec" or name not in args.loops:
            continue
        if name != "plain" and not _available(name):
            skipped[name] = "not installed"
            continue
        m = copy.deepcopy(fp32_init)
        try:
            steps[name] = builders[name](m, make_opt(m), recipe, device)
        except Exception as e:  # noqa: BLE001 -- report, do not stop the other loops
            skipped[name] = f"{type(e).__name__}: {e}"
    order = [n for n in LOOPS if n in steps]

    def timed(name: str, n: int) -> float:
        fn = steps[name]
        _sync(device)
        t0 = time.perf_counter()
        for i in range(n):
            x, y = batches[i % len(batches)]
            fn(x, y)
        _sync(device)
        return (time.perf_counter() - t0) / n

    with run.recipe.run_context():
        for name in order:
            timed(name, args.warmup)
        per_round = {n: [] for n in order}
        for r in range(args.rounds):
            k = r % len(order)
            for name in order[k:] + order[:k]:
                per_round[name].append(timed(name, args.steps))
    ratios = {n: [a / b for a, b in zip(per_round[n], per_round["plain"])] for n in order}
    return {
        "model": model_name,
        "recipe": recipe,
        "params": sum(p.numel() for p in run.model.parameters()),
        "batch_size": batch_size,
        "step_ms": {n: 1e3 * statistics.median(v) for n, v in per_round.items()},
        "ratio_vs_plain": {n: statistics.median(v) for n, v in ratios.items()},
        "ratio_range": {n: [min(v), max(v)] for n, v in ratios.items()},
        "skipped": skipped,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="mlp,transformer")
    p.add_argument("--recipes", default="fp32,bf16-mixed")
    p.add_argument("--loops", default=",".join(LOOPS), help="subset of plain,mixprec,fabric,accelerate")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--batches", type=int, default=16, help="distinct batches cycled through")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", type=int, default=20, help="steps per timed turn")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--device", default="cpu")
    p.add_argument("--flags", action="append", default=[], metavar="MODEL:KEY=VALUE,...",
                   help="a model's settings as TrainConfig flags, e.g. mlp:width=4096,depth=4,batch_size=1024 "
                        "(repeatable)")
    p.add_argument("--quick", action="store_true", help="smoke run: 3 rounds of 5 steps")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    args.loops = {"plain", "mixprec"} | set(args.loops.split(","))
    args.flags = dict(f.split(":", 1) for f in args.flags)
    if args.quick:
        args.warmup, args.steps, args.rounds = 3, 5, 3
    device = hardware.resolve_device(args.device)
    print(f"# overhead: {hardware.device_name(device)}, torch {torch.__version__}, {torch.get_num_threads()} "
          f"threads, batch {args.batch_size}, {args.rounds} rounds x {args.steps} steps, "
          f"{time.strftime('%Y-%m-%d')}")
    results = []
    print("| model | recipe | loop | step time | ratio vs plain (median) | min..max over rounds |")
    print("|---|---|---|---|---|---|")
    for model in args.models.split(","):
        for recipe in args.recipes.split(","):
            res = measure(model, resolve_recipe(recipe).name, args)
            results.append(res)
            for n, ms in res["step_ms"].items():
                lo, hi = res["ratio_range"][n]
                print(f"| {model} | {res['recipe']} | {n} | {ms:.2f} ms | {res['ratio_vs_plain'][n]:.3f} | "
                      f"{lo:.3f}..{hi:.3f} |", flush=True)
            for n, why in res["skipped"].items():
                print(f"| {model} | {res['recipe']} | {n} | skipped: {why} | | |", flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"python": platform.python_version(), "torch": torch.__version__,
                       "device": hardware.device_name(device), "argv": sys.argv[1:], "results": results}, f,
                      indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
