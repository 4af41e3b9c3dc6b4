"""One bench run in a fresh interpreter: ``python -m mixprec.bench.worker SPEC OUT``.

``SPEC`` is a :class:`~mixprec.bench.runner.RunSpec`; the worker trains with the trainer itself (logging off),
then, outside the timed run, probes one step's memory peak and (CUDA) the device's busy time per step, and writes
a :class:`~mixprec.bench.results.RunResult` to ``OUT``. A run that raises or stops on a non-finite loss writes
``status: "failed"`` and exits 1; one that dies outright writes nothing, and the parent reports its exit status.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from typing import Any

from ..jsonio import to_jsonable, write_json
from ..planning.fits import largest_batch
from ..train.build import build_run
from ..train.config import TrainConfig
from ..train.loop import train
from ..train.report import Reporter
from .measure import probe_device_busy, probe_step_memory, timing_from_history
from .results import DeviceBusy, MemoryProbe, RunResult
from .runner import RunSpec

__all__ = ["train_and_measure", "main"]


def train_and_measure(spec: RunSpec) -> RunResult:
    """Train one (recipe, repeat) and measure it; never raises for a failed run."""
    t0 = time.perf_counter()
    found: dict[str, Any] = {}  # what the run got to before it ended
    status, reason = "failed", None
    try:
        config = TrainConfig.from_dict(spec.config)
        run = build_run(config)
        found.update(impl=run.recipe.impl, describe=run.recipe.describe())
        result = train(run, reporter=Reporter(progress="off"), largest_batch=largest_batch)
        history = to_jsonable(result.history)
        found.update(history=history, summary=to_jsonable(result.summary),
                     timing=timing_from_history(history, warmup_steps=spec.warmup_steps,
                                                batch_size=config.optim.batch_size * config.optim.grad_accum))
        if result.stopped:
            reason = result.stopped
        else:
            status = "ok"
            found["memory_probe"] = _probe(run)
            found["device_busy"] = _busy(run, config.optim.grad_accum)
    except MemoryError:
        reason = "out of memory (MemoryError)"
    except Exception as e:  # noqa: BLE001 -- every failure becomes a row with its reason
        name = type(e).__name__
        reason = ("out of memory: " if "OutOfMemory" in name else "") + f"{name}: {e}".strip()
        traceback.print_exc()
    return RunResult(status=status, reason=reason, recipe=spec.recipe, repeat=spec.repeat, seed=spec.seed,
                     wall_s=time.perf_counter() - t0, **found)


def _probe(run) -> MemoryProbe:
    """The measured step peak, after the results are recorded (the probe takes real steps); a failed probe
    is a reason in the probe, not a failed run."""
    try:
        run.train_loader.set_epoch(0)
        batch = next(iter(run.train_loader))
        with run.recipe.run_context():
            return probe_step_memory(run, batch)
    except Exception as e:  # noqa: BLE001
        return MemoryProbe(reason=f"{type(e).__name__}: {e}")


def _busy(run, accum: int) -> DeviceBusy:
    """The device's busy time per step, after the memory probe; a failed probe is a reason, not a failed run."""
    try:
        with run.recipe.run_context():
            return probe_device_busy(run, accum=accum)
    except Exception as e:  # noqa: BLE001
        return DeviceBusy(reason=f"{type(e).__name__}: {e}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m mixprec.bench.worker SPEC.json OUT.json", file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as f:
        spec = RunSpec.from_dict(json.load(f))
    result = train_and_measure(spec)
    write_json(argv[1], result)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
