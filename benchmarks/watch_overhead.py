"""What ``mixprec.watch`` costs a plain PyTorch loop: per-step time watched vs unwatched, one sampled step, syncs.

Per (model, recipe) on the same model (same initial weights), batches and optimizer:

- ``plain``: the tutorial's loop (``torch.autocast`` + ``torch.amp.GradScaler``, enabled for fp16 only);
- ``watched``: the same loop on a copy of the model inside ``mixprec.watch(model, opt, scaler=scaler,
  every=EVERY)`` (no ``out``: nothing is written, so only the watch's own work is timed);
- ``unsampled``: the same again, watched with ``every`` so large that no timed step is sampled: the fixed cost
  of an unsampled step alone (its ratio to ``plain`` is reported apart).

Method (as ``benchmarks/overhead.py``): both loops warm up, then take turns in rounds, the order swapped every
round; a turn times ``EVERY`` steps between synchronised clock reads with no ``.item()`` of the benchmark's
inside, so every watched turn holds exactly one sampled step and the ratio includes its amortised cost. The
result is the median over rounds of (watched time per step / plain time per step in the same round).
Target: <= 1.03 at ``every=100``. The unsampled ratio (same rounds) splits that into the per-step cost and
the sampled step's share.

``--clip MAX_NORM``: both loops clip the gradients' norm before the step (as the tutorial does against NaNs)
and the watched loop hands the norm to the watch, whose unsampled finite check then reads that norm instead of
reducing every gradient itself. ``--check deferred``: the watch keeps its finite flag on the device until the next
sample (no read per step; for loops that skip non-finite steps themselves).

Also reported: the cost of one sampled step (a watch sampling every step against one that never samples,
per step, minus each other), and the host syncs the watch adds per unsampled step, counted by a dispatcher
mode (every ``.item()``/``bool()``/``float()`` is an ``aten._local_scalar_dense``) plus ``Tensor.tolist`` calls:
watched minus plain over the same steps.

Run on a quiet machine, from the repository root: ``PYTHONPATH=src python benchmarks/watch_overhead.py
--json watch_overhead.json`` (``--device cuda`` on a GPU), ``--quick`` for a smoke run. On a loaded CPU-only
machine ``--threads 1 --clock cpu`` times the process's CPU time instead of the wall clock (ratios only; a
shared core still stretches both sides).
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import mixprec
import mixprec.probes.subsample
from mixprec.precision import resolve_recipe
from mixprec.train.build import build_run
from mixprec.train.config import TrainConfig
from profile_ops import parse_flags  # benchmarks/, on the path when this script runs


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _loop(model, opt, recipe: str, device: torch.device, clip: float | None = None, watch=None):
    """(step function, scaler): the tutorial's loop for ``recipe`` (fp16 gets a GradScaler); with ``clip`` it
    clips the gradients' norm before the step (unscaling them first) and hands the norm to ``watch[0]``."""
    spec = resolve_recipe(recipe)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(spec.name.split("-")[0])
    scaler = torch.amp.GradScaler(device.type, enabled=dtype is torch.float16)
    watch = watch if watch is not None else [None]

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        if clip is not None:
            scaler.unscale_(opt)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            if watch[0] is not None:
                watch[0].log(grad_norm=norm)
        scaler.step(opt)
        scaler.update()

    return step, scaler


