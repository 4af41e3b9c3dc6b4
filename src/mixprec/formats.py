"""Floating-point formats, and rounding into them: element formats (fp32 ... fp8) and block-scaled FP8/FP4.

Element formats
---------------
A normal number is ``(1 + f / 2**m) * 2**E`` (``m`` mantissa bits); one ulp above ``2**E`` is ``2**(E - m)``:

========== ==== === === ============ =============== ================= ========
format     bits  e   m  max finite   smallest normal smallest subnorm. eps
========== ==== === === ============ =============== ================= ========
fp32        32   8  23  3.40e38      2**-126         2**-149           2**-23
tf32        19   8  10  3.40e38      2**-126         2**-136           2**-10
bf16        16   8   7  3.39e38      2**-126         2**-133           2**-7
fp16        16   5  10  65504        2**-14          2**-24            2**-10
fp8_e4m3     8   4   3  448          2**-6           2**-9             2**-3
fp8_e5m2     8   5   2  57344        2**-14          2**-16            2**-2
========== ==== === === ============ =============== ================= ========

The exponent width sets the range, the mantissa width the precision. tf32 (NVIDIA tensor cores' fp32 matmul
input) has no torch dtype. e4m3 is the ``fn`` variant: no infinity, its max is 448.

:func:`quantize` rounds to nearest, ties to even (RNE), bit-identical to ``x.to(dtype).float()`` including
subnormals, signed zero, infinities and overflow; it is for tf32, stochastic rounding and as a checked
reference. It works in float64, where every scaling by ``2**k`` is exact: the ulp of the format at ``x`` is
``2**k``, ``k = max(exp - 1, emin) - m`` (``torch.frexp``), and ``round(x / 2**k) * 2**k`` is the only
rounding. Past ``max``: ``±inf`` for the IEEE formats and e5m2; e4m3fn saturates to ``±448`` (probed from the
installed torch at import; older releases gave NaN). NaN stays NaN (compare by ``isnan``).

Stochastic rounding rounds up to the next grid point with probability ``(x - lo) / (hi - lo)``, so
``E[q(x)] = x`` (the small updates RNE loses survive in expectation); ``u ~ U[0, 1)`` is a float64 from
``generator``, one ``torch.rand`` of ``x.numel()`` per call. Outside ``[-max, max]`` it falls back to RNE.

Block-scaled formats
--------------------
A tensor is cut along ``axis`` (a GEMM's reduced dimension) into blocks of ``B`` values; each block stores
one scale ``s`` and ``B`` elements ``q_i`` and stands for ``q_i * s``. :func:`quantize_blocks` returns those
values in float32, :func:`quantize_blocks_with_scales` the elements and scales apart.

===================== ======= ===== ===================== ==========================================
format                element block scale                 defined by (bit for bit)
===================== ======= ===== ===================== ==========================================
``fp8_e4m3_rowwise``  e4m3    row   fp32, power of two    torchao ``Float8LinearConfig`` "rowwise"
``fp8_e4m3_block128`` e4m3    128   fp32, power of two    TransformerEngine ``Float8BlockScaling``
``mxfp8_e4m3``        e4m3    32    e8m0                  OCP MX v1.0 (MXFP8)
``mxfp8_e5m2``        e5m2    32    e8m0                  OCP MX v1.0 (MXFP8)
``mxfp4``             e2m1    32    e8m0                  OCP MX v1.0 (MXFP4)
``nvfp4``             e2m1    16    e4m3, times fp32 per  NVIDIA NVFP4, as torchao's ``nvfp4_quantize``
                                    tensor
===================== ======= ===== ===================== ==========================================

Elements: ``q = RNE(clamp(x * m, -max, max))`` with ``m`` the block's multiplier (the inverse of its scale),
saturating at the element format's max (e5m2's inf is never produced), signed zeros kept. The rounding is
:func:`round_to_grid`: PyTorch's FP8 casts on every input, and e2m1 (which has no cast) by the same rule. For a
power-of-two ``m`` the product is exact; for an fp32 ``m`` (rules ``"fp32"``, NVFP4) it rounds once to float32
first, as the references do.

Scales, per block of amax ``a``:

* rowwise (torchao's ``amax_to_scale``): ``m = float32(448 / max(a, 1e-12))``, then for rule ``"pow2"``
  (default) ``exp2(floor(log2(m)))`` in float32 -- whose ``log2`` rounds ``m`` a few ulps below ``2**k`` up
  to ``k``, so that row saturates at 448, as in torchao; ``"fp32"`` keeps ``m``. ``s = float32(1 / m)``.
* block128 (TE's ``compute_scale_from_amax``, ``amax_epsilon=0``): ``m = float32(448 / a)``, the input
  dtype's max if that overflows, 1 for a zero block; ``"pow2"`` (default) keeps its exponent bits.
* MX ``"floor"`` (OCP MX 6.3, default): ``s = 2**clamp(floor(log2 a) - emax, -127, 127)`` from a's exponent
  field (``emax``: 8 e4m3, 15 e5m2, 2 e2m1); can saturate the largest element. ``"rceil"`` (cuBLAS/cuDNN,
  ``cvt.rp.satfinite.ue8m0``; torchao's MXFP8 training): ``s = 2**clamp(ceil(log2(float32(a / max))),
  -127, 127)``, the ceiling exact from the bits. ``m = 1 / s`` exactly (``2**127`` at ``s = 2**-127``).
* NVFP4: ``t = max(float32(a_tensor / 2688), 2**-121)`` over the whole tensor, ``s = e4m3(clamp(a / 6 /
  t, 2**-6, 448))`` per block (never subnormal), ``m = (1 / t) / s``; values ``float32((q * s) * t)``.

A NaN block is NaN; an inf makes a rowwise or block128 block NaN, and the whole NVFP4 tensor; in an MX block
inf's exponent field gives the scale (``2**(128 - emax)``) and the inf element saturates, reading back as
``±inf``. Where torchao 0.18 departs from these rules, tests/test_block_formats.py pins what it does instead
(MX scale 2**-127 blocks, eager RCEIL's float32 ``log2``, NVFP4 on tiny or zero tensors and its dequantize,
rowwise ``"fp32"`` dequantize). Inputs are float32, bfloat16 or float16; every reduced dimension must be a
multiple of the block. Elementwise torch arithmetic on ``x``'s device: no host syncs, no autograd history.
The same pieces (:func:`abs_max`, the scale rules, :func:`round_to_grid`) make the low-precision GEMMs'
operands (:mod:`mixprec.lowp.quant`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

__all__ = ["Format", "FORMATS", "get_format", "quantize",
           "ElementFormat", "ScaleFormat", "BlockFormat", "BlockQuantized", "ELEMENT_FORMATS", "SCALE_FORMATS",
           "BLOCK_FORMATS", "get_block_format", "quantize_blocks", "quantize_blocks_with_scales"]


@dataclass(frozen=True)
class Format:
    """One binary floating-point format.

    ``overflow`` says what rounding past ``max`` gives: ``"inf"`` (IEEE formats), ``"saturate"``
    (clamp to ``±max``; e4m3fn in current PyTorch) or ``"nan"`` (e4m3fn in older PyTorch).
    """

    name: str
    bits: int
    exponent_bits: int
    mantissa_bits: int
    max: float
    smallest_normal: float
    smallest_subnormal: float
    eps: float
    torch_dtype: torch.dtype | None
    has_inf: bool
    overflow: str

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal number (``smallest_normal == 2**emin``)."""
        return 1 - (2 ** (self.exponent_bits - 1) - 1)


