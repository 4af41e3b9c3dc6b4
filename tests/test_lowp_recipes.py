"""The block-scaled linear recipes (fp8-rowwise, mxfp8, mxfp4, nvfp4) and --fp8-impl, in tiers:

- each GEMM's operands are the block formats' values (bit-exact against :func:`mixprec.formats.quantize_blocks`, itself
  bit-exact against torchao), along the dimension the GEMM reduces;
- scratch against torchao's emulated training on CPU: the same losses step for step -- bit-identical where
  both round the same way, a stated tolerance where the GEMM's accumulation or the bias gradient's rounding
  differ (each case says which);
- NVFP4 and MXFP4, which torchao cannot train: each GEMM's quantised operands against torchao's own
  quantisation (``NVFP4Tensor.to_nvfp4``, ``to_mx``);
- the options (RHT, stochastic rounding, --wgrad-hp, the MX scale rule), the layer filter, token padding,
  and the refusals of what cannot run.
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from mixprec.formats import quantize_blocks, quantize_blocks_with_scales
from mixprec.lowp.block import BlockLinear, block_linear, hadamard_matrix
from mixprec.errors import RecipeError
from mixprec.lowp.convert import plan_fp8_conversion
from mixprec.lowp.quant import quantize_operand
from mixprec.lowp.recipes import LINEAR_RECIPES, linear_recipe
from mixprec.precision import RecipeConfig, build_recipe

BF16 = torch.bfloat16


def _structured(m: int, n: int, seed: int = 0) -> torch.Tensor:
    """16-blocks spread over 2**-20 .. 2**6 (more binades than a row of e4m3 holds: rowwise flushes what MX
    keeps), a few outliers and exact zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, n, generator=g)
    x = x * torch.exp2(torch.randint(-20, 7, (m, n // 16), generator=g).float()).repeat_interleave(16, 1)
    x[torch.rand(m, n, generator=g) < 0.01] *= 64
    x[:, :3] = 0
    return x


# -- operands: exactly the block formats' values --------------------------------------------------------------
@pytest.mark.parametrize("fmt,block,rule", [("e4m3-row", "fp8_e4m3_rowwise", None), ("mxfp8", "mxfp8_e4m3", "rceil"),
                                            ("mxfp8", "mxfp8_e4m3", "floor"), ("mxfp4", "mxfp4", "rceil")])
@pytest.mark.parametrize("axis", [0, 1])
def test_operands_are_the_block_formats_values_in_bf16(fmt, block, rule, axis):
    x = _structured(64, 96)
    q, s = quantize_operand(x, fmt, axis, scale_rule=rule)
    ref = quantize_blocks(x, block, axis=axis, scale_rule=rule)
    assert s is None and q.dtype == BF16
    assert ref[ref != 0].abs().min() >= 2.0**-126  # no value where bf16 loses bits (module docstring)
    torch.testing.assert_close(q.float(), ref, rtol=0, atol=0)


@pytest.mark.parametrize("fmt,block,rule", [("e4m3-row", "fp8_e4m3_rowwise", None), ("mxfp8", "mxfp8_e4m3", "rceil"),
                                            ("mxfp8", "mxfp8_e4m3", "floor"), ("mxfp4", "mxfp4", "floor"),
                                            ("nvfp4", "nvfp4", None)])
def test_the_fused_operand_path_handles_zero_tiny_huge_inf_and_nan_blocks(fmt, block, rule):
    x = _structured(12, 64)
    x[0] = 0
    x[1] = torch.randn(64) * 2.0**-120  # tiny: MX scales near 2**-127
    x[2] = torch.randn(64) * 2.0**100
    x[3, 5] = float("inf")
    x[4, 40] = float("nan")
    x[5, :32] = torch.tensor([448.0, 464.0, 480.0, 13.0, 0.8125, 2.0**-10, 3 * 2.0**-10, 1.0] * 4)  # ties
    if fmt == "nvfp4":  # one inf or NaN makes a whole NVFP4 tensor NaN: the finite rows here (and that case below)
        x = x[[0, 1, 5, 6, 7]]
    q, _ = quantize_operand(x, fmt, 1, scale_rule=rule)
    bq = quantize_blocks_with_scales(x, block, axis=1, scale_rule=rule)
    ref = bq.elements * bq.scales.repeat_interleave(bq.block_size, dim=1)  # block scales in, as the GEMM sees them
    torch.testing.assert_close(q.float(), ref.to(BF16).float(), rtol=0, atol=0, equal_nan=True)
    if fmt == "nvfp4":
        bad = x.clone()
        bad[0, 0] = float("inf")
        assert quantize_operand(bad, fmt, 1)[1].isnan() and quantize_operand(bad, fmt, 1)[0].isnan().all()


@pytest.mark.parametrize("axis", [0, 1])
def test_nvfp4_operands_keep_the_tensor_scale_outside_the_gemm(axis):
    x = _structured(64, 96)
    q, t = quantize_operand(x, "nvfp4", axis)
    bq = quantize_blocks_with_scales(x, "nvfp4", axis=axis)
    torch.testing.assert_close(t, bq.tensor_scale, rtol=0, atol=0)
    torch.testing.assert_close(q.float(), bq.elements * bq.scales.repeat_interleave(16, dim=axis), rtol=0, atol=0)


def _capture(recipe, x, w, dy, mode="reference"):
    """(y, dx, dW) of block_linear under ``recipe``."""
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = block_linear(xr, wr, None, recipe, mode=mode)
    y.backward(dy)
    return y.detach(), xr.grad, wr.grad


@pytest.mark.parametrize("name", list(LINEAR_RECIPES)[1:])
def test_each_gemm_multiplies_its_operands_quantised_along_the_reduced_dimension(name):
    """y, dx and dW (fp32 reference GEMMs) equal fp32 products of the block formats' values, each operand cut
    along the GEMM's reduced dimension: x and W along in_features, dy and W along out_features, dy and x along
    tokens. A recipe quantising along the wrong axis fails this."""
    r = LINEAR_RECIPES[name]
    block = {"rowwise": "fp8_e4m3_rowwise", "mxfp8": "mxfp8_e4m3", "mxfp4": "mxfp4", "nvfp4": "nvfp4"}[name]
    x, w, dy = _structured(64, 96, 0), _structured(32, 96, 1) / 8, _structured(64, 32, 2) * 1e-3

    def qb(t, axis):
        return quantize_blocks(t, block, axis=axis, scale_rule=r.scale_rule)

    y, dx, dw = _capture(r, x, w, dy)

    def close(got, want):  # fp32 GEMMs against float64 ones: their accumulation error only (a quantisation along
        # another dimension is ~1e-2 of the largest output away)
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6 * float(want.abs().max()))

    close(y, torch.mm(qb(x, 1).double(), qb(w, 1).double().t()))
    close(dx, torch.mm(qb(dy, 1).double(), qb(w, 0).double()))
    close(dw, torch.mm(qb(dy, 0).double().t(), qb(x, 0).double()))


# -- scratch vs torchao's emulated training ----------------------------------------------------------------------
def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 32), nn.ReLU(),
                         nn.Linear(32, 10))


