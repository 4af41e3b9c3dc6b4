"""The recipe table: what each name users type means, independent of device and mechanism.

| recipe        | compute          | params | loss scaling | master weights          |
|---------------|------------------|--------|--------------|-------------------------|
| fp32          | fp32 (TF32 off)  | fp32   | no           | —                       |
| tf32          | TF32 matmuls     | fp32   | no           | —                       |
| fp16-mixed    | autocast fp16    | fp32   | dynamic      | params are the master   |
| bf16-mixed    | autocast bf16    | fp32   | no           | params are the master   |
| fp16-master   | fp16             | fp16   | dynamic      | fp32 copy the optimizer steps |
| bf16-master   | bf16             | bf16   | no           | fp32 copy the optimizer steps |
| bf16-true     | bf16             | bf16   | no           | none (optional stochastic rounding) |
| fp8-mixed     | FP8 GEMMs + bf16 | fp32   | no           | params are the master   |
| fp8-rowwise   | FP8 GEMMs + bf16 | fp32   | no           | params are the master   |
| mxfp8         | MXFP8 GEMMs+bf16 | fp32   | no           | params are the master   |
| mxfp4         | MXFP4 GEMMs+bf16 | fp32   | no           | params are the master   |
| nvfp4         | NVFP4 GEMMs+bf16 | fp32   | no           | params are the master   |

The low-precision recipes name a linear recipe (``fp8``; :mod:`mixprec.lowp.recipes` has that table). A
:class:`RecipeSpec` refuses, when built, a combination no mechanism can train; :class:`mixprec.precision.Recipe`
turns a spec into hooks for a device and a mechanism.
"""

from __future__ import annotations

import dataclasses

import torch

from .errors import RecipeError
from .lowp.recipes import LINEAR_RECIPES

__all__ = ["RECIPES", "ALIASES", "RecipeSpec", "resolve_recipe", "dtype_name"]

_F32, _F16, _BF16 = torch.float32, torch.float16, torch.bfloat16
_DTYPES = {_F32: "fp32", _F16: "fp16", _BF16: "bf16"}


def dtype_name(dt: torch.dtype) -> str:
    """``fp32``, ``fp16`` or ``bf16``: the names recipes, reports and messages use."""
    return _DTYPES[dt]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RecipeSpec:
    """What a recipe name means, independent of device and mechanism; RecipeError if it cannot train."""

    name: str
    """Canonical name (after alias resolution)."""
    compute_dtype: torch.dtype
    """Dtype of the low-precision ops (matmuls, convs); fp32 for full-precision recipes."""
    param_dtype: torch.dtype
    autocast: bool
    """Run the forward under an autocast context (cast policy per op)."""
    loss_scaling: bool
    """Dynamic loss scaling (needed when gradients can underflow: fp16's 5-bit exponent)."""
    master_weights: bool
    """Keep an fp32 copy of low-precision params for the optimizer to step."""
    tf32: bool = False
    """Allow TF32 tensor-core matmuls for fp32 tensors (GPUs of compute capability 8.0+)."""
    fp8: str | None = None
    """The linear recipe of eligible linear layers' GEMMs (a key of ``LINEAR_RECIPES``); None: none."""
    summary: str
    """One line saying what the recipe does and why."""

    def __post_init__(self) -> None:
        for field in ("compute_dtype", "param_dtype"):
            if getattr(self, field) not in _DTYPES:
                self._refuse(f"{field}={getattr(self, field)} is not one of fp32, fp16, bf16")
        problem = _contradiction(self)
        if problem:
            self._refuse(problem)

    def _refuse(self, why: str) -> None:
        raise RecipeError(f"RecipeSpec(name={self.name!r}): {why}")


def _contradiction(s: RecipeSpec) -> str | None:
    low_params = s.param_dtype != _F32
    compute, params = dtype_name(s.compute_dtype), dtype_name(s.param_dtype)
    if s.loss_scaling and s.compute_dtype != _F16:
        return (f"loss scaling with {compute} compute: only fp16's narrow exponent range needs it "
                "(set loss_scaling=False)")
    if s.master_weights and not low_params:
        return "master_weights with fp32 params: the params are already the fp32 master (set master_weights=False)"
    if low_params and s.loss_scaling and not s.master_weights:
        return (f"{params} params with loss scaling but no fp32 master: torch.amp.GradScaler refuses to unscale "
                f"{params} gradients, so the recipe would train under one mechanism and crash under the other "
                "(set master_weights=True)")
    if low_params and s.compute_dtype != s.param_dtype:
        return f"{params} params with {compute} compute: low-precision params compute in their own dtype"
    if s.tf32 and s.compute_dtype != _F32:
        return f"tf32 with {compute} compute: TF32 applies to fp32 matmuls only (set compute_dtype=torch.float32)"
    if s.fp8 is not None and s.fp8 not in LINEAR_RECIPES:
        return f"fp8={s.fp8!r} is not a linear recipe (one of {', '.join(LINEAR_RECIPES)})"
    if s.fp8 and not s.autocast:
        return "fp8 without autocast: the ops FP8 does not cover need autocast bf16 (set autocast=True)"
    if s.fp8 and s.compute_dtype != _BF16:
        return f"fp8 with {compute} compute: the ops around the FP8 GEMMs run in bf16 (set compute_dtype=torch.bfloat16)"
    if s.autocast and s.compute_dtype == _F32:
        return "autocast with fp32 compute casts nothing (set autocast=False, or a low compute_dtype)"
    if not s.autocast and s.compute_dtype != s.param_dtype:
        return f"{compute} compute without autocast: ops run in the params' {params} (set autocast=True)"
    if not s.summary:
        return "summary is empty: say in one line what the recipe does and why"
    return None