def _probe_e4m3_overflow() -> str:
    """What the installed torch's cast to float8_e4m3fn does with a finite overflow."""
    y = torch.tensor([1.0e4, float("inf")]).to(torch.float8_e4m3fn).float()
    if bool(y.isnan().all()):
        return "nan"
    if bool((y == 448.0).all()):
        return "saturate"
    raise RuntimeError(f"unexpected float8_e4m3fn overflow behaviour in torch {torch.__version__}: {y}")


_E4M3_OVERFLOW = _probe_e4m3_overflow()

FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format("fp32", 32, 8, 23, (2 - 2.0**-23) * 2.0**127, 2.0**-126, 2.0**-149, 2.0**-23,
               torch.float32, True, "inf"),
        Format("tf32", 19, 8, 10, (2 - 2.0**-10) * 2.0**127, 2.0**-126, 2.0**-136, 2.0**-10,
               None, True, "inf"),
        Format("bf16", 16, 8, 7, (2 - 2.0**-7) * 2.0**127, 2.0**-126, 2.0**-133, 2.0**-7,
               torch.bfloat16, True, "inf"),
        Format("fp16", 16, 5, 10, 65504.0, 2.0**-14, 2.0**-24, 2.0**-10,
               torch.float16, True, "inf"),
        Format("fp8_e4m3", 8, 4, 3, 448.0, 2.0**-6, 2.0**-9, 2.0**-3,
               torch.float8_e4m3fn, False, _E4M3_OVERFLOW),
        Format("fp8_e5m2", 8, 5, 2, 57344.0, 2.0**-14, 2.0**-16, 2.0**-2,
               torch.float8_e5m2, True, "inf"),
    )
}

