"""``mixprec plan``: argument handling only (the work is :func:`mixprec.planning.plan`)."""

from __future__ import annotations

import argparse

from ..train.args import add_train_arguments, config_from_args

__all__ = ["add_parser", "plan_main"]


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "plan", help="predict memory and step time of each recipe on a target, without running",
        description="Trace one training step of each recipe under fake tensors (nothing is allocated or "
                    "computed) and predict, for the target device: memory by category, the peak, the largest "
                    "batch that fits, FLOPs by dtype and the step time.")
    add_train_arguments(p, with_precision=False)
    g = p.add_argument_group("plan")
    g.add_argument("--precisions", default="fp32,bf16-mixed", metavar="RECIPES",
                   help="comma-separated recipes to plan (default fp32,bf16-mixed)")
    g.add_argument("--target", default="cpu", metavar="NAME",
                   help="where the run would happen: cpu (this machine, measured), a100-80gb, h100-sxm, h200, "
                        "b200, rtx3090, rtx4090, l4")
    g.add_argument("--json", default=None, metavar="PATH", help="write the plan as JSON")
    g.add_argument("--plot", default=None, metavar="PATH.png", help="write a PNG of memory at the peak by category")
    g.add_argument("--fallback-real", action="store_true",
                   help="what cannot be done under fake tensors is done for real on this CPU: a model whose "
                        "initialisation reads values is built for real (every parameter allocated) and traced as a "
                        "fake copy; a step that reads values runs for real on a small batch, and what grows with "
                        "the batch is scaled. Without it either is an error naming the op")
    p.set_defaults(func=plan_main)
    return p


def plan_main(args: argparse.Namespace) -> int:
    from .api import plan
    from .report import format_plan, plot_memory, write_json

    result = plan(config=config_from_args(args), precisions=args.precisions, target=args.target,
                  fallback_real=args.fallback_real)
    print(format_plan(result))
    if args.json:
        write_json(result, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        print(f"wrote {args.plot}" if plot_memory(result, args.plot) else "no plot: matplotlib is not installed")
    return 0
