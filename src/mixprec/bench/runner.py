"""Run the (recipe, repeat) matrix, one fresh subprocess per run (:mod:`.worker`), one at a time, repeat-major,
so memory peaks start clean and a shared machine's drifts hit every recipe alike. A worker that leaves no result
(a signal, out of memory, a timeout) becomes a failed row naming its exit status and its log's last line.

No worker outlives the matrix: on an interrupt the worker gets the same signal, ``STOP_GRACE_S`` seconds, then
SIGKILL; the first signal makes SIGINT/SIGTERM ignored until :func:`stop_on_signals` exits, so a second Ctrl-C
cannot orphan the worker.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import OutputError
from ..jsonio import write_json
from .results import RunResult

__all__ = ["RunSpec", "execute_matrix", "failed_reason", "Stopped", "stop_on_signals", "STOP_GRACE_S"]

STOP_GRACE_S = 10.0
"""Seconds a worker gets to exit after the forwarded signal, before SIGKILL."""


class Stopped(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived (:func:`stop_on_signals`); a KeyboardInterrupt, so SIGTERM is handled as Ctrl-C."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def signal_of(e: BaseException) -> signal.Signals:
    """The signal an interrupt stands for: ``Stopped.signum``, else SIGINT (Python's own Ctrl-C)."""
    return signal.Signals(getattr(e, "signum", signal.SIGINT))


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """While inside, SIGINT and SIGTERM raise :class:`Stopped` once; later ones are ignored until the block exits.
    A no-op outside the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def handler(signum, frame):
        for s in old:
            signal.signal(s, signal.SIG_IGN)
        raise Stopped(signum)

    for s in old:
        signal.signal(s, handler)
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunSpec:
    """What one worker runs (its ``SPEC`` file)."""

    recipe: str
    repeat: int
    seed: int
    config: dict[str, Any]
    """The run's ``TrainConfig.to_dict()``."""
    warmup_steps: int

    @property
    def name(self) -> str:
        return f"{self.recipe}-r{self.repeat}"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunSpec:
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls)})


def _last_line(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = [ln.strip() for ln in f if ln.strip()]
    except OSError:
        return ""
    return lines[-1][:300] if lines else ""


def failed_reason(returncode: int | None, log_path: str, *, timeout: float | None = None) -> str:
    """Why a worker produced no result, from its exit status and the last line of its log."""
    if returncode is None:
        why = f"timed out after {timeout:g} s (--timeout)"
    elif returncode < 0:
        try:
            sig = signal.Signals(-returncode).name
        except ValueError:
            sig = f"signal {-returncode}"
        why = f"crashed: killed by {sig}" + (" (out of memory?)" if sig == "SIGKILL" else "")
    else:
        why = f"worker exited with status {returncode} without a result"
    last = _last_line(log_path)
    return f"{why}; last log line: {last}" if last else why


def _stop_worker(proc: subprocess.Popen, sig: int | None) -> None:
    """Send ``sig`` (None: SIGKILL), wait up to STOP_GRACE_S, then SIGKILL; always reaped."""
    try:
        if sig is not None and proc.poll() is None:
            proc.send_signal(sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=STOP_GRACE_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _wait(proc: subprocess.Popen, timeout: float | None) -> int | None:
    """The worker's exit status, or None after ``timeout`` (then it is killed). Never leaves it running."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop_worker(proc, None)
        return None
    except BaseException as e:  # an interrupt (forwarded), or anything else: no orphan either way
        _stop_worker(proc, signal_of(e) if isinstance(e, KeyboardInterrupt) else None)
        raise


def _read_result(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as f:
            result = json.load(f)
    except (OSError, ValueError):
        return None
    return result if isinstance(result, dict) else None


def _run_one(spec: RunSpec, out_dir: str, timeout: float | None, env: dict[str, str], invocation: int) -> RunResult:
    spec_path = os.path.join(out_dir, "runs", f"{spec.name}.spec.json")
    result_path = os.path.join(out_dir, "runs", f"{spec.name}.json")
    log_path = os.path.join(out_dir, "logs", f"{spec.name}.log")
    t0 = time.perf_counter()
    returncode: int | None = None
    try:
        write_json(spec_path, spec.to_dict())
        if os.path.exists(result_path):
            os.unlink(result_path)
        with open(log_path, "w", encoding="utf-8") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "mixprec.bench.worker", spec_path, result_path],
                stdout=log, stderr=subprocess.STDOUT, env=env,
            )
            returncode = _wait(proc, timeout)
        raw = _read_result(result_path)
        reason = failed_reason(returncode, log_path, timeout=timeout)
    except (OSError, OutputError) as e:  # the spec, the log or the process could not be made: still a row
        raw, reason = None, f"could not run the worker: {e}"
    result = RunResult.from_dict(raw)
    if not result.ok:
        result = dataclasses.replace(result, reason=result.reason or reason)
    result = dataclasses.replace(result, recipe=spec.recipe, repeat=spec.repeat, seed=spec.seed, returncode=returncode,
                                 process_wall_s=time.perf_counter() - t0, log=os.path.relpath(log_path, out_dir),
                                 invocation=invocation)
    with contextlib.suppress(OutputError):  # the row is in results.json either way
        write_json(result_path, result)
    return result


def worker_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """A worker's environment: this process's (or ``env``), unbuffered, with this process's ``sys.path`` first on
    ``PYTHONPATH``, so a worker imports what the caller imported."""
    child = dict(os.environ if env is None else env)
    child.setdefault("PYTHONUNBUFFERED", "1")
    paths = [os.path.abspath(p or os.curdir) for p in sys.path]
    paths = [p for p in dict.fromkeys(paths) if os.path.isdir(p)]
    child["PYTHONPATH"] = os.pathsep.join(paths + [p for p in child.get("PYTHONPATH", "").split(os.pathsep) if p])
    return child


def execute_matrix(
    specs: list[RunSpec],
    out_dir: str,
    *,
    timeout: float | None = None,
    on_done: Callable[[int, int, RunResult], None] | None = None,
    env: dict[str, str] | None = None,
    invocation: int = 1,
) -> list[RunResult]:
    """Run every spec in its own ``python -m mixprec.bench.worker``; one result per spec. ``on_done(i, n, result)``
    is called as each finishes, so an interrupted caller still has every finished result."""
    os.makedirs(os.path.join(out_dir, "runs"), exist_ok=True)
    os.makedirs(os.path.join(out_dir, "logs"), exist_ok=True)
    child_env = worker_env(env)
    results: list[RunResult] = []
    for i, spec in enumerate(specs):
        results.append(_run_one(spec, out_dir, timeout, child_env, invocation))
        if on_done is not None:
            on_done(i + 1, len(specs), results[-1])
    return results
