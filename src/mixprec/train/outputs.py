"""Output paths checked before the first step, so a mistake costs nothing and nothing the user had is lost.

For ``--out``, ``--metrics-json`` and ``--resume``: an empty path is refused; a folder is created and
test-written now (:func:`check_folder`); a run never writes over a checkpoint it did not resume from (that needs
``--resume`` or ``--overwrite``); no output may be another output or the resumed checkpoint; one writer per
folder (:class:`OutputLock`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import sys
import tempfile
import threading
import time
import weakref
from typing import Any

from ..errors import ConfigError
from .checkpoint import LAST, resolve_checkpoint_path
from .config import RunConfig
from .report import write_line

__all__ = ["check_outputs", "check_folder", "OutputLock", "LOCK_NAME"]

LOCK_NAME = ".mixprec.lock"


def check_outputs(run: RunConfig, *, lock: bool = False, command: str = "mixprec train") -> OutputLock | None:
    """Raise ConfigError (exit 2, one line naming the fix) for any output path that cannot be used.
    ``lock``: on the writing rank, also take and return ``--out``'s :class:`OutputLock` (else None)."""
    for flag, value in (("--out", run.out), ("--metrics-json", run.metrics_json), ("--resume", run.resume)):
        if value is not None and not str(value).strip():
            raise ConfigError(f"{flag} is empty (an unset shell variable?); give a path or drop {flag}")
    resumed = os.path.realpath(resolve_checkpoint_path(run.resume)) if run.resume is not None else None
    checkpoint = None
    held = None
    if run.out is not None:
        check_folder(run.out, "--out")
        held = OutputLock.acquire(run.out, command=command) if lock and _writing_rank() else None
    try:
        if run.out is not None:
            checkpoint = os.path.realpath(os.path.join(run.out, LAST))
            if os.path.exists(checkpoint) and checkpoint != resumed and not run.overwrite:
                if resumed is not None and os.path.dirname(resumed) == os.path.dirname(checkpoint):
                    raise ConfigError(
                        f"--resume {run.resume} continues in its folder {run.out}, which holds another checkpoint "
                        f"({LAST}); pass --out DIR to continue elsewhere, or --overwrite to replace "
                        f"{os.path.join(run.out, LAST)}")
                raise ConfigError(
                    f"--out {run.out} already holds a checkpoint ({LAST}) of another run; continue it with --resume "
                    f"{run.out}, choose another --out, or pass --overwrite to replace it")
        if run.metrics_json is not None:
            path = os.path.realpath(run.metrics_json)
            if os.path.isdir(path):
                raise ConfigError(f"--metrics-json {run.metrics_json} is a folder; give a file path such as "
                                  f"{os.path.join(run.metrics_json, 'metrics.json')}")
            if path in (checkpoint, resumed):
                raise ConfigError(f"--metrics-json {run.metrics_json} is the run's checkpoint; writing JSON there "
                                  "would destroy it — choose another file")
            check_folder(os.path.dirname(path), "--metrics-json", value=run.metrics_json)
    except BaseException:
        if held is not None:
            held.release()
        raise
    return held


def check_folder(folder: str | os.PathLike, flag: str, *, value: str | os.PathLike | None = None) -> None:
    """Create ``folder`` if needed and prove it can be written; raise ConfigError naming ``flag`` otherwise.
    ``value``: what the user typed, when ``folder`` is its parent. Nothing of the user's is touched."""
    folder = os.fspath(folder)
    said = f"{flag} {folder if value is None else os.fspath(value)}"
    where = "the folder" if value is None else f"its folder {folder}"
    if not folder.strip():
        raise ConfigError(f"{flag} is empty (an unset shell variable?); give a path")
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise ConfigError(f"{said} is a file, not a folder; pass a folder (it is created if missing)"
                          if value is None else f"{said}: {folder} is a file, not a folder; choose another path")
    created, d = [], os.path.abspath(folder)
    while d and not os.path.exists(d):
        created.append(d)
        d = os.path.dirname(d) if os.path.dirname(d) != d else ""
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        _remove_dirs(created)
        raise ConfigError(f"{said}: cannot create {where}: {e.strerror or e}; pick a writable place") from None
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        _remove_dirs(created)
        raise ConfigError(f"{said}: cannot write into {where}: {e.strerror or e}; pick a writable place") from None


