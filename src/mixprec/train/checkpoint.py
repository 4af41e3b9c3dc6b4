"""The checkpoint file: atomic writes, safe loads (what a run saves and when: :mod:`.checkpointer`).

One file holds model, optimizer, recipe state, RNG states, position, config, resolved mechanism and metrics. It
is written to a temporary file and renamed over ``last.pt``, so a crash leaves the old checkpoint or the new one.
Loading uses ``torch.load(weights_only=True)`` and validates everything before touching the model: a bad file
raises :class:`~mixprec.errors.CheckpointError` and changes nothing. Under torchrun rank 0 writes full state
(:func:`mixprec.train.distributed.state_dicts`) and records ``world_size``. :func:`read_run` reads only config
and mechanism (memory-mapped, no tensor read), so a resume is checked before anything is built.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError, OutputError, one_line
from ..jsonio import file_mode_mask

__all__ = ["FORMAT", "VERSION", "LAST", "save_checkpoint", "load_checkpoint", "read_run", "resolve_checkpoint_path",
           "remove_stale_temporaries", "rng_state", "set_rng_state", "mechanism"]

FORMAT = "mixprec-checkpoint"
VERSION = 2
READABLE_VERSIONS = (2,)
"""Version 2 (config in sections, SHA-256 digest) is the only one read. Version 1 (flat flags, written before
the config redesign) carried no digest, so an edited file could not be told from a good one: it is refused
with the fix (:func:`_check_version`), as is a version-2 file without a digest."""
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
    """Atomically write ``payload`` (plus tags and a digest) to ``path``. A failed write raises
    :class:`OutputError` naming path and cause, and leaves a previous checkpoint as it was."""
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
        os.chmod(tmp, 0o666 & ~file_mode_mask())  # mkstemp makes 0600; a checkpoint gets the umask's mode
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


def _read(path: str | os.PathLike, p: Path, *, mmap: bool = False) -> Any:
    kind = _file_kind(path, p)
    try:
        with warnings.catch_warnings():  # "Detected pickle protocol 4...": a file we refuse needs no second voice
            warnings.simplefilter("ignore", UserWarning)
            return torch.load(p, map_location="cpu", weights_only=True, mmap=mmap)
    except PermissionError:
        raise CheckpointError(f"--resume {path}: permission denied reading {p}") from None
    except Exception as e:  # noqa: BLE001 -- corrupt zip, truncated file, pickled code refused...
        if "weights_only" in str(e) or "Unsupported global" in str(e):
            why = "it holds pickled Python objects, which mixprec never writes and refuses to load (no code ran)"
        else:
            why = f"{one_line(e)}; it may be truncated or not a mixprec checkpoint"
        raise CheckpointError(f"--resume {path}: {p} is not a readable checkpoint ({kind}): {why}") from None


_ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")  # a zip's first local header, or an empty zip's end record


def _file_kind(path: str | os.PathLike, p: Path) -> str:
    """``"a zip archive"`` or ``"a pickle"`` by the file's first bytes; anything else is refused here."""
    try:
        with open(p, "rb") as f:
            head = f.read(4)
    except PermissionError:
        raise CheckpointError(f"--resume {path}: permission denied reading {p}") from None
    except OSError as e:
        raise CheckpointError(f"--resume {path}: cannot read {p} ({e.strerror or e})") from None
    if not head:
        raise CheckpointError(f"--resume {path}: {p} is empty (0 bytes), not a mixprec checkpoint; pass the "
                              f"{LAST} an earlier run wrote")
    if head in _ZIP_MAGIC:
        return "a zip archive"
    if head[0] == 0x80 and len(head) > 1 and 2 <= head[1] <= 5:
        return "a pickle"
    raise CheckpointError(
        f"--resume {path}: {p} is not a mixprec checkpoint: it is neither a zip archive (what torch.save writes) "
        f"nor a pickle (it starts with bytes {head.hex(' ')}); pass the {LAST} an earlier run wrote")


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
    "evals": (lambda v: isinstance(v, list) and all(isinstance(h, dict) for h in v), "a list of dicts"),
    "counters": (lambda v: isinstance(v, dict) and all(_int(x) for x in v.values()), "a dict of integers"),
    "partial": (lambda v: v is None or isinstance(v, dict), "a dict or None"),
    "mechanism": (lambda v: isinstance(v, dict) and isinstance(v.get("impl"), str), "a dict with an 'impl'"),
}
_REQUIRED = ("model", "optimizer", "recipe", "rng", "epoch", "batch", "global_step", "config")


