"""Block-scaled FP8 and FP4: rowwise, 1x128, MXFP8, MXFP4 and NVFP4, exactly as their definitions round.

What a block format is
----------------------
A tensor is cut, along one ``axis``, into blocks of ``B`` consecutive values. Each block stores one
*scale* ``s`` and ``B`` *elements* ``q_i`` in a narrow float format, and stands for the values
``q_i * s``. The scale moves the block's largest magnitude ``amax`` to the top of the element
format's range, so a small format needs range only *inside* a block, not across the tensor; the
smaller the block, the less an outlier costs its neighbours. In a GEMM the reduced dimension is the
one cut into blocks, so every product of two elements shares one pair of scales and the scales
leave the inner loop. ``quantize_blocks(x, fmt, axis=...)`` returns, in float32, the values
``q_i * s`` that such a GEMM multiplies; ``quantize_blocks_with_scales`` returns ``q`` and ``s``
separately (a recipe feeds ``q`` to a GEMM and applies ``s`` outside it).

===================== ======= ===== ===================== ==========================================
format                element block scale                 defined by
===================== ======= ===== ===================== ==========================================
``fp8_e4m3_rowwise``  e4m3    row   fp32, power of two    torchao ``Float8LinearConfig`` "rowwise"
``fp8_e4m3_block128`` e4m3    128   fp32, power of two    TransformerEngine ``Float8BlockScaling``
``mxfp8_e4m3``        e4m3    32    e8m0                  OCP MX v1.0 (MXFP8)
``mxfp8_e5m2``        e5m2    32    e8m0                  OCP MX v1.0 (MXFP8)
``mxfp4``             e2m1    32    e8m0                  OCP MX v1.0 (MXFP4)
``nvfp4``             e2m1    16    e4m3, times fp32 per  NVIDIA NVFP4, as torchao's ``nvfp4_quantize``
                                    tensor
===================== ======= ===== ===================== ==========================================

Element formats: e4m3 (max 448, smallest subnormal 2**-9, no inf), e5m2 (max 57344, 2**-16, has
inf) and e2m1 (the values 0, 0.5, 1, 1.5, 2, 3, 4, 6; no inf, no NaN). e8m0 is an exponent alone:
the scales 2**-127 ... 2**127, and one NaN code. A "row" is the whole ``axis``.

Elements: one rule for every format
-----------------------------------
``q = RNE(clamp(x * m, -max, max))`` where ``m`` is the block's multiplier (the inverse of its scale,
below), ``clamp`` saturates at the element format's largest finite value (also for e5m2, whose inf
is never produced: the OCP MX spec's "clamping normal numbers to the max normal"), and RNE rounds to
nearest, ties to even, with the element format's subnormals. FP8 elements round through PyTorch's
own cast (bit-identical to :func:`mixprec.formats.quantize`); e2m1 rounds here, by the same rule,
because PyTorch's ``float4_e2m1fn_x2`` is a packed storage type without a cast. Signed zeros are
kept. For a power-of-two ``m`` the product ``x * m`` is exact, so RNE is the only rounding; for an
fp32 ``m`` (the ``"fp32"`` rules, NVFP4) it rounds once to float32 first, as the references do.

Scales
------
``fp8_e4m3_rowwise`` (torchao ``Float8LinearConfig.from_recipe_name("rowwise")``, which sets
``round_scales_to_power_of_2=True``; torchao's ``amax_to_scale`` step for step): per row,
``m = float32(448 / max(amax, 1e-12))`` in float64 (written as torchao writes it, which makes it
``448 * (1 / amax)``), then, for rule ``"pow2"`` (the default), ``m = exp2(floor(log2(m)))`` in
float32. float32 ``log2`` rounds to the integer ``k`` for an ``m`` a few ulps below ``2**k``, so such a
row gets ``m = 2**k``, not ``2**(k-1)``, and its largest element saturates at 448, as in torchao. The
1e-12 floor caps ``m`` (at 2**48 for ``"pow2"``): values below about 2**-58 always flush to zero. Rule
``"fp32"`` keeps ``m`` unrounded (``round_scales_to_power_of_2=False``). The scale is
``s = float32(1 / m)``, the reciprocal torchao passes to ``torch._scaled_mm``.

``fp8_e4m3_block128`` (TransformerEngine ``Float8BlockScaling``, 1x128 tiles, as its kernels'
``compute_scale_from_amax`` does with the recipe's ``amax_epsilon=0``): per block,
``m = float32(448 / amax)``; if that overflows (amax below 448 / FLT_MAX) ``m`` is the input dtype's
largest finite value; rule ``"pow2"`` (TE's default, ``power_2_scale=True``) keeps the sign and
exponent bits of ``m`` (round down to a power of two, exactly); an all-zero block gets ``m = 1``.
Rule ``"fp32"`` keeps ``m`` unrounded (TE with ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1``; DeepSeek-V3's
own reference cast also uses fp32 scales, but floors amax at 1e-4 and stores ``amax / 448``).
``s = float32(1 / m)``, TE's ``scale_inv``.

MX, rule ``"floor"`` (OCP MX v1.0, section 6.3, the default): ``s = 2**clamp(floor(log2(amax)) -
emax, -127, 127)`` with ``emax`` the exponent of the element format's largest normal (8 for e4m3, 15
for e5m2, 2 for e2m1), read exactly from amax's float32 exponent field, and ``m = 1 / s`` exactly.
amax whose mantissa exceeds the element max's (e4m3: amax in ``(1.75, 2) * 2**E``) saturates at max.
MX, rule ``"rceil"`` (NVIDIA's cuBLAS/cuDNN block quantization and the hardware's
``cvt.rp.satfinite.ue8m0``, what torchao's MXFP8 training uses): ``d = float32(amax / max)`` (as
torchao divides; TransformerEngine multiplies by a rounded ``1 / max``, which can move the last bit
of ``d``), ``s = 2**clamp(ceil(log2(d)), -127, 127)`` with the ceiling taken exactly from d's bits, and
``m = 1 / s`` exactly: nothing saturates except by the float32 rounding of ``d``.

``nvfp4`` (two-level, as torchao's ``nvfp4_quantize`` with ``per_tensor_amax_to_scale``): a tensor
scale ``t = float32(amax_tensor / (448 * 6))`` over the *whole* tensor, but at least ``2**-121``; per
block ``s = e4m3(clamp(float32(float32(amax / 6) / t), 2**-6, 448))`` rounded to nearest (2**-6 is
e4m3's smallest normal, torchao's ``E4M3_EPS``: block scales are never subnormal);
``m = float32(float32(1 / t) / s)``. The values are ``float32((q * s) * t)``: ``q * s`` is exact (it is
what the GEMM multiplies on the hardware, with ``t_a * t_b`` applied to its output), so this is the
float32 nearest to the value the block represents.

Zero, subnormal and non-finite blocks
-------------------------------------
* All-zero block: elements are (signed) zeros, any format. Its scale is 2**-127 (MX), 1 (block128),
  2**-48 (rowwise ``"pow2"``; ``"fp32"``: ``1 / 448e12``), 2**-6 (NVFP4 block scale).
* MX blocks whose scale is 2**-127 (FLOOR: amax below ``2**(emax - 126)``, which includes every
  amax that is a float32 subnormal; RCEIL: amax at most ``max * 2**-127``) are quantized with
  ``m = 2**127``, as the spec and cuDNN's ``vals / scale`` define it.
* NaN anywhere in a block: the block is NaN (MX: the e8m0 NaN scale; the others: NaN scale).
* Inf in an MX block: the scale is derived from inf's exponent field as if amax were ``2**128``
  (``s = 2**(128 - emax)``, RCEIL: saturates at 2**127); the inf element saturates at max, so it reads
  back as ``max * s``, which overflows float32 to ``±inf``; the block's finite elements keep their
  values on that scale (most flush to zero). The spec's ``floor(log2(inf))`` is undefined; this is
  torchao's reading (its exponent-field arithmetic); Microsoft's microxcaling emulator instead makes
  the whole block NaN.
* Inf in a rowwise or block128 block: the block is NaN (torchao's rowwise arithmetic gives that;
  TransformerEngine's kernel instead uses ``m = 1`` for a non-finite amax, so inf saturates to 448 and
  a NaN stays in place -- an overflow a loss scaler would not see).
* NVFP4: inf or NaN anywhere makes the tensor scale, and so the whole tensor, NaN.
* Values near FLT_MAX can read back as inf: an element may round up to a value whose product with
  the scale exceeds float32 (block128 or RCEIL: FLT_MAX -> element 256, scale 2**120, value 2**128).

Where torchao 0.18 departs from these rules (tests pin each one)
----------------------------------------------------------------
* MX FLOOR, scale 2**-127: ``to_mx`` divides by ``max(s, 2**-126)`` but stores ``s = 2**-127``, so the
  block dequantizes to about half its value (elements ``RNE(x * 2**126)`` under scale ``2**-127``).
* MX RCEIL, scale 2**-127: ``_to_mx_rceil`` uses ``m = 1`` (as TransformerEngine's ``exp2f_rcp``), so
  such a block flushes to zero.
* MX RCEIL in eager mode takes ``ceil`` of a float32 ``log2(d)``, which rounds down to the integer for
  ``d`` a few ulps above ``2**k``; it then picks ``2**k`` and saturates, where the exact ceiling (and
  the hardware instruction torchao uses under ``torch.compile`` on Blackwell) picks ``2**(k+1)``.
* NVFP4, tiny tensors: for an all-zero tensor torchao divides 0 by ``t = 0`` and returns NaN; for a
  tensor amax below about 5e-34 its ``1 / t / s`` overflows on a zero block, and the NaN that e2m1
  cannot hold reads back as nonzero garbage. Flooring ``t`` at 2**-121, the smallest power of two
  that keeps ``1 / t / s`` finite for every block scale, changes only tensors whose amax is below
  2688 * 2**-121 (about 1e-33).
* NVFP4 ``NVFP4Tensor.dequantize`` multiplies ``q * float32(t * s)``, rounding ``t * s`` first: up to
  one float32 ulp from the value above. Elements, block scales and ``t`` are bit-identical.
* Rowwise ``"fp32"``: ``Float8TrainingTensor.to_original_precision`` divides ``q / m``; the values here
  are ``q * float32(1 / m)``, the scale its GEMM uses: up to one ulp apart. Elements and scales agree.

Inputs are float32, bfloat16 or float16, converted to float32 exactly; every reduced dimension must
be a multiple of the block size (a layer filter skips a layer that does not fit: nothing is padded).
Everything is elementwise torch arithmetic on float32/int32 (float64 for the rowwise scale), on
``x``'s device, without host syncs and without autograd history (a recipe supplies the gradient).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ElementFormat", "ScaleFormat", "BlockFormat", "BlockQuantized", "ELEMENT_FORMATS", "SCALE_FORMATS",
           "BLOCK_FORMATS", "get_block_format", "quantize_blocks", "quantize_blocks_with_scales", "mx_scale_exponent"]


@dataclass(frozen=True, kw_only=True)
class ElementFormat:
    """A narrow float format that block elements are stored in."""

    name: str
    """``"e4m3"``, ``"e5m2"`` or ``"e2m1"``."""
    exponent_bits: int
    """Width of the exponent field."""
    mantissa_bits: int
    """Width of the mantissa field (the precision is ``2**-mantissa_bits``)."""
    max: float
    """Largest finite value; rounding saturates here."""
    emax: int
    """Exponent of the largest normal value (``max = (1 + f) * 2**emax``); the MX FLOOR rule subtracts it."""
    has_inf: bool
    """Whether the format encodes infinity (e5m2 only; block quantization never produces it)."""
    torch_dtype: torch.dtype | None
    """The PyTorch dtype whose cast rounds into this format, or ``None`` (e2m1: ``float4_e2m1fn_x2``
    packs two elements per byte and has no cast)."""

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal value."""
        return 1 - (2 ** (self.exponent_bits - 1) - 1)

    @property
    def smallest_subnormal(self) -> float:
        """The smallest positive value."""
        return 2.0 ** (self.emin - self.mantissa_bits)