def _writing_rank() -> bool:
    """Rank 0 writes a run's files: of the process group if one exists, else of torchrun's launch."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0").strip() in ("", "0")


def _remove_dirs(dirs: list[str]) -> None:
    for d in dirs:  # deepest first
        with contextlib.suppress(OSError):
            os.rmdir(d)


# ------------------------------------------------------------------------------------------ one writer


_HELD: dict[str, list[Any]] = {}  # realpath of the folder -> [fd, number of holders, pid that took it]
_HELD_LOCK = threading.Lock()


class OutputLock:
    """This process is the one writing a folder: an exclusive ``flock`` on ``FOLDER/.mixprec.lock``, whose text
    (host, pid, command) names the holder in a refusal; a stale lock is taken over with a note. Without
    ``flock`` the text alone decides. Counted within one process, so the API may build several runs on one folder.
    """

    def __init__(self, folder: str, state: list[Any]) -> None:
        self.folder = folder
        self.path = os.path.join(folder, LOCK_NAME)
        self._state = state
        self._released = False
        self._finalizer = weakref.finalize(self, _drop, os.path.realpath(folder))

    @classmethod
    def acquire(cls, folder: str | os.PathLike, *, command: str = "mixprec", flag: str = "--out") -> OutputLock:
        """Take the folder (it must exist) or raise ConfigError naming the run that writes it (``flag``: the
        option that named the folder, for the message)."""
        folder = os.fspath(folder)
        key = os.path.realpath(folder)
        with _HELD_LOCK:
            if key in _HELD:
                _HELD[key][1] += 1
                return cls(folder, _HELD[key])
            fd, note = _take(folder, command, flag)
            _HELD[key] = state = [fd, 1, os.getpid()]
        if note:
            write_line(sys.stderr, f"mixprec: note: {note}")
        return cls(folder, state)

    def release(self) -> None:
        """Give the folder up (idempotent)."""
        if not self._released:
            self._released = True
            self._finalizer()


def _drop(key: str) -> None:
    with _HELD_LOCK:
        state = _HELD.get(key)
        if state is None or state[2] != os.getpid():  # a forked child (a DataLoader worker) never releases it
            return
        state[1] -= 1
        if state[1] > 0:
            return
        del _HELD[key]
        fd = state[0]
    with contextlib.suppress(OSError):
        os.unlink(os.path.join(key, LOCK_NAME))  # while still held: nobody can take the old file meanwhile
    with contextlib.suppress(OSError):
        os.close(fd)


def _take(folder: str, command: str, flag: str) -> tuple[int, str]:
    """Open and lock ``FOLDER/.mixprec.lock``; (fd, a note about a stale holder taken over, or "")."""
    path = os.path.join(folder, LOCK_NAME)
    for _ in range(20):  # the holder may remove the file between our open and our lock: then open the new one
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise ConfigError(f"{flag} {folder}: cannot write into the folder: {e.strerror or e}; pick a writable "
                              "place") from None
        try:
            note = _lock(fd, folder, flag)
            if os.fstat(fd).st_ino != os.stat(path).st_ino:
                raise FileNotFoundError
        except FileNotFoundError:
            os.close(fd)
            continue
        except BaseException:
            os.close(fd)
            raise
        text = f"host={socket.gethostname()} pid={os.getpid()} started={time.strftime('%Y-%m-%dT%H:%M:%S')} " \
               f"command={command}\n"
        os.ftruncate(fd, 0)
        os.pwrite(fd, text.encode(), 0)
        return fd, note
    raise ConfigError(f"{flag} {folder}: the lock file {LOCK_NAME} keeps changing under this run; is another run "
                      "starting on the same folder?")


def _lock(fd: int, folder: str, flag: str) -> str:
    """flock the file, or refuse naming its holder; returns the note for a stale holder taken over."""
    holder = _read_holder(fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise ConfigError(_busy(flag, folder, _read_holder(fd) or holder)) from None
    except OSError as e:
        if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise ConfigError(f"{flag} {folder}: cannot lock {LOCK_NAME}: {e.strerror or e}") from None
        return _lock_by_text(flag, folder, holder)  # no flock on this filesystem: the text decides
    holder = _read_holder(fd)  # read again under the lock: the writer may have filled it meanwhile
    if holder:
        return (f"{flag} {folder}: took over the lock of a run that ended without releasing it ({_who(holder)}; "
                "killed?); this run writes the folder now")
    return ""


def _lock_by_text(flag: str, folder: str, holder: dict[str, str]) -> str:
    if not holder:
        return ""
    mine = holder.get("host") == socket.gethostname()
    pid = int(holder["pid"]) if holder.get("pid", "").isdigit() else None
    if mine and pid is not None and pid != os.getpid() and not _alive(pid):
        return f"{flag} {folder}: took over the stale lock of {_who(holder)}, which no longer runs"
    if mine and pid == os.getpid():
        return ""
    raise ConfigError(_busy(flag, folder, holder) + (
        "" if mine else f"; if that run is gone, delete {os.path.join(folder, LOCK_NAME)}"))


def _read_holder(fd: int) -> dict[str, str]:
    try:
        text = os.pread(fd, 4096, 0).decode("utf-8", "replace")
    except OSError:
        return {}
    head, _, command = text.strip().partition(" command=")
    fields = dict(part.split("=", 1) for part in head.split() if "=" in part)
    if command:
        fields["command"] = command
    return fields


def _who(holder: dict[str, str]) -> str:
    if not holder:
        return "a run that has not written its name yet"
    return (f"{holder.get('command', 'a mixprec run')}, pid {holder.get('pid', '?')} on host "
            f"{holder.get('host', '?')}, started {holder.get('started', '?')}")


def _busy(flag: str, folder: str, holder: dict[str, str]) -> str:
    return (f"{flag} {folder} is being written by another run ({_who(holder)}); wait for it to finish or stop it, "
            "or choose another --out (--overwrite replaces a finished run's files, never a live run's)")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
