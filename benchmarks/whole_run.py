"""`mixprec train` from the shell, start to finish, against benchmarks/plain_train.py doing the same training.

Both are separate processes, run alternately (`--rounds` times each, order swapped every round), timed from
spawn to exit: start-up, imports, data loading, every epoch, evaluation. The result is the median of the
per-round ratios mixprec / plain. Target: <= 1.05. Run on a quiet machine.
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _time(cmd, env) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=ROOT)
    return time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--precision", default="bf16-mixed")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    env = dict(os.environ)
    common = ["--precision", args.precision, "--epochs", str(args.epochs), "--batch-size", str(args.batch_size)]
    mixprec = [sys.executable, "-m", "mixprec", "train", "--model", "mlp", "--progress", "off", *common]
    plain = [sys.executable, os.path.join(ROOT, "benchmarks", "plain_train.py"), *common]
    load = os.getloadavg()[0]
    times = {"mixprec": [], "plain": []}
    for r in range(args.rounds):
        for name in (("mixprec", "plain") if r % 2 == 0 else ("plain", "mixprec")):
            times[name].append(_time(mixprec if name == "mixprec" else plain, env))
    ratios = [a / b for a, b in zip(times["mixprec"], times["plain"])]
    print(f"# whole run, mlp {args.precision}, {args.epochs} epochs, batch {args.batch_size}, {args.rounds} rounds, "
          f"load {load:.2f} -> {os.getloadavg()[0]:.2f}")
    print(f"mixprec train {statistics.median(times['mixprec']):.2f} s, plain script "
          f"{statistics.median(times['plain']):.2f} s, ratio {statistics.median(ratios):.3f} "
          f"(per round {min(ratios):.3f}..{max(ratios):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
