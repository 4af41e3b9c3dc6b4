"""Step time on a target from the traced ops: a roofline with efficiency factors.

Each op takes ``max(compute, memory, launch) + overhead``: ``compute = FLOPs / (peak[dtype] *
gemm_efficiency[dtype])`` for ops with FLOPs, ``memory = bytes moved / (bandwidth * memory_efficiency)``,
``launch`` the target's least time per op (0 on the cpu target), ``overhead`` the host time each op adds (0 on
GPUs, whose dispatch runs ahead of the kernels). Views cost nothing. The step is the sum plus the step's own host
time. On the cpu target the calls :mod:`.kernels` timed take their measured time instead.

GPU targets use fixed factors (:data:`GPU_EFFICIENCY`, not calibrated here); the cpu target uses
:data:`CPU_EFFICIENCY`, fitted by ``benchmarks/plan_vs_measured.py --calibrate`` (rerun it on another CPU).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from .kernels import KernelSpec
from .recorder import OpRecord
from .targets import Target

LOWP_DTYPES = ("bf16", "fp16", "fp8")
"""Dtype buckets (:attr:`.recorder.OpRecord.dtype`) whose GEMMs take :attr:`Efficiency.lowp_gemm_overhead_s`."""

__all__ = ["LOWP_DTYPES", "Efficiency", "GPU_EFFICIENCY", "CPU_EFFICIENCY", "StepTime", "step_time", "efficiency_for"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Efficiency:
    """How close real kernels come to the target's peaks."""

    gemm: dict[str, float]
    """Fraction of the dtype's peak FLOP/s a GEMM reaches (dtypes not listed: ``default``)."""
    memory: float
    """Fraction of the bandwidth a bandwidth-bound op reaches."""
    default: float = 0.5
    op_overhead_s: float = 0.0
    """Host time every op adds on top of its roofline time (eager dispatch; 0 on GPUs)."""
    lowp_gemm_overhead_s: float = 0.0
    """Added to ``op_overhead_s`` for a GEMM in :data:`LOWP_DTYPES` (a CPU kernel converts or reorders operands)."""
    step_overhead_s: float = 0.0
    """Host time per step outside the ops (the training loop's and the optimizer's Python)."""
    source: str = ""

    def for_dtype(self, dtype: str) -> float:
        return self.gemm.get(dtype, self.default)


GPU_EFFICIENCY = Efficiency(gemm={"fp32": 0.85, "tf32": 0.7, "bf16": 0.7, "fp16": 0.7, "fp8": 0.6}, memory=0.8,
                            source="assumed for GPUs (typical of large cuBLAS GEMMs and streaming kernels; "
                                   "not calibrated here)")
CPU_EFFICIENCY = Efficiency(gemm={"fp32": 0.816, "bf16": 0.823, "fp16": 0.823}, memory=0.754,
                            op_overhead_s=3.79e-06, lowp_gemm_overhead_s=0.0, step_overhead_s=0.000212,
                            source="fitted by benchmarks/plan_vs_measured.py --calibrate on an Intel Xeon "
                                   "(Sapphire Rapids, 2 cores, AVX512-BF16/FP16, AMX), 2026-12-02 (fp32 and "
                                   "bf16-mixed steps of SimpleNet, residual CNNs, a GRU, an MLP-Mixer, an LSTM and "
                                   "two GPTs: other families than the checked models; GEMMs, convolutions and "
                                   "attention timed on the CPU, the GEMM factors fitted on those calls)")


def efficiency_for(target: Target) -> Efficiency:
    return CPU_EFFICIENCY if target.kind == "cpu" else GPU_EFFICIENCY


@dataclasses.dataclass(frozen=True)
class StepTime:
    """Predicted time of one step and where it goes."""

    total_s: float
    gemm_s: float
    """Ops with FLOPs."""
    memory_s: float
    """Ops without FLOPs (bandwidth or launch)."""
    overhead_s: float
    """Host overhead, every op's and the step's; 0 on GPU targets."""
    ops: int
    flops_by_dtype: dict[str, int]
    timed_s: float = 0.0
    """Ops timed on this CPU (:mod:`.kernels`), their host overhead aside."""
    timed_ops: int = 0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def step_time(ops: list[OpRecord], target: Target, efficiency: Efficiency | None = None, *,
              dtype_map: dict[str, str] | None = None, kernel_times: Mapping[KernelSpec, float] | None = None,
              ) -> StepTime:
    """The roofline time of ``ops`` on ``target``. ``dtype_map`` renames a dtype's peak (``{"fp32": "tf32"}``);
    ``kernel_times``: measured seconds per :attr:`~.recorder.OpRecord.kernel`, replacing their roofline terms."""
    eff = efficiency or efficiency_for(target)
    dtype_map = dtype_map or {}
    kernel_times = kernel_times or {}
    bw = target.bandwidth * eff.memory
    gemm = mem = timed = 0.0
    flops: dict[str, int] = {}
    n = n_low_gemm = n_timed = 0
    for op in ops:
        if op.nbytes == 0 and op.flops == 0:
            continue  # views: no kernel
        if op.flops:
            dt = dtype_map.get(op.dtype, op.dtype)
            flops[dt] = flops.get(dt, 0) + op.flops
        measured = kernel_times.get(op.kernel)
        n += 1
        if measured is not None:
            timed += measured
            n_timed += 1
            continue
        t_mem = op.nbytes / bw
        if op.flops:
            n_low_gemm += op.dtype in LOWP_DTYPES
            gemm += max(op.flops / (target.peak(dt) * eff.for_dtype(dt)), t_mem, target.launch_s)
        else:
            mem += max(t_mem, target.launch_s)
    overhead = (n * eff.op_overhead_s + n_low_gemm * eff.lowp_gemm_overhead_s
                + (eff.step_overhead_s if n else 0.0))
    return StepTime(total_s=gemm + mem + overhead + timed, gemm_s=gemm, memory_s=mem, overhead_s=overhead, ops=n,
                    flops_by_dtype=flops, timed_s=timed, timed_ops=n_timed)