def _losses(precision: str, fp8_impl: str, *, steps: int = 6, mode: str | None = None, **options) -> list[float]:
    r = build_recipe(RecipeConfig(precision=precision, amp_impl="native", fp8_impl=fp8_impl, **options), device="cpu")
    model = r.convert_module(_mlp())
    if mode is not None:  # force scratch's GEMM path ("reference": fp32 GEMMs on the same operands)
        for m in model.modules():
            if isinstance(m, BlockLinear):
                m.forward = lambda inp, m=m: block_linear(inp, m.weight, m.bias, m.recipe, mode=mode)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = (_structured(64, 64, 3) / 64).to(BF16)  # bf16 activations everywhere: torchao's CPU path casts none itself
    y = torch.randint(0, 10, (64,), generator=torch.Generator().manual_seed(4))
    out = []
    for _ in range(steps):
        opt.zero_grad()
        with r.autocast():
            loss = F.cross_entropy(model(x), y)
        r.backward(loss)
        r.step(opt)
        out.append(loss.item())
    return out


@pytest.fixture(scope="module")
def torchao():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip("torchao")


@pytest.mark.slow
@pytest.mark.parametrize("precision,options,scratch_mode", [
    ("fp8-rowwise", {}, None),  # torchao's emulated rowwise runs bf16 GEMMs under the CPU autocast, as scratch
    ("fp8-rowwise", {"wgrad_hp": True}, None),
    ("mxfp8", {}, "reference"),  # torchao's MXFP8 emulation: fp32 GEMMs on the dequantised operands
    ("mxfp8", {"wgrad_hp": True}, "reference"),
])
def test_scratch_and_torchao_train_bit_identically_where_they_round_alike(torchao, precision, options, scratch_mode):
    tao = _losses(precision, "torchao", **options)
    scratch = _losses(precision, "scratch", mode=scratch_mode, **options)
    assert scratch == tao


