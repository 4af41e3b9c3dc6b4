"""Tests for the block-scaled FP8/FP4 formats of mixprec.formats.

Tiers: bit-exact (rtol=0, atol=0; signed zeros compared, NaN matches NaN) against torchao 0.18's own
implementations -- ``to_mx``/``to_dtype`` (FLOOR and RCEIL), ``NVFP4Tensor.to_nvfp4`` and float8 rowwise
``hp_tensor_to_float8_dynamic`` -- on random, tiny, huge, subnormal, all-zero, inf and NaN blocks and by
hypothesis; bit-exact against an independent pure-Python reference of the OCP MX and TransformerEngine
rules (also where torchao departs from them: each departure has its own ``test_torchao_...`` test that
pins what torchao does instead); SQNR floors on Gaussian data. The torchao tests skip when it is not
installed; mixprec itself never imports it.
"""

from __future__ import annotations

import ast
import bisect
import dataclasses
import logging
import math
import types
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mixprec import formats
from mixprec.formats import (
    BLOCK_FORMATS,
    ELEMENT_FORMATS,
    BlockFormat,
    get_block_format,
    quantize_blocks,
    quantize_blocks_with_scales,
)

MX = {"mxfp8_e4m3": torch.float8_e4m3fn, "mxfp8_e5m2": torch.float8_e5m2, "mxfp4": torch.float4_e2m1fn_x2}
INF, NAN = float("inf"), float("nan")
FLT_MAX = float(torch.finfo(torch.float32).max)


# ------------------------------------------------------------------------------------------ helpers