_ALIASES: dict[str, str] = {
    "float32": "fp32", "float": "fp32", "f32": "fp32",
    "tensorfloat32": "tf32", "tensorfloat-32": "tf32",
    "bfloat16": "bf16",
    "float16": "fp16", "half": "fp16", "f16": "fp16",
    "e4m3": "fp8_e4m3", "e4m3fn": "fp8_e4m3", "fp8_e4m3fn": "fp8_e4m3", "float8_e4m3fn": "fp8_e4m3",
    "e5m2": "fp8_e5m2", "float8_e5m2": "fp8_e5m2",
}
_BY_DTYPE: dict[torch.dtype, Format] = {f.torch_dtype: f for f in FORMATS.values() if f.torch_dtype}


def get_format(name_or_dtype: str | torch.dtype | Format) -> Format:
    """Look up a format by name (``"bf16"``), alias (``"bfloat16"``, ``"e4m3"``) or torch dtype."""
    if isinstance(name_or_dtype, Format):
        return name_or_dtype
    if isinstance(name_or_dtype, torch.dtype):
        if name_or_dtype in _BY_DTYPE:
            return _BY_DTYPE[name_or_dtype]
    elif isinstance(name_or_dtype, str):
        key = name_or_dtype.strip().lower().removeprefix("torch.")
        key = _ALIASES.get(key, key)
        if key in FORMATS:
            return FORMATS[key]
    valid = ", ".join(FORMATS)
    dtypes = ", ".join(str(d) for d in _BY_DTYPE)
    raise ValueError(
        f"get_format({name_or_dtype!r}): unknown floating format; use one of {valid} "
        f"(aliases such as 'bfloat16', 'float16', 'e4m3', 'e5m2'), or one of the dtypes {dtypes}"
    )


