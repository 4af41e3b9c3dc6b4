"""``mixprec bench``: its flags, turned into a :class:`~mixprec.bench.config.BenchConfig`, and the session run
under signal handlers that stop a running worker cleanly. Every flag defaults to :data:`UNSET`, so the command
knows which flags were typed (``--resume`` refuses the ones that would change the resumed bench)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from ..train.args import add_train_arguments
from ..train.config import TrainConfig
from ..train.outputs import OutputLock
from .config import BENCH_FLAGS, RUN_TRAIN_DEFAULTS, BenchConfig
from .resume import resume_config
from .runner import stop_on_signals
from .session import Session

__all__ = ["add_parser", "bench_main", "config_from_args"]

_DEFAULT = BenchConfig()


class _Unset:

    def __repr__(self) -> str:
        return "<not given>"


UNSET = _Unset()


def add_parser(sub) -> argparse.ArgumentParser:
    """Add ``bench`` to the CLI's subparsers."""
    p = sub.add_parser(
        "bench", help="run several precision recipes side by side and compare them",
        description="Train the same model under several precision recipes, each (recipe, repeat) in a fresh "
                    "process, and compare memory, epoch time, throughput, MFU, accuracy and convergence "
                    "parity against fp32. Every `mixprec train` flag applies to every run.",
    )
    add_train_arguments(p, with_precision=False)
    d = _DEFAULT
    g = p.add_argument_group("bench")
    g.add_argument("--precisions", metavar="R1,R2,...",
                   help=f"comma-separated recipes to compare (default {','.join(d.precisions)}); include fp32 for "
                        "the speedup, memory-saving, accuracy-delta and parity columns")
    g.add_argument("--repeats", type=int,
                   help=f"runs per recipe, with seeds seed, seed+1, ... (default {d.repeats}; parity needs >= 2)")
    g.add_argument("--out", metavar="DIR",
                   help="write results.json, results.md, plots and per-run logs here "
                        "(default runs/bench-YYYYmmdd-HHMMSS)")
    g.add_argument("--warmup-steps", type=int,
                   help=f"steps at the start of every epoch left out of the timings (default {d.warmup_steps})")
    g.add_argument("--timeout", type=float, metavar="S",
                   help="give up on a run after S seconds (its row says so; default: no limit)")
    g.add_argument("--peak-seconds", type=float, metavar="S",
                   help=f"time budget of the peak-matmul micro-benchmark, per dtype (default {d.peak_seconds})")
    g.add_argument("--no-plots", dest="plots", action="store_false", help="skip the PNG plots")
    g.add_argument("--no-plan", dest="predict", action="store_false",
                   help="skip the plan's prediction (mixprec plan for this device, traced under fake tensors "
                        "before the runs) of each recipe's step peak and step time beside the measured ones")
    g.add_argument("--resume", metavar="DIR",
                   help="continue the bench in DIR: run its missing and failed runs, keep the finished ones; "
                        "only --timeout, --no-plots, --no-plan, --data-dir and --data-path may be given with it")
    # every flag (the parse of no flags lists them all) defaults to UNSET: typed flags are the ones set
    p.set_defaults(**{dest: UNSET for dest in vars(p.parse_args([]))})
    p.set_defaults(func=bench_main)
    return p


def _given(args: argparse.Namespace) -> dict[str, Any]:
    """The flags typed, by their Python names (``--progress`` aside: bench shows no progress bar)."""
    return {k: v for k, v in vars(args).items() if v is not UNSET and k not in ("func", "command", "progress")}


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The bench the typed flags ask for (``--resume``: the folder's bench with the allowed changes)."""
    given = _given(args)
    if given.get("resume") is not None:
        return resume_config(given["resume"], given)
    bench = {k: v for k, v in given.items() if k in BENCH_FLAGS}
    train = {k: v for k, v in given.items() if k not in BENCH_FLAGS}
    return BenchConfig(train=TrainConfig.from_flags(**{**RUN_TRAIN_DEFAULTS, **train}), **bench)


def bench_main(args: argparse.Namespace) -> int:
    """``mixprec bench``: exit 0, 1 (a run failed), 2 (usage error, raised) or 128 + signal (interrupted)."""
    resume = args.resume if isinstance(args.resume, str) else None
    # --resume reads the folder's results.json first: a live bench there is named before that
    held = OutputLock.acquire(resume, command="mixprec bench", flag="--resume") if resume and os.path.isdir(resume) else None
    try:
        session = Session(config_from_args(args))
        with stop_on_signals():
            try:
                return session.run()
            except KeyboardInterrupt as e:  # SIGINT, or SIGTERM as runner.Stopped
                return session.interrupted(e)
    finally:
        if held is not None:
            held.release()