class _Syncs(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.n += 1
        return func(*args, **(kwargs or {}))


def _count_syncs(fn, batches, n: int) -> int:
    counter, tolist = _Syncs(), torch.Tensor.tolist

    def counted(self):
        counter.n += 1
        return tolist(self)

    torch.Tensor.tolist = counted
    try:
        with counter:
            for i in range(n):
                fn(*batches[i % len(batches)])
    finally:
        torch.Tensor.tolist = tolist
    return counter.n


def measure(model_name: str, recipe: str, args) -> dict:
    flags = parse_flags(args.flags.get(model_name, ""))
    batch_size = flags.pop("batch_size", args.batch_size)
    config = TrainConfig.from_flags(precision="fp32", model=model_name, dataset="synthetic",
                                    synthetic_train=batch_size * args.batches, synthetic_test=64,
                                    batch_size=batch_size, lr=0.01, log_every=0, progress="off",
                                    device=args.device, seed=0, **flags)
    run = build_run(config)
    device = run.device
    init = copy.deepcopy(run.model).float()
    batches = [(x.to(device), y.to(device)) for x, y in run.train_loader]

    def make(every: int | None):
        m = copy.deepcopy(init)
        opt = torch.optim.SGD(m.parameters(), lr=0.01)
        holder: list = [None]
        step, scaler = _loop(m, opt, recipe, device, clip=args.clip, watch=holder)
        w = None if every is None else mixprec.watch(m, opt, scaler=scaler, every=every, plots=False,
                                                      tensorboard=False, sample_elements=args.sample_elements,
                                                      check=args.check)
        holder[0] = w
        return step, w

    plain, _ = make(None)
    watched, w = make(args.every)
    unsampled, wu = make(10**9)

    clock = time.process_time if args.clock == "cpu" else time.perf_counter

    def timed(fn, n: int) -> float:
        _sync(device)
        t0 = clock()
        for i in range(n):
            fn(*batches[i % len(batches)])
        _sync(device)
        return (clock() - t0) / n

    timed(plain, args.warmup)
    timed(watched, args.warmup)
    timed(unsampled, args.warmup)  # its step 0, the only one it samples, is in the warm-up
    per_round: dict[str, list[float]] = {"plain": [], "watched": [], "unsampled": []}
    for r in range(args.rounds):
        order = [("plain", plain), ("watched", watched), ("unsampled", unsampled)][:: 1 if r % 2 == 0 else -1]
        for name, fn in order:
            per_round[name].append(timed(fn, args.every))
    w.close()
    wu.close()
    ratios = [a / b for a, b in zip(per_round["watched"], per_round["plain"])]
    unsampled_ratios = [a / b for a, b in zip(per_round["unsampled"], per_round["plain"])]

    always, wa = make(1)  # every step sampled
    never, wn = make(10**9)  # only step 0
    timed(always, 2)
    timed(never, 2)
    sampled_cost = statistics.median(timed(always, args.sample_steps) - timed(never, args.sample_steps)
                                     for _ in range(3))
    wa.close()
    wn.close()

    plain2, _ = make(None)
    quiet, wq = make(10**9)
    timed(plain2, 1)
    timed(quiet, 1)  # step 0 (sampled) out of the count
    n = args.sync_steps
    added = (_count_syncs(quiet, batches, n) - _count_syncs(plain2, batches, n)) / n
    wq.close()
    return {"model": model_name, "recipe": recipe, "params": sum(p.numel() for p in init.parameters()),
            "batch_size": batch_size, "every": args.every, "sample_elements": args.sample_elements,
            "check": args.check, "rounds": args.rounds,
            "step_ms": {k: 1e3 * statistics.median(v) for k, v in per_round.items()},
            "ratio": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)],
            "unsampled_ratio": statistics.median(unsampled_ratios),
            "sampled_step_extra_ms": 1e3 * sampled_cost,
            "sampled_step_in_plain_steps": sampled_cost / statistics.median(per_round["plain"]),
            "syncs_added_per_unsampled_step": added, "watch_reads_per_unsampled_step": wq.unsampled_reads / n}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="mlp,transformer")
    p.add_argument("--recipes", default="bf16-mixed,fp16-mixed")
    p.add_argument("--every", type=int, default=100, help="the watch's sampling interval (steps per timed turn)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--batches", type=int, default=16, help="distinct batches cycled through")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--sample-steps", type=int, default=10, help="steps timed for the cost of a sampled step")
    p.add_argument("--sync-steps", type=int, default=20, help="unsampled steps whose syncs are counted")
    p.add_argument("--sample-elements", type=int, default=mixprec.probes.subsample.DEFAULT_SAMPLE_ELEMENTS,
                   help="the watch's sample_elements (0: sampled steps read every tensor whole)")
    p.add_argument("--clip", type=float, default=None, metavar="MAX_NORM",
                   help="both loops clip the gradients' norm (clip_grad_norm_) before the step; the watched one "
                        "hands it to the watch (w.log(grad_norm=...)), whose check then reads it instead of "
                        "summing every gradient itself")
    p.add_argument("--check", choices=("exact", "deferred"), default="exact",
                   help="the watch's check: exact (read the finite flag before every step) or deferred")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall: perf_counter (a quiet machine); cpu: the process's CPU time, for a loaded CPU-only "
                        "machine with --threads 1 (other processes' load then stretches it much less)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--flags", action="append", default=[], metavar="MODEL:KEY=VALUE,...",
                   help="a model's settings as TrainConfig flags, e.g. mlp:width=4096,depth=4,batch_size=1024 "
                        "(repeatable)")
    p.add_argument("--quick", action="store_true", help="smoke run: every=5, 2 rounds, tiny counts")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    args.flags = dict(f.split(":", 1) for f in args.flags)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.every, args.rounds, args.warmup, args.sample_steps, args.sync_steps = 5, 2, 2, 2, 3
        args.batch_size, args.batches = 16, 4
    print(f"# mixprec.watch overhead: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"device {args.device}, every={args.every}, {torch.get_num_threads()} threads, {args.clock} clock, "
          f"sample_elements={args.sample_elements}, check={args.check}"
          + (f", clip_grad_norm_ {args.clip:g}" if args.clip else ""))
    print("| model | recipe | plain step | watched step | ratio (median) | min..max | unsampled only | "
          "one sampled step | syncs added / unsampled step |")
    print("|---|---|---|---|---|---|---|---|---|")
    results = []
    for model in args.models.split(","):
        for recipe in args.recipes.split(","):
            r = measure(model, resolve_recipe(recipe).name, args)
            results.append(r)
            print(f"| {model} | {r['recipe']} | {r['step_ms']['plain']:.2f} ms | {r['step_ms']['watched']:.2f} ms | "
                  f"{r['ratio']:.3f} | {r['ratio_range'][0]:.3f}..{r['ratio_range'][1]:.3f} | "
                  f"{r['unsampled_ratio']:.3f} | "
                  f"+{r['sampled_step_extra_ms']:.1f} ms ({r['sampled_step_in_plain_steps']:.1f} plain steps) | "
                  f"{r['syncs_added_per_unsampled_step']:g} |", flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
