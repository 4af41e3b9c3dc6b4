"""Step time on a target from the traced ops: a roofline with efficiency factors, and on GPUs the host's side.

Each op's device time is ``max(compute, memory, launch)``: ``compute = FLOPs / (peak[dtype] * efficiency)`` for
ops with FLOPs, ``memory = bytes moved / (bandwidth * memory_efficiency)``, ``launch`` the target's least time per
op. Views cost nothing.

cpu target: the step is the sum of the ops' times plus host overhead per op and per step, fitted by
``benchmarks/plan_vs_measured.py --calibrate`` (:data:`CPU_EFFICIENCY`); the calls :mod:`.kernels` timed take
their measured time.

GPU targets: the host dispatches the ops (:class:`HostCost`: per op an eager run dispatches, per module call)
while the GPU runs them in order, each kernel starting once issued and once the one before it ended; at each
host read of the step (:attr:`.trace.StepTrace.syncs`) the host waits for the GPU. The step is the steady-state
period of that queue: about ``max(host, device)`` between reads, their sum where a read separates them.
torchao's eager layers cost :attr:`HostCost.torchao_layer_s` each in place of their ops' dispatch; a compiled step
(:attr:`Execution.compiled`) fuses each run of bandwidth-bound ops between GEMMs into one kernel moving its
largest op's bytes, launched without per-op or per-module dispatch. benchmarks/README.md ("GPU step time") has
the fit and how well it holds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from .kernels import KernelSpec
from .recorder import OpRecord
from .targets import Target

LOWP_DTYPES = ("bf16", "fp16", "fp8")
"""Dtype buckets (:attr:`.recorder.OpRecord.dtype`) whose GEMMs take :attr:`Efficiency.lowp_gemm_overhead_s`."""

__all__ = ["LOWP_DTYPES", "Efficiency", "GPU_EFFICIENCY", "CPU_EFFICIENCY", "HostCost", "GPU_HOST", "Execution",
           "StepTime", "step_time", "efficiency_for"]


OP_HOST_S = 13.2e-6
"""Fitted: host time per op of an eager GPU step (:class:`HostCost`)."""
MODULE_HOST_S = 133e-6
"""Fitted: host time per ``nn.Module`` call of an eager GPU step."""
TORCHAO_LAYER_S = 3.13e-3
"""Fitted: host time per torchao low-precision layer per eager step."""
FIT_SOURCE = ("fitted by benchmarks/gpu_step_time.py --fit on the H200 runs demo_cnn and mlp_lowp "
              "(benchmarks/h200-2026-12-04; torch 2.11, eager), checked on bench_tf")


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

    def on(self, target: Target, dtype: str) -> float:
        """The fraction of ``dtype``'s peak a GEMM reaches on ``target``, capped at what a large GEMM reaches on the
        board (:attr:`.targets.Target.measured_flops`)."""
        e = self.for_dtype(dtype)
        measured = target.measured_flops.get(dtype)
        return min(e, measured / target.peak(dtype)) if measured else e


GPU_EFFICIENCY = Efficiency(gemm={"fp32": 0.85, "tf32": 0.7, "bf16": 0.7, "fp16": 0.7, "fp8": 0.6}, memory=0.8,
                            source="assumed for GPUs (typical of large cuBLAS GEMMs and streaming kernels; not "
                                   "calibrated here), capped at the board's measured GEMM rate where known")
CPU_EFFICIENCY = Efficiency(gemm={"fp32": 0.816, "bf16": 0.823, "fp16": 0.823}, memory=0.754,
                            op_overhead_s=3.79e-06, lowp_gemm_overhead_s=0.0, step_overhead_s=0.000212,
                            source="fitted by benchmarks/plan_vs_measured.py --calibrate on an Intel Xeon "
                                   "(Sapphire Rapids, 2 cores, AVX512-BF16/FP16, AMX), 2026-12-02 (fp32 and "
                                   "bf16-mixed steps of SimpleNet, residual CNNs, a GRU, an MLP-Mixer, an LSTM and "
                                   "two GPTs: other families than the checked models; GEMMs, convolutions and "
                                   "attention timed on the CPU, the GEMM factors fitted on those calls)")


def efficiency_for(target: Target) -> Efficiency:
    return CPU_EFFICIENCY if target.kind == "cpu" else GPU_EFFICIENCY


@dataclasses.dataclass(frozen=True, kw_only=True)
class HostCost:
    """The host's side of a step on a GPU target."""

    op_s: float
    """Per op an eager run dispatches, views included: the dispatcher, autograd's bookkeeping and the kernel's
    launch, not one of which a view skips."""
    module_s: float
    """Per ``nn.Module`` call: Python's call machinery and the module's own Python around its ops."""
    torchao_layer_s: float
    """Per torchao low-precision layer per eager step, in place of its ops' ``op_s``: its tensor subclass
    dispatches every op in Python."""
    source: str = ""


