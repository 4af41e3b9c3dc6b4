"""What the machine can do fast: explains recipes and warns before slow or emulated runs.

CPUs: bf16 matmuls are fast with AVX512-BF16 or AMX-BF16, fp16 ones only with AVX512-FP16 or AMX-FP16 (else a
scalar fallback). GPUs: bf16 and TF32 need compute capability 8.0+, FP8 matmuls 8.9+ (rowwise-scaled 9.0+),
MXFP8/MXFP4/NVFP4 block-scaled matmuls 10.x.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import platform
import time
from typing import Any

import torch

__all__ = [
    "Capabilities",
    "capabilities",
    "RELEVANT_CPU_FLAGS",
    "cpu_flags",
    "describe_device",
    "environment",
    "synchronize",
    "cpu_name",
    "device_name",
    "has_fast_bf16",
    "has_bf16_kernels",
    "has_fast_fp16",
    "has_fast_fp16_training",
    "autocast_runs_lstm",
    "has_fp8_matmul",
    "has_lowp_units",
    "has_mx_matmul",
    "has_tf32",
    "resolve_device",
    "missing_device",
]


RELEVANT_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16", "amx_tile")


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """CPU feature flags from /proc/cpuinfo (empty where that file does not exist)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.lru_cache(maxsize=1)
def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_name()


