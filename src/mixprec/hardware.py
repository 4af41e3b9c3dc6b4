"""What the machine can do fast: used to explain recipes and to warn before slow or emulated runs.

CPUs: bf16 matmuls are fast with AVX512-BF16 or AMX-BF16; fp16 matmuls are only fast with AVX512-FP16 or
AMX-FP16 — without them PyTorch's CPU fp16 GEMM is a scalar fallback, 100x+ slower than fp32 on this
project's CI machine. GPUs: bf16 needs compute capability 8.0+ (Ampere), TF32 tensor cores 8.0+, FP8
matmuls 8.9+ (Ada/Hopper).
"""

from __future__ import annotations

import functools
import platform

import torch

__all__ = [
    "cpu_flags",
    "cpu_name",
    "device_name",
    "has_fast_bf16",
    "has_fast_fp16",
    "has_fp8_matmul",
    "has_tf32",
    "resolve_device",
]


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


def has_fast_fp16(device: torch.device) -> bool:
    if device.type == "cuda":
        return True
    flags = cpu_flags()
    return bool({"avx512_fp16", "amx_fp16"} & flags)


def has_tf32(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    major, _ = torch.cuda.get_device_capability(device)
    return major >= 8


def has_fp8_matmul(device: torch.device) -> bool:
    """True where ``torch._scaled_mm`` runs real FP8 GEMMs: NVIDIA compute capability 8.9+ (Ada, Hopper).

    ROCm builds answer False: their FP8 GEMMs take the ``*_fnuz`` dtypes, which mixprec.fp8 does not use."""
    if device.type != "cuda" or torch.version.hip is not None or not hasattr(torch, "_scaled_mm"):
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def resolve_device(name: str) -> torch.device:
    """``auto`` → cuda if available, else cpu. Raises ValueError for an unavailable device."""
    from .errors import ConfigError

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(
                f"--device {name} was requested but no CUDA device is available "
                f"(torch {torch.__version__}); use --device cpu or --device auto"
            )
        return torch.device(name)
    if name == "cpu":
        return torch.device("cpu")
    raise ConfigError(f"unknown --device {name!r}; choose auto, cpu or cuda")
