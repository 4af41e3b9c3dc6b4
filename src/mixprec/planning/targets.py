"""Where a planned run would happen: memory, peak FLOP/s per dtype and memory bandwidth of each target.

GPU figures are the vendors' dense peaks (tensor-core ones with FP32 accumulation, as PyTorch's GEMMs use; ``fp32``
without tensor cores), from each entry's ``source``; memory in decimal gigabytes (the difference to GiB stands in
for the CUDA context, workspaces and fragmentation). ``cpu`` is this machine, measured when asked for.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import torch

from .. import hardware
from ..errors import UsageError

__all__ = ["Target", "TARGETS", "TargetError", "get_target", "measure_cpu", "cpu_target", "measure_bandwidth",
           "target_for_gpu"]

T = 1e12


class TargetError(UsageError):
    """An unknown ``--target``; the message lists the known ones."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Target:
    """One device a run could happen on."""

    name: str
    description: str
    kind: str
    """``cuda`` or ``cpu``."""
    memory_bytes: int
    peak_flops: dict[str, float]
    """Dense peak FLOP/s per GEMM dtype."""
    bandwidth: float
    """Memory bandwidth, bytes/s."""
    source: str
    launch_s: float = 4e-6
    """Least time one op takes (a GPU kernel's launch), the roofline's floor per op; 0 on the cpu target."""
    measured_flops: dict[str, float] = dataclasses.field(default_factory=dict)
    """FLOP/s of a large square GEMM measured on the board, where known: no GEMM of a model is faster, so
    :mod:`.roofline` caps a GEMM's efficiency at ``measured / peak``."""

    @property
    def fp8_matmul(self) -> bool:
        """Whether FP8 GEMMs run natively (``torch._scaled_mm``)."""
        return "fp8" in self.peak_flops

    @property
    def rowwise_fp8(self) -> bool:
        """Whether rowwise-scaled FP8 GEMMs run natively (compute capability 9.0+; an RTX 4090's or L4's FP8 is
        8.9)."""
        return self.fp8_matmul and self.name in _ROWWISE_FP8

    @property
    def mx_matmul(self) -> bool:
        """Whether MXFP8/MXFP4/NVFP4 GEMMs run natively (Blackwell, compute capability 10.x)."""
        return self.name in _MX_UNITS

    @property
    def fast_fp16(self) -> bool:
        return "fp16" in self.peak_flops

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s of a GEMM in ``dtype``; without its own figure fp32's (FP8: bf16's, the emulated GEMM)."""
        if dtype in self.peak_flops:
            return self.peak_flops[dtype]
        if dtype == "fp8":
            return self.peak_flops.get("bf16", self.peak_flops["fp32"])
        return self.peak_flops["fp32"]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_ROWWISE_FP8 = ("h100-sxm", "h200", "b200")
_MX_UNITS = ("b200",)


def _gpu(name, description, memory_gb, bandwidth_gbs, source, measured=None, **tflops) -> Target:
    return Target(name=name, description=description, kind="cuda", memory_bytes=int(memory_gb * 1e9),
                  peak_flops={k: v * T for k, v in tflops.items()}, bandwidth=bandwidth_gbs * 1e9, source=source,
                  measured_flops={k: v * T for k, v in (measured or {}).items()})


TARGETS: dict[str, Target] = {t.name: t for t in [
    _gpu("a100-80gb", "NVIDIA A100 80GB SXM", 80, 2039,
         "NVIDIA A100 Tensor Core GPU datasheet (dense: TF32 156, BF16/FP16 312 TFLOPS; 2,039 GB/s HBM2e)",
         fp32=19.5, tf32=156, bf16=312, fp16=312),
    _gpu("h100-sxm", "NVIDIA H100 SXM5 80GB", 80, 3350,
         "NVIDIA H100 Tensor Core GPU datasheet, SXM column (dense = half the sparsity figures: TF32 494.7, "
         "BF16/FP16 989.4, FP8 1,978.9 TFLOPS; 3.35 TB/s HBM3)",
         fp32=67, tf32=494.7, bf16=989.4, fp16=989.4, fp8=1978.9),
    _gpu("h200", "NVIDIA H200 SXM 141GB", 141, 4800,
         "NVIDIA H200 Tensor Core GPU datasheet, SXM column (dense: TF32 494.7, BF16/FP16 989.4, FP8 1,978.9 "
         "TFLOPS; 4.8 TB/s HBM3e); measured: 8192^3 matmuls on one H200 (torch 2.11, CUDA events, mean of 10 "
         "after 3 warm-ups; benchmarks/h200-2026-12-04)",
         measured=dict(fp32=51, tf32=413, bf16=800, fp16=772, fp8=1447),
         fp32=67, tf32=494.7, bf16=989.4, fp16=989.4, fp8=1978.9),
    _gpu("b200", "NVIDIA B200 (HGX B200, per GPU)", 180, 8000,
         "NVIDIA HGX B200 datasheet, 8-GPU totals divided by 8 and halved for dense (FP32 75, TF32 1,100, "
         "BF16/FP16 2,250, FP8 4,500 TFLOPS; 1,440 GB and 64 TB/s HBM3e over 8 GPUs)",
         fp32=75, tf32=1100, bf16=2250, fp16=2250, fp8=4500),
    _gpu("rtx3090", "NVIDIA GeForce RTX 3090", 24, 936,
         "NVIDIA Ampere GA102 GPU Architecture whitepaper, RTX 3090 column (FP32 35.6; dense tensor TF32 35.6, "
         "FP16/BF16 with FP32 accumulate 71 TFLOPS; 936 GB/s GDDR6X); no FP8",
         fp32=35.6, tf32=35.6, bf16=71, fp16=71),
    _gpu("rtx4090", "NVIDIA GeForce RTX 4090", 24, 1008,
         "NVIDIA Ada Lovelace GPU Architecture whitepaper, RTX 4090 column (FP32 82.6; dense tensor TF32 82.6, "
         "FP16/BF16 with FP32 accumulate 165.2, FP8 with FP32 accumulate 330.3 TFLOPS; 1,008 GB/s GDDR6X)",
         fp32=82.6, tf32=82.6, bf16=165.2, fp16=165.2, fp8=330.3),
    _gpu("l4", "NVIDIA L4", 24, 300,
         "NVIDIA L4 Tensor Core GPU datasheet (dense = half the sparsity figures: TF32 60, BF16/FP16 121, FP8 "
         "242.5 TFLOPS; FP32 30.3 TFLOPS; 300 GB/s GDDR6)",
         fp32=30.3, tf32=60, bf16=121, fp16=121, fp8=242.5),
]}
"""The GPUs ``--target`` knows (``cpu`` is measured: :func:`measure_cpu`)."""


_GPU_NAMES = (("H100", "h100-sxm"), ("H200", "h200"), ("B200", "b200"), ("A100", "a100-80gb"),
              ("RTX 3090", "rtx3090"), ("RTX 4090", "rtx4090"), (" L4 ", "l4"))


def target_for_gpu(device_name: str) -> Target | None:
    """The table's entry for a CUDA device name (``NVIDIA H100 80GB HBM3``), or None for a board it lacks."""
    name = f" {device_name} "
    if "PCIe" in name or "NVL" in name or "GH200" in name or ("A100" in name and "80GB" not in name):
        return None
    return next((TARGETS[key] for part, key in _GPU_NAMES if part in name), None)


