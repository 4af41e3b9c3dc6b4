"""FP8 linear layers, in tiers: exact where lossless (round trips of representable values, power-of-two
scales), a tight match against a reference built from ``formats.quantize``, SQNR floors against fp32
for the forward output and each gradient (checked to catch a broken scale or format), the module swap,
state_dicts, and training on digits. The real ``torch._scaled_mm`` path runs only on CUDA 8.9+."""

import contextlib
import copy
import logging

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from mixprec import hardware
from mixprec.autocast import autocast
from mixprec.formats import quantize
from mixprec.lowp import convert, fp8, quant
from mixprec.lowp.convert import convert_to_fp8, plan_fp8_conversion
from mixprec.lowp.fp8 import Fp8Linear, fp8_linear
from mixprec.lowp.quant import E4M3, E5M2, fp8_scale, to_fp8

# SQNR floors (dB) against fp32, with ~2.5 dB margin under what Gaussian data measures (seeds 0-2):
# one operand rounded to e4m3 (3 mantissa bits) 31.5, to e5m2 (2 bits) 25.5; the forward GEMM has two
# e4m3 operands, so their noise adds (-3 dB): 28.5; the gradient GEMMs are dominated by dy's e5m2: 24.5.
FLOOR = {"e4m3": 29.0, "e5m2": 23.0, "y": 26.0, "dx": 22.0, "dw": 22.0}


def sqnr(ref: torch.Tensor, x: torch.Tensor) -> float:
    ref, x = ref.double(), x.double()
    return float(20 * torch.log10(ref.norm() / (ref - x).norm()))


def _all_finite_fp8(dtype: torch.dtype) -> torch.Tensor:
    v = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    return v[torch.isfinite(v)]