@dataclass(frozen=True, kw_only=True)
class ScaleFormat:
    """The format block scales are stored in."""

    name: str
    """``"fp32"``, ``"e8m0"`` (a biased exponent alone) or ``"e4m3"``."""
    bits: int
    """Storage width of one scale."""
    min: float
    """Smallest positive scale the format stores (e4m3 scales are clamped to it)."""
    max: float
    """Largest finite scale."""
    torch_dtype: torch.dtype | None
    """PyTorch dtype that stores it, where the installed torch has one."""


@dataclass(frozen=True, kw_only=True)
class BlockFormat:
    """One block-scaled format: what a block holds and whose rules derive its scale."""

    name: str
    """Name passed to :func:`quantize_blocks`."""
    element: ElementFormat
    """Format of the elements."""
    block_size: int | None
    """Elements per scale along the quantized axis; ``None``: the whole axis (one scale per row)."""
    scale: ScaleFormat
    """Format of the per-block scales."""
    tensor_scale: bool
    """Whether a second, per-tensor float32 scale multiplies the block scales (NVFP4)."""
    scale_rules: tuple[str, ...]
    """Rules :func:`quantize_blocks` accepts as ``scale_rule``; the first is the default."""
    reference: str
    """The definition this format follows, bit for bit."""


@dataclass(frozen=True, kw_only=True)
class BlockQuantized:
    """A tensor in a block format: elements and scales, each decoded to float32.

    ``dequantize()`` gives ``elements * scales`` (times ``tensor_scale`` for NVFP4), scales repeated
    ``block_size`` times along ``axis``: the values :func:`quantize_blocks` returns.
    """

    format: BlockFormat
    """The block format."""
    scale_rule: str
    """The rule that derived the scales."""
    axis: int
    """The quantized dimension (non-negative)."""
    block_size: int
    """Elements per scale along ``axis`` (the axis length for a rowwise format)."""
    elements: torch.Tensor
    """float32, ``x``'s shape: every value is one of the element format's (NaN in a NaN block)."""
    scales: torch.Tensor
    """float32, ``x``'s shape with ``axis`` cut to ``size // block_size``: each block's decode scale
    (what its elements are multiplied by); NaN for a NaN block."""
    tensor_scale: torch.Tensor | None
    """float32 scalar for NVFP4 (the per-tensor decode scale), else ``None``."""

    def dequantize(self) -> torch.Tensor:
        """The float32 values the block format represents (see the module docstring)."""
        v = self.elements * self.scales.repeat_interleave(self.block_size, dim=self.axis)
        return v if self.tensor_scale is None else v * self.tensor_scale


