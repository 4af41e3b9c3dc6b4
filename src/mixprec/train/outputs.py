"""Output paths checked before the first step, so a mistake costs nothing and nothing the user had is lost.

Rules, for ``--out``, ``--metrics-json`` and ``--resume``:

- an empty path (an unset shell variable) is refused, never read as "the current folder" or "no resume";
- a folder is created and test-written now; a file where a folder is expected, a read-only location or a
  folder given as the JSON path is refused now, not after the training it would lose;
- a run never writes over a checkpoint it did not resume from: ``--out DIR`` holding another run's
  ``last.pt`` needs ``--resume DIR`` (continue it) or ``--overwrite`` (replace it);
- no output may be another output or the checkpoint being resumed (``--metrics-json OUT/last.pt``).
"""

from __future__ import annotations

import os
import tempfile

from ..errors import ConfigError
from .checkpoint import LAST, resolve_checkpoint_path
from .config import RunConfig

__all__ = ["check_outputs"]


def check_outputs(run: RunConfig) -> None:
    """Raise ConfigError (exit 2, one line naming the fix) for any output path that cannot be used."""
    for flag, value in (("--out", run.out), ("--metrics-json", run.metrics_json), ("--resume", run.resume)):
        if value is not None and not str(value).strip():
            raise ConfigError(f"{flag} is empty (an unset shell variable?); give a path or drop {flag}")
    resumed = os.path.realpath(resolve_checkpoint_path(run.resume)) if run.resume is not None else None
    checkpoint = None
    if run.out is not None:
        _usable_folder(run.out, "--out")
        checkpoint = os.path.realpath(os.path.join(run.out, LAST))
        if os.path.exists(checkpoint) and checkpoint != resumed and not run.overwrite:
            raise ConfigError(
                f"--out {run.out} already holds a checkpoint ({LAST}) of another run; continue it with --resume "
                f"{run.out}, choose another --out, or pass --overwrite to replace it")
    if run.metrics_json is not None:
        path = os.path.realpath(run.metrics_json)
        if os.path.isdir(path):
            raise ConfigError(f"--metrics-json {run.metrics_json} is a folder; give a file path such as "
                              f"{os.path.join(run.metrics_json, 'metrics.json')}")
        if path in (checkpoint, resumed):
            raise ConfigError(f"--metrics-json {run.metrics_json} is the run's checkpoint; writing JSON there would "
                              "destroy it — choose another file")
        _usable_folder(os.path.dirname(path), "--metrics-json")


def _usable_folder(folder: str, flag: str) -> None:
    """Create ``folder`` if needed and prove it can be written (a temporary file, removed at once)."""
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise ConfigError(f"{flag}: {folder} is a file, not a folder; choose another path")
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise ConfigError(f"{flag}: cannot write into {folder} ({e.strerror or e}); choose a writable path") from None