GPU_HOST = HostCost(op_s=OP_HOST_S, module_s=MODULE_HOST_S, torchao_layer_s=TORCHAO_LAYER_S, source=FIT_SOURCE)


@dataclasses.dataclass(frozen=True)
class Execution:
    """How a GPU step runs, beyond its ops."""

    syncs: tuple[int, ...] = ()
    """Host reads: before ``ops[i]`` the host waits for the GPU (:attr:`.trace.StepTrace.syncs`)."""
    compiled: bool = False
    """``torch.compile``'d: forward and backward fused, launched without per-op dispatch (the optimizer stays
    eager)."""
    torchao: bool = False
    """The low-precision layers are torchao's (their traced ops, mixprec's, stand in for torchao's kernels)."""
    lowp_layers: int = 0
    """Linear layers in low precision (:attr:`.trace.StepTrace.lowp_layers`)."""
    module_calls: tuple[int, ...] = ()
    """For each module call, the number of ops before it (:attr:`.trace.StepTrace.module_calls`)."""
    untraced_ops: int = 0
    """Ops an eager run dispatches in forward that the trace lacks (:attr:`.trace.StepTrace.saved_outputs`)."""


@dataclasses.dataclass(frozen=True)
class StepTime:
    """Predicted time of one step and where it goes."""

    total_s: float
    gemm_s: float
    """Ops with FLOPs."""
    memory_s: float
    """Ops without FLOPs (bandwidth or launch)."""
    overhead_s: float
    """Host overhead, every op's and the step's; on GPU targets the time the GPU waits for the host."""
    ops: int
    flops_by_dtype: dict[str, int]
    timed_s: float = 0.0
    """Ops timed on this CPU (:mod:`.kernels`), their host overhead aside."""
    timed_ops: int = 0
    host_s: float = 0.0
    """GPU targets: the host's dispatch time, overlapped with the GPU's work between host reads."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def step_time(ops: list[OpRecord], target: Target, efficiency: Efficiency | None = None, *,
              dtype_map: dict[str, str] | None = None, kernel_times: Mapping[KernelSpec, float] | None = None,
              execution: Execution | None = None, host: HostCost | None = None) -> StepTime:
    """The time of ``ops`` on ``target``. ``dtype_map`` renames a dtype's peak (``{"fp32": "tf32"}``);
    ``kernel_times``: measured seconds per :attr:`~.recorder.OpRecord.kernel`, replacing their roofline terms;
    ``execution`` and ``host`` (GPU targets): how the step runs and what the host's side costs."""
    eff = efficiency or efficiency_for(target)
    dtype_map = dtype_map or {}
    if target.kind != "cpu":
        return _gpu_step_time(ops, target, eff, dtype_map, execution or Execution(), host or GPU_HOST)
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
            gemm += max(op.flops / (target.peak(dt) * eff.on(target, dt)), t_mem, target.launch_s)
        else:
            mem += max(t_mem, target.launch_s)
    overhead = (n * eff.op_overhead_s + n_low_gemm * eff.lowp_gemm_overhead_s
                + (eff.step_overhead_s if n else 0.0))
    return StepTime(total_s=gemm + mem + overhead + timed, gemm_s=gemm, memory_s=mem, overhead_s=overhead, ops=n,
                    flops_by_dtype=flops, timed_s=timed, timed_ops=n_timed)