@pytest.mark.slow
@pytest.mark.parametrize("precision,rtol", [
    # per tensor: torchao sums the bias gradient in bf16 (its bias add is outside its Function), mixprec in fp32
    ("fp8-mixed", 1e-5),
    # MXFP8: scratch's bf16 GEMMs accumulate in another order than torchao's fp32 GEMMs, and round dW to bf16
    ("mxfp8", 1e-4),
])
def test_scratch_and_torchao_losses_agree_within_the_stated_tolerance(torchao, precision, rtol):
    tao, scratch = _losses(precision, "torchao"), _losses(precision, "scratch")
    assert scratch != _losses("bf16-mixed", "auto")  # the check can fail: quantisation moves the losses
    torch.testing.assert_close(torch.tensor(scratch), torch.tensor(tao), rtol=rtol, atol=0)


@pytest.mark.parametrize("axis", [0, 1])
def test_nvfp4_operands_equal_torchaos_nvfp4_tensor(torchao, axis):
    """torchao has no NVFP4 training layer: each GEMM's operand is compared with its NVFP4Tensor instead
    (elements times block scales, and the per-tensor scale)."""
    from mixprec.lowp.impls import quiet_torchao_import

    with quiet_torchao_import():
        from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, unpack_uint4
        from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale
    x = _structured(64, 96)
    q, t = quantize_operand(x, "nvfp4", axis)
    rows = x.movedim(axis, -1).contiguous()  # torchao cuts the last dimension
    pts = per_tensor_amax_to_scale(rows.abs().max())
    n = NVFP4Tensor.to_nvfp4(rows, per_tensor_scale=pts)
    el = f4_unpacked_to_f32(unpack_uint4(n.qdata.view(torch.uint8))).reshape(rows.shape)
    v = el * n.scale.float().reshape(*rows.shape[:-1], -1).repeat_interleave(16, -1)
    torch.testing.assert_close(q.float().movedim(axis, -1), v, rtol=0, atol=0)
    torch.testing.assert_close(t, pts, rtol=0, atol=0)


@pytest.mark.parametrize("axis", [0, 1])
def test_mxfp4_operands_equal_torchaos_to_mx(torchao, axis):
    from mixprec.lowp.impls import quiet_torchao_import

    with quiet_torchao_import():
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx
    x = _structured(64, 96) + 0.01  # no 2**-127 blocks, where torchao departs from the spec (test_block_formats)
    q, _ = quantize_operand(x, "mxfp4", axis, scale_rule="rceil")
    rows = x.movedim(axis, -1).contiguous()
    s, d = to_mx(rows, torch.float4_e2m1fn_x2, 32, ScaleCalculationMode.RCEIL)
    v = to_dtype(d, s, torch.float4_e2m1fn_x2, 32, torch.float32)
    torch.testing.assert_close(q.float().movedim(axis, -1), v, rtol=0, atol=0)


# -- the options ---------------------------------------------------------------------------------------------------
def test_the_hadamard_matrix_is_orthonormal_with_random_signs():
    h = hadamard_matrix().double()
    torch.testing.assert_close(h.T @ h, torch.eye(16, dtype=torch.float64), rtol=0, atol=1e-15)
    assert set(h.abs().unique().tolist()) == {0.25}
    assert not torch.equal(h[0], h[0].abs())  # the signs are not all +


def test_rht_keeps_dw_and_spreads_outliers_before_quantisation():
    """(H dy)^T (H x) = dy^T x (H orthonormal along tokens), and a 16-token block with one outlier comes out of
    H with its energy spread: the block's max/rms ratio (what costs its other values bits) falls from 4 to ~1."""
    from mixprec.lowp.block import _rht_rows

    g = torch.Generator().manual_seed(0)
    x, dy = torch.randn(64, 48, generator=g), torch.randn(64, 32, generator=g) * 1e-3
    dy[::16] *= 200  # one outlier token per block of 16
    exact = dy.double().T @ x.double()
    torch.testing.assert_close(_rht_rows(dy).double().T @ _rht_rows(x).double(), exact, rtol=0,
                               atol=1e-6 * float(exact.abs().max()))

    def crest(t):  # per 16-token block and column: max |v| / rms
        b = t.reshape(-1, 16, t.shape[1])
        return (b.abs().amax(1) / b.square().mean(1).sqrt()).median().item()

    assert crest(dy) > 3.5 and crest(_rht_rows(dy)) < 2.0
    plain = _capture(linear_recipe("nvfp4"), x, torch.randn(32, 48, generator=g), dy)[2]
    rht = _capture(linear_recipe("nvfp4", hadamard=True), x, torch.randn(32, 48, generator=g), dy)[2]
    for v in (plain, rht):  # both approximate dW (SQNR floor of FP4 GEMMs)
        assert float(20 * torch.log10(exact.norm() / (exact - v.double()).norm())) > 10


