"""One bench run — one (recipe, repeat) — in a fresh interpreter: ``python -m mixprec.bench.worker SPEC OUT``.

``SPEC`` is a JSON file ``{"recipe", "repeat", "seed", "warmup_steps", "config": TrainConfig.to_dict()}``;
the worker trains with the trainer itself (:func:`mixprec.train.build.build_run` + :func:`train`, logging
off so no ``.item()`` lands in the timed steps), then, outside the timed run, probes the measured memory
peak of one step (:func:`mixprec.bench.measure.probe_step_memory`), and writes ``OUT``::

    {"status": "ok" | "failed", "reason": str | None, "recipe", "impl", "repeat", "seed", "describe",
     "history": [...trainer's per-epoch records...], "summary": {...trainer's summary...},
     "timing": {...}, "memory_probe": {...}, "wall_s": float}

A run that raises (including out-of-memory) or stops on a non-finite loss writes ``status: "failed"``
with the reason and exits 1; a run that dies outright (signal, hard OOM kill) writes nothing, and the
parent reports the exit status instead. Either way the rest of the matrix goes on.

Test hook: when the environment variable ``MIXPREC_BENCH_TEST_CRASH`` names this run's recipe
(``fp16-mixed``, ``fp16-mixed:raise`` or ``fp16-mixed:hang``), the worker aborts the process (SIGABRT, no
output file), raises, or sleeps for an hour, before training. Only ``tests/test_bench.py`` sets it, to prove that one crashing run leaves the
other rows intact.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any

TEST_CRASH_ENV = "MIXPREC_BENCH_TEST_CRASH"


def _test_hook(recipe: str) -> None:
    want = os.environ.get(TEST_CRASH_ENV, "")
    name, _, mode = want.partition(":")
    if name and name == recipe:
        if mode == "raise":
            raise RuntimeError(f"deliberate failure ({TEST_CRASH_ENV}={want})")
        if mode == "hang":
            print(f"hanging on purpose (pid {os.getpid()}; {TEST_CRASH_ENV}={want})", flush=True)
            time.sleep(3600)
        sys.stdout.flush()
        os.abort()


def failed_result(spec: dict[str, Any], reason: str | None) -> dict[str, Any]:
    """The result of a run that produced nothing (the worker's own, or the runner's for a dead worker)."""
    return {"status": "failed", "reason": reason, "recipe": spec["recipe"], "repeat": spec["repeat"],
            "seed": spec["seed"], "impl": None, "history": [], "summary": None, "timing": None,
            "memory_probe": None}


def train_and_measure(spec: dict[str, Any]) -> dict[str, Any]:
    """Train one (recipe, repeat) and measure it; never raises for a failed run."""
    t0 = time.perf_counter()
    out = failed_result(spec, None)
    try:
        _test_hook(spec["recipe"])
        from ..train.build import build_run
        from ..train.config import TrainConfig
        from ..train.loop import train
        from ..train.report import Reporter
        from .measure import probe_step_memory, timing_from_history

        config = TrainConfig.from_dict(spec["config"])
        run = build_run(config)
        out["impl"] = run.recipe.impl
        out["describe"] = run.recipe.describe()
        result = train(run, reporter=Reporter(progress="off"))
        out["history"] = result.history
        out["summary"] = result.summary
        out["timing"] = timing_from_history(result.history, warmup_steps=spec["warmup_steps"],
                                            batch_size=config.optim.batch_size * config.optim.grad_accum)
        if result.stopped:
            out["reason"] = result.stopped
            return out
        out["status"] = "ok"
        try:  # after the results are recorded: the probe takes real steps
            run.train_loader.set_epoch(0)
            xb, yb = next(iter(run.train_loader))
            with run.recipe.run_context():
                out["memory_probe"] = probe_step_memory(run, xb, yb)
        except Exception as e:  # noqa: BLE001 -- a failed probe must not fail the run
            out["memory_probe"] = {"method": None, "reason": f"{type(e).__name__}: {e}"}
    except MemoryError:
        out["reason"] = "out of memory (MemoryError)"
    except Exception as e:  # noqa: BLE001 -- every failure becomes a row with its reason
        name = type(e).__name__
        out["reason"] = ("out of memory: " if "OutOfMemory" in name else "") + f"{name}: {e}".strip()
        traceback.print_exc()
    finally:
        out["wall_s"] = time.perf_counter() - t0
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m mixprec.bench.worker SPEC.json OUT.json", file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as f:
        spec = json.load(f)
    result = train_and_measure(spec)
    from ..jsonio import write_json  # after the run: the test hook fires before torch is imported
    write_json(argv[1], result)
    return 0 if result["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
