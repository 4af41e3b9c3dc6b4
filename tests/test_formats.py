"""Tests for mixprec.formats.

Tiers: the format table is checked against ``torch.finfo`` and decoded bit patterns; round to
nearest is checked bit-for-bit (rtol=0, atol=0, NaN-aware) against PyTorch's own casts, both
exhaustively at every rounding boundary and by hypothesis; tf32 (no torch dtype) against hand-built
cases and an independent integer reference; stochastic rounding by its defining properties
(always a neighbour, unbiased mean within a 5-sigma binomial bound, deterministic per generator);
lossy rounding by SQNR floors derived from the mantissa width.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mixprec.formats import FORMATS, Format, get_format, quantize

CAST_FORMATS = ["bf16", "fp16", "fp8_e4m3", "fp8_e5m2"]
_INT_VIEW = {8: torch.int8, 16: torch.int16}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: identical float32 bit patterns, or both NaN (NaN payloads are unspecified)."""
    return (a.view(torch.int32) == b.view(torch.int32)) | (a.isnan() & b.isnan())


def _assert_matches_cast(x: torch.Tensor, name: str) -> None:
    fmt = FORMATS[name]
    got = quantize(x, fmt)
    want = x.to(fmt.torch_dtype).float()
    assert got.dtype == torch.float32
    ok = _same_bits(got, want)
    if not bool(ok.all()):
        i = int((~ok).nonzero()[0])
        raise AssertionError(
            f"{name}: quantize({x[i].item()!r}) = {got[i].item()!r}, cast gives {want[i].item()!r}"
            f" ({int((~ok).sum())} mismatches out of {x.numel()})"
        )


def _all_values(name: str) -> torch.Tensor:
    """Every bit pattern of the format's dtype, decoded to float32 by torch."""
    dt = FORMATS[name].torch_dtype
    bits = torch.finfo(dt).bits
    patterns = torch.arange(-(2 ** (bits - 1)), 2 ** (bits - 1), dtype=torch.int64)
    return patterns.to(_INT_VIEW[bits]).view(dt).float()


def _sorted_finite(name: str) -> torch.Tensor:
    v = _all_values(name)
    return torch.unique(v[v.isfinite()].double())  # sorted; -0.0 and 0.0 merge


_GRIDS = {name: _sorted_finite(name) for name in CAST_FORMATS}  # every finite value, ascending


def _f32_bits_to_tensor(ints: list[int]) -> torch.Tensor:
    return torch.tensor(ints, dtype=torch.int64).to(torch.int32).view(torch.float32)


# ---------------------------------------------------------------- the table


@pytest.mark.parametrize("name", ["fp32", *CAST_FORMATS])
def test_table_matches_torch_finfo(name: str) -> None:
    fmt = FORMATS[name]
    fi = torch.finfo(fmt.torch_dtype)
    assert fmt.bits == fi.bits
    assert fmt.max == fi.max
    assert fmt.smallest_normal == fi.smallest_normal
    assert fmt.eps == fi.eps


@pytest.mark.parametrize("name", CAST_FORMATS)
def test_table_matches_decoded_bit_patterns(name: str) -> None:
    fmt = FORMATS[name]
    v = _all_values(name)
    finite = v[v.isfinite()]
    assert finite.max().item() == fmt.max
    assert finite[finite > 0].min().item() == fmt.smallest_subnormal
    assert bool(v.isinf().any()) == fmt.has_inf
    assert bool(v.isnan().any())


@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=list(FORMATS))
def test_table_is_consistent_with_bit_widths(fmt: Format) -> None:
    m = fmt.mantissa_bits
    assert fmt.bits == 1 + fmt.exponent_bits + m
    assert fmt.eps == 2.0**-m
    assert fmt.smallest_normal == 2.0**fmt.emin
    assert fmt.smallest_subnormal == 2.0 ** (fmt.emin - m)
    top = 2 ** (fmt.exponent_bits - 1) - 1  # largest exponent when the all-ones field is inf/nan
    if fmt.has_inf:
        assert fmt.max == (2 - 2.0**-m) * 2.0**top
    else:  # e4m3fn: the all-ones exponent holds normals, except the all-ones mantissa (NaN)
        assert fmt.max == (2 - 2.0 ** (1 - m)) * 2.0 ** (top + 1)
    assert (fmt.torch_dtype is None) == (fmt.name == "tf32")


def test_e4m3_overflow_mode_matches_installed_torch() -> None:
    y = torch.tensor([1e4, float("inf")]).to(torch.float8_e4m3fn).float()
    expected = "nan" if bool(y.isnan().all()) else "saturate"
    assert FORMATS["fp8_e4m3"].overflow == expected


# ---------------------------------------------------------------- lookup


