"""Run the (recipe, repeat) matrix, one fresh subprocess per run, one at a time.

Each run gets its own interpreter (:mod:`mixprec.bench.worker`): memory peaks start clean, and no kernel
cache, allocator pool or thread pool warmed by one recipe speeds up the next. Runs go repeat-major
(``fp32 s0, amp s0, bf16 s0, fp32 s1, ...``) so that slow drifts of a shared machine hit every recipe
alike. Repeat ``r`` uses seed ``seed + r`` for every recipe: the same initial weights and data order
across recipes, different ones across repeats.

A worker that exits without a result file (killed by a signal, out of memory, a crash in native code),
writes something that is not a result, cannot be started, or runs past ``timeout`` becomes a failed row
whose reason names the exit status and quotes the last line of its log (``OUT/logs/RECIPE-rN.log``); the
rest of the matrix still runs. Every finished run's result stays in ``OUT/runs/RECIPE-rN.json``.

**Stopping.** No worker outlives the matrix. When bench is interrupted (SIGINT, or SIGTERM while inside
:func:`stop_on_signals`, which raises :class:`Stopped`) or anything else escapes while a worker runs, the
worker gets the same signal, ``STOP_GRACE_S`` seconds to exit, then SIGKILL, and is waited for; then the
interrupt goes on up to the caller, which still has every finished run (its ``on_done`` saw each one).
The first signal switches SIGINT/SIGTERM to "ignore" until :func:`stop_on_signals` exits, so a second
Ctrl-C cannot cut that bounded clean-up short and orphan the worker.
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

from .worker import failed_result

__all__ = ["RunSpec", "execute_matrix", "failed_reason", "Stopped", "stop_on_signals", "STOP_GRACE_S"]

STOP_GRACE_S = 10.0
"""Seconds a worker gets to exit after the forwarded signal, before SIGKILL."""


class Stopped(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived (raised by the handler :func:`stop_on_signals` installs).

    A KeyboardInterrupt, so code that handles Ctrl-C handles SIGTERM alike; ``signum`` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def signal_of(e: BaseException) -> signal.Signals:
    """The signal an interrupt stands for: ``Stopped.signum``, else SIGINT (Python's own Ctrl-C)."""
    return signal.Signals(getattr(e, "signum", signal.SIGINT))


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """While inside, SIGINT and SIGTERM raise :class:`Stopped` — once; later ones are ignored until the
    block exits, so the clean-up the first one starts runs to its end. Outside the main thread (where
    Python cannot install handlers) it does nothing."""
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


@dataclasses.dataclass(frozen=True)
class RunSpec:
    recipe: str
    repeat: int
    seed: int
    config: dict[str, Any]
    warmup_steps: int

    @property
    def name(self) -> str:
        return f"{self.recipe}-r{self.repeat}"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


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
    """Send ``sig`` (None: straight to SIGKILL), wait up to STOP_GRACE_S, then SIGKILL; always reaped."""
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


def _run_one(spec: RunSpec, out_dir: str, timeout: float | None, env: dict[str, str]) -> dict[str, Any]:
    """Run one worker to its end; its result, or a failed row saying why there is none."""
    spec_path = os.path.join(out_dir, "runs", f"{spec.name}.spec.json")
    result_path = os.path.join(out_dir, "runs", f"{spec.name}.json")
    log_path = os.path.join(out_dir, "logs", f"{spec.name}.log")
    t0 = time.perf_counter()
    returncode: int | None = None
    try:
        with open(spec_path, "w", encoding="utf-8") as f:
            json.dump(spec.to_dict(), f, indent=2)
        if os.path.exists(result_path):
            os.unlink(result_path)
        with open(log_path, "w", encoding="utf-8") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "mixprec.bench.worker", spec_path, result_path],
                stdout=log, stderr=subprocess.STDOUT, env=env,
            )
            returncode = _wait(proc, timeout)
        result = _read_result(result_path)
        reason = failed_reason(returncode, log_path, timeout=timeout)
    except OSError as e:  # the spec, the log or the process could not be made: still a row
        result, reason = None, f"could not run the worker: {e}"
    base = failed_result(spec.to_dict(), reason)
    result = base if result is None else {**base, "reason": None, **result}
    if result.get("status") != "ok":
        result["status"] = "failed"
        result["reason"] = result.get("reason") or reason
    result.update(recipe=spec.recipe, repeat=spec.repeat, seed=spec.seed, returncode=returncode,
                  process_wall_s=time.perf_counter() - t0, log=os.path.relpath(log_path, out_dir))
    return result


def execute_matrix(
    specs: list[RunSpec],
    out_dir: str,
    *,
    timeout: float | None = None,
    on_done: Callable[[int, int, dict[str, Any]], None] | None = None,
    env: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Run every spec in its own ``python -m mixprec.bench.worker``; returns one result dict per spec.

    ``on_done(i, n, result)`` is called as each run finishes, so a caller that is interrupted (the
    KeyboardInterrupt or :class:`Stopped` propagates, after the running worker is stopped) still has
    every finished result.
    """
    os.makedirs(os.path.join(out_dir, "runs"), exist_ok=True)
    os.makedirs(os.path.join(out_dir, "logs"), exist_ok=True)
    child_env = dict(os.environ if env is None else env)
    child_env.setdefault("PYTHONUNBUFFERED", "1")
    results: list[dict[str, Any]] = []
    for i, spec in enumerate(specs):
        results.append(_run_one(spec, out_dir, timeout, child_env))
        if on_done is not None:
            on_done(i + 1, len(specs), results[-1])
    return results
