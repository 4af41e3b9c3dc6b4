"""Command line: ``mixprec train | bench | doctor | plan | tune``. Dispatch only; each command defines its own flags.
A UsageError is one line and exit 2, an OutputError exit 1."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .bench import command as bench_command
from .doctor import command as doctor_command
from .errors import OutputError, UsageError
from .planning import command as plan_command
from .train import command as train_command
from .tune import command as tune_command

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mixprec", description="Mixed-precision training for PyTorch: train, benchmark, diagnose, plan, tune."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for command in (train_command, bench_command, doctor_command, plan_command, tune_command):
        command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UsageError as e:
        print(f"mixprec {args.command}: error: {e}", file=sys.stderr)
        return 2
    except OutputError as e:
        print(f"mixprec {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("mixprec: interrupted; the last checkpoint written (if --out was given) is intact", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