def _dtype(name: str) -> torch.dtype | None:
    return getattr(torch, name, None)


ELEMENT_FORMATS: dict[str, ElementFormat] = {
    e.name: e
    for e in (
        ElementFormat(name="e4m3", exponent_bits=4, mantissa_bits=3, max=448.0, emax=8, has_inf=False,
                      torch_dtype=torch.float8_e4m3fn),
        ElementFormat(name="e5m2", exponent_bits=5, mantissa_bits=2, max=57344.0, emax=15, has_inf=True,
                      torch_dtype=torch.float8_e5m2),
        ElementFormat(name="e2m1", exponent_bits=2, mantissa_bits=1, max=6.0, emax=2, has_inf=False,
                      torch_dtype=None),
    )
}

SCALE_FORMATS: dict[str, ScaleFormat] = {
    s.name: s
    for s in (
        ScaleFormat(name="fp32", bits=32, min=2.0**-149, max=torch.finfo(torch.float32).max,
                    torch_dtype=torch.float32),
        ScaleFormat(name="e8m0", bits=8, min=2.0**-127, max=2.0**127, torch_dtype=_dtype("float8_e8m0fnu")),
        ScaleFormat(name="e4m3", bits=8, min=2.0**-6, max=448.0, torch_dtype=torch.float8_e4m3fn),
    )
}