def _validate(path: str | os.PathLike, p: Path, ckpt: Any) -> None:
    """Tags, version, digest and every field's type; the message names the bad field."""
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise CheckpointError(f"--resume {path}: {p} is not a mixprec checkpoint (no '{FORMAT}' tag)")
    _check_version(path, p, ckpt)
    missing = [k for k in _REQUIRED if k not in ckpt]
    if missing:
        raise CheckpointError(f"--resume {path}: checkpoint {p} lacks {', '.join(missing)}; it is corrupt")
    for key, (ok, what) in _SCHEMA.items():
        if key in ckpt and not ok(ckpt[key]):
            raise CheckpointError(f"--resume {path}: field {key!r} of {p} is not {what} "
                                  f"(got {type(ckpt[key]).__name__}); the file is corrupt or was edited")
    body = {k: v for k, v in ckpt.items() if k != "digest"}
    if ckpt["digest"] != _digest(body):
        raise CheckpointError(f"--resume {path}: {p} fails its integrity check (the stored digest does not "
                              "match its contents): the file was damaged or edited; use an intact copy")


def _check_version(path: str | os.PathLike, p: Path, ckpt: dict[str, Any]) -> None:
    """Only digest-carrying version-2 files are read: a version-1 file (or one re-tagged as version 1 to slip
    past the digest) is refused with the fix, and so is a version-2 file without a digest."""
    version = ckpt.get("version")
    fresh = "start a new run (its weights still load with torch.load(path, weights_only=True)['model'])"
    if version == 1:
        raise CheckpointError(
            f"--resume {path}: {p} is a version-1 checkpoint, which carries no integrity digest, so a damaged or "
            f"edited file could not be told from a good one; this mixprec resumes only digest-checked version-"
            f"{VERSION} checkpoints: finish that run with the mixprec that wrote it, or {fresh}")
    if version not in READABLE_VERSIONS:
        raise CheckpointError(
            f"--resume {path}: checkpoint version {version!r} is not supported (expected one of "
            f"{', '.join(map(str, READABLE_VERSIONS))})")
    if not isinstance(ckpt.get("digest"), str):
        raise CheckpointError(
            f"--resume {path}: {p} carries no integrity digest (written by a mixprec that predates digests, or "
            f"edited), so it cannot be verified; {fresh}")


def load_checkpoint(path: str | os.PathLike, *, world_size: int | None = None) -> dict[str, Any]:
    """Read and validate a checkpoint file or a folder's ``last.pt`` (tags, version, digest, field types);
    nothing is applied here. ``world_size`` must equal the checkpoint's. Same-run checks: :mod:`.resume`."""
    p = resolve_checkpoint_path(path)
    ckpt = _read(path, p)
    _validate(path, p, ckpt)
    theirs_world = ckpt.get("world_size", 1)
    if world_size is not None and theirs_world != world_size:
        raise CheckpointError(
            f"--resume {path}: the checkpoint was written by a run of {theirs_world} process(es), this run has "
            f"{world_size}; resume with `torchrun --nproc_per_node={theirs_world}` (the data order and the steps "
            "per epoch depend on the number of processes)"
        )
    return ckpt


def read_run(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, Any]]:
    """The stored config (nested or flat dict) and mechanism (:func:`mechanism`) of a checkpoint, memory-mapped
    so no tensor is read; the digest is checked when the run resumes."""
    p = resolve_checkpoint_path(path)
    ckpt = _read(path, p, mmap=True)
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise CheckpointError(f"--resume {path}: {p} is not a mixprec checkpoint (no '{FORMAT}' tag)")
    _check_version(path, p, ckpt)
    for key in ("config", "recipe", "mechanism"):
        if key in ckpt and not _SCHEMA[key][0](ckpt[key]):
            raise CheckpointError(f"--resume {path}: field {key!r} of {p} is not {_SCHEMA[key][1]}; the file is "
                                  "corrupt or was edited")
    if "config" not in ckpt:
        raise CheckpointError(f"--resume {path}: checkpoint {p} lacks config; it is corrupt")
    mech = ckpt.get("mechanism") or {"impl": ckpt.get("recipe", {}).get("impl")}
    return ckpt["config"], mech


def mechanism(recipe: Any) -> dict[str, Any]:
    """What a resolved recipe does on its device: the mechanism (``impl``), its dtype facts and the dtype the
    matmuls run in. A resumed run must match the checkpoint's, or it would not continue the same numerics."""
    return {"impl": recipe.impl, **recipe.facts(), "matmul_dtype": recipe.hardware_facts().matmul_dtype}
