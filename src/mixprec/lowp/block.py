"""``nn.Linear`` whose three GEMMs run a block-scaled recipe (rowwise FP8, MXFP8, MXFP4, NVFP4), from scratch.

Which operand is quantised in which format along which dimension is the recipe's (:mod:`.recipes`); the
operands are :func:`~mixprec.lowp.quant.quantize_operand`'s, each along its GEMM's reduced dimension, with the
block scales folded into bf16 values ``q * s``. That is exact wherever bf16 holds ``q * s``: always for rowwise
FP8 (power-of-two scales within 2**48 of 1) and NVFP4 (e4m3 block scales >= 2**-6 times e2m1: at most 6
significant bits); for MX unless the product falls below bf16's smallest subnormal, 2**-133 (e4m3 elements with
scales below 2**-124, e2m1 below 2**-132), where such blocks lose low bits that the hardware keeps.

The GEMM is then a bf16 GEMM: exact products, fp32 accumulation, the sum rounded once to bf16 -- what a
block-scaled tensor core does with the scales applied inside the dot product -- except that NVFP4's per-tensor
scales ``t_a * t_b`` multiply the bf16 result (the hardware applies them before its single rounding: an extra
relative error of at most 2**-9), and fp32 outputs (``dW``) carry the bf16 rounding, as in :mod:`.fp8`. fp16
outputs, and ``mode="reference"`` (tests, benchmarks: torchao's emulation, bit for bit where the quantisation
agrees), take an fp32 GEMM on the same operands.

Real GEMMs: ``rowwise`` on CUDA compute capability 9.0+ runs ``torch._scaled_mm`` with e4m3 operands and fp32
per-row/per-column scales where both operands are rowwise and every dimension is a multiple of 16 (not yet run on
a GPU); MX/NVFP4 real kernels are torchao's (``--fp8-impl torchao``).

Autograd saves ``x`` and ``W`` unquantised (backward quantises them along other dimensions); the bias add and
its gradient run outside the GEMM Function in the output dtype (as torchao's ``Float8Linear``). Tokens are
zero-padded to the weight-gradient GEMM's block (:attr:`~mixprec.lowp.recipes.LinearRecipe.token_block`): exact.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from .. import hardware
from ..formats import quantize_blocks_with_scales
from .fp8 import no_autocast, output_dtype
from .quant import layer_size, quantize_operand
from .recipes import LinearRecipe

__all__ = ["BlockLinear", "block_linear", "hadamard_matrix", "layer_seed"]

_HADAMARD_SEED = 0x4AD
"""Seed of the fixed random signs of the Hadamard transform (the same in every layer and run)."""


@functools.lru_cache(maxsize=8)
def _hadamard(device: torch.device) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < 16:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    g = torch.Generator().manual_seed(_HADAMARD_SEED)
    signs = torch.randint(0, 2, (16,), generator=g).float() * 2 - 1
    return (h / 4 * signs).to(device)  # H @ diag(signs): orthonormal, H^T H = I


def hadamard_matrix(device: torch.device | str = "cpu") -> torch.Tensor:
    """The 16x16 orthonormal random-sign Hadamard matrix of ``--fp4-hadamard`` (float32)."""
    return _hadamard(torch.device(device)).clone()


def _rht_rows(t: torch.Tensor) -> torch.Tensor:
    """``H`` applied along dim 0 of a 2-D ``t`` in blocks of 16 (dim 0 a multiple of 16), in float32."""
    m, c = t.shape
    return torch.matmul(_hadamard(t.device), t.float().reshape(m // 16, 16, c)).reshape(m, c)


def _real_rowwise_mm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``a (M, K) @ b (K, N)`` with ``torch._scaled_mm``, both rowwise e4m3 along K (UNTESTED on a GPU)."""
    qa = quantize_blocks_with_scales(a, "fp8_e4m3_rowwise", axis=1)
    qb = quantize_blocks_with_scales(b, "fp8_e4m3_rowwise", axis=0)
    fa = qa.elements.to(torch.float8_e4m3fn).contiguous()
    fb = qb.elements.to(torch.float8_e4m3fn).t().contiguous().t()  # column-major, as cuBLAS/CUTLASS want
    return torch._scaled_mm(fa, fb, scale_a=qa.scales.reshape(-1, 1).contiguous(),
                            scale_b=qb.scales.reshape(1, -1).contiguous(), out_dtype=out_dtype,
                            use_fast_accum=False)


def _gemm(a: torch.Tensor, fa: str, b: torch.Tensor, fb: str, out_dtype: torch.dtype, recipe: LinearRecipe,
          mode: str, *, stochastic_a: bool = False, generator: torch.Generator | None = None) -> torch.Tensor:
    """``a (M, K) @ b (K, N)`` with ``a`` quantised in ``fa`` along K (dim 1) and ``b`` in ``fb`` along K (dim 0)."""
    if mode == "real" and fa == fb == "e4m3-row" and all(d % 16 == 0 for d in (*a.shape, b.shape[1])):
        return _real_rowwise_mm(a, b, out_dtype)
    qa, sa = quantize_operand(a, fa, 1, scale_rule=recipe.scale_rule, stochastic=stochastic_a, generator=generator)
    qb, sb = quantize_operand(b, fb, 0, scale_rule=recipe.scale_rule)
    if mode == "reference" or out_dtype == torch.float16:
        out = torch.mm(qa.float(), qb.float())
    else:
        out = torch.mm(qa, qb)
    scale = sa if sb is None else (sb if sa is None else sa * sb)
    if scale is not None:
        out = out * scale
    return out.to(out_dtype)


