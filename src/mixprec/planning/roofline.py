"""Step time on a target from the traced ops: a roofline with efficiency factors.

Each op of the traced step takes ``max(compute, memory, launch) + overhead``: ``compute = FLOPs / (peak[dtype] *
gemm_efficiency[dtype])`` for the ops with FLOPs (matmuls, convolutions, attention: the GEMMs), at the peak
of the dtype they run in (:class:`~.targets.Target`); ``memory = bytes moved / (bandwidth *
memory_efficiency)`` for every op (elementwise ops, norms, casts, the optimizer's update are bandwidth-bound);
``launch`` is the target's least time per op (a GPU's kernel launch; 0 on the cpu target), and ``overhead``
the host time each op adds before its kernel (:attr:`Efficiency.op_overhead_s`, plus ``lowp_gemm_overhead_s``
for a GEMM in bf16/fp16/fp8: eager dispatch, which a CPU pays in line and a GPU hides behind its queue, so 0
there). View ops cost nothing. The step time is the sum (eager PyTorch runs one op after another) plus the step's own
host time (:attr:`Efficiency.step_overhead_s`; 0 on GPU targets). On the cpu target an op the roofline cannot
price there (the small GEMMs, convolutions and attention of the models a CPU trains: :mod:`.kernels`) takes
the time it was measured to take on this CPU instead, plus its host overhead.

The efficiency factors say how close real kernels come to the datasheet. **GPU targets** use fixed factors
(:data:`GPU_EFFICIENCY`): large cuBLAS GEMMs reach about 70% of the dense tensor-core peak in bf16/fp16 and
somewhat less in FP8, and streaming kernels about 80% of the bandwidth -- figures that vary with shapes and
are not calibrated here (no GPU). **The cpu target** uses :data:`CPU_EFFICIENCY`, fitted by
``benchmarks/plan_vs_measured.py --calibrate``: it measures real step times of calibration models (SimpleNet,
residual CNNs, a GRU, an MLP-Mixer, an LSTM, two GPTs; fp32 and bf16-mixed), traces the same steps, times their
GEMM, convolution and attention calls as the plan does, and solves for what is left -- the bandwidth factor of
the other ops, the host time every op adds (eager dispatch, autograd's bookkeeping) and the step's own (the
loop's Python) -- by non-negative least squares of the relative errors; the GEMM factors (for the calls too
large to time) are fitted on the timed calls. The models it checks the plan on are other families. On another
CPU rerun the calibration.
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
    """Host time every op adds on top of its roofline time: eager dispatch (Python, the dispatcher, autograd's
    bookkeeping) runs before each CPU kernel, so on a CPU it adds up; a GPU's kernels run asynchronously behind
    it (0: the target's ``launch_s`` floor stands for it there)."""
    lowp_gemm_overhead_s: float = 0.0
    """Added to ``op_overhead_s`` for an op with FLOPs (a GEMM: matmul, convolution) computing in bf16/fp16/fp8:
    on a CPU such a kernel call also converts or reorders its operands (oneDNN), a fixed cost per call that
    small GEMMs feel (``torch.profiler``: a bf16 ``mm`` at the user transformer's shapes takes longer than
    the fp32 one); a low-precision elementwise op or cast shows no such cost."""
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
    """Ops with FLOPs (at their compute, memory or launch bound, whichever is larger)."""
    memory_s: float
    """Ops without FLOPs (bandwidth or launch)."""
    overhead_s: float
    """Host overhead: every op's (:attr:`Efficiency.op_overhead_s`, ``lowp_gemm_overhead_s``) and the step's
    (``step_overhead_s``); 0 on GPU targets."""
    ops: int
    flops_by_dtype: dict[str, int]
    timed_s: float = 0.0
    """Ops timed for real on this CPU instead of their roofline terms (:mod:`.kernels`; the cpu target only):
    the calls themselves; the host overhead of a step's op around its call is in ``overhead_s``."""
    timed_ops: int = 0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def step_time(ops: list[OpRecord], target: Target, efficiency: Efficiency | None = None, *,
              dtype_map: dict[str, str] | None = None, kernel_times: Mapping[KernelSpec, float] | None = None,
              ) -> StepTime:
    """The roofline time of ``ops`` on ``target`` (see the module docstring). ``dtype_map`` renames a
    dtype's peak (the tf32 recipe's fp32 GEMMs run at the ``tf32`` peak where the target has TF32);
    ``kernel_times``: measured seconds of the ops whose :attr:`~.recorder.OpRecord.kernel` it holds
    (:class:`.kernels.KernelTimes`), which then replace their roofline terms (and the low-precision GEMM
    overhead, which the measured call includes)."""
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
