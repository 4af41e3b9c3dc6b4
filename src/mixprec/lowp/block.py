"""Linear layers whose three GEMMs run a block-scaled recipe (rowwise FP8, MXFP8, MXFP4, NVFP4), from scratch.

Which operand is quantised in which format, along which dimension, is the recipe's
(:mod:`mixprec.gemm_recipes`); the formats round exactly as :mod:`mixprec.blockformats` defines them
(bit-exact against torchao). This module runs the GEMMs.

Emulated GEMMs (every device; the only path for MX and NVFP4 here)
-----------------------------------------------------------------
Each operand is quantised along the GEMM's reduced dimension and its block scales are folded into its
values: ``v = q * s`` per block, held in **bf16**. That is exact wherever bf16 holds ``q * s``:

* rowwise and per-tensor FP8 (power-of-two scales, at most 2**48 apart from 1): always;
* MXFP8/MXFP4 (an e8m0 scale ``2**k`` times an e4m3/e2m1 element): unless the product falls below bf16's
  smallest subnormal spacing, 2**-133 -- e4m3 elements with scales below 2**-124 (amax below about
  2**-116), e2m1 below 2**-132. Such blocks lose low bits (or flush), where the hardware keeps them;
* NVFP4 block scales (e4m3, at least 2**-6) times e2m1 elements: always (at most 6 significant bits).

The GEMM is then a bf16 GEMM: exact products, fp32 accumulation, the sum rounded once to bf16 -- what a
block-scaled tensor core does with the scales applied inside the dot product. Two places differ from
the hardware:

* NVFP4's per-tensor fp32 scales ``t_a * t_b`` stay outside the GEMM (the hardware applies them as the
  GEMM's alpha before its single rounding): here the bf16 result is multiplied by them and rounded again,
  an extra relative error of at most 2**-9;
* fp32 outputs (``dW``) carry the bf16 rounding of the GEMM's sum, as in :mod:`mixprec.fp8` (the hardware
  can write fp32). fp16 outputs take an fp32 GEMM on the same operands instead.

``mode="reference"`` (tests and benchmarks) runs every GEMM in fp32 on the same bf16 operands and rounds
once to the output dtype: torchao's emulation does that, so the two agree bit for bit where their
quantisation agrees; the bf16 GEMM differs from it only by the accumulation order of oneDNN's kernels.

Real GEMMs
----------
``rowwise`` on CUDA compute capability 9.0+ runs ``torch._scaled_mm`` with FP8 e4m3 operands and fp32
per-row/per-column scales (``scale_a`` (M, 1), ``scale_b`` (1, N)) where both operands are rowwise and
every dimension is a multiple of 16; other GEMMs of the recipe (a per-tensor ``W``, bf16 ``dW``) and
MX/NVFP4 are emulated by this module -- their real kernels (sm100) are torchao's (``--fp8-impl torchao``).
**The real path has not run on a GPU yet** (written without one); it is covered on CPU only by the
emulation it must match.

Operands are quantised from the tensors as they reach the layer (``x`` in its dtype: fp32 for a first
layer fed fp32 data, bf16 after autocast ops, as :mod:`mixprec.fp8` and torchao do); autograd saves
``x`` and ``W`` unquantised, because backward quantises them again along other dimensions. The bias add
and its gradient run outside the GEMM Function in the output dtype (as torchao's ``Float8Linear``).
Tokens are zero-padded to the weight-gradient block (:attr:`LinearRecipe.token_block`).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from .. import hardware
from . import quant as quant_kernels
from .blockformats import ELEMENT_FORMATS, mx_scale_exponent, quantize_blocks, quantize_blocks_with_scales
from .gemm_context import no_autocast, output_dtype
from .recipes import LinearRecipe

__all__ = ["BlockLinear", "block_linear", "quantize_operand", "hadamard_matrix"]

_BF16 = torch.bfloat16
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


def _round_e2m1_stochastic(y: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """``y`` (within +-6) rounded to e2m1 stochastically: up with probability (y - lo) / (hi - lo)."""
    a = y.abs()
    _, e = torch.frexp(a)
    k = torch.clamp(e - 1, min=0, max=2) - 1  # log2 of e2m1's spacing at a: 0.5 below 2, then 1, then 2
    step = torch.ldexp(torch.ones_like(a), k)
    u = torch.rand(a.shape, generator=generator, device=a.device)
    q = torch.clamp(torch.floor(a / step + u) * step, max=6.0)
    return torch.copysign(q, y)


def _nvfp4_stochastic(t: torch.Tensor, axis: int, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 along ``axis`` with stochastically rounded elements: (block values ``q * s`` in bf16, tensor scale)."""
    bq = quantize_blocks_with_scales(t, "nvfp4", axis=axis)  # the scales; its RNE elements are not used
    rows = t.float().movedim(axis, -1)
    s = bq.scales.movedim(axis, -1)
    blocks = rows.reshape(*rows.shape[:-1], s.shape[-1], 16)
    m = (1.0 / bq.tensor_scale) / s
    q = _round_e2m1_stochastic(torch.clamp(blocks * m.unsqueeze(-1), -6.0, 6.0), generator)
    v = (q * s.unsqueeze(-1)).reshape(rows.shape).movedim(-1, axis)
    return v.to(_BF16), bq.tensor_scale


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """Exact float32 ``2**k`` for integer ``k`` in [-127, 127] (2**-127 is subnormal)."""
    k = k.to(torch.int32)
    return torch.where(k >= -126, (k + 127) << 23, torch.full_like(k, 1 << 22)).view(torch.float32)


