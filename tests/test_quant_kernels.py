"""Tests for mixprec.lowp.quant: the grid rounding every quantiser shares equals round-to-nearest-even (PyTorch's
FP8 casts; e2m1: an oracle here), the compiled operand quantisation gives the eager path's values bit for bit,
and it stays out of the way where it must (small operands, off, no compiler).

Tiers: bit-exact (int16 views of the bf16 values: signed zeros and NaN payloads compared) everywhere. The
rounding is checked eagerly (cheap: the same IEEE operations the compiled loop runs); the compiled kernels
themselves only in the slow tier (each compile takes seconds).
"""

from __future__ import annotations

import pytest
import torch

from mixprec.errors import ConfigError
from mixprec.formats import ELEMENT_FORMATS, round_to_grid
from mixprec.lowp import quant
from mixprec.lowp.quant import E4M3, E5M2, quantize_operand, to_fp8_as_bf16

FORMATS = {"e4m3": (4, -6, 3), "e5m2": (3, -14, 2), "e2m1": (2, 0, 1)}
"""Element format: (significant bits, smallest normal exponent, mantissa bits)."""


def _rne(y: torch.Tensor, name: str) -> torch.Tensor:
    """The oracle: PyTorch's FP8 cast; for e2m1 (no cast) ``round(y / 2**k) * 2**k`` with ``2**k`` the format's
    spacing at ``y`` (both scalings exact, ``torch.round`` half to even)."""
    el = ELEMENT_FORMATS[name]
    if el.torch_dtype is not None:
        return y.to(el.torch_dtype).float()
    _, e = torch.frexp(y.abs())
    k = (torch.clamp(e - 1, min=el.emin, max=el.emax) - el.mantissa_bits).double()
    return torch.copysign(torch.round(y.double() * torch.exp2(-k)) * torch.exp2(k), y.double()).float()


def _reference(v: torch.Tensor, name: str) -> torch.Tensor:
    """The oracle in bf16, with -0 as +0: the quantisers give +0."""
    q = _rne(v, name).to(torch.bfloat16)
    return torch.where(q == 0, torch.zeros_like(q), q)


def _rounded(v: torch.Tensor, name: str, how: str) -> torch.Tensor:
    """round_to_grid's eager formulation (the magic number, in place) or its compiled one (Veltkamp's split,
    here run eagerly: the same IEEE operations the compiled loop runs)."""
    el = ELEMENT_FORMATS[name]
    return round_to_grid(v.clone(), el if how == "magic" else torch.tensor(el.split)).to(torch.bfloat16)


def _binade_values(low_bits: tuple[int, ...] | None) -> torch.Tensor:
    """fp32 bit patterns of [1, 2): all of them (None), or those whose low 12 bits are in ``low_bits``."""
    if low_bits is None:
        return torch.arange(0x3F800000, 0x40000000, dtype=torch.int32).view(torch.float32)
    hi = torch.arange(0x3F800000 >> 12, 0x40000000 >> 12, dtype=torch.int32) << 12
    return torch.cat([hi | b for b in low_bits]).view(torch.float32)


def _check_rounding(name: str, x: torch.Tensor, how: str, binades: str = "all") -> None:
    _, emin, mbits = FORMATS[name]
    el = ELEMENT_FORMATS[name]
    ks = (range(emin - mbits - 1, el.emax + 1) if binades == "all"  # from below the subnormals to the largest
          else (emin - 1, emin, el.emax))  # the largest subnormal binade, the smallest normal one, the top one
    for k in ks:
        v = x * 2.0**k
        v = v[v <= el.max]
        for s in (v, -v):
            got, want = _rounded(s, name, how), _reference(s, name)
            bad = got.view(torch.int16) != want.view(torch.int16)
            assert not bad.any(), (name, k, s[bad][:4], got[bad][:4], want[bad][:4])


@pytest.mark.parametrize("how", ["magic", "split"])
@pytest.mark.parametrize("name", FORMATS)
def test_the_grid_rounding_equals_rne_on_ties_and_their_neighbours(name, how):
    # ties of every element format sit on fp32 patterns with low 12 bits zero; +-1 ulp around them too
    _check_rounding(name, _binade_values((0, 1, 0xFFF, 0x800)), how)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["magic", "split"])
@pytest.mark.parametrize("name", FORMATS)
def test_the_grid_rounding_equals_rne_on_every_fp32_value_of_a_binade(name, how):
    _check_rounding(name, _binade_values(None), how, binades="edges")  # the rest: powers of two apart, exactly


def _special(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-140, 130, shape, generator=g).float())
    x = x.reshape(-1)
    x[:64] = 0
    x[64:96] = torch.nan
    x[96], x[200] = float("inf"), -float("inf")
    x[300:400] *= 1e-38
    x[1000:1064] = torch.randn(64, generator=g) * 1e-42
    x[2000:2032] = 1e30
    x[3000:3032] = torch.randn(32, generator=g) * 2.0**120
    return x.reshape(shape).to(dtype)


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if a.dtype == torch.bfloat16:
        return torch.equal(a.view(torch.int16), b.view(torch.int16))
    return torch.equal(a, b) or bool(a.isnan().all() and b.isnan().all())


