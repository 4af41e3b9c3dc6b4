"""``mixprec doctor``: the diagnosis of a recipe on a built-in model and dataset (argument handling only)."""

from __future__ import annotations

import argparse

from ..errors import ConfigError, OutputError
from ..train.args import add_train_arguments, config_from_args
from ..train.outputs import OutputLock, check_folder
from ..probes.block_formats import WHAT_IF_FORMATS, BlockFormatConfig

__all__ = ["add_parser", "doctor_main"]

DEFAULT_OUT = "mixprec-doctor"


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "doctor",
        help="diagnose a recipe's numerics: precision map, ranges, first non-finite, lost updates",
        description="Train a few steps with every numerics check on and report: which op ran in which dtype, "
                    "per-layer value ranges against fp16/bf16/fp8, each linear layer's GEMM operands under every "
                    "FP8/FP4 format (SQNR, clamped scales, underflow), the first op that produced inf/nan (with an "
                    "fp32 replay that finds the modules to keep in fp32), updates rounded away in low-precision "
                    "weights, and the loss-scale history. Writes doctor.json, report.txt and PNG plots to --out.",
    )
    add_train_arguments(p)
    p.set_defaults(precision="fp16-mixed", log_every=0, progress="off")
    g = p.add_argument_group("doctor")
    g.add_argument("--steps", type=int, default=20, metavar="N", help="training steps to observe (default 20)")
    g.add_argument("--out", default=DEFAULT_OUT, metavar="DIR",
                   help=f"folder for doctor.json, report.txt and the plots (default ./{DEFAULT_OUT})")
    g.add_argument("--no-replay", action="store_true",
                   help="locate the first non-finite op of a failed step, but skip the follow-up replays "
                        "(loss-scale bisection, fp32 module search)")
    g.add_argument("--no-plots", action="store_true", help="do not write PNG plots")
    g.add_argument("--formats", default="all", metavar="LIST",
                   help="formats of the block-format what-if table, comma-separated, from "
                        f"{', '.join(WHAT_IF_FORMATS)} (aliases such as mxfp8, rowwise, e4m3 work); 'none' skips "
                        "the section (default all)")
    p.set_defaults(func=doctor_main)
    return p


def doctor_main(args: argparse.Namespace) -> int:
    if args.steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {args.steps}")
    if args.grad_accum != 1:
        raise ConfigError("mixprec doctor observes one batch per optimizer step; drop --grad-accum "
                          f"{args.grad_accum} (a smaller --batch-size shows the same numerics)")
    if args.strategy not in ("auto", "none"):
        raise ConfigError(f"mixprec doctor runs in one process; drop --strategy {args.strategy} (the numerics of "
                          "one rank are what it diagnoses)")
    block_formats = BlockFormatConfig.coerce(args.formats)
    # --out is the doctor's folder here, not the trainer's checkpoint folder
    config = config_from_args(args, out=None, checkpoint_every=None, resume=None, metrics_json=None)
    check_folder(args.out, "--out")  # before the diagnosis: a file or a read-only place costs nothing
    held = OutputLock.acquire(args.out, command="mixprec doctor")  # a second doctor (or a train) there is refused
    try:
        written = _diagnose(args, config, block_formats)
    finally:
        held.release()
    print(f"\nwrote {', '.join(written)}")
    return 0


def _diagnose(args: argparse.Namespace, config, block_formats: BlockFormatConfig) -> list[str]:
    """Build the run, observe it, print and write the report; the files written, in order."""
    from ..train.build import build_run
    from .api import diagnose_run

    r = build_run(config)
    print(f"mixprec doctor: observing {args.steps} steps of {config.model.name} on {r.data.name} "
          f"with {r.recipe.name} [{r.recipe.impl}] ...", flush=True)
    report = diagnose_run(
        r, steps=args.steps, replay=not args.no_replay, block_formats=block_formats,
        title={"model": config.model.name, "data": r.data.name, "batch_size": config.optim.batch_size},
    )
    print(report.render())
    written: list[str] = []
    try:
        report.write(args.out, plots=not args.no_plots, written=written)
    except OutputError as e:  # a disk that filled up since the check: name the file, keep what was written
        kept = f"; written before it, intact: {', '.join(written)}" if written else "; nothing was written"
        raise OutputError(f"{e}{kept}") from None
    return written