def quantize(
    x: torch.Tensor,
    fmt: str | torch.dtype | Format,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Round ``x`` to the values representable in ``fmt``; returns a new float32 tensor.

    Args:
        x: a floating-point tensor (converted to float32 first, as PyTorch's casts do).
        fmt: a :class:`Format`, a name or alias from :data:`FORMATS`, or a torch dtype.
        rounding: ``"nearest"`` (ties to even; bit-identical to ``x.to(dtype).float()``) or
            ``"stochastic"`` (unbiased; see the module docstring).
        generator: the random source for ``"stochastic"``, on ``x``'s device. ``None`` uses the
            global default generator of that device (the one ``torch.manual_seed`` seeds).
            Ignored for ``"nearest"``.
    """
    f = get_format(fmt)
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"quantize(..., rounding={rounding!r}): use 'nearest' or 'stochastic'")
    if not x.is_floating_point():
        raise TypeError(f"quantize(x, ...): x must be a floating-point tensor, got {x.dtype}")
    x32 = x.to(torch.float32)
    if f.name == "fp32":
        return x32.clone() if x32 is x else x32

    x64 = x32.to(torch.float64)
    _, exp = torch.frexp(x64)  # x = mant * 2**exp, 0.5 <= |mant| < 1; exp = 0 for 0, inf, nan
    k = torch.clamp(exp - 1, min=f.emin) - f.mantissa_bits  # log2 of the ulp of fmt at x
    y = x64 * pow2(-k, torch.float64)  # exact: |y| < 2**(m + 1)
    r = torch.round(y)  # half to even
    if rounding == "stochastic":
        lo = torch.floor(y)
        u = torch.rand(y.shape, dtype=torch.float64, device=y.device, generator=generator)
        sr = lo + (u < (y - lo)).to(torch.float64)
        r = torch.where(x64.abs() <= f.max, sr, r)
    q = torch.copysign(r * pow2(k, torch.float64), x64)  # exact; copysign keeps -0.0 for values rounded to zero

    over = q.abs() > f.max  # includes +-inf inputs, never NaN
    if f.overflow == "inf":
        q = torch.where(over, torch.copysign(torch.full_like(q, float("inf")), x64), q)
    elif f.overflow == "saturate":
        q = torch.where(over, torch.copysign(torch.full_like(q, f.max), x64), q)
    else:
        q = torch.where(over, torch.full_like(q, float("nan")), q)
    return q.to(torch.float32)


# ------------------------------------------------------------------------------------ block-scaled formats


@dataclass(frozen=True, kw_only=True)
class ElementFormat:
    """A narrow float format that block elements are stored in."""

    name: str
    """``"e4m3"``, ``"e5m2"`` or ``"e2m1"``."""
    exponent_bits: int
    mantissa_bits: int
    max: float
    """Largest finite value; rounding saturates here."""
    emax: int
    """Exponent of the largest normal value (``max = (1 + f) * 2**emax``); the MX FLOOR rule subtracts it."""
    has_inf: bool
    """Whether the format encodes infinity (e5m2 only; block quantization never produces it)."""
    torch_dtype: torch.dtype | None
    """The PyTorch dtype of the format, or ``None`` (e2m1: ``float4_e2m1fn_x2`` packs two per byte, no cast)."""

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal value."""
        return 1 - (2 ** (self.exponent_bits - 1) - 1)

    @property
    def smallest_subnormal(self) -> float:
        return 2.0 ** (self.emin - self.mantissa_bits)

    @functools.cached_property
    def magic(self) -> tuple[int, int]:
        """The constants of :func:`round_to_grid`'s magic number (int32 bits): ``2**emin``'s, and what turns
        ``2**e`` into ``1.5 * 2**(e + 23 - mbits)``."""
        return (127 + self.emin) << 23, ((23 - self.mantissa_bits) << 23) | 0x400000

    @property
    def split(self) -> tuple[float, float, float]:
        """The constants of :func:`round_to_grid`'s split: ``2**(24 - p) + 1``, ``1.5 * 2**(emin - mbits + 23)``,
        ``2**emin``."""
        m = self.mantissa_bits
        return 2.0 ** (23 - m) + 1, 1.5 * 2.0 ** (self.emin - m + 23), 2.0**self.emin


@dataclass(frozen=True, kw_only=True)
class ScaleFormat:
    """The format block scales are stored in."""

    name: str
    """``"fp32"``, ``"e8m0"`` (a biased exponent alone) or ``"e4m3"``."""
    bits: int
    min: float
    """Smallest positive scale the format stores (e4m3 scales are clamped to it)."""
    max: float
    torch_dtype: torch.dtype | None
    """PyTorch dtype that stores it, where the installed torch has one."""


@dataclass(frozen=True, kw_only=True)
class BlockFormat:
    """One block-scaled format: what a block holds and whose rules derive its scale."""

    name: str
    element: ElementFormat
    block_size: int | None
    """Elements per scale along the quantized axis; ``None``: the whole axis (one scale per row)."""
    scale: ScaleFormat
    tensor_scale: bool
    """Whether a second, per-tensor float32 scale multiplies the block scales (NVFP4)."""
    scale_rules: tuple[str, ...]
    """Rules :func:`quantize_blocks` accepts as ``scale_rule``; the first is the default."""
    reference: str
    """The definition this format follows, bit for bit."""


@dataclass(frozen=True, kw_only=True)
class BlockQuantized:
    """A tensor in a block format: elements and scales, each decoded to float32."""

    format: BlockFormat
    scale_rule: str
    axis: int
    """The quantized dimension (non-negative)."""
    block_size: int
    """Elements per scale along ``axis`` (the axis length for a rowwise format)."""
    elements: torch.Tensor
    """float32, ``x``'s shape: every value is one of the element format's (NaN in a NaN block)."""
    scales: torch.Tensor
    """float32, ``x``'s shape with ``axis`` cut to ``size // block_size``: each block's decode scale."""
    tensor_scale: torch.Tensor | None
    """float32 scalar for NVFP4 (the per-tensor decode scale), else ``None``."""

    def dequantize(self) -> torch.Tensor:
        """``elements * scales`` (times ``tensor_scale``): the values :func:`quantize_blocks` returns."""
        v = self.elements * self.scales.repeat_interleave(self.block_size, dim=self.axis)
        return v if self.tensor_scale is None else v * self.tensor_scale


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
        ScaleFormat(name="e8m0", bits=8, min=2.0**-127, max=2.0**127,
                    torch_dtype=getattr(torch, "float8_e8m0fnu", None)),
        ScaleFormat(name="e4m3", bits=8, min=2.0**-6, max=448.0, torch_dtype=torch.float8_e4m3fn),
    )
}

