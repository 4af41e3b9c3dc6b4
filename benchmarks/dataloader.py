"""A user's map-style Dataset through mixprec's loop vs the plain DataLoader loop on the same data.

The dataset: Fashion-MNIST (the Debian package's IDX files) wrapped as a map-style ``torch.utils.data.Dataset``
(one ``(image, label)`` per ``__getitem__``, as a user's would be). Both loops train the same MLP with the same
batch size, seeded sampler and ``num_workers``: the plain one is ``DataLoader`` + forward/backward/``SGD.step``
written out, mixprec's is ``build_run`` (``--dataset module:callable``) + its loop's step over its loader. Turns
alternate; each times ``--steps`` steps including the batch fetching; the result is the median per-round ratio
of steps/s (mixprec / plain). Target >= 0.95. Run on a quiet machine.
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from mixprec.train.build import build_run
from mixprec.train.config import TrainConfig
from mixprec.train.data import load_dataset
from mixprec.train.step import train_step


class FashionItems(Dataset):
    def __init__(self, train: bool):
        d = load_dataset("fashion-mnist")
        self.x, self.y = (d.x_train, d.y_train) if train else (d.x_test, d.y_test)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], int(self.y[i])


def make_data():
    return FashionItems(True), FashionItems(False)


def _turn(step, it, steps):
    t0 = time.perf_counter()
    for _ in range(steps):
        step(*next(it))
    return steps / (time.perf_counter() - t0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--precision", default="fp32")
    args = p.parse_args(argv)
    config = TrainConfig.from_flags(model="mlp", dataset=f"{os.path.abspath(__file__)}:make_data",
                                    batch_size=args.batch_size, num_workers=args.num_workers,
                                    precision=args.precision, log_every=0, progress="off")
    run = build_run(config)
    mine = iter(run.train_loader)

    plain_model = build_run(config.with_flags(dataset="fashion-mnist")).model
    opt = torch.optim.SGD(plain_model.parameters(), lr=0.01)
    ds = FashionItems(True)
    loader = DataLoader(ds, batch_size=args.batch_size, num_workers=args.num_workers,
                        persistent_workers=args.num_workers > 0,
                        sampler=DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=0))
    theirs = iter(loader)
    dtype = {"fp32": None, "bf16-mixed": torch.bfloat16}[args.precision]

    def plain_step(x, y):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = F.cross_entropy(plain_model(x), y)
        loss.backward()
        opt.step()

    def mixprec_step(x, y):
        train_step(run.ctx, x, y)

    load = os.getloadavg()[0]
    _turn(plain_step, theirs, 10), _turn(mixprec_step, mine, 10)
    rates = {"plain": [], "mixprec": []}
    with run.recipe.run_context():
        for r in range(args.rounds):
            for name in (("plain", "mixprec") if r % 2 == 0 else ("mixprec", "plain")):
                rates[name].append(_turn(plain_step if name == "plain" else mixprec_step,
                                         theirs if name == "plain" else mine, args.steps))
    ratios = [a / b for a, b in zip(rates["mixprec"], rates["plain"])]
    print(f"# dataloader: map-style Fashion-MNIST, mlp {args.precision}, batch {args.batch_size}, num_workers "
          f"{args.num_workers}, {args.rounds} rounds x {args.steps} steps, load {load:.2f} -> {os.getloadavg()[0]:.2f}")
    print(f"plain DataLoader loop {statistics.median(rates['plain']):.1f} steps/s, mixprec "
          f"{statistics.median(rates['mixprec']):.1f} steps/s, ratio {statistics.median(ratios):.3f} "
          f"(per round {min(ratios):.3f}..{max(ratios):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