@pytest.mark.parametrize(
    ("key", "name"),
    [
        ("fp32", "fp32"), ("float32", "fp32"), (torch.float32, "fp32"),
        ("TF32", "tf32"),
        ("bf16", "bf16"), ("bfloat16", "bf16"), ("torch.bfloat16", "bf16"), (torch.bfloat16, "bf16"),
        ("fp16", "fp16"), ("float16", "fp16"), ("half", "fp16"), (torch.float16, "fp16"),
        ("e4m3", "fp8_e4m3"), ("fp8_e4m3fn", "fp8_e4m3"), (torch.float8_e4m3fn, "fp8_e4m3"),
        ("e5m2", "fp8_e5m2"), ("float8_e5m2", "fp8_e5m2"), (torch.float8_e5m2, "fp8_e5m2"),
    ],
)
def test_get_format_names_aliases_dtypes(key: object, name: str) -> None:
    assert get_format(key) is FORMATS[name]
    assert get_format(FORMATS[name]) is FORMATS[name]


@pytest.mark.parametrize("bad", ["fp64", "int8", torch.float64, torch.int32])
def test_get_format_unknown_lists_valid_names(bad: object) -> None:
    with pytest.raises(ValueError, match=r"fp32, tf32, bf16, fp16, fp8_e4m3, fp8_e5m2"):
        get_format(bad)


def test_quantize_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="rounding"):
        quantize(torch.ones(2), "bf16", rounding="truncate")
    with pytest.raises(TypeError, match="floating-point"):
        quantize(torch.ones(2, dtype=torch.int32), "bf16")


# ---------------------------------------------------------------- round to nearest: exact vs torch


@pytest.mark.parametrize("name", CAST_FORMATS)
def test_nearest_matches_cast_at_every_rounding_boundary(name: str) -> None:
    """Every representable value, every midpoint (a tie) and the float32 values either side of it."""
    fmt = FORMATS[name]
    grid = _sorted_finite(name)
    ulp_above_max = 2.0 ** (math.floor(math.log2(fmt.max)) - fmt.mantissa_bits)
    grid = torch.cat([grid, grid.new_tensor([fmt.max + ulp_above_max, -fmt.max - ulp_above_max])])
    grid = torch.unique(grid)
    mids = ((grid[1:] + grid[:-1]) / 2).float()  # exact: one more bit than the format has
    mids = mids[mids.abs() < 3e38]
    up = torch.nextafter(mids, torch.full_like(mids, float("inf")))
    down = torch.nextafter(mids, torch.full_like(mids, -float("inf")))
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 3.4e38, -3.4e38,
                             fmt.smallest_subnormal / 4, -fmt.smallest_subnormal / 4, 1e-45, -1e-45])
    x = torch.cat([grid.float(), mids, up, down, specials])
    _assert_matches_cast(x, name)


@pytest.mark.parametrize("name", CAST_FORMATS)
def test_nearest_matches_cast_on_random_float32_bit_patterns(name: str) -> None:
    g = torch.Generator().manual_seed(1234)
    bits = torch.randint(-(2**31), 2**31, (1 << 18,), generator=g, dtype=torch.int64)
    _assert_matches_cast(bits.to(torch.int32).view(torch.float32), name)


@settings(max_examples=150, deadline=None)
@given(name=st.sampled_from(CAST_FORMATS),
       ints=st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=64))
def test_nearest_matches_cast_property_bit_patterns(name: str, ints: list[int]) -> None:
    _assert_matches_cast(_f32_bits_to_tensor(ints), name)


@settings(max_examples=150, deadline=None)
@given(name=st.sampled_from(CAST_FORMATS),
       values=st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), min_size=1, max_size=64))
def test_nearest_matches_cast_property_floats(name: str, values: list[float]) -> None:
    _assert_matches_cast(torch.tensor(values, dtype=torch.float32), name)


@settings(max_examples=200, deadline=None)
@given(name=st.sampled_from(CAST_FORMATS), data=st.data())
def test_nearest_matches_cast_property_near_format_values(name: str, data: st.DataObject) -> None:
    """A representable value or midpoint, nudged by a few float32 ulps: the rounding decisions."""
    fmt = FORMATS[name]
    grid = _GRIDS[name]
    i = data.draw(st.integers(0, grid.numel() - 2))
    base = grid[i] if data.draw(st.booleans()) else (grid[i] + grid[i + 1]) / 2
    if data.draw(st.booleans()):  # the overflow boundary: max + half ulp is the last tie
        base = base.new_tensor(data.draw(st.sampled_from([fmt.max, -fmt.max])))
        base = base + base.sign() * 2.0 ** (math.floor(math.log2(fmt.max)) - fmt.mantissa_bits - 1)
    x = base.float().view(torch.int32) + data.draw(st.integers(-3, 3))
    _assert_matches_cast(x.view(torch.float32).reshape(1), name)