def _device_s(op: OpRecord, target: Target, eff: Efficiency, dtype_map: dict[str, str]) -> float:
    t_mem = op.nbytes / (target.bandwidth * eff.memory)
    if op.flops:
        dt = dtype_map.get(op.dtype, op.dtype)
        return max(op.flops / (target.peak(dt) * eff.on(target, dt)), t_mem, target.launch_s)
    return max(t_mem, target.launch_s)


def _gpu_step_time(ops: list[OpRecord], target: Target, eff: Efficiency, dtype_map: dict[str, str],
                   ex: Execution, host: HostCost) -> StepTime:
    lowp = sum(1 for op in ops if op.lowp and op.dispatched)
    torchao_op_s = host.torchao_layer_s * ex.lowp_layers / lowp if ex.torchao and lowp else None
    work: list[tuple[float, float, bool]] = []  # per op: host seconds, device seconds (0: no kernel), has FLOPs
    fused = -1  # index in work of the open fused kernel (compiled), -1 when none
    flops: dict[str, int] = {}
    for op in ops:
        kernel = op.nbytes > 0 or op.flops > 0
        if op.flops:
            dt = dtype_map.get(op.dtype, op.dtype)
            flops[dt] = flops.get(dt, 0) + op.flops
        if not op.dispatched:
            work.append((0.0, 0.0, False))
            continue
        if ex.compiled and op.phase in ("forward", "backward"):
            if not kernel:  # a view: no kernel, and nothing dispatches it
                work.append((0.0, 0.0, False))
                continue
            if op.flops:
                fused = -1
                work.append((target.launch_s, _device_s(op, target, eff, dtype_map), True))
                continue
            t = _device_s(op, target, eff, dtype_map)
            if fused >= 0 and ops[fused].phase == op.phase:
                work[fused] = (work[fused][0], max(work[fused][1], t), False)
                work.append((0.0, 0.0, False))
            else:
                fused = len(work)
                work.append((target.launch_s, t, False))
            continue
        fused = -1
        cost = torchao_op_s if (op.lowp and torchao_op_s is not None) else host.op_s
        work.append((cost, _device_s(op, target, eff, dtype_map) if kernel else 0.0, bool(op.flops)))
    extra = [0.0] * (len(work) + 1)
    for i in ex.syncs:  # the read itself (``.item()``) is an op
        extra[i] += host.op_s
    if not ex.compiled:
        for i in ex.module_calls:
            extra[i] += host.module_s
        extra[0] += ex.untraced_ops * host.op_s
    work = [(h + e, d, f) for (h, d, f), e in zip(work, extra)]
    period = _queue(work, set(ex.syncs))
    gemm = sum(d for _, d, f in work if f)
    mem = sum(d for _, d, f in work if not f)
    return StepTime(total_s=period, gemm_s=gemm, memory_s=mem, overhead_s=max(0.0, period - gemm - mem),
                    ops=sum(1 for _, d, _ in work if d > 0), flops_by_dtype=flops, host_s=sum(h for h, _, _ in work))


def _queue(work: list[tuple[float, float, bool]], syncs: set[int], steps: int = 3) -> float:
    """The steady-state period of steps of ``work`` issued by the host (its seconds per op, in order) to a GPU
    that runs each kernel once issued and once the one before it ended; the host waits for the GPU before the
    ops at ``syncs``."""
    h = g = 0.0
    ends = []
    for _ in range(steps):
        for i, (host_s, device_s, _) in enumerate(work):
            if i in syncs:
                h = max(h, g)
            h += host_s
            if device_s > 0:
                g = max(g, h) + device_s
        ends.append(max(h, g))
    return ends[-1] - ends[-2]
