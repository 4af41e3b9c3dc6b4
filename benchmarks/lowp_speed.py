"""Step time of the emulated FP8/FP4 recipes against bf16-mixed, side by side in one process (issue 19's targets:
fp8-mixed <= 1.15x and mxfp8 <= 1.5x a bf16-mixed step on the 784-1024-1024-16 MLP at batch 256).

Every variant trains its own copy of the same model on the same batch with SGD, built the way ``mixprec train``
builds a recipe (``build_recipe`` + ``convert_module``, ``--amp-impl native``). Variants are interleaved round
by round (rotating the order, so drift in machine load hits all alike); each round times ``--steps`` steps per
variant after warm-up, and the table reports the median step time and the median over rounds of the per-round
ratio to the first variant (bf16-mixed). A variant is ``RECIPE`` or ``RECIPE:FP8_IMPL`` (``fp8-rowwise:torchao``:
torchao's emulated layers, if installed), optionally ``@auto``/``@on``/``@off``: the fused (``torch.compile``'d)
operand quantisation of :mod:`mixprec.lowp.quant` for that variant (default ``--fused-quant``), so
``fp8-mixed@off,fp8-mixed@on`` is an A/B of the eager and the fused paths. The table's ``warm-up`` column is
the first steps' time, which holds the compiles of the fused kernels (cached on disk by Inductor across runs).

``--profile VARIANT`` prints torch.profiler's op table (self CPU time, call counts) for a few steps of one
variant instead: op counts and time shares are meaningful on a loaded machine, absolute times are not.

    python benchmarks/lowp_speed.py                                  # the issue's comparison (quiet machine)
    python benchmarks/lowp_speed.py --quick --width 64               # smoke run
    python benchmarks/lowp_speed.py --profile mxfp8
    python benchmarks/lowp_speed.py --variants bf16-mixed,fp8-mixed@off,fp8-mixed@on,mxfp8@off,mxfp8@on
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from mixprec.precision import RecipeConfig, build_recipe
from mixprec.lowp.quant import set_fused_quant
from mixprec.train.models import build_model

DEFAULT_VARIANTS = "bf16-mixed,fp8-mixed,fp8-rowwise,mxfp8,mxfp4,nvfp4"


class Variant:
    def __init__(self, spec: str, args: argparse.Namespace) -> None:
        recipe_impl, _, fused = spec.partition("@")
        precision, _, impl = recipe_impl.partition(":")
        self.name = spec
        self.fused = fused or args.fused_quant
        self.warmup_s = 0.0
        options = {"fp8_impl": impl} if impl else {}
        self.recipe = build_recipe(RecipeConfig(precision=precision, amp_impl="native", **options), device="cpu")
        torch.manual_seed(0)
        model = build_model("mlp", input_shape=(1, 28, 28), num_classes=args.classes, width=args.width, depth=2)
        self.model = self.recipe.convert_module(model)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(args.batch_size, 1, 28, 28, generator=g)
        self.y = torch.randint(0, args.classes, (args.batch_size,), generator=g)

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        with set_fused_quant(self.fused), self.recipe.autocast():
            loss = F.cross_entropy(self.model(self.x), self.y)
        loss.backward()  # no .item(): the recipes' finite check would sync; the timing is of the step's work
        self.opt.step()

    def warm(self, steps: int) -> None:
        t0 = time.perf_counter()
        for _ in range(steps):
            self.step()
        self.warmup_s = time.perf_counter() - t0

    def time(self, steps: int, clock=time.perf_counter) -> float:
        t0 = clock()
        for _ in range(steps):
            self.step()
        return (clock() - t0) / steps


def profile(spec: str, args: argparse.Namespace) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    v = Variant(spec, args)
    v.warm(args.warmup)
    with prof(activities=[ProfilerActivity.CPU]) as p:
        for _ in range(args.steps):
            v.step()
    print(f"# {spec}: {args.steps} steps, batch {args.batch_size}, width {args.width}, "
          f"{torch.get_num_threads()} threads")
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help="comma-separated RECIPE[:FP8_IMPL]; first is the "
                                                                 "reference")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--classes", type=int, default=16)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--fused-quant", choices=("auto", "on", "off"), default=None,
                   help="fused operand quantisation of variants without @MODE (mixprec.lowp.quant; default: "
                        "$MIXPREC_FUSED_QUANT, else auto)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall: elapsed time (a quiet machine); cpu: this process's CPU time, steadier on a loaded "
                        "machine with --threads 1 (threads' spin-waits count as CPU time)")
    p.add_argument("--quick", action="store_true", help="2 rounds x 1 step (smoke test)")
    p.add_argument("--profile", metavar="VARIANT", help="print the profiler's op table for one variant instead")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.rounds, args.steps, args.warmup = 2, 1, 1
    if args.profile:
        profile(args.profile, args)
        return 0
    load = os.getloadavg()[0]
    variants = [Variant(s, args) for s in args.variants.split(",")]
    for v in variants:
        v.warm(args.warmup)
    times: dict[str, list[float]] = {v.name: [] for v in variants}
    for r in range(args.rounds):
        for v in variants[r % len(variants):] + variants[:r % len(variants)]:
            times[v.name].append(v.time(args.steps, time.process_time if args.clock == "cpu" else time.perf_counter))
    ref = variants[0].name
    print(f"# lowp_speed: mlp 784-{args.width}-{args.width}-{args.classes}, batch {args.batch_size}, "
          f"{torch.get_num_threads()} threads, {args.clock} clock, {args.rounds} rounds x {args.steps} steps, "
          f"torch {torch.__version__}, "
          f"load {load:.2f} -> {os.getloadavg()[0]:.2f}")
    print(f"| variant | layers | step time (median) | time vs {ref} (median of ratios) | min..max | warm-up |")
    print("|---|---|---|---|---|---|")
    for v in variants:
        ratios = [a / b for a, b in zip(times[v.name], times[ref])]
        impl = "" if v.recipe.fp8 is None else f" [{v.recipe.fp8.name}]"
        n = 0 if v.recipe.fp8_conversion is None else len(v.recipe.fp8_conversion.converted)
        print(f"| {v.name}{impl} | {n} converted | {statistics.median(times[v.name]) * 1e3:.2f} ms | "
              f"{statistics.median(ratios):.2f}x | {min(ratios):.2f}..{max(ratios):.2f} | {v.warmup_s:.1f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
