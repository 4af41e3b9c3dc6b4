"""Step time of mixprec's from-scratch autocast against torch.autocast on this machine's CPU.

One training step = zero_grad, forward + cross-entropy under the autocast, backward, SGD step.
Every configuration trains its own copy of the same model on the same batch. Configurations are
interleaved round by round (so drift in machine load hits all of them alike), each round times
``--steps`` steps per configuration after ``--warmup`` untimed steps, and the table reports the
median per-step time over rounds and ratios of medians measured in the same run.

Configurations:
  fp32            no autocast
  native bf16     torch.autocast("cpu", torch.bfloat16)
  scratch bf16    mixprec.autocast.autocast(torch.bfloat16)
  native fp16     torch.autocast("cpu", torch.float16)  (real fp16 kernels; very slow on CPUs
                  without AVX512-FP16, so it runs fewer rounds: --fp16-rounds)
  emulated fp16   mixprec autocast(torch.float16, emulate=True): fp16 rounding, fp32 arithmetic
  emulated bf16   mixprec autocast(torch.bfloat16, emulate=True): what --amp-impl auto runs on a CPU without
                  bf16 kernels (AVX2 only), where native bf16 is a scalar fallback

    python benchmarks/scratch_vs_native.py [--models mlp cnn transformer] [--rounds 15]
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mixprec.autocast import autocast

try:
    from mixprec.train.models import build_model
except ImportError:  # pragma: no cover -- models.py is part of the package
    build_model = None

INPUT_SHAPE = (1, 28, 28)  # Fashion-MNIST
NUM_CLASSES = 10


def make_model(name: str) -> nn.Module:
    if build_model is None:
        raise SystemExit("mixprec.train.models.build_model is missing")
    return build_model(name, input_shape=INPUT_SHAPE, num_classes=NUM_CLASSES)


CONTEXTS: dict[str, Callable[[], object]] = {
    "fp32": lambda: torch.autocast("cpu", enabled=False),
    "native bf16": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
    "scratch bf16": lambda: autocast(torch.bfloat16, device_type="cpu"),
    "native fp16": lambda: torch.autocast("cpu", dtype=torch.float16),
    "emulated fp16": lambda: autocast(torch.float16, device_type="cpu", emulate=True),
    "emulated bf16": lambda: autocast(torch.bfloat16, device_type="cpu", emulate=True),
}


class Runner:
    def __init__(self, model: nn.Module, ctx: Callable[[], object], x: torch.Tensor, y: torch.Tensor):
        self.model = model
        self.ctx = ctx
        self.x, self.y = x, y
        self.opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        with self.ctx():
            loss = F.cross_entropy(self.model(self.x), self.y)
        loss.backward()
        self.opt.step()

    def time_steps(self, n: int) -> float:
        """Seconds per step over n steps (CPU ops are synchronous; no .item() inside)."""
        t0 = time.perf_counter()
        for _ in range(n):
            self.step()
        return (time.perf_counter() - t0) / n


def bench_model(name: str, args: argparse.Namespace) -> dict[str, list[float]]:
    """Per-round seconds per step for each configuration."""
    torch.manual_seed(0)
    base = make_model(name)
    x = torch.randn(args.batch_size, *INPUT_SHAPE)
    y = torch.randint(0, NUM_CLASSES, (args.batch_size,))
    configs = [c for c in CONTEXTS if c != "native fp16" or args.fp16_rounds > 0]
    runners = {c: Runner(copy.deepcopy(base), CONTEXTS[c], x, y) for c in configs}
    for c, r in runners.items():  # warm-up: allocator, oneDNN primitive caches, lazy init
        for _ in range(args.warmup if c != "native fp16" else 1):
            r.step()
    samples: dict[str, list[float]] = {c: [] for c in configs}
    for i in range(args.rounds):
        order = configs if i % 2 == 0 else configs[::-1]  # ABBA: no config always runs first
        for c in order:
            if c == "native fp16" and i >= args.fp16_rounds:
                continue
            samples[c].append(runners[c].time_steps(args.steps if c != "native fp16" else 1))
    return samples


def paired_ratio(num: list[float], den: list[float]) -> float:
    """Median over rounds of num/den measured in the same round (robust to load drift)."""
    return statistics.median(a / b for a, b in zip(num, den))


def steady_malloc() -> str:
    """Stop glibc from returning freed memory to the OS and re-faulting it on the next step.

    With the default dynamic thresholds, whether a step's large buffers (weight gradients,
    activations) come from the heap or from fresh zeroed pages depends on the allocation history,
    which differs between configurations and runs; the page faults then dominate the noise
    (checked: the same configuration varied by 2x in backward). Applied to the whole process, so
    every configuration is timed under the same allocator settings.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        ok = libc.mallopt(m_mmap_threshold, 32 << 20) and libc.mallopt(m_trim_threshold, 1 << 30)
    except (OSError, AttributeError):
        ok = False
    return "glibc malloc: no trimming, mmap above 32 MiB" if ok else "default malloc"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["mlp", "cnn", "transformer"])
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--steps", type=int, default=5, help="timed steps per round and configuration")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--fp16-rounds", type=int, default=3, help="rounds for native fp16 (0 skips it)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--default-malloc", action="store_true",
                   help="keep glibc's dynamic trim/mmap thresholds (noisier)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    allocator = "default malloc" if args.default_malloc else steady_malloc()

    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads, batch {args.batch_size}, input {INPUT_SHAPE}; "
          f"median of {args.rounds} rounds x {args.steps} steps (native fp16: {args.fp16_rounds} x 1); "
          f"ratios are medians of per-round ratios; {allocator}; "
          f"load average {os.getloadavg()[0]:.1f}; oneDNN bf16 kernels: "
          f"{bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())}\n")
    print("| model | fp32 ms | native bf16 ms | scratch bf16 ms | scratch / native bf16 "
          "| native fp16 ms | emulated fp16 ms | emulated / native fp16 | emulated fp16 / fp32 "
          "| emulated bf16 ms | emulated / native bf16 | emulated bf16 / fp32 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.models:
        s = bench_model(name, args)
        med = {c: statistics.median(v) for c, v in s.items()}
        nf16 = s.get("native fp16")
        cells = [
            name, f"{med['fp32'] * 1e3:.2f}", f"{med['native bf16'] * 1e3:.2f}",
            f"{med['scratch bf16'] * 1e3:.2f}",
            f"{paired_ratio(s['scratch bf16'], s['native bf16']):.3f}",
            f"{med['native fp16'] * 1e3:.1f}" if nf16 else "skipped",
            f"{med['emulated fp16'] * 1e3:.2f}",
            f"{paired_ratio(s['emulated fp16'], nf16):.3f}" if nf16 else "-",
            f"{paired_ratio(s['emulated fp16'], s['fp32']):.3f}",
            f"{med['emulated bf16'] * 1e3:.2f}",
            f"{paired_ratio(s['emulated bf16'], s['native bf16']):.3f}",
            f"{paired_ratio(s['emulated bf16'], s['fp32']):.3f}",
        ]
        print("| " + " | ".join(cells) + " |", flush=True)
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f} (other processes on the machine "
          f"inflate and scatter the times; the paired ratios are the robust figure)")


if __name__ == "__main__":
    main()
