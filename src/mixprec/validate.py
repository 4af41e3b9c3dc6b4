"""The checks every setting goes through, so the same mistake gets the same message wherever it is made. Each
raises the :class:`~mixprec.errors.UsageError` subclass its caller passes, naming the flag as the user typed it."""

from __future__ import annotations

import math
import numbers
from typing import Any

from .errors import ConfigError, UsageError

__all__ = ["is_real", "is_int", "flag_name", "positive", "positive_int", "nonnegative", "nonnegative_int",
           "one_of", "F32_MAX"]

F32_MAX = 3.4028234663852886e38
"""The largest finite float32: settings that become float32 tensors must fit in it."""


def is_real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def flag_name(name: str) -> str:
    """``max_steps`` -> ``--max-steps``; a name that already starts with ``-`` is kept."""
    return name if name.startswith("-") else "--" + name.replace("_", "-")


def positive(name: str, value: Any, *, allow_none: bool = False, error: type[UsageError] = ConfigError) -> None:
    if value is None and allow_none:
        return
    if not (is_real(value) and math.isfinite(value) and value > 0):
        raise error(f"{flag_name(name)} must be a positive number, got {value!r}")


def positive_int(name: str, value: Any, *, allow_none: bool = False, error: type[UsageError] = ConfigError) -> None:
    if value is None and allow_none:
        return
    if not (is_int(value) and value >= 1):
        raise error(f"{flag_name(name)} must be a positive integer, got {value!r}")


def nonnegative(name: str, value: Any, *, error: type[UsageError] = ConfigError) -> None:
    if not (is_real(value) and math.isfinite(value) and value >= 0):
        raise error(f"{flag_name(name)} must be a finite number >= 0, got {value!r}")


def nonnegative_int(name: str, value: Any, *, error: type[UsageError] = ConfigError) -> None:
    if not (is_int(value) and value >= 0):
        raise error(f"{flag_name(name)} must be an integer >= 0, got {value!r}")


def one_of(name: str, value: Any, choices: tuple[str, ...], *, error: type[UsageError] = ConfigError) -> None:
    if value not in choices:
        raise error(f"unknown {flag_name(name)} {value!r}; choose one of: {', '.join(choices)}")