def test_stochastic_rounding_is_unbiased_and_lands_on_neighbouring_e2m1_values():
    from mixprec.lowp.quant import _round_e2m1_stochastic

    y = torch.tensor([0.1, 0.3, 0.75, 1.2, 2.5, 3.3, 4.5, 5.9, -1.7, 6.0, 0.0]).repeat(20000, 1)
    q = _round_e2m1_stochastic(y, torch.Generator().manual_seed(0))
    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    assert torch.isin(q.abs(), grid).all()
    lo = grid[(torch.searchsorted(grid, y[0].abs(), right=True) - 1).clamp(min=0)]
    assert ((q.abs() >= lo) & (q.abs() <= lo + (grid[1:] - grid[:-1]).max())).all()
    torch.testing.assert_close(q.mean(0), y[0], rtol=0, atol=0.02)


def test_stochastic_rounding_changes_only_the_gradient_gemms():
    x, w, dy = _structured(64, 96, 0), _structured(32, 96, 1) / 8, _structured(64, 32, 2) * 1e-3
    rn, sr = linear_recipe("nvfp4"), linear_recipe("nvfp4", stochastic_rounding=True)
    y0, dx0, dw0 = _capture(rn, x, w, dy)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y1 = block_linear(xr, wr, None, sr, mode="reference", generator=torch.Generator().manual_seed(0))
    y1.backward(dy)
    assert torch.equal(y0, y1.detach())
    assert not torch.equal(dx0, xr.grad) and not torch.equal(dw0, wr.grad)


def test_wgrad_hp_keeps_the_weight_gradient_gemm_in_bf16():
    r = linear_recipe("rowwise", wgrad_hp=True)
    assert r.grad_weight == ("bf16", "bf16") and r.grad_input == ("e4m3-row", "e4m3-tensor")  # rowwise_with_gw_hp
    x, w, dy = _structured(64, 96, 0), _structured(32, 96, 1) / 8, _structured(64, 32, 2) * 1e-3
    dw = _capture(r, x, w, dy)[2]
    torch.testing.assert_close(dw, (dy.to(BF16).float().T @ x.to(BF16).float()), rtol=0, atol=0)
    assert linear_recipe("mxfp8", wgrad_hp=True).grad_input == ("mxfp8", "mxfp8")


def test_the_mx_scale_rule_option_reaches_the_layers():
    assert linear_recipe("mxfp8", mx_scale_rule="floor").scale_rule == "floor"
    r = build_recipe(RecipeConfig(precision="mxfp4", mx_scale_rule="floor"), device="cpu")
    m = r.convert_module(nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 10)))
    assert m[0].recipe.scale_rule == "floor"


# -- the layer filter and token padding ----------------------------------------------------------------------------
def test_the_layer_filter_follows_each_formats_block():
    model = nn.Sequential(nn.Linear(48, 64), nn.Linear(64, 96), nn.Linear(96, 16), nn.Linear(16, 10))
    mx, nv = (plan_fp8_conversion(model, recipe=LINEAR_RECIPES[n]) for n in ("mxfp8", "nvfp4"))
    assert mx.converted == ("1",) and nv.converted == ("0", "1", "2")
    reasons = dict(mx.skipped)
    assert "multiples of 32" in reasons["0"] and "multiples of 32" in reasons["2"]
    assert "multiples of 16" in dict(nv.skipped)["3"]