@pytest.fixture
def fresh_state(monkeypatch):
    """quant's process state, restored after the test."""
    for key, value in (("broken", False), ("fns", {}), ("env", None), ("mode", None)):
        monkeypatch.setitem(quant._state, key, value)


@pytest.mark.slow
def test_the_compiled_kernels_give_the_eager_values(fresh_state):
    # each dtype once with every special value (two shapes between them), and one plain random tensor
    inputs = [_special((64, 128), torch.float32, 0), _special((96, 64), torch.bfloat16, 1), torch.randn(256, 96)]
    for x in inputs:
        for fmt in ("mxfp8", "mxfp4", "e4m3-row", "nvfp4"):
            for axis in (0, 1):
                for rule in (("rceil", "floor") if fmt.startswith("mx") else ("rceil",)):  # MX alone has two
                    with quant.set_fused_quant("off"):
                        want = quantize_operand(x, fmt, axis, scale_rule=rule)
                    with quant.set_fused_quant("on"):
                        got = quantize_operand(x, fmt, axis, scale_rule=rule)
                    if quant._state["broken"]:
                        pytest.skip("torch.compile is unavailable here (no C compiler or Inductor)")
                    assert _same(got[0], want[0]) and _same(got[1], want[1]), (x.dtype, x.shape, fmt, axis, rule)
        for dtype in (E4M3, E5M2):
            for t in (x, torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0) * 1e-30, torch.zeros_like(x)):
                with quant.set_fused_quant("off"):
                    want = to_fp8_as_bf16(t, dtype)
                with quant.set_fused_quant("on"):
                    got = to_fp8_as_bf16(t, dtype)
                assert _same(got[0], want[0]) and _same(got[1], want[1]), (t.dtype, dtype)
    out, s = torch.randn(64, 96).bfloat16(), torch.tensor(2.0**-7)
    with quant.set_fused_quant("on"):
        assert torch.equal(quant.scaled_float(out, s), out.float().mul_(s))


def test_auto_fuses_the_operands_of_large_cpu_layers_only_and_off_never(fresh_state):
    small, large = torch.zeros(64, 64), torch.empty((quant.MIN_COMPILE_NUMEL,), device="meta")
    assert not quant._wanted(small)
    assert not quant._wanted(large)  # not a CPU tensor
    with quant.layer_size(quant.MIN_COMPILE_NUMEL):  # an operand of a large layer
        assert quant._wanted(small)
        assert not quant._wanted(torch.zeros(8, 8))  # too small to be worth a call
        with quant.set_fused_quant("off"):
            assert not quant._wanted(small)
            to_fp8_as_bf16(small, E4M3)
    assert quant._state["fns"] == {}  # nothing compiled
    with quant.layer_size(quant.MIN_COMPILE_NUMEL - 1):
        assert not quant._wanted(torch.zeros(quant.MIN_COMPILE_NUMEL))
    with quant.set_fused_quant("on"):
        assert quant._wanted(small)
    assert quant.fused_quant_mode() == "auto"


def test_a_bad_mode_is_a_config_error_naming_the_choices(fresh_state, monkeypatch):
    with pytest.raises(ConfigError, match="auto, on, off"):
        with quant.set_fused_quant("always"):
            pass
    monkeypatch.setenv("MIXPREC_FUSED_QUANT", "yes")
    with pytest.raises(ConfigError, match="MIXPREC_FUSED_QUANT='yes'"):
        quant.fused_quant_mode()


def test_a_failed_compile_falls_back_to_the_eager_values_once(fresh_state, monkeypatch, caplog):
    def broken_compile(fn, **kwargs):
        def call(*args):
            raise RuntimeError("no C compiler")
        return call

    monkeypatch.setattr(torch, "compile", broken_compile)
    x = _special((64, 128), torch.float32)
    with quant.set_fused_quant("off"):
        want = quantize_operand(x, "mxfp8", 1, scale_rule="rceil"), to_fp8_as_bf16(x, E4M3)
    with caplog.at_level("INFO", logger="mixprec.lowp.quant"), quant.set_fused_quant("on"):
        got = quantize_operand(x, "mxfp8", 1, scale_rule="rceil"), to_fp8_as_bf16(x, E4M3)
    assert quant._state["broken"]
    assert _same(got[0][0], want[0][0]) and _same(got[1][0], want[1][0]) and _same(got[1][1], want[1][1])
    assert [r.getMessage() for r in caplog.records].count(
        "mixprec: fused quantisation unavailable (RuntimeError: no C compiler); using the eager path") == 1
