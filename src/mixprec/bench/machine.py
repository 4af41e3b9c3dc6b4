"""What a bench measures about the machine before its runs, afresh at every invocation: the model's FLOPs per
step, the peak matmul rate of every dtype the recipes' matmuls run in, and the software and hardware."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy
import torch

from .. import __version__, hardware
from ..train.contract import as_batch
from .flops import StepFlops, count_step_flops
from .plan import Plan

__all__ = ["Machine", "measure_machine"]

_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclasses.dataclass(frozen=True)
class Machine:
    """What was measured before the matrix."""

    flops: StepFlops
    """Model FLOPs of one micro-batch, forward and backward."""
    peaks: dict[str, dict[str, Any]]
    """Matmul dtype -> its measured peak (:func:`mixprec.hardware.measure_matmul_peak`)."""
    env: dict[str, Any]
    """:func:`mixprec.hardware.environment` and versions."""
    prediction: dict[str, Any] | None = None
    """The plan's prediction of every recipe (:mod:`mixprec.bench.predict`); None with ``--no-plan``."""


def measure_machine(p: Plan) -> Machine:
    """Count FLOPs and measure the peaks; drops the plan's reference run afterwards."""
    ref = p.reference
    ref.train_loader.set_epoch(0)
    batch = as_batch(next(iter(ref.train_loader))).to(ref.device)  # one micro-batch; a step runs `accum`
    flops = count_step_flops(ref.model, batch, ref.objective)
    peaks = {dt: hardware.measure_matmul_peak(_DTYPES[dt], ref.device, budget_s=p.config.peak_seconds, tf32=(dt == "tf32"))
             for dt in dict.fromkeys(c.matmul_dtype for c in p.checks.values())}
    env = _environment(ref.device)
    p.reference = None  # the reference run's model and data are not needed any more
    return Machine(flops=flops, peaks=peaks, env=env)


def _environment(device: torch.device) -> dict[str, Any]:
    env = {"mixprec": __version__, **hardware.environment(device), "numpy": numpy.__version__}
    try:  # optional: only the plots need it
        import matplotlib

        env["matplotlib"] = matplotlib.__version__
    except ImportError:
        env["matplotlib"] = None
    return env
