"""The plan's prediction beside the measurement: every bench checks ``mixprec plan``.

Before the matrix, bench plans its recipes (:class:`mixprec.planning.api.Planner`, same config and batch as the
runs) for the device the runs use -- a CPU with the peaks bench just measured, a GPU by its table entry -- and
the report shows the predicted step peak and step time beside the measured ones (measured / predicted). The
planner runs the user's model, so it runs in its own process (``python -m mixprec.bench.predict SPEC OUT``) with
a time limit, writing its result after every recipe: a model that cannot be traced costs the predictions from
that recipe on, never the bench.

Compared: the probe's step peak (what one step adds above the resident state, :mod:`.measure`) with the plan's
peak less :data:`RESIDENT` and the batch; the median step with the roofline time, ``--grad-accum K`` counted as
K forward+backward passes and one optimizer phase.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from typing import Any

from ..errors import OutputError, UsageError, one_line
from ..jsonio import write_json
from .results import Prediction

__all__ = ["predict", "PREDICT_TIMEOUT_S", "main", "target_spec"]

PREDICT_TIMEOUT_S = 300.0
"""The planner's time limit when the bench has no ``--timeout`` (the bench's own limit otherwise)."""

RESIDENT = ("parameters", "buffers", "optimizer_state", "master_weights")
"""Categories that exist before a step (the probe's baseline holds them)."""


def target_spec(device_type: str, device_name: str, peaks: dict[str, dict[str, Any]]) -> tuple[Any, str | None]:
    """What the planner plans for: ``{"cpu": peak FLOP/s per dtype}``, a GPU table name, or None and why not."""
    if device_type == "cpu":
        rates = {k: float(v["flops_per_s"]) for k, v in peaks.items()
                 if k in ("fp32", "bf16", "fp16") and isinstance(v, dict) and v.get("flops_per_s")}
        return ({"cpu": rates}, None) if "fp32" in rates else (None, "no fp32 peak was measured")
    if device_type == "cuda":
        from ..planning.targets import target_for_gpu

        t = target_for_gpu(device_name)
        if t is None:
            return None, (f"mixprec plan has no table entry for {device_name} (it knows a100-80gb, h100-sxm, "
                          "h200, b200, rtx3090, rtx4090, l4)")
        return t.name, None
    return None, f"mixprec plan has no target for a {device_type} device"


def predict(p, machine, *, say=print) -> dict[str, Any] | None:
    """Plan every recipe of bench plan ``p`` in a subprocess: results.json's ``prediction`` (None: ``--no-plan``)."""
    if not p.config.predict:
        return None
    t0 = time.perf_counter()
    env = machine.env
    target, why = target_spec(str(env.get("device", "cpu")).split(":")[0], str(env.get("device_name", "")),
                              machine.peaks)
    doc: dict[str, Any] = {"target": None, "recipes": {}}
    if target is not None:
        doc = _run(p, target)
    doc["seconds"] = time.perf_counter() - t0
    recipes = doc.setdefault("recipes", {})
    for name in p.recipes:
        if name not in recipes:
            recipes[name] = {"reason": why or doc.get("died") or "not planned"}
    got = [n for n in p.recipes if "step_time_s" in recipes[n]]
    if got:
        say(f"plan ({doc.get('target_name')}, {doc['seconds']:.1f} s): predicted step peak / step time: " + ", ".join(
            f"{n} {_bytes(recipes[n]['step_peak_bytes'])} / {_seconds(recipes[n]['step_time_s'])}" for n in got))
    missing = [n for n in p.recipes if n not in got]
    if missing:
        reasons = dict.fromkeys(recipes[n]["reason"] for n in missing)
        say(f"plan: no prediction for {', '.join(missing)}: " + "; ".join(reasons))
    return doc


def predictions(doc: dict[str, Any] | None) -> dict[str, Prediction]:
    """Each recipe's :class:`Prediction` from the ``prediction`` section (ratios not set yet)."""
    if not isinstance(doc, dict):
        return {}
    out = {}
    for name, r in (doc.get("recipes") or {}).items():
        r = r if isinstance(r, dict) else {}
        if "step_time_s" not in r:
            out[name] = Prediction(target=doc.get("target_name"), reason=r.get("reason") or "not planned")
        else:
            out[name] = Prediction(target=doc.get("target_name"), peak_bytes=r.get("peak_bytes"),
                                   step_peak_bytes=r.get("step_peak_bytes"), step_time_s=r.get("bench_step_time_s"),
                                   peak_compared_with="measured_step_peak_bytes")
    return out


def _bytes(n: Any) -> str:
    from ..train.report import format_bytes

    return format_bytes(n) if isinstance(n, (int, float)) else "?"


def _seconds(s: Any) -> str:
    if not isinstance(s, (int, float)):
        return "?"
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


def _run(p, target) -> dict[str, Any]:
    from .runner import _wait, failed_reason

    runs, logs = os.path.join(p.out_dir, "runs"), os.path.join(p.out_dir, "logs")
    spec_path, out_path, log_path = (os.path.join(runs, "plan.spec.json"), os.path.join(runs, "plan.json"),
                                     os.path.join(logs, "plan.log"))
    timeout = p.config.timeout or PREDICT_TIMEOUT_S
    returncode = None
    try:
        os.makedirs(runs, exist_ok=True)
        os.makedirs(logs, exist_ok=True)
        write_json(spec_path, {"config": p.base.to_dict(), "precisions": list(p.recipes), "target": target})
        with contextlib.suppress(FileNotFoundError):
            os.unlink(out_path)
        from .runner import worker_env

        env = worker_env()
        with open(log_path, "w", encoding="utf-8") as log:
            proc = subprocess.Popen([sys.executable, "-m", "mixprec.bench.predict", spec_path, out_path],
                                    stdout=log, stderr=subprocess.STDOUT, env=env)
            returncode = _wait(proc, timeout)
    except (OSError, OutputError) as e:
        return {"recipes": {}, "died": f"the planner could not be run: {e}"}
    try:
        with open(out_path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError):
        doc = {}
    doc = doc if isinstance(doc, dict) else {}
    if returncode != 0 or not doc.get("done"):
        doc["died"] = (f"the planner's process ({os.path.relpath(log_path, p.out_dir)}) ended while planning "
                       f"{doc.get('planning', 'its first recipe')}: "
                       + failed_reason(returncode, log_path, timeout=timeout).replace(" (--timeout)", ""))
    return doc


# ------------------------------------------------------------------------------------- the planner's process

def _target(spec: Any):
    from ..planning.targets import cpu_target, get_target

    if isinstance(spec, dict) and "cpu" in spec:
        return cpu_target(spec["cpu"], source="this machine: the bench's peak matmul rates, measured in this "
                                              "invocation, a 256 MiB copy, /proc/meminfo MemTotal")
    return get_target(spec)


def _recipe_doc(planner, name: str, accum: int) -> dict[str, Any]:
    from ..precision import LAYERS_SUFFIX, resolve_recipe

    tr, notes, tf32 = planner.trace(name if name.endswith(LAYERS_SUFFIX) else resolve_recipe(name).name)
    rp = planner.recipe_plan(tr, tf32=tf32, notes=notes)
    resident = sum(rp.at_peak.get(c, 0) for c in RESIDENT) + _batch_bytes(planner.batch)
    doc = rp.to_dict()
    dtype_map = {"fp32": "tf32"} if tf32 and "tf32" in planner.target.peak_flops else {}
    if accum > 1:  # K forward+backward passes, one optimizer phase
        passes = planner.step_time([o for o in tr.ops if o.phase in ("forward", "backward")],
                                   dtype_map=dtype_map).total_s
        rest = planner.step_time([o for o in tr.ops if o.phase not in ("forward", "backward")],
                                 dtype_map=dtype_map).total_s
        doc["bench_step_time_s"] = accum * passes + rest
    else:
        doc["bench_step_time_s"] = rp.step_time_s
    doc["step_peak_bytes"] = max(0, rp.peak_bytes - resident)
    return doc


def _batch_bytes(batch) -> int:
    import torch

    tensors = [*batch.args, *batch.kwargs.values(), batch.targets]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def run_planner(spec: dict[str, Any], out_path: str) -> None:
    """Plan each recipe of ``spec`` in turn, writing ``out_path`` after each."""
    from ..planning.api import Planner
    from ..planning.roofline import efficiency_for
    from ..train.config import TrainConfig

    config = TrainConfig.from_dict(spec["config"])
    doc: dict[str, Any] = {"recipes": {}, "done": False}
    try:
        target = _target(spec["target"])
        doc.update(target_name=target.name, target=target.to_dict(), efficiency=efficiency_for(target).source)
        write_json(out_path, doc)
        planner = Planner(config=config, target=target, fallback_real=True)  # bench builds the model anyway
    except Exception as e:  # noqa: BLE001 -- every recipe then says why
        doc["died"] = f"the planner could not start: {one_line(e)}"
        doc["done"] = True
        write_json(out_path, doc)
        return
    for name in spec["precisions"]:
        doc["planning"] = name
        write_json(out_path, doc)
        try:
            doc["recipes"][name] = _recipe_doc(planner, name, config.optim.grad_accum)
        except UsageError as e:  # TraceError: the model does what fake tensors cannot; the contract's errors
            doc["recipes"][name] = {"reason": str(e).split("; plan with --fallback-real")[0].splitlines()[0][:300]}
        except Exception as e:  # noqa: BLE001
            doc["recipes"][name] = {"reason": f"the planner failed: {one_line(e)}"}
    doc.pop("planning", None)
    doc["done"] = True
    write_json(out_path, doc)


def _exit_with_parent(poll_s: float = 1.0) -> None:
    """End this process when the bench that started it is gone (a SIGKILLed bench cannot stop it)."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="mixprec-parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m mixprec.bench.predict SPEC.json OUT.json", file=sys.stderr)
        return 2
    _exit_with_parent()
    with open(argv[0], encoding="utf-8") as f:
        run_planner(json.load(f), argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