def _pad_rows(t: torch.Tensor, block: int | None) -> torch.Tensor:
    rem = t.shape[0] % block if block else 0
    return t if not rem else torch.cat([t, t.new_zeros(block - rem, t.shape[1])])


class _BlockMatmul(torch.autograd.Function):
    """``x @ W^T`` for 2-D ``x`` (tokens, in_features), the three GEMMs as ``recipe`` says."""

    @staticmethod
    def forward(ctx, x, weight, out_dtype, recipe, mode, generator):
        with no_autocast(x.device.type), layer_size(weight.numel()):
            y = _gemm(x, recipe.output[0], weight.t(), recipe.output[1], out_dtype, recipe, mode)
        ctx.save_for_backward(x, weight)
        ctx.recipe, ctx.mode, ctx.generator = recipe, mode, generator
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        r, mode = ctx.recipe, ctx.mode
        dx = dw = None
        with no_autocast(dy.device.type), layer_size(weight.numel()):
            if ctx.needs_input_grad[0]:
                dx = _gemm(dy, r.grad_input[0], weight, r.grad_input[1], x.dtype, r, mode,
                           stochastic_a=r.stochastic_rounding, generator=ctx.generator)
            if ctx.needs_input_grad[1]:
                dyp, xp = _pad_rows(dy, r.token_block), _pad_rows(x, r.token_block)
                if r.hadamard:
                    dyp, xp = _rht_rows(dyp), _rht_rows(xp)
                dw = _gemm(dyp.t(), r.grad_weight[0], xp, r.grad_weight[1], weight.dtype, r, mode,
                           stochastic_a=r.stochastic_rounding, generator=ctx.generator)
        return dx, dw, None, None, None, None


def _gemm_mode(device: torch.device, recipe: LinearRecipe, emulate: bool | None) -> str:
    from .fp8 import planned_mode

    planned = planned_mode()
    if planned is not None:  # mixprec plan traces the path the target takes (lowp.fp8.planned_gemm_path)
        return "real" if planned == "real" and recipe.name == "rowwise" and not recipe.wgrad_hp else "emulated"
    real = recipe.name == "rowwise" and hardware.has_lowp_units("rowwise", device)
    if emulate is False and not real:
        raise RuntimeError(f"block_linear(..., emulate=False) with the {recipe.name} recipe needs real kernels "
                           f"(rowwise FP8: CUDA compute capability 9.0+), which {device} lacks; use emulate=None")
    return "real" if real and not emulate else "emulated"


def block_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: LinearRecipe, *,
                 emulate: bool | None = None, generator: torch.Generator | None = None,
                 mode: str | None = None) -> torch.Tensor:
    """``F.linear`` with the three GEMMs of ``recipe``. ``emulate`` as :func:`~mixprec.lowp.fp8.fp8_linear`;
    ``mode`` (tests, benchmarks) forces ``"emulated"``, ``"reference"`` or ``"real"``."""
    mode = mode or _gemm_mode(x.device, recipe, emulate)
    out = _BlockMatmul.apply(x.reshape(-1, x.shape[-1]), weight, output_dtype(x), recipe, mode, generator)
    out = out.reshape(*x.shape[:-1], out.shape[-1])
    return out if bias is None else out + bias.to(out.dtype)


class BlockLinear(nn.Linear):
    """``nn.Linear`` running a block-scaled :class:`~mixprec.lowp.recipes.LinearRecipe` (module docstring).
    Same parameters and state_dict keys as ``nn.Linear``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None, *,
                 recipe: LinearRecipe, emulate: bool | None = None, seed: int = 0) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.recipe = recipe
        self.emulate = emulate
        self.generator: torch.Generator | None = None
        self._seed = seed

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, recipe: LinearRecipe, emulate: bool | None = None,
                    seed: int = 0) -> BlockLinear:
        """Wrap ``linear``'s own Parameter objects (no copy)."""
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=False, recipe=recipe, emulate=emulate, seed=seed)
        new.weight = linear.weight
        new.bias = linear.bias
        new.train(linear.training)
        return new

    def rounding_generator(self) -> torch.Generator | None:
        """The stochastic-rounding generator, made on the weight's device at first use (seeded per layer)."""
        if self.recipe.stochastic_rounding and (self.generator is None or self.generator.device != self.weight.device):
            self.generator = torch.Generator(device=self.weight.device).manual_seed(self._seed)
        return self.generator

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return block_linear(x, self.weight, self.bias, self.recipe, emulate=self.emulate,
                            generator=self.rounding_generator())

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.name}, emulate={self.emulate}"


def layer_seed(base: int, name: str) -> int:
    """A stable per-layer seed for stochastic rounding (the same model gets the same streams every run)."""
    return (base * 1_000_003 + sum((i + 1) * ord(c) for i, c in enumerate(name))) % (2**63) if name else base

