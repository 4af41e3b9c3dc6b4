"""User-facing errors.

Every mistake a user can make on the command line (a bad recipe name, a missing data file, a checkpoint
that is not ours, contradictory flags) raises a subclass of :class:`UsageError`. The CLI turns these
into ``mixprec: error: <message>`` and exit code 2, never a traceback. Messages repeat what was asked
and name the fix.
"""

from __future__ import annotations

__all__ = ["UsageError", "RecipeError", "ConfigError", "CheckpointError", "ScalerConfigError", "NonFiniteError",
           "OutputError", "one_line"]


class UsageError(ValueError):
    """A mistake in what the user asked for; the message says how to fix it."""


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
