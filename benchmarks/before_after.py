"""Before/after: the same step-time measurement on an older mixprec checkout and on this one, in one session.

``python benchmarks/before_after.py --before /path/to/old/checkout`` (e.g. a ``git worktree`` at the commit
before the performance work). For each model, a fresh worker process per (checkout, turn) builds the runs
with that checkout's own ``build_run`` (whichever API it has) and times the recipes' training steps
interleaved in rounds; the worker reports each recipe's median step time and its ratio to fp32 measured in
the same rounds. Checkouts alternate (before, after, before, after...), ``--turns`` times each; the table
gives the median over turns. Ratios are the robust figures on a shared machine; run it quietly anyway.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

WORKER = r'''
import json, statistics, sys, time, torch
model, batch, recipes, rounds, steps = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(","), int(sys.argv[4]), int(sys.argv[5])
from mixprec.train.config import TrainConfig
flags = dict(model=model, dataset="fashion-mnist", batch_size=batch, limit_train=batch * 8, limit_test=100,
             log_every=0, progress="off")
if hasattr(TrainConfig, "from_flags"):
    from mixprec.train.build import build_run
    from mixprec.train.step import train_step
    make = lambda r: build_run(TrainConfig.from_flags(precision=r, **flags))
    step = lambda run, x, y: train_step(run.ctx, x, y)
else:
    from mixprec.train.loop import build_run, train_step
    make = lambda r: build_run(TrainConfig(precision=r, **flags))
    step = lambda run, x, y: train_step(run, x, y)
runs = {}
for r in recipes:
    run = make(r); run.train_loader.set_epoch(0); runs[r] = (run, list(run.train_loader))
def turn(r, n):
    run, b = runs[r]
    with run.recipe.run_context():
        t0 = time.perf_counter()
        for i in range(n):
            step(run, *b[i % len(b)])
        return (time.perf_counter() - t0) / n
for r in recipes:
    turn(r, 3)
times = {r: [] for r in recipes}
for k in range(rounds):
    for r in recipes[k % len(recipes):] + recipes[:k % len(recipes)]:
        times[r].append(turn(r, steps))
out = {r: {"step_s": statistics.median(v), "vs_fp32": statistics.median([a / b for a, b in zip(v, times["fp32"])])}
       for r, v in times.items()}
print(json.dumps(out))
'''


def _worker(src: str, model: str, args) -> dict:
    env = dict(os.environ, PYTHONPATH=os.path.join(src, "src"))
    out = subprocess.run([sys.executable, "-c", WORKER, model, str(args.batch_size), args.recipes, str(args.rounds),
                          str(args.steps)], env=env, capture_output=True, text=True, check=True, cwd=src)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", required=True, help="path of the older checkout")
    p.add_argument("--after", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p.add_argument("--models", default="mlp,cnn,transformer")
    p.add_argument("--recipes", default="fp32,bf16-mixed,fp16-mixed,fp8-mixed", help="fp32 first")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args(argv)
    load = os.getloadavg()[0]
    rows = []
    for model in args.models.split(","):
        got = {"before": [], "after": []}
        for _ in range(args.turns):
            for which in ("before", "after"):
                got[which].append(_worker(getattr(args, which), model, args))
        for r in args.recipes.split(","):
            med = {w: (statistics.median(x[r]["step_s"] for x in got[w]),
                       statistics.median(x[r]["vs_fp32"] for x in got[w])) for w in got}
            rows.append((model, r, med["before"], med["after"]))
    print(f"# before/after, batch {args.batch_size}, {args.turns} turns x {args.rounds} rounds x {args.steps} steps, "
          f"load {load:.2f} -> {os.getloadavg()[0]:.2f}")
    print("| model | recipe | step before | step after | time vs fp32 before | time vs fp32 after |")
    print("|---|---|---|---|---|---|")
    for model, r, b, a in rows:
        print(f"| {model} | {r} | {b[0] * 1e3:.2f} ms | {a[0] * 1e3:.2f} ms | {b[1]:.2f} | {a[1]:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
