"""The checks every setting goes through, in one place: config sections, models, the text corpus and the
loss scaler all use these, so the same mistake gets the same message wherever it is made.

Each check raises the error class its caller passes (a :class:`~mixprec.errors.UsageError` subclass:
the CLI turns it into one line and exit 2) with a message naming the flag as the user typed it.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from .errors import ConfigError, UsageError

__all__ = ["is_real", "is_int", "flag_name", "positive", "positive_int", "nonnegative", "nonnegative_int",
           "one_of", "F32_MAX"]

F32_MAX = 3.4028234663852886e38
"""The largest finite float32: settings that become float32 tensors (lr, loss scale) must fit in it."""


def is_real(x: Any) -> bool:
    """A real number that is not a bool."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def is_int(x: Any) -> bool:
    """An integer that is not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def flag_name(name: str) -> str:
    """``max_steps`` -> ``--max-steps``; a name that already starts with ``-`` is kept."""
    return name if name.startswith("-") else "--" + name.replace("_", "-")


def positive(name: str, value: Any, *, allow_none: bool = False, error: type[UsageError] = ConfigError) -> None:
    """A finite number > 0 (or None when ``allow_none``)."""
    if value is None and allow_none:
        return
    if not (is_real(value) and math.isfinite(value) and value > 0):
        raise error(f"{flag_name(name)} must be a positive number, got {value!r}")


def positive_int(name: str, value: Any, *, allow_none: bool = False, error: type[UsageError] = ConfigError) -> None:
    """An integer >= 1 (or None when ``allow_none``)."""
    if value is None and allow_none:
        return
    if not (is_int(value) and value >= 1):
        raise error(f"{flag_name(name)} must be a positive integer, got {value!r}")


def nonnegative(name: str, value: Any, *, error: type[UsageError] = ConfigError) -> None:
    """A finite number >= 0."""
    if not (is_real(value) and math.isfinite(value) and value >= 0):
        raise error(f"{flag_name(name)} must be a finite number >= 0, got {value!r}")


def nonnegative_int(name: str, value: Any, *, error: type[UsageError] = ConfigError) -> None:
    """An integer >= 0."""
    if not (is_int(value) and value >= 0):
        raise error(f"{flag_name(name)} must be an integer >= 0, got {value!r}")


def one_of(name: str, value: Any, choices: tuple[str, ...], *, error: type[UsageError] = ConfigError) -> None:
    """One of ``choices``; the message lists them."""
    if value not in choices:
        raise error(f"unknown {flag_name(name)} {value!r}; choose one of: {', '.join(choices)}")
