"""Run the (recipe, repeat) matrix, one fresh subprocess per run, one at a time.

Each run gets its own interpreter (:mod:`mixprec.bench.worker`): memory peaks start clean, and no kernel
cache, allocator pool or thread pool warmed by one recipe speeds up the next. Runs go repeat-major
(``fp32 s0, amp s0, bf16 s0, fp32 s1, ...``) so that slow drifts of a shared machine hit every recipe
alike. Repeat ``r`` uses seed ``seed + r`` for every recipe: the same initial weights and data order
across recipes, different ones across repeats.

A worker that exits without a result file (killed by a signal, out of memory, a crash in native code) or
runs past ``timeout`` becomes a failed row whose reason names the exit status and quotes the last line of
its log (``OUT/logs/RECIPE-rN.log``); the rest of the matrix still runs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from .worker import failed_result

__all__ = ["RunSpec", "execute_matrix", "failed_reason"]


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


def execute_matrix(
    specs: list[RunSpec],
    out_dir: str,
    *,
    timeout: float | None = None,
    on_done: Callable[[int, int, dict[str, Any]], None] | None = None,
    env: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Run every spec in its own ``python -m mixprec.bench.worker``; returns one result dict per spec."""
    runs_dir = os.path.join(out_dir, "runs")
    logs_dir = os.path.join(out_dir, "logs")
    os.makedirs(runs_dir, exist_ok=True)
    os.makedirs(logs_dir, exist_ok=True)
    child_env = dict(os.environ if env is None else env)
    child_env.setdefault("PYTHONUNBUFFERED", "1")
    results: list[dict[str, Any]] = []
    for i, spec in enumerate(specs):
        spec_path = os.path.join(runs_dir, f"{spec.name}.spec.json")
        result_path = os.path.join(runs_dir, f"{spec.name}.json")
        log_path = os.path.join(logs_dir, f"{spec.name}.log")
        with open(spec_path, "w", encoding="utf-8") as f:
            json.dump(spec.to_dict(), f, indent=2)
        if os.path.exists(result_path):
            os.unlink(result_path)
        t0 = time.perf_counter()
        returncode: int | None
        with open(log_path, "w", encoding="utf-8") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "mixprec.bench.worker", spec_path, result_path],
                stdout=log, stderr=subprocess.STDOUT, env=child_env,
            )
            try:
                returncode = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                returncode = None
        wall = time.perf_counter() - t0
        result = None
        if os.path.exists(result_path):
            try:
                with open(result_path, encoding="utf-8") as f:
                    result = json.load(f)
            except (OSError, ValueError):
                result = None
        if result is None:
            result = failed_result(spec.to_dict(), failed_reason(returncode, log_path, timeout=timeout))
        result["returncode"] = returncode
        result["process_wall_s"] = wall
        result["log"] = os.path.relpath(log_path, out_dir)
        results.append(result)
        if on_done is not None:
            on_done(i + 1, len(specs), result)
    return results