def test_nearest_specials_explicitly() -> None:
    x = torch.tensor([-0.0, 0.0, float("inf"), -float("inf"), float("nan"), -1e-45])
    for name in CAST_FORMATS:
        q = quantize(x, name)
        assert q[0].item() == 0.0 and math.copysign(1.0, q[0].item()) == -1.0  # -0.0 survives
        assert math.copysign(1.0, q[1].item()) == 1.0
        assert q[4].isnan()
        assert q[5].item() == 0.0 and math.copysign(1.0, q[5].item()) == -1.0  # underflow keeps sign
        expected_inf = float("inf") if FORMATS[name].has_inf else 448.0
        if FORMATS[name].overflow == "nan":
            assert q[2:4].isnan().all()
        else:
            assert q[2:4].tolist() == [expected_inf, -expected_inf]
    assert quantize(torch.tensor([65519.0, 65520.0]), "fp16").tolist() == [65504.0, float("inf")]


@pytest.mark.parametrize("src", [torch.float64, torch.float16, torch.bfloat16])
def test_nearest_from_other_input_dtypes_matches_cast(src: torch.dtype) -> None:
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(4096, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(-6, 6, (4096,), generator=g)).to(src)
    for name in CAST_FORMATS:
        fmt = FORMATS[name]
        got = quantize(x, fmt)
        want = x.to(fmt.torch_dtype).float()
        assert bool(_same_bits(got, want).all()), name


def test_fp32_is_identity_and_a_new_tensor() -> None:
    x = torch.tensor([1.0 + 2.0**-23, 1e-45, float("inf")])
    q = quantize(x, "fp32")
    assert bool(_same_bits(q, x).all())
    assert q.data_ptr() != x.data_ptr()


# ---------------------------------------------------------------- tf32


def _tf32_reference(x: torch.Tensor) -> torch.Tensor:
    """Independent RNE to a 10-bit mantissa on the raw float32 bits (valid for all non-NaN inputs:
    tf32 keeps fp32's exponent field, so the rounding carry into it is exactly right)."""
    b = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    b = (b + 0xFFF + ((b >> 13) & 1)) & ~0x1FFF  # the sign bit is never reached: max carries to inf
    b = torch.where(b >= 2**31, b - 2**32, b)  # back to a signed int32 bit pattern
    return b.to(torch.int32).view(torch.float32)


def test_tf32_hand_built_cases() -> None:
    cases = [
        (1.0 + 2.0**-11, 1.0),  # tie, 1.0 has an even mantissa
        (1.0 + 3 * 2.0**-11, 1.0 + 2.0**-9),  # tie, 1 + 2**-10 has an odd mantissa: round up
        (1.0 + 2.0**-11 + 2.0**-23, 1.0 + 2.0**-10),  # just above the tie
        (-(1.0 + 2.0**-11 + 2.0**-23), -(1.0 + 2.0**-10)),
        (2.0 - 2.0**-23, 2.0),  # carry into the exponent
        ((2 - 2.0**-10) * 2.0**127, (2 - 2.0**-10) * 2.0**127),  # max is representable
        ((2 - 2.0**-23) * 2.0**127, float("inf")),  # fp32 max rounds past tf32 max
        (2.0**-136, 2.0**-136),  # smallest subnormal
        (2.0**-137, 0.0),  # half of it: tie to zero (even)
        (3 * 2.0**-137, 2.0**-135),  # tie between 1 and 2 subnormal ulps: even is 2
        (2.0**-126 + 2.0**-137, 2.0**-126),  # fp32 normal near the bottom, 10-bit mantissa
    ]
    x = torch.tensor([c[0] for c in cases], dtype=torch.float32)
    want = torch.tensor([c[1] for c in cases], dtype=torch.float32)
    got = quantize(x, "tf32")
    assert bool(_same_bits(got, want).all()), list(zip(got.tolist(), want.tolist()))


def test_tf32_matches_integer_reference_on_random_bit_patterns() -> None:
    g = torch.Generator().manual_seed(99)
    x = torch.randint(-(2**31), 2**31, (1 << 18,), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)
    x = x[~x.isnan()]
    assert bool(_same_bits(quantize(x, "tf32"), _tf32_reference(x)).all())


# ---------------------------------------------------------------- SQNR floors (lossy tier)


def _sqnr_db(x: torch.Tensor, q: torch.Tensor) -> float:
    x, q = x.double(), q.double()
    return 10 * math.log10(float((x * x).sum() / ((x - q) ** 2).sum()))


