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
import hashlib
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..errors import CheckpointError, OutputError, UsageError, one_line
from ..memory import local_tensor
from . import distributed
from .config import RESUME_MAY_CHANGE, TrainConfig

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


def _digest(obj: Any, h: Any = None) -> str:
    """SHA-256 over a payload's structure and every tensor's bytes (keys sorted): a flipped bit in any weight,
    any optimizer state or any position changes it."""
    h = h or hashlib.sha256()
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(obj, dict):
        h.update(b"{")
        for k in sorted(obj, key=repr):
            h.update(repr(k).encode())
            _digest(obj[k], h)
        h.update(b"}")
    elif isinstance(obj, (list, tuple)):
        h.update(b"[")
        for v in obj:
            _digest(v, h)
        h.update(b"]")
    else:
        h.update(repr(obj).encode())
    return h.hexdigest()


def remove_stale_temporaries(folder: str | os.PathLike) -> list[str]:
    """Delete ``.last.pt.*.tmp`` files that killed saves left behind in ``folder``; returns their names."""
    gone = []
    for p in Path(folder).glob(f".{LAST}.*.tmp"):
        with contextlib.suppress(OSError):
            p.unlink()
            gone.append(p.name)
    return gone


def save_checkpoint(path: str | os.PathLike, payload: dict[str, Any]) -> Path:
    """Atomically write ``payload`` (plus format/version tags and a digest) to ``path``.

    A failed write (disk full, read-only folder) raises :class:`OutputError` naming the path and
    the cause; the temporary file is removed and a previous checkpoint at ``path`` stays as it was.
    """
    path = Path(path)
    payload = {"format": FORMAT, "version": VERSION, **payload}
    payload["digest"] = _digest({k: v for k, v in payload.items() if k != "digest"})
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:
        _unlink(tmp)
        raise OutputError(
            f"could not write the checkpoint {path} ({one_line(e)}); the previous checkpoint there, if any, is "
            "intact — free disk space or pass a writable --out"
        ) from None
    except BaseException:
        _unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    return path


def _unlink(path: str | None) -> None:
    if path is not None:
        with contextlib.suppress(OSError):
            os.unlink(path)


def resolve_checkpoint_path(path: str | os.PathLike) -> Path:
    if not str(path).strip():
        raise CheckpointError("--resume is empty (an unset shell variable?); pass the --out folder of an earlier "
                              "run or its last.pt, or drop --resume to start from scratch")
    p = Path(path)
    if p.is_dir():
        p = p / LAST
    if not p.is_file():
        raise CheckpointError(
            f"--resume {path}: no checkpoint found at {p}; pass the --out folder of an earlier run or its last.pt"
        )
    return p


def _read(path: str | os.PathLike, p: Path) -> Any:
    try:
        return torch.load(p, map_location="cpu", weights_only=True)
    except PermissionError:
        raise CheckpointError(f"--resume {path}: permission denied reading {p}") from None
    except Exception as e:  # noqa: BLE001 -- corrupt zip, truncated or empty file, pickled code refused...
        if "weights_only" in str(e) or "Unsupported global" in str(e):
            why = "it holds pickled Python objects, which mixprec never writes and refuses to load (no code ran)"
        else:
            why = f"{one_line(e)}; it may be truncated, empty or not a mixprec checkpoint"
        raise CheckpointError(f"--resume {path}: {p} is not a readable checkpoint: {why}") from None


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


_SCHEMA: dict[str, tuple[Any, str]] = {
    "model": (lambda v: isinstance(v, dict) and all(isinstance(t, torch.Tensor) for t in v.values()),
              "a dict of tensors"),
    "optimizer": (lambda v: isinstance(v, dict) and isinstance(v.get("state"), dict)
                  and isinstance(v.get("param_groups"), list), "an optimizer state dict"),
    "recipe": (lambda v: isinstance(v, dict) and isinstance(v.get("name"), str)
               and isinstance(v.get("scaler") or {}, dict) and isinstance(v.get("master") or {}, dict),
               "a recipe state dict"),
    "rng": (lambda v: isinstance(v, dict) and isinstance(v.get("torch"), torch.Tensor)
            and v["torch"].dtype == torch.uint8, "RNG states"),
    "epoch": (_int, "an integer >= 0"),
    "batch": (_int, "an integer >= 0"),
    "global_step": (_int, "an integer >= 0"),
    "config": (lambda v: isinstance(v, dict), "a dict"),
    "world_size": (lambda v: _int(v) and v >= 1, "an integer >= 1"),
    "history": (lambda v: isinstance(v, list) and all(isinstance(h, dict) for h in v), "a list of dicts"),
    "counters": (lambda v: isinstance(v, dict) and all(_int(x) for x in v.values()), "a dict of integers"),
    "partial": (lambda v: v is None or isinstance(v, dict), "a dict or None"),
}
_REQUIRED = ("model", "optimizer", "recipe", "rng", "epoch", "batch", "global_step", "config")


