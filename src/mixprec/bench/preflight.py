"""Hardware preflight: before the matrix runs, say per recipe whether this machine runs its dtype fast.

Nothing is rewritten: a recipe the machine runs slowly still runs as asked, and the line says why it will
be slow (fp16 on a CPU without AVX512-FP16/AMX-FP16 is a scalar fallback, 100x+ slower than fp32; TF32
on a CPU is plain fp32). ``--amp-impl auto`` already picks fp16 emulation on such CPUs, and the line says
that too. Each recipe also gets the dtype its matmuls actually run in, which picks the peak its MFU is
measured against (emulated fp16 multiplies in fp32, so its peak is fp32's).
"""

from __future__ import annotations

import dataclasses

import torch

from .. import hardware
from ..precision import Recipe

__all__ = ["Preflight", "preflight", "RELEVANT_CPU_FLAGS"]

RELEVANT_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16", "amx_tile")


@dataclasses.dataclass(frozen=True)
class Preflight:
    recipe: str
    impl: str
    matmul_dtype: str
    """``fp32``, ``tf32``, ``bf16`` or ``fp16``: what the matmuls run in (the MFU peak's dtype)."""
    fast: bool
    """Whether this machine has native fast kernels for that dtype."""
    line: str

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _flags_text(device: torch.device) -> str:
    if device.type != "cpu":
        return hardware.device_name(device)
    have = [f for f in RELEVANT_CPU_FLAGS if f in hardware.cpu_flags()]
    return f"{hardware.cpu_name()} [{', '.join(have) or 'no AVX2/AVX-512 flags'}]"


def preflight(recipe: Recipe) -> Preflight:
    """What ``recipe`` will run as on its device, in one line."""
    s, dev = recipe.spec, recipe.device
    label = f"{s.name} [{recipe.impl}]" if s.autocast else s.name
    if getattr(s, "fp8", False):
        if hardware.has_fp8_matmul(dev):
            return Preflight(s.name, recipe.impl, "bf16", True,
                             f"{label}: real FP8 GEMMs (torch._scaled_mm) on {hardware.device_name(dev)}; other ops "
                             "bf16; MFU is measured against the bf16 peak (no FP8 peak is measured)")
        return Preflight(
            s.name, recipe.impl, "fp32", False,
            f"{label}: no FP8 matmuls on this device ({_flags_text(dev)}), so FP8 is EMULATED: operands scaled and "
            "rounded to e4m3/e5m2, GEMMs in fp32, other ops bf16 — fp8 numerics, SLOWER than fp32 (amax, casts); "
            "MFU is measured against the fp32 peak",
        )
    if s.compute_dtype == torch.float32:
        if s.tf32 and hardware.has_tf32(dev):
            return Preflight(s.name, recipe.impl, "tf32", True, f"{label}: fp32 tensors, TF32 tensor-core matmuls")
        if s.tf32:
            return Preflight(s.name, recipe.impl, "fp32", True,
                             f"{label}: {dev.type} has no TF32 tensor cores, so this runs exactly as fp32 "
                             "(kept as asked, not rewritten)")
        return Preflight(s.name, recipe.impl, "fp32", True, f"{label}: fp32 matmuls, the reference")
    if s.compute_dtype == torch.bfloat16:
        fast = hardware.has_fast_bf16(dev)
        if dev.type == "cuda":
            why = "bf16 tensor cores"
        elif fast:
            why = f"fast bf16 matmuls on this CPU ({_flags_text(dev)})"
        else:
            why = (f"this CPU has no native bf16 matmul instructions (no AVX512-BF16/AMX-BF16: {_flags_text(dev)}); "
                   "bf16 matmuls are converted in software and likely SLOWER than fp32")
        return Preflight(s.name, recipe.impl, "bf16", fast, f"{label}: {why}")
    # fp16
    if hardware.has_fast_fp16(dev):
        why = "fp16 tensor cores" if dev.type == "cuda" else f"fast fp16 matmuls on this CPU ({_flags_text(dev)})"
        return Preflight(s.name, recipe.impl, "fp16", True, f"{label}: {why}")
    if recipe.emulate and recipe.impl == "scratch":
        return Preflight(
            s.name, recipe.impl, "fp32", False,
            f"{label}: this CPU has no fast fp16 kernels (no AVX512-FP16/AMX-FP16: {_flags_text(dev)}), so fp16 is "
            "EMULATED: values rounded to fp16, arithmetic in fp32 — fp16 numerics at fp32 speed; MFU is "
            "measured against the fp32 peak",
        )
    return Preflight(
        s.name, recipe.impl, "fp16", False,
        f"{label}: WARNING: this CPU has no fast fp16 kernels (no AVX512-FP16/AMX-FP16: {_flags_text(dev)}); "
        "native fp16 matmuls are a scalar fallback, expect steps 100x+ slower than fp32 "
        "(--amp-impl auto or scratch emulates fp16 instead)",
    )