@pytest.mark.parametrize("name", ["mxfp8", "nvfp4"])
def test_tokens_are_padded_to_the_block_with_zero_rows_exactly(name):
    """5 tokens: the weight-gradient GEMM cuts tokens into blocks, so they are padded with zero rows; the result
    equals running 32 tokens whose last 27 are zero (their output gradient zero too)."""
    r = LINEAR_RECIPES[name]
    x, w, dy = _structured(5, 64, 0), _structured(32, 64, 1) / 8, _structured(5, 32, 2) * 1e-3
    pad = lambda t: torch.cat([t, t.new_zeros(27, t.shape[1])])  # noqa: E731
    y, dx, dw = _capture(r, x, w, dy)
    y2, dx2, dw2 = _capture(r, pad(x), w, pad(dy))
    torch.testing.assert_close(y, y2[:5], rtol=0, atol=0)
    torch.testing.assert_close(dx, dx2[:5], rtol=0, atol=0)
    torch.testing.assert_close(dw, dw2, rtol=0, atol=0)


# -- what cannot run is refused in one line ------------------------------------------------------------------------
@pytest.mark.parametrize("config,words", [
    (dict(precision="fp8-mixed", wgrad_hp=True), "--wgrad-hp"),
    (dict(precision="mxfp8", fp4_hadamard=True), "--fp4-hadamard is an option of the nvfp4 recipe"),
    (dict(precision="nvfp4", mx_scale_rule="floor"), "only the MX recipes"),
    (dict(precision="nvfp4", fp4_hadamard=True, wgrad_hp=True), "drop one"),
    (dict(precision="bf16-mixed", fp8_impl="torchao"), "--fp8-impl"),
    (dict(precision="bf16-mixed", fp4_stochastic_rounding=True), "does not have"),
    (dict(precision="nvfp4", fp8_impl="torchao"), "no training layer for nvfp4"),
    (dict(precision="mxfp4", fp8_impl="torchao"), "no training layer for mxfp4"),
    (dict(precision="mxfp8", fp8_impl="torchao", mx_scale_rule="floor"), "RCEIL"),
    (dict(precision="fp8-rowwise", fp8_impl="torchao", amp_impl="scratch"), "--amp-impl native"),
    (dict(precision="fp8-rowwise", fp8_impl="nope"), "unknown --fp8-impl"),
])
def test_impossible_options_are_refused_naming_the_flag(config, words, monkeypatch):
    from mixprec.lowp import impls

    monkeypatch.setattr(impls, "torchao_available", lambda: True)  # the refusal does not hinge on the install
    with pytest.raises(RecipeError, match=words):
        build_recipe(RecipeConfig(**config), device="cpu")


def test_torchao_missing_is_a_one_line_error(monkeypatch):
    from mixprec.lowp import impls

    monkeypatch.setattr(impls, "torchao_available", lambda: False)
    with pytest.raises(RecipeError, match=r"pip install 'mixprec\[fp8\]'"):
        build_recipe(RecipeConfig(precision="fp8-rowwise", fp8_impl="torchao"), device="cpu")
    assert build_recipe("mxfp8", device="cpu").fp8.name == "scratch"


def test_auto_picks_torchao_only_where_the_gpu_has_units_for_the_format(monkeypatch):
    from mixprec.hardware import Capabilities
    from mixprec.lowp import impls

    monkeypatch.setattr(impls, "torchao_available", lambda: True)
    h100 = Capabilities(torch.device("cuda"), "H100", fp8_matmul=True, rowwise_fp8=True)
    picks = {n: impls.auto_fp8_impl(r, h100) for n, r in LINEAR_RECIPES.items()}
    assert picks == {"tensorwise": "torchao", "rowwise": "torchao", "mxfp8": "scratch", "mxfp4": "scratch",
                     "nvfp4": "scratch"}
    b200 = Capabilities(torch.device("cuda"), "B200", fp8_matmul=True, rowwise_fp8=True, mx_matmul=True)
    picks = {n: impls.auto_fp8_impl(r, b200) for n, r in LINEAR_RECIPES.items()}
    assert picks == {"tensorwise": "torchao", "rowwise": "torchao", "mxfp8": "torchao", "mxfp4": "scratch",
                     "nvfp4": "scratch"}  # torchao has no MXFP4/NVFP4 training layer
    assert impls.auto_fp8_impl(linear_recipe("mxfp8", mx_scale_rule="floor"), b200) == "scratch"


def test_bench_drops_the_options_a_recipe_does_not_have():
    c = RecipeConfig(fp8_impl="scratch", fp4_hadamard=True, wgrad_hp=True)
    bf16, notes = c.for_recipe("bf16-mixed")
    assert (bf16.fp8_impl, bf16.fp4_hadamard, bf16.wgrad_hp) == ("auto", False, False) and len(notes) == 3
    mx, notes = c.for_recipe("mxfp8")
    assert (mx.fp8_impl, mx.fp4_hadamard, mx.wgrad_hp) == ("scratch", False, True)
    assert any("--fp4-hadamard" in n for n in notes)