def _data(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(512, 256, generator=g)
    w = torch.randn(128, 256, generator=g) / 16
    b = torch.randn(128, generator=g) / 10
    dy = torch.randn(512, 128, generator=g) * 1e-3  # gradients are small: scaling must lift them
    return x, w, b, dy


def _three_gemms(x, w, b, dy, mode=None, **kw):
    """(y, dx, dW, db) of fp8_linear (or of one GEMM path, ``mode`` as in fp8._gemm) and of F.linear in fp32."""
    out = []
    fp8_fn = (lambda *a: fp8_linear(*a, **kw)) if mode is None else (lambda *a: fp8._linear(*a, mode))
    for fn in (fp8_fn, F.linear):
        xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
        y = fn(xr, wr, br)
        y.backward(dy)
        out.append((y.detach(), xr.grad, wr.grad, br.grad))
    return out


# -- exact tier ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("shift", [0, -20, 30])
def test_representable_values_round_trip_exactly_under_power_of_two_scaling(dtype, shift):
    v = _all_finite_fp8(dtype) * 2.0**shift
    q, inv = to_fp8(v, dtype)
    assert q.dtype == dtype
    torch.testing.assert_close(q.float() * inv, v, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_scale_is_the_largest_power_of_two_that_keeps_amax_in_range(dtype):
    fmax = torch.finfo(dtype).max
    amax = torch.cat([torch.rand(1000) * 10.0 ** torch.randint(-30, 30, (1000,)).float(),
                      torch.tensor([fmax, fmax / 2, fmax * 2, 1.0, 1e-30])])
    for a in amax:
        s = fp8_scale(a, dtype)
        m, _ = torch.frexp(s)
        assert m.item() == 0.5  # a power of two
        assert a * s <= fmax < a * s * 2  # largest such: amax lands in (fmax/2, fmax]
        assert s.reciprocal() * s == 1  # the inverse scale is exact


def test_scale_edge_cases():
    assert fp8_scale(torch.tensor(0.0), E4M3).item() == 2.0**126  # all zeros: any scale is exact
    assert fp8_scale(torch.tensor(1e-38), E4M3).item() == 2.0**126  # clamped: 1/scale stays a normal fp32
    assert torch.isnan(fp8_scale(torch.tensor(float("inf")), E4M3))
    assert torch.isnan(fp8_scale(torch.tensor(float("nan")), E5M2))


@pytest.mark.parametrize("dtype,fmt", [(E4M3, "fp8_e4m3"), (E5M2, "fp8_e5m2")])
def test_quantization_is_formats_quantize_of_the_scaled_tensor(dtype, fmt):
    x = torch.randn(64, 64) * 1e-3
    q, inv = to_fp8(x, dtype)
    scale = inv.reciprocal()
    torch.testing.assert_close(q.float(), quantize(x * scale, fmt), rtol=0, atol=0)


# fp32 accumulation: the error scales with the largest entry (cancellation makes small ones relatively worse);
# the emulated path also rounds each GEMM result once to bf16 (relative error <= 2**-9)
_QDQ_RTOL = {"reference": 1e-5, "emulated": 2.0**-8}


@pytest.mark.parametrize("mode", ["reference", "emulated"])
def test_emulated_gemms_match_a_quantize_dequantize_reference(mode):
    """Forward and both gradients equal float64 GEMMs of formats.quantize'd operands (fp32 accumulation)."""
    x, w, b, dy = _data()
    (y, dx, dw, db), _ = _three_gemms(x, w, b, dy, mode=mode)

    def qdq(t, fmt, dtype):
        s = fp8_scale(t.abs().amax(), dtype)
        return quantize(t * s, fmt).double() / s.double()

    xq, wq, dyq = qdq(x, "fp8_e4m3", E4M3), qdq(w, "fp8_e4m3", E4M3), qdq(dy, "fp8_e5m2", E5M2)
    for got, ref in ((y - b, xq @ wq.T), (dx, dyq @ wq), (dw, dyq.T @ xq)):  # the bias is added after the GEMM
        torch.testing.assert_close(got.double(), ref, rtol=_QDQ_RTOL[mode], atol=1e-6 * float(ref.abs().max()))
    torch.testing.assert_close(db, dy.sum(0), rtol=1e-6, atol=0)  # the bias gradient is not quantized


def test_zeros_give_zeros_and_non_finite_inputs_give_nan_not_saturation():
    w = torch.randn(16, 32, requires_grad=True)
    x = torch.zeros(16, 32, requires_grad=True)
    y = fp8_linear(x, w)
    y.sum().backward()
    assert torch.equal(y, torch.zeros_like(y)) and torch.equal(w.grad, torch.zeros_like(w))
    bad = torch.randn(16, 32)
    bad[3, 4] = float("inf")
    assert torch.isnan(fp8_linear(bad, w)).all()  # e4m3 would saturate inf to 448; NaN reaches the loss check


# -- the emulated path: FP8 values held in bf16, bf16 GEMMs ------------------------------------------------
def _grid_and_ties(dtype):
    """Every finite FP8 value and every midpoint between neighbours (the RNE ties), both signs, as fp32."""
    v = _all_finite_fp8(dtype).unique()
    mids = ((v[1:].double() + v[:-1].double()) / 2).float()  # one more bit than the format: exact in fp32
    quarter = ((3 * v[1:].double() + v[:-1].double()) / 4).float()  # off the tie: rounds up
    return torch.cat([v, mids, quarter])


def _same_values(q_bf16, q8):
    """Equal as values (+0 == -0); NaN where the FP8 cast gives NaN."""
    a, b = q_bf16.float(), q8.float()
    return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("shift", [0, -20, 30, -135])  # -135: fp32 subnormal inputs, the scale clamps at 2**126
def test_emulated_operands_equal_the_fp8_casts_on_the_grid_and_its_ties(dtype, shift):
    t = _grid_and_ties(dtype) * 2.0**shift
    q, inv = quant.to_fp8_as_bf16(t, dtype)
    q8, inv8 = to_fp8(t, dtype)
    assert q.dtype == torch.bfloat16 and torch.equal(inv, inv8)
    assert _same_values(q, q8)
    if shift == 0:  # the ties did round both ways (ties to even), and the test values reach the format's max
        assert (q.float() != t).sum() > 100 and q.float().abs().max() == torch.finfo(dtype).max


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_emulated_operands_equal_the_fp8_casts_on_random_tensors(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(4096, generator=g) * 2.0 ** torch.randint(-40, 40, (4096,), generator=g).float()
    for t in (torch.randn(257, 129, generator=g), wide, torch.randn(64, 80, generator=g).bfloat16() * 1e-3,
              torch.zeros(8, 16), torch.randn(33, generator=g) * 1e-30):
        q, inv = quant.to_fp8_as_bf16(t, dtype)
        q8, inv8 = to_fp8(t, dtype)
        assert torch.equal(inv, inv8) and _same_values(q, q8), t.dtype
    bad = torch.randn(16, 32, generator=g)
    bad[3, 4] = float("inf")
    q, inv = quant.to_fp8_as_bf16(bad, dtype)
    assert torch.isnan(q).all() and torch.isnan(inv)  # as the cast path: NaN everywhere, never saturation


def test_host_and_device_scales_agree():
    amax = torch.cat([torch.rand(2000) * 10.0 ** torch.randint(-45, 39, (2000,)).float(),
                      torch.tensor([0.0, 448.0, 57344.0, 448.00003, 1e-38, 1e-45, 3e38, float("inf"), float("nan")])])
    for dtype in (E4M3, E5M2):
        host = torch.stack([fp8_scale(a, dtype) for a in amax])
        device = torch.stack([quant._device_scale(a, dtype) for a in amax])
        assert torch.equal(host.isnan(), device.isnan()) and torch.equal(host.nan_to_num(), device.nan_to_num())


def _sqnrs(results, ref):
    return {k: sqnr(r, g) for k, r, g in zip(("y", "dx", "dw"), ref[:3], results[:3])}


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("bf16_autocast", [False, True])
def test_emulated_path_keeps_the_reference_emulations_sqnr(seed, bf16_autocast):
    """Same operands, fp32 accumulation: y, dx and dW are as far from fp32 as the former emulation's (FP8 casts,
    fp32 GEMMs), within 0.1 dB. The bf16 rounding of fp32 results (dW; y, dx outside bf16 autocast) shows as
    new-vs-reference noise ~55 dB down, 25-30 dB below the FP8 noise."""
    x, w, b, dy = _data(seed)
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16_autocast else contextlib.nullcontext()
    with ctx:
        new, ref32 = _three_gemms(x, w, b, dy, mode="emulated")
        old, _ = _three_gemms(x, w, b, dy, mode="reference")
    got_new, got_old = _sqnrs(new, ref32), _sqnrs(old, ref32)
    for k in got_new:
        assert got_new[k] >= FLOOR[k] and abs(got_new[k] - got_old[k]) <= 0.1, (k, got_new, got_old)
        assert _sqnrs(new, old)[k] >= 50.0
    if bf16_autocast:
        assert new[0].dtype == torch.bfloat16
        torch.testing.assert_close(new[0], old[0], rtol=2.0**-7, atol=0)  # one rounding each: at most a tie flip
    torch.testing.assert_close(new[3], old[3], rtol=0, atol=0)  # db is not quantized


def test_two_emulated_layers_train_like_the_reference():
    """Operands saved for backward survive the next layer's quantization (its work buffers are reused)."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 32))
    x, grads = torch.randn(48, 64), {}
    for mode in ("emulated", "reference"):
        m = copy.deepcopy(base)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = m[4](m[3](fp8._linear(m[1](fp8._linear(x, m[0].weight, m[0].bias, mode)), m[2].weight, m[2].bias,
                                      mode)))
        h.float().square().mean().backward()
        grads[mode] = [p.grad for p in m.parameters()]
    for new, old in zip(grads["emulated"], grads["reference"]):
        assert sqnr(old, new) >= 40.0


# -- SQNR tier ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1])
def test_sqnr_floors_of_the_operands_the_output_and_each_gradient(seed):
    x, w, b, dy = _data(seed)
    for dtype, name in ((E4M3, "e4m3"), (E5M2, "e5m2")):
        q, inv = to_fp8(x, dtype)
        assert sqnr(x, q.float() * inv) >= FLOOR[name], name
    (y, dx, dw, db), (y_ref, dx_ref, dw_ref, db_ref) = _three_gemms(x, w, b, dy)
    got = {"y": sqnr(y_ref, y), "dx": sqnr(dx_ref, dx), "dw": sqnr(dw_ref, dw)}
    assert all(got[k] >= FLOOR[k] for k in got), got
    torch.testing.assert_close(db, db_ref, rtol=1e-5, atol=0)


_REAL_SCALE = quant.fp8_scale


def _inverted_scale(monkeypatch):
    monkeypatch.setattr(quant, "fp8_scale", lambda amax, dtype: 1.0 / _REAL_SCALE(amax, dtype))


def _unscaled_e4m3_everywhere(monkeypatch):
    monkeypatch.setattr(quant, "fp8_scale", lambda amax, dtype: torch.ones((), device=amax.device))
    monkeypatch.setattr(fp8, "E5M2", E4M3)


@pytest.mark.parametrize("mutant,dy_scale,broken", [
    (_inverted_scale, 1.0, {"y", "dx", "dw"}),
    # no scaling, gradients in e4m3: typical 1e-3 gradients fall below e4m3's smallest subnormal (2**-9)
    (_unscaled_e4m3_everywhere, 1.0, {"dx", "dw"}),
    # the same with ~1e4-sized gradients: they saturate at e4m3's 448 (e5m2 would hold them up to 57344)
    (_unscaled_e4m3_everywhere, 1e7, {"dx", "dw"}),
], ids=["inverted-scale", "unscaled-e4m3-grads-underflow", "unscaled-e4m3-grads-overflow"])
@pytest.mark.parametrize("mode", ["reference", "emulated"])
def test_the_floors_catch_broken_implementations(monkeypatch, mutant, dy_scale, broken, mode):
    if mode == "emulated" and dy_scale != 1.0:
        pytest.skip("the emulated rounding has no saturation to break: it relies on the scale, which keeps every "
                    "value within the format's max (test_scale_is_the_largest_power_of_two_that_keeps_amax_in_range)")
    x, w, b, dy = _data()
    mutant(monkeypatch)
    (y, dx, dw, _), (y_ref, dx_ref, dw_ref, _) = _three_gemms(x, w, b, dy * dy_scale, mode=mode)
    got = {"y": sqnr(y_ref, y), "dx": sqnr(dx_ref, dx), "dw": sqnr(dw_ref, dw)}
    assert {k for k in got if not got[k] >= FLOOR[k]} >= broken, got


# -- dtypes under autocast --------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", ["native", "scratch"])
@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16])
def test_autocast_sets_the_output_dtype_but_never_recasts_the_fp8_gemm(impl, low):
    """The scaled FP8 GEMM's fp32 result reaches |y| > 65504 here, so if autocast re-cast the GEMM to fp16 the
    output would be inf. The fp32 sum was rounded once, to the autocast dtype: for fp16 by the same fp32 GEMM as
    the reference path (exact), for bf16 by the bf16 GEMM (another summation order: a rare one-ulp tie flip)."""
    torch.manual_seed(0)
    x = torch.randn(32, 64, requires_grad=True)
    w = torch.randn(16, 64, requires_grad=True)
    ref = fp8._linear(x, w, None, "reference")
    ctx = torch.autocast("cpu", dtype=low) if impl == "native" else autocast(low, device_type="cpu")
    with ctx:
        y = fp8_linear(x, w)
    assert y.dtype == low
    tol = 0 if low == torch.float16 else 2.0**-7
    torch.testing.assert_close(y, ref.detach().to(low), rtol=tol, atol=0)
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and w.grad.dtype == torch.float32


# -- the module swap -----------------------------------------------------------------------------------------
class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 30))
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)  # .out_proj: a Linear subclass
        self.proj = nn.Linear(30, 32)
        self.head = nn.Linear(32, 16)  # eligible by shape, kept out by name

    def forward(self, x):
        h = self.proj(self.body(x))
        return self.head(h + self.attn(h[:, None], h[:, None], h[:, None], need_weights=False)[0][:, 0])


def test_convert_swaps_exactly_the_eligible_layers_and_reports_the_rest(caplog):
    torch.manual_seed(0)
    model = _Net()
    params = {n: p for n, p in model.named_parameters()}
    with caplog.at_level(logging.INFO, logger="mixprec.lowp.convert"):
        plan = plan_fp8_conversion(model)
        out = convert_to_fp8(model)
    assert out is model
    assert plan.converted == ("body.0", "body.2")
    reasons = dict(plan.skipped)
    assert set(reasons) == {"body.4", "attn.out_proj", "proj", "head"}
    assert "multiples of 16" in reasons["body.4"] and "multiples of 16" in reasons["proj"]
    assert "subclass" in reasons["attn.out_proj"] and "final classifier" in reasons["head"]
    fp8_names = {n for n, m in model.named_modules() if isinstance(m, Fp8Linear)}
    assert fp8_names == {"body.0", "body.2"}
    assert all(type(model.get_submodule(n)) is not Fp8Linear for n in reasons)
    assert {n: p for n, p in model.named_parameters()} == params  # the same Parameter objects
    assert all(n in caplog.text for n in reasons)
    assert model(torch.randn(4, 32)).shape == (4, 16)


def test_module_filter_fn_replaces_the_name_rule_but_not_the_shape_rule():
    model = convert_to_fp8(_Net(), module_filter_fn=lambda m, fqn: fqn != "body.2")
    assert {n for n, m in model.named_modules() if isinstance(m, Fp8Linear)} == {"body.0", "head"}
    assert isinstance(convert_to_fp8(nn.Linear(16, 32)), Fp8Linear)  # a bare linear layer is the root


def test_state_dict_of_a_converted_model_loads_into_a_plain_one_and_back():
    torch.manual_seed(0)
    plain, converted = _Net(), convert_to_fp8(_Net())
    sd = converted.state_dict()
    assert list(sd) == list(plain.state_dict())
    plain.load_state_dict(sd, strict=True)
    converted.load_state_dict(plain.state_dict(), strict=True)
    x = torch.randn(64, 32)
    assert sqnr(plain(x).detach(), converted(x).detach()) >= FLOOR["y"] - 6  # two FP8 layers in a row


class Conv1D(nn.Module):
    """transformers.pytorch_utils.Conv1D, copied verbatim (transformers is not a dependency): GPT-2's linear layer,
    weight stored transposed, (in, out)."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.nx = nx
        self.weight = nn.Parameter(torch.empty(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))
        nn.init.normal_(self.weight, std=0.02)

    def __repr__(self) -> str:
        return "Conv1D(nf={nf}, nx={nx})".format(**self.__dict__)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        x = x.view(size_out)
        return x


class _Gpt2Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc = Conv1D(128, 32)
        self.c_proj = Conv1D(32, 128)
        self.odd = Conv1D(10, 32)  # 10 outputs: not a multiple of 16

    def forward(self, x):
        return self.odd(self.c_proj(F.gelu(self.c_fc(x))))


def test_hf_conv1d_layers_are_converted_with_their_stored_layout_and_numerics():
    torch.manual_seed(0)
    model, plain = _Gpt2Mlp(), _Gpt2Mlp()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    plain.load_state_dict(model.state_dict())
    params = dict(model.named_parameters())
    plan = plan_fp8_conversion(model)
    assert plan.converted == ("c_fc", "c_proj")
    assert dict(plan.skipped).keys() == {"odd"} and "multiples of 16" in dict(plan.skipped)["odd"]
    convert_to_fp8(model, emulate=True)
    fc = model.c_fc
    assert type(fc) is convert.Fp8AdaptedLinear and (fc.in_features, fc.out_features) == (32, 128)
    assert (fc.nf, fc.nx) == (128, 32) and type(model.odd) is Conv1D
    assert dict(model.named_parameters()) == params  # the same Parameter objects, stored (in, out)
    assert list(model.state_dict()) == list(plain.state_dict())
    plain.load_state_dict(model.state_dict(), strict=True)
    model.load_state_dict(plain.state_dict(), strict=True)

    # exactly an Fp8Linear holding the transposed weight: the same FP8 operands (amax ignores the layout)
    x = torch.randn(4, 6, 32)
    lin = Fp8Linear(32, 128, emulate=True)
    with torch.no_grad():
        lin.weight.copy_(fc.weight.t())
        lin.bias.copy_(fc.bias)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = fc(xa), lin(xb)
    torch.testing.assert_close(ya, yb, rtol=0, atol=0)
    dy = torch.randn_like(ya)
    ya.backward(dy)
    yb.backward(dy)
    assert fc.weight.grad.shape == (32, 128)
    torch.testing.assert_close(fc.weight.grad, lin.weight.grad.t(), rtol=0, atol=0)
    torch.testing.assert_close(xa.grad, xb.grad, rtol=0, atol=0)
    # and x @ W + b of the original layer, to FP8 accuracy
    assert sqnr(plain.c_fc(x).detach(), fc(x).detach()) >= FLOOR["y"]


def test_register_linear_adapter_teaches_convert_a_new_layer_class():
    class Packed(nn.Module):  # weight stored (in, out) as Conv1D, under another name
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(32, 48))
            self.bias = None

        def forward(self, x):
            return x @ self.weight

    model = nn.Sequential(Packed(), nn.ReLU())
    assert plan_fp8_conversion(model).converted == ()
    adapter = convert.register_linear_adapter(Packed, torch.t)
    try:
        convert_to_fp8(model, emulate=True)
        assert type(model[0]) is convert.Fp8AdaptedLinear and model[0].out_features == 48
        x = torch.randn(8, 32)
        ref = fp8_linear(x, model[0].weight.t().contiguous(), None, emulate=True)
        torch.testing.assert_close(model(x), F.relu(ref), rtol=0, atol=0)
    finally:
        convert.unregister_linear_adapter(adapter)
    assert plan_fp8_conversion(nn.Sequential(Packed())).converted == ()


@pytest.mark.slow
def test_gpt2_from_transformers_converts_every_conv1d():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(cfg)
    conv1d = {n for n, m in model.named_modules() if type(m).__name__ == "Conv1D"}
    plan = plan_fp8_conversion(model)
    assert len(conv1d) == 8 and set(plan.converted) == conv1d
    assert dict(plan.skipped).keys() == {"lm_head"}  # 50 outputs
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    convert_to_fp8(model, emulate=True)
    assert all(torch.equal(sd[k], v) for k, v in model.state_dict().items()) and sd.keys() == model.state_dict().keys()
    ids = torch.randint(0, 50, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(ids, labels=ids)
    out.loss.backward()
    assert torch.isfinite(out.loss) and all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_emulate_false_without_fp8_hardware_says_what_to_do():
    if hardware.has_fp8_matmul(torch.device("cpu")):
        pytest.skip("unreachable: CPUs have no FP8 matmuls")
    with pytest.raises(RuntimeError, match="emulate=None"):
        fp8_linear(torch.randn(16, 16), torch.randn(16, 16), emulate=False)


# -- the recipe ------------------------------------------------------------------------------------------------
def test_recipe_converts_the_model_and_says_emulated_on_cpu():
    from mixprec.precision import build_recipe

    r = build_recipe("fp8-mixed", device="cpu")
    model = r.convert_module(_Net())
    assert isinstance(model.body[0], Fp8Linear) and type(model.head) is nn.Linear
    d = r.describe()
    assert "EMULATED" in d and "2 linear layer(s) in FP8" in d and "head" in d
    assert all(p.dtype == torch.float32 for p in model.parameters())


DIGITS = dict(dataset="digits", model="mlp", width=64, depth=1, batch_size=32, log_every=0, progress="off",
              epochs=4, lr=0.05, momentum=0.9)


@pytest.mark.slow
def test_fp8_training_on_digits_is_within_2_points_of_fp32_and_native_equals_scratch():
    from mixprec.train.config import TrainConfig
    from mixprec.train.loop import train

    fp32 = train(TrainConfig.from_flags(**DIGITS, precision="fp32")).summary["test_accuracy"]
    runs = {impl: train(TrainConfig.from_flags(**DIGITS, precision="fp8-mixed", amp_impl=impl)) for impl in ("native", "scratch")}
    for r in runs.values():
        assert abs(r.summary["test_accuracy"] - fp32) <= 0.02, (r.summary["test_accuracy"], fp32)
    # the FP8 GEMMs run outside either autocast, and both autocasts run the rest identically in bf16
    curves = [torch.tensor([v for ep in r.history for v in ep["loss_curve"]]) for r in runs.values()]
    torch.testing.assert_close(curves[0], curves[1], rtol=0, atol=0)


# -- the real FP8 path ---------------------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.version.hip is not None
                    or torch.cuda.get_device_capability() < (8, 9),
                    reason="real FP8 GEMMs (torch._scaled_mm) need an NVIDIA GPU of compute capability 8.9+")
def test_real_fp8_gemms_match_the_emulation_on_the_gpu():
    """The real path (``torch._scaled_mm``, fp32 output) against the reference (an fp32 GEMM on the same FP8
    operands) and the emulation (a bf16 GEMM on them; fp8.py, "Emulated and real paths").

    Real and reference differ by fp32 accumulation order only, ~1000x (60 dB) below the FP8 rounding noise
    (25-30 dB) a wrong quantization or scale would show. The emulation rounds the GEMM's fp32 sum once to bf16
    before the unscale and the bias, where the real path writes fp32: <= 2**-9 relative, ~55 dB on this data
    (emulated vs reference on CPU, test_emulated_path_keeps_the_reference_emulations_sqnr), so real vs emulated is
    held to 50 dB. Under bf16 autocast both round once to bf16. cuBLAS's split-K reduction in bf16, a second
    rounding the CPU emulation never makes, is switched off for the test."""
    x, w, b, dy = (t.cuda() for t in _data())
    matmul = torch.backends.cuda.matmul
    allowed = matmul.allow_bf16_reduced_precision_reduction
    matmul.allow_bf16_reduced_precision_reduction = False
    try:
        (y_real, dx_real, dw_real, db_real), (y_ref, dx_ref, dw_ref, _) = _three_gemms(x, w, b, dy)
        reference, _ = _three_gemms(x, w, b, dy, mode="reference")
        (y_emu, dx_emu, dw_emu, db_emu), _ = _three_gemms(x, w, b, dy, emulate=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = fp8_linear(x, w, b)
            y_emu16 = fp8_linear(x, w, b, emulate=True)
            y_odd = fp8_linear(x[:500], w, b)  # 500 tokens: not a multiple of 16, that GEMM falls back to fp32
    finally:
        matmul.allow_bf16_reduced_precision_reduction = allowed
    for name, real, ref, emu in zip(("y", "dx", "dw"), (y_real, dx_real, dw_real), reference, (y_emu, dx_emu, dw_emu)):
        assert real.dtype == torch.float32
        assert sqnr(ref, real) >= 60.0, name
        assert sqnr(real, emu) >= 50.0, name
    torch.testing.assert_close(db_real, db_emu)
    assert sqnr(y_ref, y_real) >= FLOOR["y"] and sqnr(dx_ref, dx_real) >= FLOOR["dx"]
    assert sqnr(dw_ref, dw_real) >= FLOOR["dw"]
    assert y.dtype == y_emu16.dtype == y_odd.dtype == torch.bfloat16
    assert sqnr(y.float(), y_emu16.float()) >= 50.0
    assert sqnr(y_ref, y.float()) >= FLOOR["y"] and sqnr(y_ref[:500], y_odd.float()) >= FLOOR["y"]