def _validate(path: str | os.PathLike, p: Path, ckpt: Any) -> None:
    """Tags, version, digest and every field's type; the message names the bad field."""
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise CheckpointError(f"--resume {path}: {p} is not a mixprec checkpoint (no '{FORMAT}' tag)")
    if ckpt.get("version") not in READABLE_VERSIONS:
        raise CheckpointError(
            f"--resume {path}: checkpoint version {ckpt.get('version')!r} is not supported (expected one of "
            f"{', '.join(map(str, READABLE_VERSIONS))})"
        )
    missing = [k for k in _REQUIRED if k not in ckpt]
    if missing:
        raise CheckpointError(f"--resume {path}: checkpoint {p} lacks {', '.join(missing)}; it is corrupt")
    for key, (ok, what) in _SCHEMA.items():
        if key in ckpt and not ok(ckpt[key]):
            raise CheckpointError(f"--resume {path}: field {key!r} of {p} is not {what} "
                                  f"(got {type(ckpt[key]).__name__}); the file is corrupt or was edited")
    if ckpt["version"] >= 2:
        body = {k: v for k, v in ckpt.items() if k != "digest"}
        if ckpt.get("digest") != _digest(body):
            raise CheckpointError(f"--resume {path}: {p} fails its integrity check (the stored digest does not "
                                  "match its contents): the file was damaged or edited; use an intact copy")


def load_checkpoint(
    path: str | os.PathLike, *, config: TrainConfig | None = None, world_size: int | None = None
) -> dict[str, Any]:
    """Read and validate a checkpoint; nothing is applied to any model here.

    Args:
        path: a checkpoint file, or a folder holding ``last.pt``.
        config: the current run's config; every flag but those in RESUME_MAY_CHANGE must equal the
            checkpoint's (a field the checkpoint predates counts as its default).
        world_size: the current number of processes; must equal the checkpoint's (1 if it has none),
            because the data order and the steps per epoch depend on it.
    """
    p = resolve_checkpoint_path(path)
    ckpt = _read(path, p)
    _validate(path, p, ckpt)
    if config is not None:
        _same_run(path, ckpt, config)
    theirs_world = ckpt.get("world_size", 1)
    if world_size is not None and theirs_world != world_size:
        raise CheckpointError(
            f"--resume {path}: the checkpoint was written by a run of {theirs_world} process(es), this run has "
            f"{world_size}; resume with `torchrun --nproc_per_node={theirs_world}` (the data order and the steps "
            "per epoch depend on the number of processes)"
        )
    return ckpt


def _same_run(path: str | os.PathLike, ckpt: dict[str, Any], config: TrainConfig) -> None:
    try:
        theirs = TrainConfig.from_dict(ckpt["config"]).flags()
    except (UsageError, TypeError, AttributeError) as e:
        raise CheckpointError(f"--resume {path}: the checkpoint's config is unreadable ({e})") from None
    diffs = [f"--{k.replace('_', '-')} {theirs[k]!r} in the checkpoint vs {v!r} now"
             for k, v in config.flags().items() if k not in RESUME_MAY_CHANGE and v != theirs[k]]
    if diffs:
        raise CheckpointError(
            f"--resume {path}: the checkpoint is from a different run: " + "; ".join(diffs)
            + ". Resume with the same flags (only --epochs/--max-steps, output and display options may change)."
        )


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
    partial: dict[str, Any] | None = None
    """The running sums of the epoch a mid-epoch checkpoint interrupted (see EpochMeter.state_dict)."""

    def counters(self) -> dict[str, int]:
        return {"skipped_total": self.skipped_total, "consecutive_skips": self.consecutive_skips}


