"""``mixprec tune``: argument handling only (the work is :func:`mixprec.tune.tune`)."""

from __future__ import annotations

import argparse
import sys

from ..train.args import add_train_arguments, config_from_args

__all__ = ["add_parser", "tune_main"]


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "tune", help="choose each linear layer's format: the cheapest that pays on a target and keeps the loss",
        description="Measure each linear layer's GEMM operands in every candidate format on a few real batches "
                    "(safe: SQNR near the format's ideal, little flushed to zero), price the layer in each format "
                    "on the target with the planner (pays: faster than bf16), and write a layer-formats file for "
                    "train, bench and plan (--layer-formats).")
    add_train_arguments(p, with_precision=False)
    g = p.add_argument_group("tune")
    g.add_argument("--target", default="h100-sxm", metavar="NAME",
                   help="the GPU the run will train on (a plan target: h100-sxm, h200, b200, a100-80gb, l4, ...)")
    g.add_argument("--candidates", default=None, metavar="RECIPES",
                   help="comma-separated formats to consider (default: the FP8/FP4 recipes the target has units "
                        "for, bf16-mixed and fp32)")
    g.add_argument("--steps", type=int, default=4, help="batches the safety measurement sees (default 4)")
    g.add_argument("--plan-batch-size", type=int, default=None, metavar="N",
                   help="the batch size the target will train with, if not --batch-size (the safety measurement runs "
                        "on --batch-size here; the layers are priced at N's tokens)")
    g.add_argument("--min-gain", type=float, default=1.05, metavar="X",
                   help="how much faster than bf16 a format must make a layer to be chosen (default 1.05; 0: the "
                        "fastest safe format, paying or not, to study the numerics alone)")
    g.add_argument("--out", dest="formats_out", default="layer-formats.json", metavar="FILE",
                   help="where to write the layer-formats file (default layer-formats.json)")
    p.set_defaults(func=tune_main)
    return p


def tune_main(args: argparse.Namespace) -> int:
    from .api import tune

    result = tune(config_from_args(args), target=args.target, candidates=args.candidates, steps=args.steps,
                  min_gain=args.min_gain, plan_batch_size=args.plan_batch_size, out=args.formats_out, log=lambda line: print(line, file=sys.stderr))
    print(result.table())
    counts: dict[str, int] = {}
    for c in result.layers:
        counts[c.format] = counts.get(c.format, 0) + 1
    print(f"\n{len(result.layers)} linear layer(s): " + ", ".join(f"{n} {f}" for f, n in sorted(counts.items())))
    print(f"thresholds: safe = every GEMM operand's SQNR within {result.thresholds['sqnr_margin_db']:g} dB of its "
          f"format's ideal and at most {100 * result.thresholds['max_underflow']:g}% flushed to zero; pays = at least "
          f"{result.thresholds['min_gain']:g}x faster than bf16 on {result.target}"
          + (" (compiled, as --compile auto runs it)" if result.thresholds["compiled"] else " (eager)"))
    print("not seen: layers are tuned one at a time (an error one layer lets through may grow in the next), on the "
          f"run's first {args.steps} batches")
    print(f"wrote {args.formats_out}; use it with --layer-formats {args.formats_out} (train, bench, plan)")
    return 0