def _mx_scales(amax: torch.Tensor, el, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    k = mx_scale_exponent(amax, el, rule)
    nan = torch.isnan(amax)
    return (torch.where(nan, torch.nan, _pow2(-k)), torch.where(nan, torch.nan, _pow2(k)))


def _rowwise_scales(amax: torch.Tensor, el, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    # blockformats' rowwise "pow2" rule: torchao's float32 m = 448 / max(amax, 1e-12), rounded down to 2**k by
    # exp2(floor(log2(m))) in float32; a non-finite amax makes the row NaN
    m = (el.max / torch.clamp(amax.double(), min=1e-12)).float()
    m = torch.exp2(torch.floor(torch.log2(m)))
    m = torch.where(torch.isfinite(amax), m, torch.nan)
    return m, torch.reciprocal(m)


def _nvfp4_scales(amax: torch.Tensor, el, rule: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # blockformats' nvfp4: tensor scale t (floored at 2**-121, NaN for inf/NaN), e4m3 block scales s >= 2**-6
    amax_t = amax.max()
    t = torch.clamp(amax_t / (448.0 * el.max), min=2.0**-121)
    t = torch.where(torch.isinf(amax_t), torch.nan, t)
    s = torch.clamp(amax / el.max / t, 2.0**-6, 448.0).to(torch.float8_e4m3fn).to(torch.float32)
    return (1.0 / t) / s, s, t


_E4M3, _E2M1 = ELEMENT_FORMATS["e4m3"], ELEMENT_FORMATS["e2m1"]
_FAST = {"mxfp8": (_E4M3, 32, _mx_scales), "mxfp4": (_E2M1, 32, _mx_scales), "e4m3-row": (_E4M3, None, _rowwise_scales),
         "nvfp4": (_E2M1, 16, _nvfp4_scales)}
"""Operand formats with a fused path: element format, block (None: the row) and the scale rule."""


def _fast_values(t: torch.Tensor, fmt: str, axis: int, rule: str | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`quantize_operand` for the formats of :data:`_FAST`, in few passes and without FP8 casts.

    The values are those of :func:`mixprec.blockformats.quantize_blocks` (tests check every format along both
    axes, with zero, tiny, huge, inf and NaN blocks): ``v = clamp(x * m, -max, max)`` is rounded to the element
    grid by the add/subtract of :func:`mixprec.fp8.to_fp8_as_bf16` -- ``M = 1.5 * 2**(max(e, emin) + 23 - mbits)``
    from v's own exponent ``e``, so fp32's spacing at ``M`` is the element format's at ``v`` and ``(v + M) - M``
    rounds to it, ties to even -- and the block scale is multiplied in on the way to bf16 (exact, one pass).
    Signed zeros come out as +0. Contiguous operands large enough take :func:`_fused_values` instead (the same
    values from one or two compiled calls, :mod:`mixprec.quant_kernels`).
    """
    if t.dim() == 2 and not t.is_contiguous() and t.t().is_contiguous():  # a transposed view: quantise the
        v, ts = _fast_values(t.t(), fmt, 1 - axis, rule)                   # stored tensor along the other axis
        return v.t(), ts
    el, block, scales = _FAST[fmt]
    axis = axis % t.dim()
    n = t.shape[axis]
    if t.is_contiguous():
        fused = _fused_values(t, el, block or n, scales, axis, rule)
        if fused is not None:
            return fused
    v = torch.empty(t.shape, dtype=torch.float32, device=t.device)
    v.copy_(t)  # a fresh fp32 copy in t's layout: everything below is in place on it; blocks along ``axis``
    b = v.view(*t.shape[:axis], n // (block or n), block or n, *t.shape[axis + 1:])
    amax = torch.maximum(b.amax(axis + 1), b.amin(axis + 1).neg())  # two read-only passes, NaN propagates
    got = scales(amax, el, rule)
    m, s = got[0].unsqueeze(axis + 1), got[1].unsqueeze(axis + 1)
    b.mul_(m).clamp_(-el.max, el.max)
    magic = torch.bitwise_and(v.view(torch.int32), 0x7F800000)
    magic.clamp_(min=(127 + el.emin) << 23).add_(((23 - el.mantissa_bits) << 23) | 0x400000)
    mf = magic.view(torch.float32)
    v.add_(mf).sub_(mf)
    out = torch.empty(t.shape, dtype=_BF16, device=t.device)
    torch.mul(b, s, out=out.view(b.shape))
    return out, (got[2] if len(got) > 2 else None)


def _fused_values(t: torch.Tensor, el, block: int, scales, axis: int, rule: str | None
                  ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """:func:`_fast_values` of a contiguous ``t`` through :mod:`mixprec.quant_kernels`: MX in one compiled
    call (amax, e8m0 scales, rounding); rowwise and NVFP4 as the compiled block amax, their scales computed
    eagerly as :func:`_fast_values` does, then the compiled scale-round-unscale. None where it does not compile."""
    if scales is _mx_scales:
        q = quant_kernels.mx_values(t, axis, block=block, el_max=el.max, emax=el.emax, sig=el.mantissa_bits + 1,
                                    emin=el.emin, mbits=el.mantissa_bits, floor=rule == "floor")
        return None if q is None else (q, None)
    b = t.view(*t.shape[:axis], t.shape[axis] // block, block, *t.shape[axis + 1:])
    amax = quant_kernels.block_amax(b, axis + 1)
    if amax is None:
        return None
    got = scales(amax, el, rule)
    m, s = got[0].unsqueeze(axis + 1), got[1].unsqueeze(axis + 1)
    q = quant_kernels.apply_scaled(b, m, s, el.max, sig=el.mantissa_bits + 1, emin=el.emin, mbits=el.mantissa_bits,
                                  dim=axis + 1)
    return None if q is None else (q.view(t.shape), got[2] if len(got) > 2 else None)


def quantize_operand(t: torch.Tensor, fmt: str, axis: int, *, scale_rule: str | None = None,
                     stochastic: bool = False, generator: torch.Generator | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A GEMM operand in ``fmt`` (a key of :data:`mixprec.gemm_recipes.OPERAND_FORMATS`) quantised along
    ``axis`` (the reduced dimension): ``(bf16 values with the block scales folded in, the scale the GEMM's
    output is multiplied by, or None)``. The second is NVFP4's per-tensor scale and the per-tensor FP8
    scale; block scales are in the values (exact in bf16, see the module docstring).
    """
    t = t.detach()
    if fmt == "bf16":
        return t.to(_BF16), None
    if fmt == "e5m2-tensor":
        raise ValueError("per-tensor e5m2 operands are mixprec.fp8's (the tensorwise recipe), not a block format")
    if fmt == "e4m3-tensor":
        # torchao's tensorwise rule with power-of-two scales = its rowwise rule over the flattened tensor
        v = quantize_blocks(t.reshape(1, -1), "fp8_e4m3_rowwise", axis=1).reshape(t.shape)
        return v.to(_BF16), None
    if fmt == "nvfp4" and stochastic:
        return _nvfp4_stochastic(t, axis, generator)
    return _fast_values(t, fmt, axis, scale_rule)


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
        with no_autocast(x.device.type), quant_kernels.layer_size(weight.numel()):
            y = _gemm(x, recipe.output[0], weight.t(), recipe.output[1], out_dtype, recipe, mode)
        ctx.save_for_backward(x, weight)
        ctx.recipe, ctx.mode, ctx.generator = recipe, mode, generator
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        r, mode = ctx.recipe, ctx.mode
        dx = dw = None
        with no_autocast(dy.device.type), quant_kernels.layer_size(weight.numel()):
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
    real = recipe.name == "rowwise" and hardware.has_lowp_units("rowwise", device)
    if emulate is False and not real:
        raise RuntimeError(f"block_linear(..., emulate=False) with the {recipe.name} recipe needs real kernels "
                           f"(rowwise FP8: CUDA compute capability 9.0+), which {device} lacks; use emulate=None")
    return "real" if real and not emulate else "emulated"


def block_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: LinearRecipe, *,
                 emulate: bool | None = None, generator: torch.Generator | None = None,
                 mode: str | None = None) -> torch.Tensor:
    """``F.linear`` with the three GEMMs of ``recipe``. ``emulate`` as :func:`mixprec.fp8.fp8_linear`;
    ``mode`` (tests, benchmarks) forces ``"emulated"``, ``"reference"`` or ``"real"``."""
    mode = mode or _gemm_mode(x.device, recipe, emulate)
    out = _BlockMatmul.apply(x.reshape(-1, x.shape[-1]), weight, output_dtype(x), recipe, mode, generator)
    out = out.reshape(*x.shape[:-1], out.shape[-1])
    return out if bias is None else out + bias.to(out.dtype)


class BlockLinear(nn.Linear):
    """``nn.Linear`` running a block-scaled :class:`~mixprec.gemm_recipes.LinearRecipe` (module docstring).
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