_E4M3, _E5M2, _E2M1 = ELEMENT_FORMATS["e4m3"], ELEMENT_FORMATS["e5m2"], ELEMENT_FORMATS["e2m1"]
_FP32, _E8M0, _E4M3_SCALE = SCALE_FORMATS["fp32"], SCALE_FORMATS["e8m0"], SCALE_FORMATS["e4m3"]
_MX_RULES = ("floor", "rceil")
_OCP = "OCP MX v1.0 section 6.3 (FLOOR); NVIDIA cuBLAS/cuDNN block quantization (RCEIL)"

BLOCK_FORMATS: dict[str, BlockFormat] = {
    f.name: f
    for f in (
        BlockFormat(name="fp8_e4m3_rowwise", element=_E4M3, block_size=None, scale=_FP32, tensor_scale=False,
                    scale_rules=("pow2", "fp32"),
                    reference="torchao Float8LinearConfig.from_recipe_name('rowwise') (float8 amax_to_scale)"),
        BlockFormat(name="fp8_e4m3_block128", element=_E4M3, block_size=128, scale=_FP32, tensor_scale=False,
                    scale_rules=("pow2", "fp32"),
                    reference="TransformerEngine Float8BlockScaling, 1x128 tiles (compute_scale_from_amax)"),
        BlockFormat(name="mxfp8_e4m3", element=_E4M3, block_size=32, scale=_E8M0, tensor_scale=False,
                    scale_rules=_MX_RULES, reference=_OCP),
        BlockFormat(name="mxfp8_e5m2", element=_E5M2, block_size=32, scale=_E8M0, tensor_scale=False,
                    scale_rules=_MX_RULES, reference=_OCP),
        BlockFormat(name="mxfp4", element=_E2M1, block_size=32, scale=_E8M0, tensor_scale=False,
                    scale_rules=_MX_RULES, reference=_OCP),
        BlockFormat(name="nvfp4", element=_E2M1, block_size=16, scale=_E4M3_SCALE, tensor_scale=True,
                    scale_rules=("nearest",),
                    reference="NVIDIA NVFP4 as torchao nvfp4_quantize computes it (per_tensor_amax_to_scale)"),
    )
}

