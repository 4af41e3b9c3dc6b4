"""Checkpoints: atomic writes, safe loads, exact resume.

A checkpoint is one file holding model, optimizer, recipe (loss scaler, master weights), RNG states,
position (epoch, batch, global step), the run's config and the metrics so far. It is written to a
temporary file in the same folder, flushed to disk, then renamed over ``last.pt``: ``os.replace`` is
atomic, so a crash at any moment leaves either the old checkpoint or the new one, never half of one.

Loading uses ``torch.load(weights_only=True)`` (no pickled code runs) and validates everything before
touching the model, so a checkpoint that is not ours, corrupt, or from a different run raises
:class:`~mixprec.errors.CheckpointError` and leaves the model and optimizer as they were.

Under torchrun the file is the same: rank 0 writes it, with full (unsharded) model and optimizer state
from :func:`mixprec.train.distributed.state_dicts`, and records ``world_size``; a resume must use the same
number of processes.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError
from .config import RESUME_MUST_MATCH, TrainConfig

__all__ = ["FORMAT", "VERSION", "save_checkpoint", "load_checkpoint", "resolve_checkpoint_path", "rng_state",
           "set_rng_state"]

FORMAT = "mixprec-checkpoint"
VERSION = 1
LAST = "last.pt"


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(path: str | os.PathLike, payload: dict[str, Any]) -> Path:
    """Atomically write ``payload`` (plus format/version tags) to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"format": FORMAT, "version": VERSION, **payload}
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    return path


def resolve_checkpoint_path(path: str | os.PathLike) -> Path:
    p = Path(path)
    if p.is_dir():
        p = p / LAST
    if not p.is_file():
        raise CheckpointError(
            f"--resume {path}: no checkpoint found at {p}; pass the --out folder of an earlier run or its last.pt"
        )
    return p


def load_checkpoint(
    path: str | os.PathLike, *, config: dict[str, Any] | None = None, world_size: int | None = None
) -> dict[str, Any]:
    """Read and validate a checkpoint; nothing is applied to any model here.

    Args:
        path: a checkpoint file, or a folder holding ``last.pt``.
        config: the current run's config; fields in RESUME_MUST_MATCH must equal the checkpoint's (a field
            the checkpoint predates counts as its default).
        world_size: the current number of processes; must equal the checkpoint's (1 if it has none),
            because the data order and the steps per epoch depend on it.
    """
    p = resolve_checkpoint_path(path)
    try:
        ckpt = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # corrupt zip, truncated file, pickled code refused by weights_only...
        raise CheckpointError(
            f"--resume {path}: {p} is not a readable checkpoint ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
            "it may be truncated or not a mixprec checkpoint"
        ) from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise CheckpointError(f"--resume {path}: {p} is not a mixprec checkpoint (no '{FORMAT}' tag)")
    if ckpt.get("version") != VERSION:
        raise CheckpointError(
            f"--resume {path}: checkpoint version {ckpt.get('version')} is not supported (expected {VERSION})"
        )
    missing = [k for k in ("model", "optimizer", "recipe", "rng", "epoch", "batch", "global_step", "config")
               if k not in ckpt]
    if missing:
        raise CheckpointError(f"--resume {path}: checkpoint {p} lacks {', '.join(missing)}; it is corrupt")
    if config is not None:
        theirs = ckpt["config"]
        defaults = TrainConfig().to_dict()
        diffs = []
        for k in RESUME_MUST_MATCH:
            a, b = config.get(k), theirs.get(k, defaults.get(k))
            if isinstance(a, tuple):
                a = list(a)
            if isinstance(b, tuple):
                b = list(b)
            if a != b:
                diffs.append(f"--{k.replace('_', '-')} {b!r} in the checkpoint vs {a!r} now")
        if diffs:
            raise CheckpointError(
                f"--resume {path}: the checkpoint is from a different run: " + "; ".join(diffs)
                + ". Resume with the same flags (only --epochs/--max-steps and output options may change)."
            )
    theirs_world = ckpt.get("world_size", 1)
    if world_size is not None and theirs_world != world_size:
        raise CheckpointError(
            f"--resume {path}: the checkpoint was written by a run of {theirs_world} process(es), this run has "
            f"{world_size}; resume with `torchrun --nproc_per_node={theirs_world}` (the data order and the steps "
            "per epoch depend on the number of processes)"
        )
    return ckpt
