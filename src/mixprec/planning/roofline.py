"""Step time on a target from the traced ops: a roofline with efficiency factors.

Each op of the traced step takes ``max(compute, memory, launch) + overhead``: ``compute = FLOPs / (peak[dtype] *
gemm_efficiency[dtype])`` for the ops with FLOPs (matmuls, convolutions, attention: the GEMMs), at the peak
of the dtype they run in (:class:`~.targets.Target`); ``memory = bytes moved / (bandwidth *
memory_efficiency)`` for every op (elementwise ops, norms, casts, the optimizer's update are bandwidth-bound);
``launch`` is the target's least time per op (a GPU's kernel launch; 0 on the cpu target), and ``overhead``
the host time each op adds before its kernel (:attr:`Efficiency.op_overhead_s`, ``lowp_op_overhead_s`` for
bf16/fp16/fp8 ops: eager dispatch, which a CPU pays in line and a GPU hides behind its queue, so 0 there).
View ops cost nothing. The step time is the sum (eager PyTorch runs one op after another) plus the step's own
host time (:attr:`Efficiency.step_overhead_s`; 0 on GPU targets).

The efficiency factors say how close real kernels come to the datasheet. **GPU targets** use fixed factors
(:data:`GPU_EFFICIENCY`): large cuBLAS GEMMs reach about 70% of the dense tensor-core peak in bf16/fp16 and
somewhat less in FP8, and streaming kernels about 80% of the bandwidth -- figures that vary with shapes and
are not calibrated here (no GPU). **The cpu target** uses :data:`CPU_EFFICIENCY`, fitted by ``benchmarks/plan_vs_measured.py --calibrate``:
it measures real step times of calibration models (SimpleNet, residual CNNs, a GRU, an MLP-Mixer, an LSTM,
two GPTs; fp32 and bf16-mixed), traces the same steps, and solves for the factors by non-negative least
squares of the relative errors. The models it checks the plan on are other families. On a CPU the host time
counts as much as the kernels on small steps: every op adds a dispatch cost (more for a low-precision op,
whose kernel converts or reorders its operands) and every step the loop's own Python. The fitted bandwidth
factor is above 1 (small operands stay in cache, faster than the streaming copy that measures the
bandwidth). On another CPU rerun the calibration.
"""

from __future__ import annotations

import dataclasses

from .recorder import OpRecord
from .targets import Target

LOWP_DTYPES = ("bf16", "fp16", "fp8")
"""Dtype buckets (:attr:`.recorder.OpRecord.dtype`) whose ops take :attr:`Efficiency.lowp_op_overhead_s`."""

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
    lowp_op_overhead_s: float | None = None
    """The same for ops computing in bf16/fp16/fp8 (None: ``op_overhead_s``): on a CPU a low-precision kernel
    call also converts or reorders its operands (oneDNN), a fixed cost per call that small GEMMs feel."""
    step_overhead_s: float = 0.0
    """Host time per step outside the ops (the training loop's and the optimizer's Python)."""
    source: str = ""

    def for_dtype(self, dtype: str) -> float:
        return self.gemm.get(dtype, self.default)


GPU_EFFICIENCY = Efficiency(gemm={"fp32": 0.85, "tf32": 0.7, "bf16": 0.7, "fp16": 0.7, "fp8": 0.6}, memory=0.8,
                            source="assumed for GPUs (typical of large cuBLAS GEMMs and streaming kernels; "
                                   "not calibrated here)")
CPU_EFFICIENCY = Efficiency(gemm={"fp32": 0.575, "bf16": 0.296, "fp16": 0.296}, memory=1.35,
                            op_overhead_s=1.33e-05, lowp_op_overhead_s=2.73e-05, step_overhead_s=0.00079,
                            source="fitted by benchmarks/plan_vs_measured.py --calibrate on an Intel Xeon "
                                   "(Sapphire Rapids, 2 cores, AVX512-BF16/FP16, AMX), 2026-12-02 (fp32 and "
                                   "bf16-mixed steps of SimpleNet, residual CNNs, a GRU, an MLP-Mixer, an LSTM and "
                                   "two GPTs: other families than the checked models)")


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
    """Host overhead: every op's (:attr:`Efficiency.op_overhead_s`, ``lowp_op_overhead_s``) and the step's
    (``step_overhead_s``); 0 on GPU targets."""
    ops: int
    flops_by_dtype: dict[str, int]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def step_time(ops: list[OpRecord], target: Target, efficiency: Efficiency | None = None, *,
              dtype_map: dict[str, str] | None = None) -> StepTime:
    """The roofline time of ``ops`` on ``target`` (see the module docstring). ``dtype_map`` renames a
    dtype's peak (the tf32 recipe's fp32 GEMMs run at the ``tf32`` peak where the target has TF32)."""
    eff = efficiency or efficiency_for(target)
    dtype_map = dtype_map or {}
    bw = target.bandwidth * eff.memory
    gemm = mem = 0.0
    flops: dict[str, int] = {}
    n = n_low = 0
    for op in ops:
        if op.nbytes == 0 and op.flops == 0:
            continue  # views: no kernel
        n += 1
        n_low += op.dtype in LOWP_DTYPES
        t_mem = op.nbytes / bw
        if op.flops:
            dt = dtype_map.get(op.dtype, op.dtype)
            flops[dt] = flops.get(dt, 0) + op.flops
            gemm += max(op.flops / (target.peak(dt) * eff.for_dtype(dt)), t_mem, target.launch_s)
        else:
            mem += max(t_mem, target.launch_s)
    lowp = eff.op_overhead_s if eff.lowp_op_overhead_s is None else eff.lowp_op_overhead_s
    overhead = (n - n_low) * eff.op_overhead_s + n_low * lowp + (eff.step_overhead_s if n else 0.0)
    return StepTime(total_s=gemm + mem + overhead, gemm_s=gemm, memory_s=mem, overhead_s=overhead, ops=n,
                    flops_by_dtype=flops)