_ALIASES = {"fp8_rowwise": "fp8_e4m3_rowwise", "rowwise": "fp8_e4m3_rowwise", "fp8_block128": "fp8_e4m3_block128",
            "block128": "fp8_e4m3_block128", "mxfp8": "mxfp8_e4m3"}
_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ROWWISE_EPS = 1e-12  # torchao.float8.float8_utils.EPS
_NVFP4_MIN_TENSOR_SCALE = 2.0**-121  # keeps 1 / t / s finite for every block scale s >= 2**-6


def get_block_format(fmt: str | BlockFormat) -> BlockFormat:
    """Look up a block format by name (``"mxfp8_e4m3"``) or alias (``"mxfp8"``, ``"fp8-rowwise"``)."""
    if isinstance(fmt, BlockFormat):
        return fmt
    if isinstance(fmt, str):
        key = fmt.strip().lower().replace("-", "_")
        key = _ALIASES.get(key, key)
        if key in BLOCK_FORMATS:
            return BLOCK_FORMATS[key]
    raise ValueError(f"get_block_format({fmt!r}): unknown block format; use one of {', '.join(BLOCK_FORMATS)} "
                     f"(aliases: {', '.join(_ALIASES)})")


# ------------------------------------------------------------------------------------------- helpers


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """Exact float32 ``2**k`` for integer ``k`` in [-127, 127], built from bits (2**-127 is subnormal)."""
    k = k.to(torch.int32)
    bits = torch.where(k >= -126, (k + 127) << 23, torch.full_like(k, 1 << 22))
    return bits.view(torch.float32)


def _exponent_field(a: torch.Tensor) -> torch.Tensor:
    """``floor(log2(a))`` for a positive normal float32 ``a``; -127 for 0 and subnormals; 128 for inf."""
    return ((a.view(torch.int32) >> 23) & 0xFF) - 127


