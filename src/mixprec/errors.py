"""User-facing errors: every user mistake raises a :class:`UsageError`, which the CLI prints as one line naming
the fix, exit 2."""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable, Iterable

__all__ = ["UsageError", "RecipeError", "ConfigError", "CheckpointError", "ScalerConfigError", "NonFiniteError",
           "OutputError", "UnknownKeywordError", "check_keywords", "keywords_checked", "one_line"]


class UsageError(ValueError):
    """A mistake in what the user asked for; the message says how to fix it."""


class UnknownKeywordError(UsageError, TypeError):
    """A public function called with a keyword it does not take (a ``TypeError`` too)."""


def check_keywords(call: str, given: Iterable[str], valid: Iterable[str], hints: dict[str, str] | None = None,
                   error: type[UsageError] = UnknownKeywordError) -> None:
    """Refuse the first of ``given`` not in ``valid``, naming the closest valid one (or ``hints``') and all."""
    valid = sorted(set(valid))
    for k in given:
        if k in valid:
            continue
        close = (hints or {}).get(k) or next(iter(difflib.get_close_matches(k, valid, n=1, cutoff=0.5)), None)
        guess = f" (did you mean {close}?)" if close else ""
        raise error(f"{call}(..., {k}=...): unknown keyword{guess}; it takes: {', '.join(valid)}")


def keywords_checked(fn: Callable) -> Callable:
    """Decorate a public function without ``**kwargs`` so an unknown keyword is :func:`check_keywords`' line."""
    valid = set(inspect.signature(fn).parameters)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        check_keywords(fn.__name__, kwargs, valid)
        return fn(*args, **kwargs)

    return call


class RecipeError(UsageError):
    """Unknown recipe, or a recipe this device cannot run."""


class ConfigError(UsageError):
    """Invalid or contradictory training options."""


class CheckpointError(UsageError):
    """A checkpoint that is missing, corrupt, not mixprec's, or from a different run."""


class ScalerConfigError(UsageError):
    """A loss-scaler setting or saved state out of range or of the wrong type."""


class NonFiniteError(RuntimeError):
    """A non-finite loss or gradient (``what``) at global ``step`` (0-based) that no loss scaler can skip."""

    def __init__(self, message: str, *, step: int | None = None, what: str = "loss") -> None:
        super().__init__(message)
        self.step = step
        self.what = what


class OutputError(RuntimeError):
    """Writing a run's output failed during the run; the CLI prints one line and exits 1."""


def one_line(e: BaseException, limit: int = 200) -> str:
    """``Type: first line of the message``, cut at ``limit`` characters."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:limit]}" if text else type(e).__name__
