"""User-facing errors.

Every mistake a user can make on the command line (a bad recipe name, a missing data file, a checkpoint
that is not ours, contradictory flags) raises a subclass of :class:`UsageError`. The CLI turns these
into ``mixprec: error: <message>`` and exit code 2, never a traceback. Messages repeat what was asked
and name the fix.
"""

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
    """A public function called with a keyword it does not take (a ``TypeError`` too, as Python's own)."""


def check_keywords(call: str, given: Iterable[str], valid: Iterable[str], hints: dict[str, str] | None = None,
                   error: type[UsageError] = UnknownKeywordError) -> None:
    """Refuse the first of ``given`` not in ``valid``, in one line: the closest valid name (or ``hints``' answer
    for a known mistake) and every valid one."""
    valid = sorted(set(valid))
    for k in given:
        if k in valid:
            continue
        close = (hints or {}).get(k) or next(iter(difflib.get_close_matches(k, valid, n=1, cutoff=0.5)), None)
        guess = f" (did you mean {close}?)" if close else ""
        raise error(f"{call}(..., {k}=...): unknown keyword{guess}; it takes: {', '.join(valid)}")


def keywords_checked(fn: Callable) -> Callable:
    """Decorate a public function without ``**kwargs``: a keyword it does not take is :func:`check_keywords`' one
    line instead of Python's ``TypeError``."""
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
    """A loss-scaler setting or saved scaler state that is out of range or of the wrong type
    (raised by :func:`mixprec.scaler.validate_scaler_settings`; the message names the flag, argument
    or state-dict key)."""


class NonFiniteError(RuntimeError):
    """Training produced a non-finite loss or gradient and the recipe has no loss scaler to skip it.

    Attributes:
        step: the global step (0-based) whose loss or gradient was non-finite.
        what: ``"loss"`` or ``"gradient"``.
    """

    def __init__(self, message: str, *, step: int | None = None, what: str = "loss") -> None:
        super().__init__(message)
        self.step = step
        self.what = what


class OutputError(RuntimeError):
    """Writing a run's output (checkpoint, metrics) failed during the run — disk full, folder gone. The CLI
    prints the one-line message and exits 1; what was written before is intact."""


def one_line(e: BaseException, limit: int = 200) -> str:
    """``Type: first line of the message`` (cut at ``limit`` characters), for quoting a cause in one line."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:limit]}" if text else type(e).__name__
