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
import dataclasses
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..errors import CheckpointError, UsageError
from ..memory import local_tensor
from . import distributed
from .config import RESUME_MUST_MATCH, TrainConfig

if TYPE_CHECKING:
    from .build import Run

__all__ = ["FORMAT", "VERSION", "LAST", "save_checkpoint", "load_checkpoint", "resolve_checkpoint_path",
           "rng_state", "set_rng_state", "TrainState", "Checkpointer"]

FORMAT = "mixprec-checkpoint"
VERSION = 2
READABLE_VERSIONS = (1, 2)
"""Version 1 stored the config as flat flags, version 2 in sections; both resume."""
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
    path: str | os.PathLike, *, config: TrainConfig | None = None, world_size: int | None = None
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
    if ckpt.get("version") not in READABLE_VERSIONS:
        raise CheckpointError(
            f"--resume {path}: checkpoint version {ckpt.get('version')} is not supported (expected one of "
            f"{', '.join(map(str, READABLE_VERSIONS))})"
        )
    missing = [k for k in ("model", "optimizer", "recipe", "rng", "epoch", "batch", "global_step", "config")
               if k not in ckpt]
    if missing:
        raise CheckpointError(f"--resume {path}: checkpoint {p} lacks {', '.join(missing)}; it is corrupt")
    if config is not None:
        try:
            theirs = TrainConfig.from_dict(ckpt["config"]).flags()
        except (UsageError, TypeError, AttributeError) as e:
            raise CheckpointError(f"--resume {path}: the checkpoint's config is unreadable ({e})") from None
        ours = config.flags()
        diffs = []
        for k in RESUME_MUST_MATCH:
            a, b = ours[k], theirs[k]
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


# ------------------------------------------------------------------------------------------ during a run


@dataclasses.dataclass
class TrainState:
    """Where a run is: what a checkpoint restores besides the tensors."""

    epoch: int = 0
    batch: int = 0
    """Next batch of the loader in ``epoch`` (0 once the resumed epoch is under way)."""
    global_step: int = 0
    history: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    skipped_total: int = 0
    consecutive_skips: int = 0

    def counters(self) -> dict[str, int]:
        return {"skipped_total": self.skipped_total, "consecutive_skips": self.consecutive_skips}


class Checkpointer:
    """Resume, cadence and save of one run's ``last.pt`` (``--out``, ``--checkpoint-every``, ``--resume``).

    Under torchrun every rank calls :meth:`save` (gathering FSDP state is a collective); rank 0 writes.
    """

    def __init__(self, run: Run) -> None:
        self.run = run
        self.out = run.config.run.out
        self.every = run.config.run.checkpoint_every

    def resume(self) -> tuple[TrainState, str | None]:
        """The state to start from, and a line saying where it came from (None for a fresh run)."""
        run, path = self.run, self.run.config.run.resume
        if not path:
            return TrainState(), None
        ck = load_checkpoint(path, config=run.config, world_size=run.world_size)
        try:
            distributed.load_state_dicts(run.model, run.optimizer, ck["model"], ck["optimizer"])
            run.recipe.load_state_dict(ck["recipe"])
        except (RuntimeError, KeyError, ValueError) as e:
            raise CheckpointError(f"--resume {path}: checkpoint does not fit this model: {e}") from None
        set_rng_state(ck["rng"])
        counters = ck.get("counters") or {}
        state = TrainState(epoch=ck["epoch"], batch=ck["batch"], global_step=ck["global_step"],
                           history=list(ck.get("history") or []), **counters)
        return state, (f"resumed from {path} at epoch {state.epoch}, batch {state.batch} "
                       f"(step {state.global_step})")

    def save(self, state: TrainState, epoch: int, batch: int) -> None:
        """Write ``last.pt`` for position (epoch, batch); no-op without ``--out``."""
        if self.out is None:
            return
        run = self.run
        model_state, optimizer_state = distributed.state_dicts(run.model, run.optimizer)
        payload = {
            "model": model_state, "optimizer": optimizer_state, "recipe": run.recipe.state_dict(),
            "world_size": run.world_size, "rng": rng_state(), "epoch": epoch, "batch": batch,
            "global_step": state.global_step, "config": run.config.to_dict(), "history": state.history,
            "counters": state.counters(),
        }
        if run.rank == 0:
            save_checkpoint(os.path.join(self.out, LAST), payload)

    def after_step(self, state: TrainState, epoch: int, pos: int) -> None:
        """Save on the ``--checkpoint-every`` cadence."""
        if self.every and state.global_step % self.every == 0:
            self.save(state, epoch, pos)

    def after_epoch(self, state: TrainState, epoch: int, pos: int, n_batches: int) -> None:
        """Save at the end of an epoch's steps: into the next epoch when the loader is exhausted."""
        if pos >= n_batches:
            self.save(state, epoch + 1, 0)
        else:
            self.save(state, epoch, pos)

    def keep_last_good(self, state: TrainState, epoch: int, batch: int, step: int | None) -> str:
        """After a non-finite stop: save the state before the failed step if the params are still finite.
        Returns the clause that says what was kept."""
        if self.out is None:
            return ""
        if _params_finite(self.run.model, self.run.device):
            self.save(state, epoch, batch)
            return f"; the last good state (before step {step}) is saved in {self.out}/{LAST}"
        return f"; parameters are already non-finite, so {self.out}/{LAST} was left as it was"


def _params_finite(model: torch.nn.Module, device: torch.device) -> bool:
    """All parameters finite, on every rank (one all-reduce under torchrun)."""
    bad = sum((~torch.isfinite(local_tensor(p))).sum() for p in model.parameters())
    return distributed.all_reduce_sum(torch.as_tensor(bad, dtype=torch.float64, device=device)).item() == 0