_E4M3, _E5M2, _E2M1 = ELEMENT_FORMATS["e4m3"], ELEMENT_FORMATS["e5m2"], ELEMENT_FORMATS["e2m1"]
_MX_RULES = ("floor", "rceil")
_OCP = "OCP MX v1.0 section 6.3 (FLOOR); NVIDIA cuBLAS/cuDNN block quantization (RCEIL)"

BLOCK_FORMATS: dict[str, BlockFormat] = {
    f.name: f
    for f in (
        BlockFormat(name="fp8_e4m3_rowwise", element=_E4M3, block_size=None, scale=SCALE_FORMATS["fp32"],
                    tensor_scale=False, scale_rules=("pow2", "fp32"),
                    reference="torchao Float8LinearConfig.from_recipe_name('rowwise') (float8 amax_to_scale)"),
        BlockFormat(name="fp8_e4m3_block128", element=_E4M3, block_size=128, scale=SCALE_FORMATS["fp32"],
                    tensor_scale=False, scale_rules=("pow2", "fp32"),
                    reference="TransformerEngine Float8BlockScaling, 1x128 tiles (compute_scale_from_amax)"),
        BlockFormat(name="mxfp8_e4m3", element=_E4M3, block_size=32, scale=SCALE_FORMATS["e8m0"], tensor_scale=False,
                    scale_rules=_MX_RULES, reference=_OCP),
        BlockFormat(name="mxfp8_e5m2", element=_E5M2, block_size=32, scale=SCALE_FORMATS["e8m0"], tensor_scale=False,
                    scale_rules=_MX_RULES, reference=_OCP),
        BlockFormat(name="mxfp4", element=_E2M1, block_size=32, scale=SCALE_FORMATS["e8m0"], tensor_scale=False,
                    scale_rules=_MX_RULES, reference=_OCP),
        BlockFormat(name="nvfp4", element=_E2M1, block_size=16, scale=SCALE_FORMATS["e4m3"], tensor_scale=True,
                    scale_rules=("nearest",),
                    reference="NVIDIA NVFP4 as torchao nvfp4_quantize computes it (per_tensor_amax_to_scale)"),
    )
}

_BLOCK_ALIASES = {"fp8_rowwise": "fp8_e4m3_rowwise", "rowwise": "fp8_e4m3_rowwise",
                  "fp8_block128": "fp8_e4m3_block128", "block128": "fp8_e4m3_block128", "mxfp8": "mxfp8_e4m3"}
_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ROWWISE_EPS = 1e-12  # torchao.float8.float8_utils.EPS
_NVFP4_MIN_TENSOR_SCALE = 2.0**-121  # keeps 1 / t / s finite for every block scale s >= 2**-6


def get_block_format(fmt: str | BlockFormat) -> BlockFormat:
    """Look up a block format by name (``"mxfp8_e4m3"``) or alias (``"mxfp8"``, ``"fp8-rowwise"``)."""
    if isinstance(fmt, BlockFormat):
        return fmt
    if isinstance(fmt, str):
        key = fmt.strip().lower().replace("-", "_")
        key = _BLOCK_ALIASES.get(key, key)
        if key in BLOCK_FORMATS:
            return BLOCK_FORMATS[key]
    raise ValueError(f"get_block_format({fmt!r}): unknown block format; use one of {', '.join(BLOCK_FORMATS)} "
                     f"(aliases: {', '.join(_BLOCK_ALIASES)})")