def has_fast_bf16(device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    flags = cpu_flags()
    return bool({"avx512_bf16", "amx_bf16"} & flags)


def has_bf16_kernels(device: torch.device) -> bool:
    """Whether PyTorch has real bf16 GEMM kernels on ``device``: CUDA, and CPUs whose oneDNN does bf16 (AVX-512);
    elsewhere ``--amp-impl auto`` emulates bf16. Fast bf16 (:func:`has_fast_bf16`) needs AVX512-BF16 or AMX."""
    if device.type != "cpu":
        return True
    pinned = os.environ.get(BF16_KERNELS_ENV, "").strip()
    if pinned:
        if pinned not in ("0", "1"):
            from .errors import ConfigError

            raise ConfigError(f"{BF16_KERNELS_ENV}={pinned!r}: set 1 (a CPU with bf16 kernels) or 0 (none: "
                              "--amp-impl auto emulates bf16), or unset it to ask this CPU")
        return pinned == "1"
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


BF16_KERNELS_ENV = "MIXPREC_CPU_BF16_KERNELS"
"""``1`` or ``0`` pins what :func:`has_bf16_kernels` answers for the CPU (the test suite pins ``1``)."""


def has_fast_fp16(device: torch.device) -> bool:
    if device.type == "cuda":
        return True
    flags = cpu_flags()
    return bool({"avx512_fp16", "amx_fp16"} & flags)


def has_fast_fp16_training(device: torch.device) -> bool:
    """Whether whole fp16 training steps run fast in real fp16 on ``device``: CUDA, never a CPU (even with fast
    fp16 matmuls, its fp16 convolution backward and other ops are slow paths; benchmarks/README.md)."""
    return device.type != "cpu"


def autocast_runs_lstm(dtype: torch.dtype) -> bool:
    """Whether ``torch.autocast("cpu", dtype)`` can train an ``nn.LSTM`` here (oneDNN's ``mkldnn_rnn_layer`` lacks
    some dtypes on some CPUs). Found by trying one step of a 1-unit LSTM, once per dtype and oneDNN setting."""
    return _autocast_runs_lstm(dtype, torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled)


@functools.lru_cache(maxsize=None)
def _autocast_runs_lstm(dtype: torch.dtype, onednn: bool) -> bool:
    if not onednn:  # PyTorch's own LSTM then runs, in fp32 (torch.autocast does not lower it)
        return True
    from torch.utils._python_dispatch import _disable_current_modes

    # real tensors, whatever modes the caller is under (a plan converts its model inside FakeTensorMode)
    with _disable_current_modes(), torch._C.DisableTorchFunction():
        lstm = torch.nn.LSTM(1, 1)
        try:
            with torch.enable_grad(), torch.autocast("cpu", dtype=dtype):
                out, _ = lstm(torch.zeros(1, 1, 1))
            out.float().sum().backward()
            return True
        except RuntimeError:
            return False


def has_tf32(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    major, _ = torch.cuda.get_device_capability(device)
    return major >= 8


def has_fp8_matmul(device: torch.device) -> bool:
    """True where ``torch._scaled_mm`` runs real FP8 GEMMs: NVIDIA 8.9+ (not ROCm: its ``*_fnuz`` dtypes)."""
    if device.type != "cuda" or torch.version.hip is not None or not hasattr(torch, "_scaled_mm"):
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def missing_device(device: torch.device | str) -> str | None:
    """Why this process cannot run on ``device`` (no CUDA, no such GPU index), or None if it can."""
    device = torch.device(device)
    if device.type == "cpu":
        return None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return f"no CUDA device is available (torch {torch.__version__})"
        if device.index is not None and device.index >= torch.cuda.device_count():
            return f"this machine has {torch.cuda.device_count()} CUDA device(s), so there is no {device}"
        return None
    backend = getattr(torch, device.type, None)
    if backend is not None and callable(getattr(backend, "is_available", None)) and backend.is_available():
        return None
    return f"no {device.type} device is available (torch {torch.__version__})"


def has_mx_matmul(device: torch.device) -> bool:
    """True where the GPU has MXFP8/MXFP4/NVFP4 tensor cores: NVIDIA compute capability 10.x."""
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    return (10, 0) <= torch.cuda.get_device_capability(device) < (11, 0)


def has_lowp_units(recipe: str, device: torch.device) -> bool:
    """Whether ``device`` has units for low-precision linear recipe ``recipe``'s formats (tensorwise FP8 8.9+,
    rowwise 9.0+, MX and NVFP4 10.x)."""
    if recipe == "tensorwise":
        return has_fp8_matmul(device)
    if recipe == "rowwise":
        return has_fp8_matmul(device) and torch.cuda.get_device_capability(device) >= (9, 0)
    return has_mx_matmul(device)


def resolve_device(name: str) -> torch.device:
    """``auto`` → cuda if available, else cpu. Raises ConfigError for an unavailable device."""
    from .errors import ConfigError

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda"):
        try:
            device = torch.device(name)
        except RuntimeError:
            raise ConfigError(f"unknown --device {name!r}; choose auto, cpu, cuda or cuda:N") from None
        why = missing_device(device)
        if why is not None:
            raise ConfigError(f"--device {name} was requested but {why}; use --device cpu or --device auto")
        return device
    if name == "cpu":
        return torch.device("cpu")
    raise ConfigError(f"unknown --device {name!r}; choose auto, cpu or cuda")


def describe_device(device: torch.device) -> str:
    """The device's name; for a CPU also its relevant flags, e.g. ``AMD EPYC ... [avx2, avx512_bf16]``."""
    if device.type != "cpu":
        return device_name(device)
    have = [f for f in RELEVANT_CPU_FLAGS if f in cpu_flags()]
    return f"{cpu_name()} [{', '.join(have) or 'no AVX2/AVX-512 flags'}]"


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (before reading a clock); no-op on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def environment(device: torch.device) -> dict[str, Any]:
    """The software and hardware a measurement ran on (for metrics JSON and bench results)."""
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "device": str(device),
        "device_name": device_name(device),
        "cpu": cpu_name(),
        "cpu_flags": [f for f in RELEVANT_CPU_FLAGS if f in cpu_flags()],
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "gpu": None,
    }
    if device.type == "cuda":
        env["gpu"] = {"name": torch.cuda.get_device_name(device),
                      "capability": list(torch.cuda.get_device_capability(device)),
                      "cuda": torch.version.cuda}
    return env


def measure_matmul_peak(
    dtype: torch.dtype, device: torch.device | str = "cpu", *, budget_s: float = 1.0, tf32: bool = False,
    sizes: tuple[int, ...] | None = None,
) -> dict[str, Any]:
    """Best measured rate (FLOP/s) of square matmuls in ``dtype``: sizes grow while one fits the budget, each
    warmed up then repeated (best time wins). ``tf32`` allows TF32 for fp32 (restored afterwards)."""
    device = torch.device(device)
    sizes = sizes or ((2048, 4096, 8192) if device.type == "cuda" else (512, 1024, 2048))
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    gen = torch.Generator(device="cpu").manual_seed(0)
    best_rate, best_n, best_t = 0.0, None, None
    start = time.perf_counter()
    try:
        for n in sizes:
            flops = 2.0 * n**3
            used = time.perf_counter() - start
            if best_rate and flops / best_rate > max(0.0, budget_s - used) / 2:
                break  # one warm-up + one timed run would not fit
            a = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
            b = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
            synchronize(device)
            t0 = time.perf_counter()
            a @ b  # warm-up: kernel selection, page faults
            synchronize(device)
            t_warm = time.perf_counter() - t0
            best = t_warm
            deadline = start + budget_s
            reps = 0
            while reps < 1 or (time.perf_counter() + best < deadline and reps < 10):
                t0 = time.perf_counter()
                a @ b
                synchronize(device)
                best = min(best, time.perf_counter() - t0)
                reps += 1
            rate = flops / best
            if rate > best_rate:
                best_rate, best_n, best_t = rate, n, best
            del a, b
    finally:
        torch.set_float32_matmul_precision(prev)
    return {"flops_per_s": best_rate, "n": best_n, "seconds": best_t,
            "dtype": str(dtype).replace("torch.", ""), "tf32": tf32, "device": str(device)}


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What one device does with the recipes' dtypes, asked once (:func:`capabilities`) when a recipe is built and
    passed down: the recipe, its mechanism and its low-precision layer implementation read this object, never the
    hardware again."""

    device: torch.device
    description: str
    """:func:`describe_device`'s words (a planned target: its device type)."""
    tf32: bool = False
    fast_bf16: bool = False
    bf16_kernels: bool = True
    fast_fp16: bool = False
    fast_fp16_training: bool = False
    fp8_matmul: bool = False
    rowwise_fp8: bool = False
    mx_matmul: bool = False

    def lowp_units(self, recipe: str) -> bool:
        """Units for low-precision linear recipe ``recipe`` (tensorwise FP8, rowwise FP8, MX and NVFP4)."""
        return {"tensorwise": self.fp8_matmul, "rowwise": self.rowwise_fp8}.get(recipe, self.mx_matmul)

    @property
    def slow_dtypes(self) -> frozenset[torch.dtype]:
        """The low dtypes whose real training steps are slow here (the scratch engine emulates them): fp16 on every
        CPU, bf16 on a CPU without bf16 kernels."""
        return frozenset(d for d, fast in ((torch.float16, self.fast_fp16_training),
                                           (torch.bfloat16, self.bf16_kernels)) if not fast)

    def autocast_runs_lstm(self, dtype: torch.dtype) -> bool:
        """:func:`autocast_runs_lstm`, probed on first ask (only a native CPU recipe with an LSTM asks)."""
        return self.device.type != "cpu" or autocast_runs_lstm(dtype)


def capabilities(device: torch.device | str, *, target: bool = False) -> Capabilities:
    """The device's :class:`Capabilities`. ``target``: a GPU being planned for, which this machine need not have:
    nothing is asked (a GPU's dtypes assumed fast, no low-precision units: the planner prices GEMM paths from its
    own target table)."""
    device = torch.device(device)
    if target and device.type != "cpu":
        return Capabilities(device, device.type, tf32=True, fast_bf16=True, fast_fp16=True, fast_fp16_training=True)
    return Capabilities(device, describe_device(device), tf32=has_tf32(device), fast_bf16=has_fast_bf16(device),
                        bf16_kernels=has_bf16_kernels(device), fast_fp16=has_fast_fp16(device),
                        fast_fp16_training=has_fast_fp16_training(device), fp8_matmul=has_fp8_matmul(device),
                        rowwise_fp8=has_lowp_units("rowwise", device), mx_matmul=has_mx_matmul(device))
