"""What a recipe says about itself in words: its one-line description, what the device does with its dtypes,
and what to try when its run went non-finite. Wording only; the decisions are made elsewhere."""

from __future__ import annotations

import torch

from . import hardware
from .mechanisms import Mechanism
from .recipes import RecipeSpec, dtype_name
from .scaler import ScalerConfig

__all__ = ["HARDWARE_NOTES", "describe", "hardware_note", "layer_formats_clause", "nonfinite_remedies"]

_NO_FAST_FP16 = "this CPU has no fast fp16 kernels (no AVX512-FP16/AMX-FP16: {where})"
_NO_BF16_KERNELS = "this CPU has no bf16 kernels (oneDNN does bf16 from AVX-512 on: {where}"

HARDWARE_NOTES: dict[str, str] = {
    "fp8-real": ("{fp8_words} are REAL here ({fp8_impl} on {where}); other ops bf16; MFU is measured against "
                 "the bf16 peak (no FP8 peak)"),
    "lowp-emulated": ("no {fp8_words} on this device ({where}; {fp8_needs}), so they are EMULATED ({fp8_impl}): "
                      "operands quantised exactly and held in bf16 with their block scales, GEMMs in bf16 with fp32 "
                      "accumulation, other ops bf16; MFU is measured against the bf16 peak"),
    "fp8-emulated": ("no FP8 matmuls on this device ({where}; they need CUDA compute capability 8.9+), so FP8 is "
                     "EMULATED: operands scaled and rounded to e4m3/e5m2 and held in bf16 (exactly), GEMMs in bf16 "
                     "with fp32 accumulation, other ops bf16 — FP8 numerics at bf16 GEMM speed plus amax and "
                     "rounding passes; MFU is measured against the bf16 peak"),
    "tf32": "fp32 tensors, TF32 tensor-core matmuls",
    "tf32-absent": "{device} has no TF32 tensor cores, so this runs exactly as fp32",
    "fp32": "fp32 matmuls, the reference",
    "bf16-gpu": "bf16 tensor cores",
    "bf16-cpu": "fast bf16 matmuls on this CPU ({where})",
    "bf16-slow": ("this CPU has no native bf16 matmul instructions (no AVX512-BF16/AMX-BF16: {where}); bf16 "
                  "matmuls are converted in software and likely SLOWER than fp32"),
    "bf16-fallback": ("WARNING: " + _NO_BF16_KERNELS + "); native bf16 matmuls are a scalar fallback, many times "
                      "slower than fp32 — use --amp-impl scratch or auto (emulated bf16)"),
    "bf16-emulated": (_NO_BF16_KERNELS + "; PyTorch's own bf16 matmul is a scalar fallback), so bf16 is EMULATED: "
                      "operands and results rounded to bf16, arithmetic in fp32 (bf16 numerics at fp32 speed); MFU "
                      "is measured against the fp32 peak"),
    "fp16-gpu": "fp16 tensor cores",
    "fp16-cpu": ("fast fp16 matmuls on this CPU ({where}), but PyTorch's CPU fp16 convolution backward is a slow "
                 "path, many times slower than fp32 on CNNs — --amp-impl auto emulates fp16 instead"),
    "fp16-emulated": ("PyTorch's fp16 kernels are slow on a CPU ({where}; without AVX512-FP16/AMX-FP16 its fp16 "
                      "matmuls are a scalar fallback, with them its fp16 convolution backward still is), so fp16 is "
                      "EMULATED: operands and results rounded to fp16, arithmetic in fp32 (fp16 numerics at fp32 "
                      "speed); MFU is measured against the fp32 peak"),
    "fp16-slow": ("WARNING: " + _NO_FAST_FP16 + "; native fp16 matmuls are a scalar fallback, many times slower "
                  "than fp32 — use --amp-impl scratch or auto (emulated fp16) or bf16-mixed"),
}
"""One clause per case of :meth:`mixprec.precision.Recipe.hardware_facts`."""


_LOWP_WORDS = {"tensorwise": ("FP8 GEMMs", "they need CUDA compute capability 8.9+"),
               "rowwise": ("rowwise-scaled FP8 GEMMs", "they need CUDA compute capability 9.0+"),
               "mxfp8": ("MXFP8 GEMMs", "they need Blackwell tensor cores, CUDA compute capability 10.x"),
               "mxfp4": ("MXFP4 GEMMs", "they need Blackwell tensor cores, CUDA compute capability 10.x"),
               "nvfp4": ("NVFP4 GEMMs", "they need Blackwell tensor cores, CUDA compute capability 10.x")}