def test_describe_names_the_formats_of_each_gemm():
    d = build_recipe(RecipeConfig(precision="nvfp4", fp4_hadamard=True), device="cpu").describe()
    assert "dW nvfp4" in d and "RHT" in d and "EMULATED" in d and "NVFP4 GEMMs" in d


def test_torchao_import_noise_stays_out_of_the_output(torchao, capfd, caplog):
    """Converting with torchao (which imports it) prints and logs nothing at WARNING."""
    with caplog.at_level(logging.WARNING):
        r = build_recipe(RecipeConfig(precision="fp8-rowwise", amp_impl="native", fp8_impl="torchao"), device="cpu")
        r.convert_module(nn.Sequential(nn.Linear(32, 32)))
    out, err = capfd.readouterr()
    assert out == "" and err == "" and not [rec for rec in caplog.records if rec.levelno >= logging.WARNING]


# -- the commands end to end -----------------------------------------------------------------------------------------
TINY = ["--model", "mlp", "--width", "32", "--depth", "1", "--dataset", "synthetic", "--synthetic-train", "64",
        "--synthetic-test", "32", "--synthetic-shape", "1,8,8", "--batch-size", "32"]


@pytest.mark.slow
@pytest.mark.parametrize("recipe,flags", [("fp8-rowwise", ["--wgrad-hp"]), ("mxfp8", ["--mx-scale-rule", "floor"]),
                                          ("mxfp4", []), ("nvfp4", ["--fp4-hadamard", "--fp4-stochastic-rounding"])])
def test_train_doctor_run_each_new_recipe(cli, one_thread, tmp_path, recipe, flags):
    code, out, err = cli("train", "--precision", recipe, *flags, *TINY, "--max-steps", "2", "--epochs", "1",
                         "--progress", "off", "--log-every", "0", "--device", "cpu")
    assert code == 0, err
    assert f"| {recipe} |" in out and "EMULATED" in out and "1 linear layer(s) in" in out
    code, out, err = cli("doctor", "--precision", recipe, *flags, *TINY, "--steps", "2", "--out", tmp_path / "d")
    assert code == 0, err
    assert (tmp_path / "d" / "doctor.json").exists()


@pytest.mark.slow
def test_bench_compares_the_new_recipes_and_drops_options_where_they_do_not_apply(cli, tmp_path):
    code, out, err = cli("bench", "--precisions", "bf16-mixed,fp8-rowwise,mxfp8,mxfp4,nvfp4", *TINY, "--max-steps", "2",
                         "--warmup-steps", "1", "--epochs", "1", "--repeats", "1", "--no-plots", "--no-plan", "--fp4-hadamard",
                         "--out", tmp_path / "b")
    assert code == 0, err
    for recipe in ("fp8-rowwise", "mxfp8", "mxfp4", "nvfp4"):
        assert f"| {recipe} |" in out
    assert "--fp4-hadamard does not apply" in out + err


@pytest.mark.slow
def test_a_resumed_stochastic_rounding_run_continues_each_layers_random_stream(cli, one_thread, tmp_path):
    """nvfp4 --fp4-stochastic-rounding: each converted layer's generator is checkpointed with the recipe, so 2
    steps + resume to 4 equal 4 steps straight bit for bit (a fresh generator would redraw step 1's numbers)."""
    flags = ["--precision", "nvfp4", "--fp4-stochastic-rounding", *TINY, "--epochs", "2", "--progress", "off",
             "--log-every", "0", "--device", "cpu", "--checkpoint-every", "1"]
    code, _, err = cli("train", *flags, "--out", tmp_path / "straight")
    assert code == 0, err
    code, _, err = cli("train", *flags, "--max-steps", "2", "--out", tmp_path / "split")
    assert code == 0, err
    code, _, err = cli("train", "--resume", tmp_path / "split", "--max-steps", "none")
    assert code == 0, err
    a, b = (torch.load(tmp_path / d / "last.pt", weights_only=True) for d in ("straight", "split"))
    assert a["global_step"] == b["global_step"] == 4
    assert a["recipe"]["rounding_generators"]  # the converted layer(s), by module name
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