@pytest.mark.parametrize("name", ["tf32", *CAST_FORMATS])
def test_sqnr_floor_from_mantissa_width(name: str) -> None:
    """Normal-range relative error is at most 2**-(m+1) for RNE and 2**-m for SR."""
    fmt = FORMATS[name]
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1 << 16, generator=g)
    x = x[(x.abs() >= fmt.smallest_normal) & (x.abs() <= fmt.max)]
    m = fmt.mantissa_bits
    assert _sqnr_db(x, quantize(x, fmt)) >= 20 * math.log10(2.0 ** (m + 1))
    assert _sqnr_db(x, quantize(x, fmt, "stochastic", generator=g)) >= 20 * math.log10(2.0**m)


# ---------------------------------------------------------------- stochastic rounding


def _neighbours(x: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Largest representable <= x and smallest >= x, from the decoded table of all values."""
    grid = _GRIDS[name]
    x64 = x.double()
    hi_i = torch.searchsorted(grid, x64, side="left").clamp(max=grid.numel() - 1)
    lo_i = (torch.searchsorted(grid, x64, side="right") - 1).clamp(min=0)
    return grid[lo_i], grid[hi_i]


@pytest.mark.parametrize("name", CAST_FORMATS)
def test_stochastic_is_always_one_of_the_two_neighbours(name: str) -> None:
    fmt = FORMATS[name]
    g = torch.Generator().manual_seed(3)
    mags = 2.0 ** torch.randint(fmt.emin - fmt.mantissa_bits - 2, int(math.log2(fmt.max)), (1 << 15,), generator=g)
    x = (torch.randn(1 << 15, generator=g, dtype=torch.float64) * mags).float()
    x = x[x.abs() <= fmt.max]
    lo, hi = _neighbours(x, name)
    rne = x.to(fmt.torch_dtype).double()
    assert bool(((rne == lo) | (rne == hi)).all())  # the table neighbours agree with torch
    for _ in range(3):
        q = quantize(x, fmt, "stochastic", generator=g).double()
        assert bool(((q == lo) | (q == hi)).all())
        exact = lo == hi
        assert bool((q[exact] == x.double()[exact]).all())
        assert bool((torch.signbit(q) == torch.signbit(x)).all())  # no sign flips through zero


@pytest.mark.parametrize("name", ["tf32", *CAST_FORMATS])
def test_stochastic_is_unbiased(name: str) -> None:
    """Mean of N roundings of x within 5 sigma of x, sigma = (hi - lo) * sqrt(p(1-p)/N)."""
    fmt = FORMATS[name]
    m = fmt.mantissa_bits
    n = 20000
    bases = [1.0, -3.0 * 2.0**5, 2.0 ** (fmt.emin - 1)]  # normal, negative normal, subnormal range
    g = torch.Generator().manual_seed(11)
    for base in bases:
        ulp = 2.0 ** (max(math.floor(math.log2(abs(base))), fmt.emin) - m)
        for frac in (1 / 128, 1 / 4, 1 / 2, 7 / 8):  # dyadic, so x is exact in float32
            x = base + math.copysign(frac * ulp, base)
            xs = torch.full((n,), x, dtype=torch.float32)
            assert xs[0].item() == x
            mean = quantize(xs, fmt, "stochastic", generator=g).double().mean().item()
            sigma = ulp * math.sqrt(frac * (1 - frac) / n)
            assert abs(mean - x) <= 5 * sigma + ulp * 2.0**-40, (name, x, mean)
            if frac < 0.5:  # round to nearest is biased here: it always returns the lower neighbour
                assert quantize(xs[:1], fmt).item() == base


def test_stochastic_is_deterministic_given_generator() -> None:
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    a = quantize(x, "bf16", "stochastic", generator=torch.Generator().manual_seed(42))
    b = quantize(x, "bf16", "stochastic", generator=torch.Generator().manual_seed(42))
    c = quantize(x, "bf16", "stochastic", generator=torch.Generator().manual_seed(43))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    torch.manual_seed(5)
    d = quantize(x, "bf16", "stochastic")  # generator=None: the global default generator
    torch.manual_seed(5)
    assert torch.equal(d, quantize(x, "bf16", "stochastic"))


@pytest.mark.parametrize("name", CAST_FORMATS)
def test_stochastic_out_of_range_and_specials_follow_the_cast(name: str) -> None:
    fmt = FORMATS[name]
    x = torch.tensor([fmt.max * 1.01, -fmt.max * 1.5, 3e38, float("inf"), -float("inf"), float("nan"), -0.0, 0.0])
    got = quantize(x, fmt, "stochastic", generator=torch.Generator().manual_seed(0))
    assert bool(_same_bits(got, x.to(fmt.torch_dtype).float()).all())