class Checkpointer:
    """Resume, cadence and save of one run's ``last.pt`` (``--out``, ``--checkpoint-every``, ``--resume``).

    Nothing non-finite is ever written: :meth:`save` checks parameters, optimizer state and master weights
    first (one pass over them, at save points only) and returns the reason to stop instead. A checkpoint
    taken mid-epoch also holds the epoch's running sums, so the resumed epoch's metrics cover all its steps;
    one taken after the epoch's last step resumes into the evaluation of that epoch, then the next epoch.
    Under torchrun every rank calls :meth:`save` (gathering FSDP state is a collective); rank 0 writes.
    """

    def __init__(self, run: Run) -> None:
        self.run = run
        self.out = run.config.run.out
        self.every = run.config.run.checkpoint_every
        if self.out is not None and run.rank == 0 and os.path.isdir(self.out):
            remove_stale_temporaries(self.out)

    def resume(self) -> tuple[TrainState, str | None]:
        """The state to start from, and a line saying where it came from (None for a fresh run)."""
        run, path = self.run, self.run.config.run.resume
        if path is None:
            return TrainState(), None
        ck = load_checkpoint(path, config=run.config, world_size=run.world_size)
        if ck["batch"] > len(run.train_loader):
            raise CheckpointError(f"--resume {path}: the checkpoint's position (epoch {ck['epoch']}, batch "
                                  f"{ck['batch']}) is past the end of an epoch of {len(run.train_loader)} batches; "
                                  "it was edited or is from another data set")
        try:
            distributed.load_state_dicts(run.model, run.optimizer, ck["model"], ck["optimizer"])
            run.recipe.load_state_dict(ck["recipe"])
        except (RuntimeError, KeyError, ValueError, TypeError, AssertionError) as e:
            raise CheckpointError(f"--resume {path}: checkpoint does not fit this model: {one_line(e)}") from None
        set_rng_state(ck["rng"])
        counters = ck.get("counters") or {}
        state = TrainState(epoch=ck["epoch"], batch=ck["batch"], global_step=ck["global_step"],
                           history=list(ck.get("history") or []), partial=ck.get("partial"),
                           skipped_total=counters.get("skipped_total", 0),
                           consecutive_skips=counters.get("consecutive_skips", 0))
        if state.partial is not None and state.history and state.history[-1]["epoch"] == state.epoch:
            state.history.pop()  # the interrupted epoch's record: the resumed epoch records all its steps again
        return state, (f"resumed from {path} at epoch {state.epoch}, batch {state.batch} "
                       f"(step {state.global_step})")

    def save(self, state: TrainState, epoch: int, batch: int, meter: Any = None) -> str | None:
        """Write ``last.pt`` for position (epoch, batch) — no file without ``--out``.

        Returns None, or why the run must stop: the state is not finite (then nothing is written, and the
        previous ``last.pt`` stays). ``meter``: the interrupted epoch's EpochMeter, for a mid-epoch position.
        """
        run = self.run
        if not _state_finite(run):
            return (f"the weights or optimizer state became non-finite by step {state.global_step} (epoch {epoch})"
                    + (f"; {self.out}/{LAST} keeps the last finite state saved before" if self.out else "")
                    + f". Remedies: {run.recipe.nonfinite_remedies()}")
        if self.out is None:
            return None
        model_state, optimizer_state = distributed.state_dicts(run.model, run.optimizer)
        payload = {
            "model": model_state, "optimizer": optimizer_state, "recipe": run.recipe.state_dict(),
            "world_size": run.world_size, "rng": rng_state(), "epoch": epoch, "batch": batch,
            "global_step": state.global_step, "config": run.config.to_dict(), "history": state.history,
            "counters": state.counters(), "partial": None if meter is None else meter.state_dict(),
        }
        if run.rank == 0:
            save_checkpoint(os.path.join(self.out, LAST), payload)
        return None

    def after_step(self, state: TrainState, epoch: int, meter: Any) -> str | None:
        """Save on the ``--checkpoint-every`` cadence (the epoch's running sums with it)."""
        if self.every and state.global_step % self.every == 0:
            return self.save(state, epoch, meter.pos, meter)
        return None

    def after_epoch(self, state: TrainState, epoch: int, meter: Any) -> str | None:
        """Save once an epoch's steps and evaluation are done: into the next epoch when the loader is
        exhausted, else (``--max-steps`` ended it) where it stopped."""
        if meter.pos >= len(self.run.train_loader):
            return self.save(state, epoch + 1, 0)
        return self.save(state, epoch, meter.pos, meter)

    def keep_last_good(self, state: TrainState, epoch: int, batch: int, step: int | None, meter: Any) -> str:
        """After a non-finite stop: save the state before the failed step if it is still finite.
        Returns the clause that says what was kept."""
        if self.out is None:
            return ""
        if self.save(state, epoch, batch, meter) is None:
            return f"; the last good state (before step {step}) is saved in {self.out}/{LAST}"
        return f"; parameters are already non-finite, so {self.out}/{LAST} was left as it was"


def _state_finite(run: Run) -> bool:
    """Parameters, optimizer state and master weights all finite, on every rank (one all-reduce)."""
    tensors = [p for p in run.model.parameters()]
    tensors += [p for g in run.optimizer.param_groups for p in g["params"]]  # fp32 masters where they exist
    tensors += [t for st in run.optimizer.state.values() for t in st.values()
                if isinstance(t, torch.Tensor) and t.is_floating_point()]
    bad = torch.zeros((), dtype=torch.float64, device=run.device)
    for t in tensors:
        bad += (~torch.isfinite(local_tensor(t))).sum().to(bad.device)
    return distributed.all_reduce_sum(bad).item() == 0
