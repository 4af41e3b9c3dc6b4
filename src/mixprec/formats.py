"""Floating-point formats used in mixed-precision training, and rounding into them.

The formats
-----------
Every binary floating format stores ``sign | exponent | mantissa``. With ``e`` exponent bits and
``m`` mantissa bits, a normal number is ``(1 + f / 2**m) * 2**E`` and the spacing of representable
values (one ulp) just above a power of two ``2**E`` is ``2**(E - m)``. So:

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

The exponent width sets the *range* (bf16 and tf32 share fp32's range; fp16 and e5m2 overflow
above ~6.5e4), the mantissa width sets the *precision* (``eps``, the gap between 1 and the next
value, is ``2**-m``). tf32 is not a storage type: it is the fp32-range, 10-bit-mantissa format
that NVIDIA tensor cores use for fp32 matmul inputs, so it has no torch dtype. e4m3 is the
``fn`` ("finite") variant: it has no infinity, and the all-ones bit pattern is its only NaN,
which is why its max is 448 (``1.110b * 2**8``) rather than 480.

Round to nearest, ties to even (RNE)
------------------------------------
``quantize(x, fmt)`` returns, in float32, the value that ``x.to(fmt_dtype).float()`` gives, bit for
bit, including subnormals, signed zero, infinities and overflow. RNE is the IEEE-754 default: it
is the most accurate rounding (error at most half an ulp) and, because exact ties go to the
neighbour with an even last mantissa bit, it has no systematic upward or downward drift on ties.

The implementation works in float64, where every float32 input, every power of two needed as a
scale, and every intermediate value is exact: with ``x = mant * 2**exp`` (``torch.frexp``), the
ulp of the target format at ``x`` is ``2**k`` with ``k = max(exp - 1, emin) - m`` (the ``max``
with the format's smallest normal exponent ``emin`` gives the fixed spacing of the subnormal
range). ``round(x / 2**k) * 2**k`` then rounds to the format's grid; ``torch.round`` rounds half
to even, and both scalings by powers of two are exact, so the only rounding is the one we want.
Inputs of other floating dtypes are first converted to float32, which is also what PyTorch's
own casts do (they are defined on float32), so float64 inputs round identically too. For tf32,
RNE models the format; hardware differs (PTX ``cvt.rna.tf32.f32`` rounds ties away from zero,
and tensor cores may simply drop the low mantissa bits).

Where torch has the dtype, ``x.to(dtype).float()`` gives the same result as ``quantize`` with
less memory traffic (the tests prove the equality); ``quantize`` is for tf32, for stochastic
rounding, and as a checked reference. It allocates a few float64 temporaries of ``x``'s size.

Overflow
--------
What happens above ``max`` follows PyTorch's cast for each dtype:

* fp32, tf32, bf16, fp16, e5m2 (``overflow="inf"``): RNE beyond the largest finite value gives
  ``±inf`` (e.g. fp16: 65519 -> 65504, 65520 -> inf), and ``±inf`` stays ``±inf``.
* e4m3fn: it has no infinity. PyTorch's cast (``c10::fp8e4m3fn_from_fp32_value``; checked on
  torch 2.13) *saturates*: every finite value that rounds above 448, and ``±inf`` itself, becomes
  ``±448`` (``overflow="saturate"``). Older PyTorch releases returned NaN instead
  (``overflow="nan"``). The table entry is built by probing the installed torch once at import, so
  ``quantize`` always matches the cast of the torch it runs with.

NaN stays NaN. Its sign and payload are not specified (PyTorch's own scalar and vectorised cast
kernels disagree on them), so compare NaNs by ``isnan``, not by bits.

Stochastic rounding (SR)
------------------------
RNE is biased for a *sum of many small updates*: adding ``d`` with ``|d| < ulp/2`` to ``w`` gives
``w`` back every time, however often it is done (the "lost update" that master weights fix).
Stochastic rounding rounds ``x`` up to the next grid point ``hi`` with probability
``(x - lo) / (hi - lo)`` and down to ``lo`` otherwise, so ``E[q(x)] = x``: the small updates survive
in expectation. The result is always one of the two neighbours of ``x`` (or ``x`` itself when it
is representable). Here: ``y = x / 2**k`` (exact), ``q = (floor(y) + [u < y - floor(y)]) * 2**k``
with ``u ~ U[0, 1)`` drawn as a float64 from ``generator`` on ``2**-53`` steps, so the rounding
probability is exact to within ``2**-53`` of an ulp. Given the generator's state the result is
deterministic; each call advances the generator by one ``torch.rand`` of ``x.numel()`` float64s.
Outside ``[-max, max]`` SR falls back to RNE, so overflow behaves exactly like the cast.

Block-scaled formats
--------------------
FP8 and FP4 as GEMMs consume them -- one scale per row, per 1x128 tile, per 32 (MX) or 16 (NVFP4)
values -- live in :mod:`mixprec.blockformats` and are re-exported here: ``quantize_blocks(x, fmt,
axis=...)``, ``quantize_blocks_with_scales``, ``BLOCK_FORMATS``. That module's docstring states each
format's rounding and scale rules and where torchao departs from them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .lowp.blockformats import (
    BLOCK_FORMATS,
    BlockFormat,
    BlockQuantized,
    get_block_format,
    quantize_blocks,
    quantize_blocks_with_scales,
)

__all__ = ["Format", "FORMATS", "get_format", "quantize",
           # block-scaled FP8/FP4 (rowwise, 1x128, MXFP8, MXFP4, NVFP4): see mixprec.blockformats
           "BlockFormat", "BlockQuantized", "BLOCK_FORMATS", "get_block_format", "quantize_blocks",
           "quantize_blocks_with_scales"]


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


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """Exact ``2.0**k`` in float64 for an integer tensor ``k`` in [-1022, 1023], built from bits."""
    return ((k.to(torch.int64) + 1023) << 52).view(torch.float64)


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
    y = x64 * _pow2(-k)  # exact: |y| < 2**(m + 1)
    r = torch.round(y)  # half to even
    if rounding == "stochastic":
        lo = torch.floor(y)
        u = torch.rand(y.shape, dtype=torch.float64, device=y.device, generator=generator)
        sr = lo + (u < (y - lo)).to(torch.float64)
        r = torch.where(x64.abs() <= f.max, sr, r)
    q = torch.copysign(r * _pow2(k), x64)  # exact; copysign keeps -0.0 for values rounded to zero

    over = q.abs() > f.max  # includes +-inf inputs, never NaN
    if f.overflow == "inf":
        q = torch.where(over, torch.copysign(torch.full_like(q, float("inf")), x64), q)
    elif f.overflow == "saturate":
        q = torch.where(over, torch.copysign(torch.full_like(q, f.max), x64), q)
    else:
        q = torch.where(over, torch.full_like(q, float("nan")), q)
    return q.to(torch.float32)