def assert_bits(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Equal bit for bit as float32 (so -0.0 != 0.0); NaN matches NaN (payloads are unspecified)."""
    a, e = actual.float().reshape(-1), expected.float().reshape(-1)
    assert a.shape == e.shape, f"{what}: shapes {tuple(actual.shape)} vs {tuple(expected.shape)}"
    ok = (a.view(torch.int32) == e.view(torch.int32)) | (a.isnan() & e.isnan())
    if not bool(ok.all()):
        i = (~ok).nonzero()[:5, 0]
        raise AssertionError(f"{what}: {int((~ok).sum())} of {a.numel()} differ, e.g. at {i.tolist()}: "
                             f"{a[i].tolist()} vs {e[i].tolist()}")


def f32(v: float) -> float:
    """Python float -> nearest float32 (inf past the range), as a Python float."""
    with np.errstate(over="ignore"):
        return float(np.float32(v))


def _grid(name: str) -> list[float]:
    if name == "e2m1":
        return [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    dt = ELEMENT_FORMATS[name].torch_dtype
    v = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dt).double()
    return sorted(set(v[v.isfinite() & (v >= 0)].tolist()))


GRIDS = {name: _grid(name) for name in ELEMENT_FORMATS}


def ref_rne(v: float, name: str) -> float:
    """Saturating round-to-nearest-even into an element format, by search in its list of values."""
    g = GRIDS[name]
    a = min(abs(v), g[-1])
    i = bisect.bisect_left(g, a)
    if g[i] != a:
        lo, hi = g[i - 1], g[i]
        i = i - 1 if (a - lo < hi - a or (a - lo == hi - a and (i - 1) % 2 == 0)) else i
    return math.copysign(g[i], v)


def ref_mx_block(vals: list[float], fmt: str, rule: str) -> tuple[list[float], float, list[float]]:
    """OCP MX (FLOOR) / cuDNN (RCEIL) for one block, in Python floats: (elements, scale, values)."""
    el = BLOCK_FORMATS[fmt].element
    if any(math.isnan(v) for v in vals):
        return [NAN] * len(vals), NAN, [NAN] * len(vals)
    amax = max(abs(v) for v in vals)
    if rule == "floor":
        e = 128 if amax == INF else (-1000 if amax == 0 else math.frexp(amax)[1] - 1)
        k = e - el.emax
    else:
        d = f32(amax / el.max)
        m, e = math.frexp(d)
        k = 128 if d == INF else (-1000 if d == 0 else (e - 1 if m == 0.5 else e))
    k = min(max(k, -127), 127)
    s = 2.0**k
    q = [ref_rne(v / s, el.name) for v in vals]
    return q, s, [f32(e * s) for e in q]


def ref_block128(vals: list[float], rule: str, in_dtype: torch.dtype) -> tuple[list[float], float, list[float]]:
    """TransformerEngine's 1x128 rule (compute_scale_from_amax, eps 0), non-finite blocks NaN."""
    if not all(math.isfinite(v) for v in vals):
        return [NAN] * len(vals), NAN, [NAN] * len(vals)
    amax = max(abs(v) for v in vals)
    if amax == 0:
        m = 1.0
    else:
        m = f32(448.0 / amax)
        if m == INF:
            m = float(torch.finfo(in_dtype).max)
        if rule == "pow2":
            m = 2.0 ** (math.frexp(m)[1] - 1)
    q = [ref_rne(f32(v * m), "e4m3") for v in vals]
    s = f32(1.0 / m)
    return q, s, [f32(e * s) for e in q]


def ref_rowwise(vals: list[float], rule: str) -> tuple[list[float], float, list[float]]:
    """torchao's rowwise amax_to_scale in Python doubles; "pow2" keeps its float32 log2 (torch's, the rule)."""
    if not all(math.isfinite(v) for v in vals):
        return [NAN] * len(vals), NAN, [NAN] * len(vals)
    m = f32(448.0 * (1.0 / max(max(abs(v) for v in vals), 1e-12)))  # torchao's 448 / tensor: 448 * (1 / amax)
    if rule == "pow2":
        m = float(torch.exp2(torch.floor(torch.log2(torch.tensor(m)))))
    q = [ref_rne(f32(v * m), "e4m3") for v in vals]
    s = f32(1.0 / m)
    return q, s, [f32(e * s) for e in q]


def ref_nvfp4(rows: list[list[float]]) -> tuple[list[list[float]], list[float], list[list[float]], float]:
    """torchao's nvfp4_quantize (blocks of 16) in Python doubles, tensor scale floored at 2**-121."""
    flat = [v for row in rows for v in row]
    if not all(math.isfinite(v) for v in flat):
        return [[NAN] * len(r) for r in rows], [NAN] * len(rows), [[NAN] * len(r) for r in rows], NAN
    t = max(f32(max(abs(v) for v in flat) / (448.0 * 6.0)), 2.0**-121)
    es, ss, vs = [], [], []
    for vals in rows:
        s = ref_rne(min(max(f32(f32(max(abs(v) for v in vals) / 6.0) / t), 2.0**-6), 448.0), "e4m3")
        m = f32(f32(1.0 / t) / s)
        q = [ref_rne(f32(v * m), "e2m1") for v in vals]
        es.append(q), ss.append(s), vs.append([f32(e * s * t) for e in q])
    return es, ss, vs, t


def check_against_reference(x: torch.Tensor, fmt: str, rule: str) -> None:
    """quantize_blocks_with_scales(x) (2-D, blocks along the last dim) equals the Python reference."""
    r = quantize_blocks_with_scales(x, fmt, scale_rule=rule)
    bs = BLOCK_FORMATS[fmt].block_size or x.shape[-1]
    rows = x.float().reshape(-1, bs).tolist()
    got_e, got_s, got_v = (r.elements.reshape(-1, bs), r.scales.reshape(-1), r.dequantize().reshape(-1, bs))
    if fmt == "nvfp4":
        want_e, want_s, want_v, t = ref_nvfp4(rows)
        assert_bits(r.tensor_scale, torch.tensor(t), "nvfp4 tensor scale")
    else:
        refs = {"fp8_e4m3_rowwise": lambda v: ref_rowwise(v, rule),
                "fp8_e4m3_block128": lambda v: ref_block128(v, rule, x.dtype)}
        ref = refs.get(fmt, lambda v: ref_mx_block(v, fmt, rule))
        want_e, want_s, want_v = zip(*map(ref, rows))
    for i, vals in enumerate(rows):
        where = f"{fmt}/{rule} block {i} (amax {max(abs(v) for v in vals)!r})"
        assert_bits(got_e[i], torch.tensor(want_e[i]), f"{where} elements")
        assert_bits(got_s[i], torch.tensor(want_s[i]), f"{where} scale")
        assert_bits(got_v[i], torch.tensor(want_v[i]), f"{where} values")


def block_rows(seed: int, rows: int, width: int, bs: int, lo: int, hi: int) -> torch.Tensor:
    """Gaussian blocks, each multiplied by its own power of two 2**U[lo, hi]."""
    g = torch.Generator().manual_seed(seed)
    e = torch.randint(lo, hi + 1, (rows, width // bs, 1), generator=g).double()
    return (torch.randn(rows, width // bs, bs, generator=g, dtype=torch.float64) * 2.0**e).float().reshape(rows, width)


def special_rows(bs: int, width: int = 128) -> torch.Tensor:
    """Rows of blocks that exercise every rule but the 2**-127 scale (see the departure tests)."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(16, width, generator=g)
    x[0] = 0.0                                             # all-zero blocks
    x[1, ::2] = -0.0                                       # signed zeros inside a block
    x[1, 1::2] = 0.0
    x[2, 3] = INF                                          # +inf in the first block
    x[3, (bs + 1) % width] = -INF                          # -inf in the second block (rowwise: the row)
    x[4, 5] = NAN                                          # NaN in the first block
    x[5, 0], x[5, 1] = INF, NAN                            # both
    x[6] = torch.randn(width, generator=g) * 1e37          # huge
    x[6, 0] = FLT_MAX
    x[6, width - 1] = -FLT_MAX
    x[7] = torch.randn(width, generator=g) * 2.0**-100     # tiny, still normal
    x[8] = torch.randn(width, generator=g) * 1e-44         # float32 subnormal elements ...
    x[8, ::bs] = 1.0                                       # ... under a normal amax
    x[9] = 1.9 * torch.sign(torch.randn(width, generator=g))  # mantissa above e4m3's: FLOOR saturates
    x[10] = torch.tensor([448.0, 464.0, 480.0, 13.0, 0.8125, 2.0**-10, 3 * 2.0**-10, 1.0] * (width // 8))  # ties
    x[11] = torch.tensor([6.0, 5.0, 2.5, 0.25, 0.75, 1.25, 1.75, 3.5] * (width // 8))  # e2m1 ties
    return x


@pytest.fixture(scope="module")
def tao():
    """torchao's reference implementations; its import-time extension warnings are silenced."""
    loggers = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pytest.importorskip("torchao")
            from torchao.float8.config import ScalingGranularity
            from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
            from torchao.float8.float8_training_tensor import LinearMMConfig
            from torchao.prototype.mx_formats.config import ScaleCalculationMode
            from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, unpack_uint4
            from torchao.prototype.mx_formats.mx_tensor import get_fp_scale, to_dtype, to_mx
            from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale
    finally:
        for lg, lv in zip(loggers, levels):
            lg.setLevel(lv)

    def mx(x: torch.Tensor, fmt: str, rule: str):
        """(elements, scales, values) from to_mx / to_dtype, blocks of 32 along the last dim."""
        dt = MX[fmt]
        mode = {"floor": ScaleCalculationMode.FLOOR, "rceil": ScaleCalculationMode.RCEIL}[rule]
        s, d = to_mx(x.contiguous(), dt, 32, mode)
        if dt == torch.float4_e2m1fn_x2:
            elements = f4_unpacked_to_f32(unpack_uint4(d)).reshape(x.shape)
        else:
            elements = d.float()
        return elements, get_fp_scale(s).reshape(*x.shape[:-1], -1), to_dtype(d, s, dt, 32, torch.float32)

    def rowwise(x: torch.Tensor, axis: int, rule: str):
        """(elements, the reciprocal scale _scaled_mm gets, to_original_precision())."""
        t = hp_tensor_to_float8_dynamic(x, torch.float8_e4m3fn, LinearMMConfig(),
                                        scaling_granularity=ScalingGranularity.AXISWISE, axiswise_dim=axis,
                                        round_scales_to_power_of_2=rule == "pow2")
        return t._data.float(), t._scale.reciprocal(), t.to_original_precision().float()

    def nvfp4(x: torch.Tensor):
        """(elements, block scales, tensor scale, NVFP4Tensor.dequantize()) along the last dim."""
        pts = per_tensor_amax_to_scale(torch.max(torch.abs(x)))
        n = NVFP4Tensor.to_nvfp4(x.contiguous(), per_tensor_scale=pts)
        elements = f4_unpacked_to_f32(unpack_uint4(n.qdata.view(torch.uint8))).reshape(x.shape)
        return elements, n.scale.float().reshape(*x.shape[:-1], -1), pts, n.dequantize(torch.float32)

    return types.SimpleNamespace(mx=mx, rowwise=rowwise, nvfp4=nvfp4)


def torchao_mx_departures(x: torch.Tensor, fmt: str, rule: str) -> torch.Tensor:
    """Blocks (rows, n_blocks) where torchao departs from the rules by design (pinned below):
    scale 2**-127 with a nonzero amax, and, for RCEIL, float32 log2 missing the exact ceiling."""
    r = quantize_blocks_with_scales(x, fmt, scale_rule=rule)
    amax = x.float().reshape(*r.scales.shape, -1).abs().amax(-1)
    departs = (r.scales == 2.0**-127) & (amax > 0)
    if rule == "rceil":
        k_tao = torch.clamp(torch.ceil(torch.log2(amax / BLOCK_FORMATS[fmt].element.max)), -127, 127)
        k = torch.frexp(r.scales)[1] - 1
        departs |= torch.isfinite(amax) & (k_tao != k)
    return departs


def compare_mx_with_torchao(tao, x: torch.Tensor, fmt: str, rule: str, *, allow_departures: bool) -> None:
    r = quantize_blocks_with_scales(x, fmt, scale_rule=rule)
    e, s, v = tao.mx(x, fmt, rule)
    keep = ~torchao_mx_departures(x, fmt, rule)
    if not allow_departures:
        assert bool(keep.all()), f"{fmt}/{rule}: test data meant to avoid torchao's departures hits one"
    nan_block = s.isnan()
    keep_el = (keep & ~nan_block).repeat_interleave(32, dim=-1)  # torchao's NaN-block elements are unspecified
    assert_bits(r.elements[keep_el], e[keep_el], f"{fmt}/{rule} elements")
    assert_bits(r.scales[keep], s[keep], f"{fmt}/{rule} scales")
    keep_v = keep.repeat_interleave(32, dim=-1)
    assert_bits(r.dequantize()[keep_v], v[keep_v], f"{fmt}/{rule} values")


# ------------------------------------------------------------------------------- table and errors


def test_table_entries() -> None:
    spec = {  # name: (element, block size, scale format, tensor scale, default rule)
        "fp8_e4m3_rowwise": ("e4m3", None, "fp32", False, "pow2"),
        "fp8_e4m3_block128": ("e4m3", 128, "fp32", False, "pow2"),
        "mxfp8_e4m3": ("e4m3", 32, "e8m0", False, "floor"),
        "mxfp8_e5m2": ("e5m2", 32, "e8m0", False, "floor"),
        "mxfp4": ("e2m1", 32, "e8m0", False, "floor"),
        "nvfp4": ("e2m1", 16, "e4m3", True, "nearest"),
    }
    assert {n: (f.element.name, f.block_size, f.scale.name, f.tensor_scale, f.scale_rules[0])
            for n, f in BLOCK_FORMATS.items()} == spec
    for f in BLOCK_FORMATS.values():
        assert f.element.max == GRIDS[f.element.name][-1]
        assert f.element.max == (2 - 2.0 ** -f.element.mantissa_bits * (1 + (f.element.name == "e4m3"))) \
            * 2.0**f.element.emax
        assert f.element.smallest_subnormal == GRIDS[f.element.name][1]
    with pytest.raises(dataclasses.FrozenInstanceError):
        BLOCK_FORMATS["mxfp4"].block_size = 16  # type: ignore[misc]


def test_reexported_from_formats_and_torchao_never_imported() -> None:
    assert formats.quantize_blocks is quantize_blocks and formats.BLOCK_FORMATS is BLOCK_FORMATS
    for mod in ("formats.py",):
        tree = ast.parse((Path(formats.__file__).parent / mod).read_text())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert not [n for n in names if n.split(".")[0] == "torchao"], mod


@pytest.mark.parametrize(("key", "name"), [("mxfp8", "mxfp8_e4m3"), ("MXFP8-E5M2", "mxfp8_e5m2"),
                                           ("fp8-rowwise", "fp8_e4m3_rowwise"), ("block128", "fp8_e4m3_block128"),
                                           ("nvfp4", "nvfp4")])
def test_get_block_format_names_and_aliases(key: str, name: str) -> None:
    assert get_block_format(key) is BLOCK_FORMATS[name]
    assert get_block_format(BLOCK_FORMATS[name]) is BLOCK_FORMATS[name]


def test_misuse_fails_with_a_message_that_names_the_fix() -> None:
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match=r"unknown block format; use one of fp8_e4m3_rowwise, .*nvfp4"):
        quantize_blocks(x, "mxfp6")
    with pytest.raises(ValueError, match=r"scale_rule='rceil' is not a rule of nvfp4; use one of 'nearest'"):
        quantize_blocks(x, "nvfp4", scale_rule="rceil")
    with pytest.raises(ValueError, match=r"use one of 'floor', 'rceil'"):
        quantize_blocks(x, "mxfp4", scale_rule="ceil")
    with pytest.raises(TypeError, match=r"x is torch.float64; pass float32, bfloat16 or float16"):
        quantize_blocks(x.double(), "mxfp4")
    with pytest.raises(ValueError, match=r"axis 2 is not a dimension of x"):
        quantize_blocks(x, "mxfp4", axis=2)
    with pytest.raises(ValueError, match=r"axis -1 is not a dimension of x"):
        quantize_blocks(torch.tensor(1.0), "fp8_e4m3_rowwise")


@pytest.mark.parametrize(("fmt", "bs"), [("mxfp8_e4m3", 32), ("mxfp4", 32), ("nvfp4", 16), ("fp8_e4m3_block128", 128)])
def test_shape_not_a_multiple_of_the_block_is_refused(fmt: str, bs: int) -> None:
    x = torch.randn(3, bs + 8, 2 * bs)
    shape = r"\(3, " + str(bs + 8) + ", " + str(2 * bs) + r"\)"
    with pytest.raises(ValueError, match=rf"x of shape {shape}, '{fmt}', axis=1\): dimension 1 has {bs + 8} elements, "
                                         rf"not a multiple of {fmt}'s block size {bs}"):
        quantize_blocks(x, fmt, axis=1)
    quantize_blocks(x, fmt, axis=2)  # the other dimension fits
    quantize_blocks(x, "fp8_e4m3_rowwise", axis=1)  # a row is any length


# ------------------------------------------------------------------------ layout, dtypes, structure


@pytest.mark.parametrize("fmt", list(BLOCK_FORMATS))
def test_any_axis_is_the_last_axis_moved(fmt: str) -> None:
    x = block_rows(1, 4 * 128, 64, 32, -8, 8).reshape(4, 128, 64)
    want = quantize_blocks(x.movedim(1, -1).contiguous(), fmt).movedim(-1, 1)
    assert_bits(quantize_blocks(x, fmt, axis=1), want, f"{fmt} axis=1")
    assert_bits(quantize_blocks(x, fmt, axis=-2), want, f"{fmt} axis=-2")
    r = quantize_blocks_with_scales(x, fmt, axis=1)
    n_blocks = 1 if BLOCK_FORMATS[fmt].block_size is None else 128 // BLOCK_FORMATS[fmt].block_size
    assert r.axis == 1 and r.scales.shape == (4, n_blocks, 64) and r.elements.shape == x.shape


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", list(BLOCK_FORMATS))
def test_half_inputs_quantize_like_their_float32_values(fmt: str, dtype: torch.dtype) -> None:
    x = (block_rows(2, 8, 256, 32, -6, 6) * 0.5).to(dtype)
    x[0, :16] = 0.0
    x[1, 0] = float("inf")
    for rule in BLOCK_FORMATS[fmt].scale_rules:
        assert_bits(quantize_blocks(x, fmt, scale_rule=rule), quantize_blocks(x.float(), fmt, scale_rule=rule),
                    f"{fmt}/{rule} {dtype}")


@pytest.mark.parametrize("fmt", list(BLOCK_FORMATS))
def test_elements_are_format_values_and_scales_are_format_scales(fmt: str) -> None:
    f = BLOCK_FORMATS[fmt]
    x = block_rows(3, 16, 256, 32, -30, 30)
    for rule in f.scale_rules:
        r = quantize_blocks_with_scales(x, fmt, scale_rule=rule)
        grid = torch.tensor(GRIDS[f.element.name])
        assert bool(torch.isin(r.elements.abs(), grid).all()), (fmt, rule)
        mant, _ = torch.frexp(r.scales)
        if f.scale.name == "e8m0" or rule == "pow2":
            assert bool((mant == 0.5).all()), (fmt, rule)  # powers of two
        if f.scale.name == "e4m3":
            assert bool((r.scales.to(torch.float8_e4m3fn).float() == r.scales).all())
            assert bool(((r.scales >= 2.0**-6) & (r.scales <= 448)).all())  # normal e4m3 only
        assert bool(((r.scales >= f.scale.min) & (r.scales <= f.scale.max)).all())


def test_results_carry_no_autograd_history() -> None:
    x = torch.randn(2, 128, requires_grad=True)
    for fmt in BLOCK_FORMATS:
        r = quantize_blocks_with_scales(x, fmt)
        assert not (r.elements.requires_grad or r.scales.requires_grad or quantize_blocks(x, fmt).requires_grad)


def test_empty_tensors() -> None:
    for fmt in BLOCK_FORMATS:
        assert quantize_blocks(torch.empty(0, 128), fmt).shape == (0, 128)
    assert quantize_blocks(torch.empty(3, 0), "fp8_e4m3_rowwise").shape == (3, 0)


# ------------------------------------------------------------ the rules, against a Python reference


@pytest.mark.parametrize("rule", ["floor", "rceil"])
@pytest.mark.parametrize("fmt", list(MX))
def test_mx_matches_the_spec_reference_on_special_blocks(fmt: str, rule: str) -> None:
    check_against_reference(special_rows(32), fmt, rule)
    check_against_reference(block_rows(4, 4, 128, 32, -126, 126), fmt, rule)


@pytest.mark.parametrize("rule", ["pow2", "fp32"])
def test_block128_matches_the_transformer_engine_rule(rule: str) -> None:
    check_against_reference(special_rows(128, 256), "fp8_e4m3_block128", rule)
    x = block_rows(5, 4, 512, 128, -126, 126)
    x[0, :128] = torch.randn(128, generator=torch.Generator().manual_seed(5)) * 1e-38  # amax below 448 / FLT_MAX:
    # 448 / amax overflows float32 and the scale takes the input dtype's max instead
    check_against_reference(x, "fp8_e4m3_block128", rule)
    check_against_reference(x.bfloat16(), "fp8_e4m3_block128", rule)


def test_mx_rules_by_hand() -> None:
    def one(values: list[float], fmt: str, rule: str = "floor"):
        r = quantize_blocks_with_scales(torch.tensor(values + [0.0] * (32 - len(values))), fmt, scale_rule=rule)
        return r.scales.item(), r.dequantize()[: len(values)].tolist()

    assert one([1.0, 0.3], "mxfp8_e4m3") == (2.0**-8, [1.0, 0.3125])      # 1.0 -> 256, 0.3 * 256 = 76.8 -> 80
    assert one([1.9], "mxfp8_e4m3") == (2.0**-8, [1.75])                   # FLOOR: 486.4 saturates at 448
    assert one([1.9], "mxfp8_e4m3", "rceil") == (2.0**-7, [1.875])         # 1.9/448 rounds up to 2**-7; 243.2 -> 240
    assert one([1.9], "mxfp4") == (0.25, [1.5])                            # 2**(0-2); 1.9/0.25 = 7.6 -> 6
    assert one([1.9, 0.1], "mxfp4", "rceil") == (0.5, [2.0, 0.0])          # 1.9/6 -> 2**-1; 3.8 -> 4, 0.2 -> 0
    assert one([2.0**-130, -2.0**-131], "mxfp8_e4m3") == (2.0**-127, [2.0**-130, -2.0**-131])  # subnormal amax: exact
    assert one([INF, 1.0], "mxfp8_e4m3") == (2.0**120, [INF, 0.0])         # inf's exponent field: 2**(128-8)
    assert one([-INF, 1e38], "mxfp8_e5m2", "rceil") == (2.0**127, [-INF, 0.625 * 2.0**127])  # 0.588 -> 0.625
    s, v = one([NAN, 1.0], "mxfp4")
    assert math.isnan(s) and all(math.isnan(t) for t in v)


@pytest.mark.parametrize("fmt", ["fp8_e4m3_rowwise", "fp8_e4m3_block128", "nvfp4"])
def test_nonfinite_blocks(fmt: str) -> None:
    x = block_rows(6, 4, 256, 128, -4, 4)
    x[1, 5] = INF
    x[2, 200] = NAN
    v = quantize_blocks(x, fmt)
    if fmt == "nvfp4":  # the tensor scale is NaN: everything is
        assert bool(v.isnan().all())
        return
    width = 256 if fmt == "fp8_e4m3_rowwise" else 128
    assert bool(v[1, :width].isnan().all()) and bool(v[2, 256 - width:].isnan().all())
    assert bool(v.isnan().sum() == 2 * width)
    assert_bits(v[[0, 3]], quantize_blocks(x[[0, 3]], fmt), f"{fmt} finite rows")


def test_zero_blocks_keep_signed_zeros() -> None:
    x = torch.zeros(128, 128)
    x[64:] = -0.0
    for fmt in BLOCK_FORMATS:
        assert_bits(quantize_blocks(x, fmt), x, fmt)
        assert_bits(quantize_blocks(x, fmt, axis=0), x, fmt)
    r = quantize_blocks_with_scales(x, "nvfp4")
    assert r.scales.unique().tolist() == [2.0**-6] and r.tensor_scale.item() == 2.0**-121


@pytest.mark.parametrize("rule", ["pow2", "fp32"])
def test_rowwise_matches_the_torchao_rule(rule: str) -> None:
    x = torch.cat([block_rows(17, 8, 64, 64, -126, 126), special_rows(64, 64)])
    x[0, 1:] = 0.0
    x[0, 0] = 3e-13  # below torchao's amax floor 1e-12
    check_against_reference(x, "fp8_e4m3_rowwise", rule)
    check_against_reference(x.bfloat16(), "fp8_e4m3_rowwise", rule)


def test_nvfp4_matches_the_torchao_rule() -> None:
    x = torch.cat([block_rows(18, 8, 64, 16, -12, 12), special_rows(16, 64)[[0, 1, 7, 8, 9, 10, 11]]])
    x[3, 16:32] = 1e-44
    check_against_reference(x, "nvfp4", "nearest")
    check_against_reference(x * 1e-36, "nvfp4", "nearest")  # the tensor scale's floor
    for i in (2, 3, 4, 5):  # inf, -inf, NaN, both: the whole tensor is NaN
        y = torch.cat([x, special_rows(16, 64)[i:i + 1]])
        check_against_reference(y, "nvfp4", "nearest")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_format_matches_the_reference_property(data: st.DataObject) -> None:
    fmt = data.draw(st.sampled_from(list(BLOCK_FORMATS)))
    f = BLOCK_FORMATS[fmt]
    rule = data.draw(st.sampled_from(f.scale_rules))
    bs = f.block_size or 48
    rows = []
    for _ in range(2):
        e = data.draw(st.integers(-150, 127))
        mant = data.draw(st.lists(st.floats(-2, 2, width=32), min_size=bs, max_size=bs))
        row = [f32(m * 2.0**e) for m in mant]
        special = data.draw(st.sampled_from([None, None, None, 0.0, -0.0, INF, -INF, NAN, FLT_MAX]))
        if special is not None:
            row[data.draw(st.integers(0, bs - 1))] = special
        rows.append(row)
    check_against_reference(torch.tensor(rows, dtype=torch.float32), fmt, rule)


# ------------------------------------------------------------------------ bit-exact against torchao


@pytest.mark.parametrize("rule", ["floor", "rceil"])
@pytest.mark.parametrize("fmt", list(MX))
def test_mx_bit_exact_with_torchao(tao, fmt: str, rule: str) -> None:
    compare_mx_with_torchao(tao, block_rows(8, 64, 256, 32, -100, 100), fmt, rule, allow_departures=False)
    compare_mx_with_torchao(tao, special_rows(32), fmt, rule, allow_departures=False)
    compare_mx_with_torchao(tao, block_rows(9, 16, 256, 32, -40, 40).bfloat16(), fmt, rule, allow_departures=False)
    x16 = block_rows(10, 16, 256, 32, -6, 6).half()  # torchao takes float32/bf16 only
    assert_bits(quantize_blocks(x16, fmt, scale_rule=rule), tao.mx(x16.float(), fmt, rule)[2], f"{fmt} fp16")


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mx_bit_exact_with_torchao_property(tao, data: st.DataObject) -> None:
    fmt, rule = data.draw(st.sampled_from(list(MX))), data.draw(st.sampled_from(["floor", "rceil"]))
    bits = data.draw(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=4 * 32, max_size=4 * 32))
    x = torch.tensor(bits, dtype=torch.int32).view(torch.float32).reshape(2, 64)  # any float32 at all
    e = data.draw(st.integers(-120, 120))
    mant = data.draw(st.lists(st.floats(-4, 4, width=32), min_size=64, max_size=64))
    y = (torch.tensor(mant) * 2.0**e).reshape(1, 64)
    for t in (x, y.float()):
        compare_mx_with_torchao(tao, t, fmt, rule, allow_departures=True)
        check_against_reference(t, fmt, rule)  # the blocks torchao departs on follow the rules


@pytest.mark.parametrize("rule", ["pow2", "fp32"])
@pytest.mark.parametrize("axis", [-1, 0])
def test_rowwise_bit_exact_with_torchao(tao, axis: int, rule: str) -> None:
    x = torch.cat([block_rows(11, 32, 256, 256, -60, 60), special_rows(256, 256)])
    x[20, 7] = 3e-13  # amax below torchao's 1e-12 floor
    x[20, 8:] = 0.0
    for t in (x, x.bfloat16(), x.t().contiguous()):
        r = quantize_blocks_with_scales(t, "fp8_e4m3_rowwise", axis=axis, scale_rule=rule)
        e, s, v = tao.rowwise(t, axis, rule)
        finite = torch.isfinite(t.float()).all(dim=axis, keepdim=True).expand_as(t)
        assert_bits(r.elements[finite], e[finite], f"rowwise/{rule} elements")  # torchao's elements: 0 or NaN
        assert_bits(r.scales, torch.where(s.isinf(), NAN, s), f"rowwise/{rule} scales")  # its 1/0 is our NaN
        assert bool(v[~finite].isnan().all()) and bool(r.dequantize()[~finite].isnan().all())
        if rule == "pow2":  # exact: q / s == q * (1 / s)
            assert_bits(r.dequantize(), v.float(), f"rowwise/{rule} values")


def test_rowwise_pow2_keeps_torchaos_float32_log2_rounding(request) -> None:
    """448 / amax a few ulps below 2**16: float32 log2 rounds to 16, so torchao (and we) take 2**16, not 2**15,
    and the largest element saturates at 448."""
    amax = float(torch.nextafter(torch.tensor(448 * 2.0**-16), torch.tensor(INF)))
    x = torch.tensor([[amax, 1e-3] + [0.0] * 30])
    r = quantize_blocks_with_scales(x, "fp8_e4m3_rowwise")
    assert r.scales.item() == 2.0**-16 and r.elements[0, 0].item() == 448.0
    try:
        tao = request.getfixturevalue("tao")
    except pytest.skip.Exception:
        return
    e, s, _ = tao.rowwise(x, -1, "pow2")
    assert_bits(r.elements, e, "elements")
    assert_bits(r.scales, s, "scales")


def test_nvfp4_bit_exact_with_torchao(tao) -> None:
    x = torch.cat([block_rows(12, 41, 256, 16, -10, 10), special_rows(16, 256)[[0, 1, 7, 8, 9, 10, 11]] * 1e3])
    x[5, :16] = 1e-44  # a block of float32 subnormals
    for t in (x, x.bfloat16(), x.t().contiguous()):
        r = quantize_blocks_with_scales(t, "nvfp4")
        e, s, pts, _ = tao.nvfp4(t)
        assert_bits(r.elements, e, "nvfp4 elements")
        assert_bits(r.scales, s, "nvfp4 block scales")
        assert_bits(r.tensor_scale, pts, "nvfp4 tensor scale")
        assert_bits(r.dequantize(), (e * s.repeat_interleave(16, dim=-1)) * pts, "nvfp4 values")
    for bad in (INF, NAN):
        y = x.clone()
        y[3, 3] = bad
        assert bool(quantize_blocks(y, "nvfp4").isnan().all()) and bool(tao.nvfp4(y)[3].isnan().all())


# ----------------------------------------------------------- where torchao departs, pinned one by one


def _exact_block(fmt: str) -> torch.Tensor:
    """A block at scale 2**-127 whose values, and their halves, are exact elements."""
    top = {"mxfp8_e4m3": 256.0, "mxfp8_e5m2": 32768.0, "mxfp4": 4.0}[fmt]
    v = torch.zeros(2, 32)
    v[0, :4] = torch.tensor([top, top / 2, 2.0, -1.0]) * 2.0**-127  # normal amax below 2**(emax - 126)
    v[1, :2] = torch.tensor([1.0, -1.0]) * 2.0**-127                  # amax a float32 subnormal
    return v


@pytest.mark.parametrize("fmt", list(MX))
def test_torchao_mx_floor_halves_a_block_whose_scale_is_2_pow_minus_127(tao, fmt: str) -> None:
    """OCP FLOOR gives scale 2**-127 and elements x * 2**127, so these blocks are lossless; torchao's to_mx
    divides by max(scale, 2**-126) yet stores 2**-127, so it returns half of every value."""
    x = _exact_block(fmt)
    r = quantize_blocks_with_scales(x, fmt)
    assert bool((r.scales == 2.0**-127).all())
    assert_bits(r.dequantize(), x, f"{fmt} spec")
    check_against_reference(x, fmt, "floor")
    e, s, v = tao.mx(x, fmt, "floor")
    assert bool((s == 2.0**-127).all())
    assert_bits(v, x / 2, f"{fmt} torchao")
    assert bool(torchao_mx_departures(x, fmt, "floor").all())


@pytest.mark.parametrize("fmt", list(MX))
def test_torchao_mx_rceil_flushes_a_block_whose_scale_is_2_pow_minus_127(tao, fmt: str) -> None:
    """cuDNN's RCEIL quantizes vals / scale; torchao (like TransformerEngine's exp2f_rcp) multiplies by 1
    instead of 2**127 when the e8m0 code is 0, so these blocks become zero."""
    x = _exact_block(fmt)
    r = quantize_blocks_with_scales(x, fmt, scale_rule="rceil")
    assert bool((r.scales == 2.0**-127).all())
    assert_bits(r.dequantize(), x, f"{fmt} spec")
    e, s, v = tao.mx(x, fmt, "rceil")
    assert bool((s == 2.0**-127).all()) and bool((v == 0).all())


@pytest.mark.parametrize("fmt", list(MX))
def test_torchao_mx_rceil_eager_log2_misses_the_ceiling_just_above_a_power_of_two(tao, fmt: str) -> None:
    """amax / max = 2**-20 * (1 + 2**-23): its ceiling is 2**-19 (the exact rule, and cvt.rp.satfinite.ue8m0);
    torchao's eager path takes ceil of a float32 log2 that rounds to -20, and saturates the block's max."""
    el = BLOCK_FORMATS[fmt].element
    amax = float(torch.nextafter(torch.tensor(el.max * 2.0**-20), torch.tensor(INF)))
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1] = amax, amax / 3
    r = quantize_blocks_with_scales(x, fmt, scale_rule="rceil")
    assert r.scales.item() == 2.0**-19
    check_against_reference(x, fmt, "rceil")
    e, s, v = tao.mx(x, fmt, "rceil")
    assert s.item() == 2.0**-20 and e[0, 0].item() == el.max


def test_torchao_nvfp4_returns_nan_for_a_zero_or_tiny_tensor(tao) -> None:
    """t = amax / 2688 is 0 for an all-zero tensor: torchao returns NaN. For a tensor amax below ~5e-34,
    1 / t / s overflows on a zero block: 0 * inf is NaN, which e2m1 cannot hold, and the zero block reads
    back as nonzero garbage. The tensor scale floored at 2**-121 keeps zeros zero."""
    zero = torch.zeros(4, 32)
    assert_bits(quantize_blocks(zero, "nvfp4"), zero, "nvfp4 zeros")
    assert bool(tao.nvfp4(zero)[3].isnan().all())
    tiny = block_rows(13, 4, 32, 16, 0, 0) * 1e-35
    tiny[0, :16] = 0.0
    ours = quantize_blocks(tiny, "nvfp4")
    assert bool(ours.isfinite().all()) and bool((ours[0, :16] == 0).all())
    assert not bool((tao.nvfp4(tiny)[3][0, :16] == 0).any())
    x = tiny * 2.0**20  # tensor scale above 2**-121: no NaN, and bit-exact again
    assert_bits(quantize_blocks(x, "nvfp4"), (lambda e, s, t, _: e * s.repeat_interleave(16, -1) * t)(*tao.nvfp4(x)))


def test_torchao_nvfp4_dequantize_rounds_the_product_of_the_two_scales_first(tao) -> None:
    """Our values are float32((q * s) * t) -- q * s is exact, one rounding; NVFP4Tensor.dequantize computes
    q * float32(t * s): a second rounding, at most one ulp away, and it differs on Gaussian data."""
    x = block_rows(14, 64, 256, 16, -3, 3)
    ours, theirs = quantize_blocks(x, "nvfp4"), tao.nvfp4(x)[3]
    ulps = (ours.view(torch.int32).long() - theirs.view(torch.int32).long()).abs()
    assert int(ulps.max()) == 1


def test_torchao_rowwise_fp32_rule_dequantizes_by_dividing(tao) -> None:
    """With unrounded fp32 scales our values are q * float32(1 / s), the reciprocal torchao passes to
    torch._scaled_mm; its to_original_precision() divides q / s instead: at most one ulp apart."""
    x = block_rows(15, 64, 256, 256, -3, 3)
    r = quantize_blocks_with_scales(x, "fp8_e4m3_rowwise", scale_rule="fp32")
    e, s, v = tao.rowwise(x, -1, "fp32")
    assert_bits(r.dequantize(), e * s, "rowwise/fp32 with the reciprocal")
    nz = v != 0
    ulps = (r.dequantize().view(torch.int32).long() - v.view(torch.int32).long()).abs()[nz]
    assert int(ulps.max()) == 1


# ------------------------------------------------------------------------------------ SQNR floors


SQNR_FLOORS = {  # dB on N(0, 1) data, blocks along the last dim; (format, rule): floor
    ("fp8_e4m3_rowwise", "pow2"): 31.0, ("fp8_e4m3_rowwise", "fp32"): 31.0,
    ("fp8_e4m3_block128", "pow2"): 31.0, ("fp8_e4m3_block128", "fp32"): 31.0,
    ("mxfp8_e4m3", "floor"): 30.0, ("mxfp8_e4m3", "rceil"): 31.0,
    ("mxfp8_e5m2", "floor"): 24.5, ("mxfp8_e5m2", "rceil"): 24.5,
    ("mxfp4", "floor"): 18.0, ("mxfp4", "rceil"): 18.0,
    ("nvfp4", "nearest"): 19.5,
}


def _sqnr(x: torch.Tensor, q: torch.Tensor) -> float:
    return 10 * math.log10(float((x.double() ** 2).sum() / ((x.double() - q.double()) ** 2).sum()))


def test_sqnr_floors_on_gaussian_data() -> None:
    x = torch.randn(128, 512, generator=torch.Generator().manual_seed(0))
    got = {(n, r): _sqnr(x, quantize_blocks(x, n, scale_rule=r)) for n, f in BLOCK_FORMATS.items()
           for r in f.scale_rules}
    assert set(got) == set(SQNR_FLOORS)
    low = {k: round(v, 2) for k, v in got.items() if v < SQNR_FLOORS[k]}
    assert not low, f"below the floor: {low}"
    assert got[("nvfp4", "nearest")] > got[("mxfp4", "floor")] + 1.0  # 16-blocks with e4m3 scales beat MXFP4
    assert got[("mxfp8_e4m3", "rceil")] > got[("mxfp8_e4m3", "floor")]  # FLOOR saturates the top of each block
    assert 10 < got[("mxfp4", "floor")] < 25  # a floor that a lossless (or broken) quantizer would not meet


def test_a_block_format_object_is_accepted_and_its_fields_rule() -> None:
    x = block_rows(16, 2, 64, 16, -3, 3)
    f = dataclasses.replace(BLOCK_FORMATS["mxfp4"], name="mxfp4_b16", block_size=16)
    assert isinstance(f, BlockFormat)
    two = quantize_blocks(x.reshape(-1, 32), "mxfp4").reshape(x.shape)
    per16 = torch.stack([quantize_blocks(torch.cat([b, torch.zeros(2, 16)], 1), "mxfp4")[:, :16]
                         for b in x.split(16, dim=1)], 1).reshape(x.shape)  # a 16-block padded with zeros
    assert_bits(quantize_blocks(x, f), per16, "mxfp4 with 16-blocks")
    assert not torch.equal(two, per16)  # the block size matters on this data
