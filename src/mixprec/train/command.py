"""``mixprec train``: the tutorial's ``train.py``, grown up (argument handling only)."""

from __future__ import annotations

import argparse

from .args import add_output_arguments, add_train_arguments, config_from_args

__all__ = ["add_parser", "train_main"]


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("train", help="train a model with a precision recipe",
                       description="Train a model with a precision recipe (the tutorial's train.py, grown up).")
    add_train_arguments(p)
    add_output_arguments(p)
    p.set_defaults(func=train_main)
    return p


def train_main(args: argparse.Namespace) -> int:
    from . import distributed
    from .loop import train

    try:
        result = train(config_from_args(args))
    finally:
        distributed.teardown()  # leave torchrun's process group (no-op in a one-process run)
    return 1 if result.stopped else 0
