"""Where a watched no-scaler step's time goes: the finite check's candidate reductions and empty hooks, A/B.

One model, one optimizer, one loop (bf16 autocast, SGD, no scaler: the watch's bf16 path); each variant is a
turn of ``--steps`` steps in which the loop does one extra thing where the watch does it, switched by a flag
(no model copies: copies alone moved ratios by up to ±5% on a noisy VM):

- ``none``: the plain loop;
- ``hooks``: four empty hooks in the watch's places (the root module's forward pre/post hooks, the optimizer's
  step pre/post hooks), registered for the turn;
- ``sums`` / ``dots`` / ``foreach_norm``: the check alone between backward and step -- each gradient reduced
  (``sum``, ``dot(g, g)``, ``torch._foreach_norm``), stacked, one host read (``tolist``);
- ``post_acc_sums``: the same sums taken in a post-accumulate-grad hook, while each gradient is fresh, read
  before the step.

Turns alternate in rounds (the order reversed every round); the result per variant is the median over rounds
of (its time per step / ``none``'s in the same round), and the median extra microseconds per step.

Run on a quiet machine from the repository root: ``PYTHONPATH=src python benchmarks/watch_check_ab.py``
(``--model transformer``; ``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from mixprec.train.build import build_run
from mixprec.train.config import TrainConfig

VARIANTS = ("none", "hooks", "sums", "dots", "foreach_norm", "post_acc_sums")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="mlp")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=100, help="steps per turn")
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--quick", action="store_true", help="smoke run: 3 rounds of 5 steps")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.steps = 3, 5
    names = args.variants.split(",")
    if names[0] != "none" or not set(names) <= set(VARIANTS):
        p.error(f"--variants: a comma list from {', '.join(VARIANTS)}, starting with none")

    config = TrainConfig.from_flags(precision="fp32", model=args.model, dataset="synthetic",
                                    synthetic_train=args.batch_size * 16, synthetic_test=64,
                                    batch_size=args.batch_size, lr=0.01, log_every=0, progress="off", device="cpu",
                                    seed=0)
    run = build_run(config)
    model = copy.deepcopy(run.model).float()
    batches = list(run.train_loader)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    params = list(model.parameters())
    mode, fresh = ["none"], []

    def check() -> None:
        k = mode[0]
        if k == "sums":
            torch.stack([q.grad.sum(dtype=torch.float32) for q in params]).tolist()
        elif k == "dots":
            torch.stack([torch.dot(q.grad.view(-1), q.grad.view(-1)) for q in params]).tolist()
        elif k == "foreach_norm":
            torch.stack(torch._foreach_norm([q.grad for q in params])).tolist()
        elif k == "post_acc_sums" and fresh:
            torch.stack(fresh).tolist()
            fresh.clear()

    def step(x, y) -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        check()
        opt.step()

    def noop(*a, **k) -> None:
        return None

    def turn(k: str) -> float:
        mode[0] = k
        handles = []
        if k == "hooks":
            handles = [model.register_forward_pre_hook(noop, with_kwargs=True),
                       model.register_forward_hook(noop, with_kwargs=True),
                       opt.register_step_pre_hook(noop), opt.register_step_post_hook(noop)]
        elif k == "post_acc_sums":
            handles = [q.register_post_accumulate_grad_hook(lambda q: fresh.append(q.grad.sum(dtype=torch.float32)))
                       for q in params]
        t0 = time.perf_counter()
        for i in range(args.steps):
            step(*batches[i % len(batches)])
        t = (time.perf_counter() - t0) / args.steps
        for h in handles:
            h.remove()
        return t

    for k in names:  # warm-up
        turn(k)
    times: dict[str, list[float]] = {k: [] for k in names}
    for r in range(args.rounds):
        for k in names if r % 2 == 0 else names[::-1]:
            times[k].append(turn(k))
    print(f"# watch check A/B: {args.model}, batch {args.batch_size}, {platform.processor() or platform.machine()}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.rounds} rounds of {args.steps} steps, "
          f"{sum(q.numel() for q in params)} parameters")
    print("| variant | step (median) | ratio to none (median) | extra per step |")
    print("|---|---|---|---|")
    base = times["none"]
    for k in names:
        ratio = statistics.median(a / b for a, b in zip(times[k], base))
        extra = statistics.median(a - b for a, b in zip(times[k], base))
        print(f"| {k} | {1e3 * statistics.median(times[k]):.3f} ms | {ratio:.3f} | {1e6 * extra:+.0f} µs |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