RECIPES: dict[str, RecipeSpec] = {
    s.name: s
    for s in [
        RecipeSpec(name="fp32", compute_dtype=_F32, param_dtype=_F32, autocast=False, loss_scaling=False,
                   master_weights=False, summary="fp32 everywhere, TF32 off: the reference"),
        RecipeSpec(name="tf32", compute_dtype=_F32, param_dtype=_F32, autocast=False, loss_scaling=False,
                   master_weights=False, tf32=True,
                   summary="fp32 tensors, matmuls on TF32 tensor cores (10-bit mantissa) where the GPU has them"),
        RecipeSpec(name="fp16-mixed", compute_dtype=_F16, param_dtype=_F32, autocast=True, loss_scaling=True,
                   master_weights=False,
                   summary="autocast float16 + dynamic loss scaling (fp16's range is too narrow for small gradients)"),
        RecipeSpec(name="bf16-mixed", compute_dtype=_BF16, param_dtype=_F32, autocast=True, loss_scaling=False,
                   master_weights=False,
                   summary="autocast bfloat16, no loss scaling (bf16 has fp32's exponent range)"),
        RecipeSpec(name="fp16-master", compute_dtype=_F16, param_dtype=_F16, autocast=True, loss_scaling=True,
                   master_weights=True,
                   summary="fp16 params and compute, dynamic loss scaling, fp32 master weights in the optimizer"),
        RecipeSpec(name="bf16-master", compute_dtype=_BF16, param_dtype=_BF16, autocast=True, loss_scaling=False,
                   master_weights=True,
                   summary="bf16 params and compute, fp32 master weights in the optimizer"),
        RecipeSpec(name="bf16-true", compute_dtype=_BF16, param_dtype=_BF16, autocast=True, loss_scaling=False,
                   master_weights=False,
                   summary="bf16 params, compute and optimizer state; no fp32 copy (small updates can round away)"),
        RecipeSpec(name="fp8-mixed", compute_dtype=_BF16, param_dtype=_F32, autocast=True, loss_scaling=False,
                   master_weights=False, fp8="tensorwise",
                   summary="FP8 GEMMs in linear layers (e4m3 activations/weights, e5m2 gradients, per-tensor "
                           "power-of-two scales, so no loss scaling), other ops autocast bfloat16"),
        RecipeSpec(name="fp8-rowwise", compute_dtype=_BF16, param_dtype=_F32, autocast=True, loss_scaling=False,
                   master_weights=False, fp8="rowwise",
                   summary="FP8 e4m3 GEMMs in linear layers with a power-of-two scale per row of each operand "
                           "along the reduced dimension (torchao's rowwise; gradients e4m3 too), other ops "
                           "autocast bfloat16"),
        RecipeSpec(name="mxfp8", compute_dtype=_BF16, param_dtype=_F32, autocast=True, loss_scaling=False,
                   master_weights=False, fp8="mxfp8",
                   summary="MXFP8 GEMMs in linear layers (e4m3 elements, an e8m0 scale per 32 values along each "
                           "GEMM's reduced dimension, RCEIL; torchao's MXFP8 training), other ops autocast bfloat16"),
        RecipeSpec(name="mxfp4", compute_dtype=_BF16, param_dtype=_F32, autocast=True, loss_scaling=False,
                   master_weights=False, fp8="mxfp4",
                   summary="MXFP4 GEMMs in linear layers (e2m1 elements, an e8m0 scale per 32 values along each "
                           "GEMM's reduced dimension), other ops autocast bfloat16"),
        RecipeSpec(name="nvfp4", compute_dtype=_BF16, param_dtype=_F32, autocast=True, loss_scaling=False,
                   master_weights=False, fp8="nvfp4",
                   summary="NVFP4 GEMMs in linear layers (e2m1 elements, an e4m3 scale per 16 values along each "
                           "GEMM's reduced dimension and an fp32 scale per tensor; no Hadamard transform or "
                           "stochastic rounding unless asked), other ops autocast bfloat16"),
    ]
}

ALIASES: dict[str, str] = {
    "32": "fp32", "32-true": "fp32", "float32": "fp32",
    "amp": "fp16-mixed", "16-mixed": "fp16-mixed", "fp16": "fp16-mixed",
    "bf16": "bf16-mixed", "bf16-mixed": "bf16-mixed",
}


def resolve_recipe(name: str) -> RecipeSpec:
    """Map a recipe name or alias to its spec; unknown names raise RecipeError listing the valid ones."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in RECIPES:
        aliases = ", ".join(f"{a}={c}" for a, c in ALIASES.items() if a != c)
        raise RecipeError(
            f"unknown precision {name!r}; choose one of: {', '.join(RECIPES)} (aliases: {aliases})"
        )
    return RECIPES[key]
