"""``mixprec train``: argument handling only (``--resume``: :mod:`mixprec.train.resume`).

Exit codes: 0 finished; 1 stopped with its reason or could not write its outputs; 2 a usage mistake; 3 out of
memory in a step (:mod:`mixprec.train.oom`); 130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys

from .args import add_output_arguments, add_train_arguments, typed_flags

__all__ = ["add_parser", "train_main"]


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("train", help="train a model with a precision recipe",
                       description="Train a model with a precision recipe (the tutorial's train.py, grown up).")
    add_train_arguments(p, typed_only=True)
    add_output_arguments(p, typed_only=True)
    p.set_defaults(func=train_main)
    return p


def train_main(args: argparse.Namespace) -> int:
    from ..planning.fits import largest_batch
    from . import distributed, oom
    from .build import build_run
    from .config import TrainConfig
    from .loop import train
    from .oom import StepOutOfMemoryError
    from .report import write_line
    from .resume import resume_config

    typed = typed_flags(args)
    config = resume_config(typed) if typed.get("resume") is not None else TrainConfig.from_flags(**typed)
    try:
        run = build_run(config)
        with _watching(run):
            result = train(run, largest_batch=largest_batch)
            if run.world_size > 1:
                _finish_together()
    except StepOutOfMemoryError as e:  # one line, its own exit code; the last checkpoint is intact
        write_line(sys.stderr, f"mixprec train: error: {e}")
        return oom.EXIT_CODE
    except RuntimeError:  # under torchrun: a collective broken by a rank that stopped alone stops this one too
        peer = distributed.peer_stop()
        if peer is None:
            raise
        write_line(sys.stderr, f"mixprec train: error: {peer}")
        return oom.EXIT_CODE
    finally:
        distributed.teardown()  # leave torchrun's process group (no-op in a one-process run)
    return 1 if result.stopped else 0


def _finish_together() -> None:
    """The run is decided (``train`` ended in a barrier): ignore SIGTERM from here on, so torchrun's stop of the
    ranks still exiting does not turn their exit code into -15."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _watching(run):
    """``--watch N``: :func:`mixprec.watch` over the built run's model, optimizer and scaler (the same watch a
    user's own loop gets), or nothing."""
    every = run.config.run.watch
    if every is None:
        return contextlib.nullcontext()
    from ..watching.api import start

    out = os.path.join(run.config.run.out, "watch") if run.config.run.out else "mixprec-watch"
    return start(run.model, run.optimizer, scaler=run.recipe.scaler, source="mixprec train", out=out, every=every)