def _round_elements(y: torch.Tensor, el: ElementFormat) -> torch.Tensor:
    """RNE of ``y`` (already within ±max, or NaN) into ``el``, as float32."""
    if el.torch_dtype is not None:
        return y.to(el.torch_dtype).to(torch.float32)
    a = y.abs()
    _, e = torch.frexp(a)  # a = mant * 2**e, 0.5 <= mant < 1; e = 0 for a = 0
    k = torch.clamp(e - 1, min=el.emin, max=el.emax) - el.mantissa_bits  # log2 of the spacing at a
    q = torch.round(a * _pow2(-k)) * _pow2(k)  # both scalings exact; torch.round is half-to-even
    return torch.copysign(q, y)


def _saturate_round(blocks: torch.Tensor, m: torch.Tensor, el: ElementFormat) -> torch.Tensor:
    return _round_elements(torch.clamp(blocks * m.unsqueeze(-1), -el.max, el.max), el)


def _nan_where(bad: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return torch.where(bad, torch.full_like(t, float("nan")), t)


# ---------------------------------------------------------------------- one function per scale family


def _rowwise(blocks: torch.Tensor, f: BlockFormat, rule: str, in_dtype: torch.dtype):
    amax = blocks.abs().amax(dim=-1)
    m = (f.element.max / torch.clamp(amax.double(), min=_ROWWISE_EPS)).float()  # as torchao: 448 * (1 / amax)
    if rule == "pow2":
        m = torch.exp2(torch.floor(torch.log2(m)))  # torchao's _round_scale_down_to_power_of_2, float32
    bad = ~torch.isfinite(amax)
    elements = _nan_where(bad.unsqueeze(-1), _saturate_round(blocks, m, f.element))
    return elements, _nan_where(bad, torch.reciprocal(m)), None


def _block128(blocks: torch.Tensor, f: BlockFormat, rule: str, in_dtype: torch.dtype):
    amax = blocks.abs().amax(dim=-1)
    m = torch.full_like(amax, f.element.max) / amax  # one rounding, TE's __fdiv_rn (a Python number / a tensor
    # would be 448 * (1 / amax), two)
    m = torch.where(torch.isinf(m), torch.full_like(m, torch.finfo(in_dtype).max), m)
    if rule == "pow2":
        m = (m.view(torch.int32) & 0x7F800000).view(torch.float32)  # m > 0: keep the exponent bits
    m = torch.where(amax == 0, torch.ones_like(m), m)
    bad = ~torch.isfinite(amax)
    elements = _nan_where(bad.unsqueeze(-1), _saturate_round(blocks, m, f.element))
    return elements, _nan_where(bad, torch.reciprocal(m)), None


def mx_scale_exponent(amax: torch.Tensor, el: ElementFormat, rule: str) -> torch.Tensor:
    """int32 ``k`` of each MX block's scale ``2**k`` from its float32 ``amax`` (``rule``: ``"floor"`` or
    ``"rceil"``, module docstring); NaN blocks are the caller's to mark."""
    if rule == "floor":
        # Subnormal (and zero) amax reads as -127; its true floor(log2) is lower, but emax >= 2 puts
        # both below the e8m0 minimum, so the clamp gives the spec's scale either way.
        k = _exponent_field(amax) - el.emax
    else:
        d = amax / el.max
        bits = d.view(torch.int32)
        k = _exponent_field(d) + ((bits & 0x7FFFFF) != 0).to(torch.int32)  # exact ceil(log2(d)), d normal
        k = torch.where(bits < (1 << 23), torch.where(bits > (1 << 22), -126, -127), k)  # d subnormal or 0
    return torch.clamp(k, -127, 127)


def _mx(blocks: torch.Tensor, f: BlockFormat, rule: str, in_dtype: torch.dtype):
    el = f.element
    amax = blocks.abs().amax(dim=-1)
    k = mx_scale_exponent(amax, el, rule)
    nan = torch.isnan(amax)
    elements = _nan_where(nan.unsqueeze(-1), _saturate_round(blocks, _pow2(-k), el))
    return elements, _nan_where(nan, _pow2(k)), None


def _nvfp4(blocks: torch.Tensor, f: BlockFormat, rule: str, in_dtype: torch.dtype):
    el, sf = f.element, f.scale
    amax_t = blocks.abs().amax()
    t = torch.clamp(amax_t / (sf.max * el.max), min=_NVFP4_MIN_TENSOR_SCALE)  # NaN stays NaN
    t = _nan_where(torch.isinf(amax_t), t)
    s = torch.clamp(blocks.abs().amax(dim=-1) / el.max / t, sf.min, sf.max).to(sf.torch_dtype).to(torch.float32)
    m = (1.0 / t) / s
    return _saturate_round(blocks, m, el), s, t


def _quantizer(f: BlockFormat):
    """The scale family of a format: e8m0 scales are MX; a tensor scale is NVFP4; else fp32 per row or tile."""
    if f.scale.name == "e8m0":
        return _mx
    if f.tensor_scale:
        return _nvfp4
    return _rowwise if f.block_size is None else _block128


# ------------------------------------------------------------------------------------------- public


@torch.no_grad()
def quantize_blocks_with_scales(
    x: torch.Tensor, fmt: str | BlockFormat, *, axis: int = -1, scale_rule: str | None = None
) -> BlockQuantized:
    """Quantize ``x`` to a block format along ``axis``; returns its elements and scales separately.

    Args:
        x: float32, bfloat16 or float16 tensor; ``x.shape[axis]`` must be a multiple of the block size.
        fmt: a name from :data:`BLOCK_FORMATS` (or alias), or a :class:`BlockFormat`.
        axis: the dimension cut into blocks (the GEMM's reduced dimension).
        scale_rule: one of the format's ``scale_rules`` (MX: ``"floor"``, the default, or ``"rceil"``;
            rowwise and block128: ``"pow2"``, the default, or ``"fp32"``); ``None`` for the default.
    """
    f = get_block_format(fmt)
    call = f"quantize_blocks(x of shape {tuple(x.shape)}, {f.name!r}, axis={axis})"
    rule = f.scale_rules[0] if scale_rule is None else scale_rule
    if rule not in f.scale_rules:
        raise ValueError(f"{call}: scale_rule={scale_rule!r} is not a rule of {f.name}; "
                         f"use one of {', '.join(map(repr, f.scale_rules))} (or None for {f.scale_rules[0]!r})")
    if x.dtype not in _INPUT_DTYPES:
        raise TypeError(f"{call}: x is {x.dtype}; pass float32, bfloat16 or float16 (convert it first)")
    if x.dim() == 0 or not -x.dim() <= axis < x.dim():
        raise ValueError(f"{call}: axis {axis} is not a dimension of x; x needs at least one dimension")
    ax = axis % x.dim()
    n = x.shape[ax]
    bs = f.block_size or n
    if f.block_size is not None and n % bs:
        raise ValueError(f"{call}: dimension {ax} has {n} elements, not a multiple of {f.name}'s block size {bs}; "
                         f"every dimension a block format reduces must be a multiple of its block size "
                         f"(keep this tensor in higher precision, or pad it)")
    x32 = x.to(torch.float32)
    rows = x32.movedim(ax, -1)
    if rows.numel() == 0:
        scales = torch.ones(*rows.shape[:-1], n // bs if bs else 1, device=x.device).movedim(-1, ax)
        t = torch.ones((), device=x.device) if f.tensor_scale else None
        return BlockQuantized(format=f, scale_rule=rule, axis=ax, block_size=bs, elements=x32.clone(),
                              scales=scales, tensor_scale=t)
    blocks = rows.reshape(*rows.shape[:-1], n // bs, bs)
    elements, scales, t = _quantizer(f)(blocks, f, rule, x.dtype)
    return BlockQuantized(format=f, scale_rule=rule, axis=ax, block_size=bs,
                          elements=elements.reshape(rows.shape).movedim(-1, ax), scales=scales.movedim(-1, ax),
                          tensor_scale=t)


def quantize_blocks(
    x: torch.Tensor, fmt: str | BlockFormat, *, axis: int = -1, scale_rule: str | None = None
) -> torch.Tensor:
    """The float32 values ``x`` holds in block format ``fmt`` along ``axis`` (what a block-scaled GEMM
    multiplies); arguments as :func:`quantize_blocks_with_scales`."""
    return quantize_blocks_with_scales(x, fmt, axis=axis, scale_rule=scale_rule).dequantize()