def hardware_note(case: str, caps: hardware.Capabilities, fp8=None) -> str:
    """The clause for ``case`` on the device ``caps`` describes; ``fp8``: the recipe's ``Fp8Impl``."""
    words, needs = _LOWP_WORDS[fp8.recipe.name] if fp8 is not None else ("", "")
    return HARDWARE_NOTES[case].format(where=caps.description, device=caps.device.type, fp8_words=words,
                                       fp8_needs=needs, fp8_impl=fp8.words if fp8 is not None else "")


def describe(spec: RecipeSpec, mechanism: Mechanism, *, scaler: ScalerConfig, stochastic_rounding: bool,
             device_note: str, fp8_conversion=None, fp8=None) -> str:
    """One line: what the recipe does on this device and why (:meth:`mixprec.precision.Recipe.describe`)."""
    s = spec
    if not s.autocast:
        mech = "no autocast"
    else:
        mech = mechanism.autocast_words + (f" + {mechanism.scaler_words}" if s.loss_scaling else "")
    parts = [f"{s.name} [{mechanism.name}]: {s.summary}; {mech}"]
    if s.loss_scaling:
        parts.append(f"loss scale starts at {scaler.init_scale:g}, x{scaler.growth_factor:g} after "
                     f"{scaler.growth_interval} finite steps, x{scaler.backoff_factor:g} on overflow")
    if s.master_weights:
        parts.append("optimizer steps fp32 master copies, params rounded to "
                     f"{dtype_name(s.param_dtype)} after each step" + (" stochastically" if stochastic_rounding else ""))
    elif stochastic_rounding and s.param_dtype != torch.float32:
        parts.append(f"updates rounded stochastically into {dtype_name(s.param_dtype)} params")
    if s.compute_dtype != torch.float32 or s.tf32:
        parts.append(device_note)
    parts.extend(mechanism.notes())
    if fp8 is not None and fp8.recipe.name != "tensorwise":
        parts.append(f"{fp8.recipe.name} GEMMs: {fp8.recipe.describe()} [{fp8.name}]")
    if s.fp8 and fp8_conversion is not None:
        c = fp8_conversion
        what = "FP8" if s.fp8 in ("tensorwise", "rowwise") else s.fp8.upper()
        parts.append(f"{len(c.converted)} linear layer(s) in {what}"
                     + (f", kept out: {', '.join(n for n, _ in c.skipped)}" if c.skipped else ""))
    return "; ".join(parts)


def layer_formats_clause(layers, impls: dict, spec: RecipeSpec) -> str:
    """How many of a layer-formats file's layers run in which format, each low-precision format with whose layers
    and whether its GEMMs are real here (:meth:`mixprec.precision.Recipe.describe`)."""
    made = ", ".join(x for x in (layers.model.get("name"), f"tuned for {layers.target}" if layers.target else "") if x)
    parts = []
    for fmt, names in layers.by_format().items():
        where = ""
        if fmt in impls:
            impl = impls[fmt]
            where = f" [{impl.name}, real]" if impl.real() else (
                f" [{impl.name}, EMULATED: {_LOWP_WORDS[impl.recipe.name][1]}]")
        elif fmt != "fp32" and spec.fp8:
            where = f" (kept out of {spec.name}'s conversion)"
        parts.append(f"{len(names)}{' linear layer(s)' if not parts else ''} in {fmt}{where}")
    return (f"--layer-formats {layers.path}" + (f" ({made})" if made else "") + ": " + ", ".join(parts)
            + f"; the others as {spec.name}")


def nonfinite_remedies(spec: RecipeSpec) -> str:
    """What to try when a run of ``spec`` went non-finite (never suggests the recipe itself)."""
    s = spec
    tips = ["lower --lr", "add --clip-grad-norm 1.0"]
    if s.param_dtype != torch.float32 and not s.master_weights:
        tips.append(f"keep fp32 master weights (--precision {dtype_name(s.compute_dtype)}-master)")
    if s.compute_dtype == torch.float16 and not s.loss_scaling:
        tips.append("use a loss-scaled recipe (fp16-mixed)")
    if s.compute_dtype != torch.float32 and s.name != "bf16-mixed":
        tips.append("try bf16-mixed (fp32's exponent range)")
    elif s.compute_dtype != torch.float32:
        tips.append("compare with --precision fp32: if it diverges too, precision is not the cause")
    else:
        tips.append("this recipe computes in fp32, so precision is not the cause")
    tips.append("run `mixprec doctor` to locate the first non-finite op")
    return ", ".join(tips)