# ---------------------------------------- the pieces every quantiser shares (also mixprec.lowp.quant's, compiled)


def pow2(k: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Exact ``2**k`` for an integer tensor ``k``, from bits: float32 for k in [-127, 127] (2**-127 is
    subnormal), float64 for k in [-1022, 1023]."""
    if dtype == torch.float64:
        return ((k.to(torch.int64) + 1023) << 52).view(torch.float64)
    k = k.to(torch.int32)
    return torch.where(k >= -126, (k + 127) << 23, torch.full_like(k, 1 << 22)).view(torch.float32)


def abs_max(t: torch.Tensor, dim: int | tuple[int, ...] = (), keepdim: bool = False) -> torch.Tensor:
    """``max |t|`` along ``dim`` (all of ``t`` by default) in two read-only passes, without a ``|t|``
    temporary; NaN where any value is NaN."""
    return torch.maximum(t.amax(dim, keepdim), t.amin(dim, keepdim).neg())


def round_to_grid(v: torch.Tensor, grid, magic: torch.Tensor | None = None) -> torch.Tensor:
    """Round float32 ``v`` (within the format's ±max, or NaN) to an element format's grid, ties to even: PyTorch's
    FP8 cast on every such input, except that a value rounding to zero gives +0. Use the result (``v`` may be
    overwritten).

    ``grid`` is the :class:`ElementFormat` (eager: in place, with the exponent-bit "magic number"; ``magic`` an
    int32 work tensor like ``v``, or None) or its :attr:`~ElementFormat.split` as a float32 tensor (compiled
    code: Veltkamp's split, which Inductor vectorises where its bit casts are slow, for bf16 inputs; one graph
    for every format). Magic number: with ``e`` the exponent of ``v``, ``M = 1.5 * 2**(max(e, emin) + 23 -
    mbits)`` has fp32 spacing equal to the format's spacing at ``v`` and ``|v| < M / 3``, so ``(v + M) - M``
    rounds ``v`` onto the grid (fp32's RNE; ``M``'s last bit is even). Split, for ``p = mbits + 1``
    significant bits: ``c = v * (2**(24 - p) + 1)``, ``c - (c - v)`` is ``v`` rounded to ``p`` bits; below
    ``2**emin`` (fixed spacing ``2**(emin - mbits)``) ``(v + C) - C`` with ``C = 1.5 * 2**(emin - mbits + 23)``.
    Both use only correctly rounded IEEE operations; tests check them on every fp32 value of a binade."""
    if isinstance(grid, ElementFormat):
        lowest, offset = grid.magic
        magic = torch.bitwise_and(v.view(torch.int32), 0x7F800000, out=magic)
        magic.clamp_(min=lowest).add_(offset)
        m = magic.view(torch.float32)
        return v.add_(m).sub_(m)
    c = v * grid[0]
    return torch.where(torch.abs(v) < grid[2], (v + grid[1]) - grid[1], c - (c - v))


def _exponent_field(a: torch.Tensor) -> torch.Tensor:
    """``floor(log2(a))`` for a positive normal float32 ``a``; -127 for 0 and subnormals; 128 for inf."""
    return ((a.view(torch.int32) >> 23) & 0xFF) - 127


# One function per scale family: the block amax -> (multiplier m, decode scale s, tensor scale t or None), with
# m NaN for a block that comes out NaN.


def rowwise_scales(amax: torch.Tensor, el_max: float, rule: str = "pow2"):
    m = (el_max / torch.clamp(amax.double(), min=_ROWWISE_EPS)).float()  # as torchao writes it: 448 * (1 / amax)
    if rule == "pow2":
        m = torch.exp2(torch.floor(torch.log2(m)))  # torchao's _round_scale_down_to_power_of_2, in float32
    m = torch.where(torch.isfinite(amax), m, torch.nan)
    return m, torch.reciprocal(m), None


def block128_scales(amax: torch.Tensor, el_max: float, rule: str, in_dtype: torch.dtype):
    m = torch.full_like(amax, el_max) / amax  # one rounding, TE's __fdiv_rn (448 / tensor would be 448 * (1 / amax))
    m = torch.where(torch.isinf(m), torch.finfo(in_dtype).max, m)
    if rule == "pow2":
        m = (m.view(torch.int32) & 0x7F800000).view(torch.float32)  # m > 0: keep the exponent bits
    m = torch.where(amax == 0, 1.0, m)
    m = torch.where(torch.isfinite(amax), m, torch.nan)
    return m, torch.reciprocal(m), None


def mx_scales(amax: torch.Tensor, el_max, emax, floor):
    """MX: ``(2**-k, 2**k, None)`` per block; ``floor`` (a bool, or a bool tensor in compiled code): the FLOOR
    rule, else RCEIL; ``el_max``, ``emax``: the element format's, numbers or tensors."""
    # A subnormal or zero amax reads as -127 for FLOOR; emax >= 2 puts its true floor(log2) below -127 too
    k_floor = _exponent_field(amax) - emax
    d = amax / el_max
    bits = d.view(torch.int32)
    k_rceil = _exponent_field(d) + ((bits & 0x7FFFFF) != 0).to(torch.int32)  # exact ceil(log2(d)), d normal
    k_rceil = torch.where(bits < (1 << 23), torch.where(bits > (1 << 22), -126, -127), k_rceil)  # d subnormal or 0
    k = torch.where(floor, k_floor, k_rceil) if torch.is_tensor(floor) else (k_floor if floor else k_rceil)
    k = torch.clamp(k, -127, 127)
    nan = torch.isnan(amax)
    return torch.where(nan, torch.nan, pow2(-k)), torch.where(nan, torch.nan, pow2(k)), None


def nvfp4_scales(amax: torch.Tensor):
    """NVFP4 from the blocks' amax (all of the tensor's blocks: their max is the tensor's amax)."""
    sf, el = SCALE_FORMATS["e4m3"], _E2M1
    amax_t = amax.max()
    t = torch.clamp(amax_t / (sf.max * el.max), min=_NVFP4_MIN_TENSOR_SCALE)  # NaN stays NaN
    t = torch.where(torch.isinf(amax_t), torch.nan, t)
    s = torch.clamp(amax / el.max / t, sf.min, sf.max).to(sf.torch_dtype).to(torch.float32)
    return (1.0 / t) / s, s, t


def block_scales(amax: torch.Tensor, f: BlockFormat, rule: str, in_dtype: torch.dtype = torch.float32):
    """The scale rule of format ``f`` applied to its blocks' amax: ``(m, s, t)``."""
    if f.scale.name == "e8m0":
        return mx_scales(amax, f.element.max, f.element.emax, rule == "floor")
    if f.tensor_scale:
        return nvfp4_scales(amax)
    if f.block_size is None:
        return rowwise_scales(amax, f.element.max, rule)
    return block128_scales(amax, f.element.max, rule, in_dtype)


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
    rows = x.to(torch.float32).movedim(ax, -1)
    if rows.numel() == 0:
        scales = torch.ones(*rows.shape[:-1], n // bs if bs else 1, device=x.device).movedim(-1, ax)
        t = torch.ones((), device=x.device) if f.tensor_scale else None
        return BlockQuantized(format=f, scale_rule=rule, axis=ax, block_size=bs, elements=rows.movedim(-1, ax).clone(),
                              scales=scales, tensor_scale=t)
    blocks = rows.reshape(*rows.shape[:-1], n // bs, bs)
    m, s, t = block_scales(abs_max(blocks, -1), f, rule, x.dtype)
    q = torch.clamp(blocks * m.unsqueeze(-1), -f.element.max, f.element.max)
    q = torch.copysign(round_to_grid(q, f.element), blocks)  # the signed zeros the definitions keep
    return BlockQuantized(format=f, scale_rule=rule, axis=ax, block_size=bs,
                          elements=q.reshape(rows.shape).movedim(-1, ax), scales=s.movedim(-1, ax), tensor_scale=t)


def quantize_blocks(
    x: torch.Tensor, fmt: str | BlockFormat, *, axis: int = -1, scale_rule: str | None = None
) -> torch.Tensor:
    """The float32 values ``x`` holds in block format ``fmt`` along ``axis`` (what a block-scaled GEMM
    multiplies); arguments as :func:`quantize_blocks_with_scales`."""
    return quantize_blocks_with_scales(x, fmt, axis=axis, scale_rule=scale_rule).dequantize()