def known_targets() -> list[str]:
    return ["cpu", *TARGETS]


def get_target(name: str | Target) -> Target:
    """The target called ``name`` (``cpu`` is measured on first use)."""
    if isinstance(name, Target):
        return name
    key = name.strip().lower()
    if key == "cpu":
        return measure_cpu()
    if key not in TARGETS:
        raise TargetError(f"unknown --target {name!r}; choose one of: {', '.join(known_targets())}")
    return TARGETS[key]


def measure_bandwidth(*, mib: int = 256, repeats: int = 3) -> float:
    """Bytes/s of the best of ``repeats`` copies of a ``mib`` MiB buffer (each copy reads and writes it)."""
    src = torch.ones(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * 4 / best


def _mem_total() -> int:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@functools.lru_cache(maxsize=1)
def measure_cpu(budget_s: float = 0.5) -> Target:
    """This machine as a target: measured matmul peaks and bandwidth, MemTotal (once per process)."""
    cpu = torch.device("cpu")
    peaks = {"fp32": hardware.measure_matmul_peak(torch.float32, cpu, budget_s=budget_s)["flops_per_s"]}
    if hardware.has_fast_bf16(cpu):
        peaks["bf16"] = hardware.measure_matmul_peak(torch.bfloat16, cpu, budget_s=budget_s)["flops_per_s"]
    if hardware.has_fast_fp16(cpu):
        peaks["fp16"] = hardware.measure_matmul_peak(torch.float16, cpu, budget_s=budget_s)["flops_per_s"]
    return cpu_target(peaks, source=f"measured now on this machine ({torch.get_num_threads()} threads): "
                                    "square-matmul peaks (hardware.measure_matmul_peak), a 256 MiB copy, "
                                    "/proc/meminfo MemTotal")


def cpu_target(peak_flops: dict[str, float], *, source: str) -> Target:
    """This machine with the matmul peaks given (``fp32`` at least), the bandwidth measured now and MemTotal."""
    cpu = torch.device("cpu")
    return Target(name="cpu", description=hardware.describe_device(cpu), kind="cpu", memory_bytes=_mem_total(),
                  peak_flops=dict(peak_flops), bandwidth=measure_bandwidth(), launch_s=0.0, source=source)
