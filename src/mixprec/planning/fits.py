"""The largest batch that fits a built run's model, recipe and device, as the out-of-memory stop asks it
(:mod:`mixprec.train.oom`): one step traced under fake tensors, with a time limit."""

from __future__ import annotations

import dataclasses
import threading
from typing import TYPE_CHECKING, Any

import torch

from .. import hardware
from ..errors import one_line

if TYPE_CHECKING:
    from ..train.build import Run

__all__ = ["largest_batch", "PLAN_BUDGET_S"]

PLAN_BUDGET_S = 5.0
"""How long the stop waits for the planner's largest batch; past it the line says what to try without one."""


def largest_batch(run, budget_s: float = PLAN_BUDGET_S) -> int | str:
    """The planner's largest batch for the run's model, recipe and device, or why there is none (the planner
    failed, or gave no answer within ``budget_s``: it runs in a daemon thread that is left behind)."""
    result: dict[str, Any] = {}

    def plan() -> None:
        try:
            result["fits"] = _plan_largest(run)
        except Exception as e:  # noqa: BLE001 -- no answer is an answer: the line says what to try
            result["why"] = one_line(e, limit=120)

    worker = threading.Thread(target=plan, name="mixprec-oom-plan", daemon=True)
    worker.start()
    worker.join(budget_s)
    if "fits" in result:
        return result["fits"]
    return result.get("why", f"no answer within {budget_s:g} s")


def _plan_largest(run: Run) -> int:
    from .api import Planner, _max_batch

    target = _target(run.device)
    planner = Planner(config=run.config, target=target, data=run.data)
    trace, _, _ = planner.trace(run.recipe.name)
    return _max_batch(trace, target.memory_bytes)


def _target(device: torch.device):
    """The planner's target for the device this run trains on: its whole memory (the table's figures for a
    GPU the planner knows, else neutral rates: only the memory is asked)."""
    from .targets import Target, _mem_total, target_for_gpu

    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        known = target_for_gpu(torch.cuda.get_device_name(device))
        if known is not None:
            return dataclasses.replace(known, memory_bytes=total)
        rates = {k: 1.0 for k in ("fp32", "tf32", "bf16", "fp16")}
        if hardware.has_fp8_matmul(device):
            rates["fp8"] = 1.0
        return Target(name=str(device), description=hardware.device_name(device), kind="cuda", memory_bytes=total,
                      peak_flops=rates, bandwidth=1.0, source="this GPU's memory (rates not used)")
    return Target(name="cpu", description=hardware.device_name(device), kind="cpu", memory_bytes=_mem_total(),
                  peak_flops={"fp32": 1.0}, bandwidth=1.0, launch_s=0.0, source="MemTotal (rates not used)")

