"""The doctor's block-format section: SQNR, clamped scales and underflow against direct quantization, the
GEMM axes each operand is quantized along, n/a layers, flagged layers in the advice, the report and the CLI."""

import json
import math
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixprec.formats import quantize_blocks, quantize_blocks_with_scales
from mixprec.doctor import diagnose
from mixprec.probes.advice import _block_formats
from mixprec.probes.block_formats import (
    OPERANDS,
    WHAT_IF_FORMATS,
    BlockFormatConfig,
    BlockFormatProbe,
    Cell,
    operand_stats,
    scale_clamped,
)
from mixprec.errors import ConfigError
from mixprec.lowp.quant import E4M3, E5M2, to_fp8
from mixprec.jsonio import to_jsonable

pytestmark = pytest.mark.usefixtures("one_thread")

ALL = dict(max_elements=2**30)  # no sampling


def _direct(x: torch.Tensor, fmt: str, axis: int = -1) -> torch.Tensor:
    """``x`` as ``fmt`` holds it, computed without the doctor: quantize_blocks, or lowp/quant.py's per-tensor to_fp8."""
    if fmt in ("fp8_e4m3", "fp8_e5m2"):
        q, inv = to_fp8(x, E4M3 if fmt == "fp8_e4m3" else E5M2)
        return q.float() * inv
    return quantize_blocks(x, fmt, axis=axis)


def _direct_sqnr(x: torch.Tensor, q: torch.Tensor, axis: int = -1) -> tuple[float, float]:
    """(per dot product, whole tensor) SQNR in dB; the rows are the vectors along ``axis``."""
    x, q = x.double().movedim(axis, -1), q.double().movedim(axis, -1)
    sig, noi = x.square().sum(-1), (x - q).square().sum(-1)
    live = sig > 0
    per_row = -10 * math.log10(float((noi[live] / sig[live]).mean()))
    return per_row, 10 * math.log10(float(sig.sum() / noi.sum()))


def _cell(x: torch.Tensor, fmt: str, **kw) -> Cell:
    return Cell.from_stats(operand_stats(x, fmt, **{**ALL, **kw}).tolist())


def _heavy_tailed(rows=8, k=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, k, generator=g) * torch.exp(2 * torch.randn(rows, k, generator=g))


# ---------------------------------------------------------------------------------------------------
# one operand: against direct quantization
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", WHAT_IF_FORMATS)
def test_sqnr_equals_a_direct_computation_with_quantize_blocks(fmt):
    x = _heavy_tailed()
    c = _cell(x, fmt)
    per_row, whole = _direct_sqnr(x, _direct(x, fmt))
    assert c.status == "ok"
    assert c.sqnr_db == pytest.approx(per_row, rel=1e-9) and c.tensor_sqnr_db == pytest.approx(whole, rel=1e-9)
    assert c.elements == x.numel() and c.nonfinite == 0


@pytest.mark.parametrize("fmt", WHAT_IF_FORMATS)
def test_a_sampled_operand_counts_its_rows_exactly_as_the_whole_tensor_quantizes_them(fmt):
    x = _heavy_tailed(rows=64, k=128, seed=1)
    x[5, 7] = 1e4  # the tensor's amax, in a row the even sample (0, 8, 16, ...) leaves out
    q = _direct(x, fmt)
    rows = torch.arange(8) * 64 // 8
    expect = _direct_sqnr(x[rows], q[rows])
    c = _cell(x, fmt, max_elements=8 * 128)  # 8 rows, plus the amax row that sets the tensor scales
    assert c.elements == 8 * 128
    assert (c.sqnr_db, c.tensor_sqnr_db) == pytest.approx(expect, rel=1e-9)


def test_tiny_values_underflow_in_mxfp4_but_not_in_mxfp8():
    block = torch.full((1, 32), 0.05)
    block[0, 0] = 1.0  # amax 1: MXFP4's scale 2**-2 puts 0.05 at 0.2, below e2m1's 0.25 (half its 0.5)
    fp4, fp8 = _cell(block, "mxfp4"), _cell(block, "mxfp8_e4m3")
    assert fp4.underflow == pytest.approx(31 / 32) and fp8.underflow == 0
    assert torch.count_nonzero(quantize_blocks(block, "mxfp4")) == 1  # the direct quantization agrees
    assert fp4.scale_clamped == 0 == fp8.scale_clamped


def test_values_on_subnormal_elements_are_counted():
    block = torch.full((1, 32), 2.0**-15)
    block[0, 0] = 1.0  # MXFP8 e4m3 scale 2**-8: 2**-15 becomes the element 2**-7, an e4m3 subnormal (< 2**-6)
    c = _cell(block, "mxfp8_e4m3")
    assert c.subnormal == pytest.approx(31 / 32) and c.underflow == 0
    assert _cell(block, "mxfp8_e5m2").subnormal == 0  # e5m2 is normal down to 2**-14


def test_a_block_whose_amax_needs_a_scale_beyond_e8m0_is_clamped():
    x = torch.ones(3, 32)
    x[1] = 2.0**-121  # e4m3 (emax 8) needs the scale 2**-129 < 2**-127; e2m1 (emax 2) needs 2**-123, which fits
    x[2] = 2.0**-140  # an fp32 subnormal: beyond e8m0 for both
    mx8, mx4 = _cell(x, "mxfp8_e4m3"), _cell(x, "mxfp4")
    assert mx8.scale_clamped == pytest.approx(2 / 3) and mx4.scale_clamped == pytest.approx(1 / 3)
    scales = quantize_blocks_with_scales(x, "mxfp8_e4m3").scales.flatten()
    assert scales[1] == scales[2] == 2.0**-127 and scales[0] == 2.0**-8  # the format really clamped them


@pytest.mark.parametrize("fmt,amax,clamped", [
    ("nvfp4", 1e-5, True),  # block scale 1e-5 / 6 * 2688 < 2**-6, relative to a tensor amax of 1
    ("nvfp4", 1e-4, False),
    ("fp8_e4m3_rowwise", 1e-13, True),  # below torchao's amax floor of 1e-12
    ("fp8_e4m3_rowwise", 1e-11, False),
    ("fp8_e4m3_block128", 1e-37, True),  # 448 / amax overflows float32
    ("fp8_e4m3_block128", 1e-35, False),
    ("mxfp8_e4m3", 2.0**-119, False), ("mxfp8_e4m3", 2.0**-120, True),  # the e8m0 edge: 2**-127 = 2**(-119 - 8)
])
def test_scale_clamping_of_each_scale_format(fmt, amax, clamped):
    assert bool(scale_clamped(fmt, torch.tensor([amax]), torch.tensor(1.0))) is clamped


def test_a_per_tensor_fp8_scale_is_clamped_for_an_fp32_subnormal_tensor():
    x = torch.full((2, 16), 1e-40)
    assert _cell(x, "fp8_e4m3").scale_clamped == 1 and _cell(torch.ones(2, 16), "fp8_e4m3").scale_clamped == 0
    assert _cell(torch.zeros(2, 32), "mxfp4").status == "zero"


# ---------------------------------------------------------------------------------------------------
# the probe on a layer: which axis each operand is quantized along
# ---------------------------------------------------------------------------------------------------

def _probe_one_step(model, x, formats=WHAT_IF_FORMATS, **kw):
    probe = BlockFormatProbe(model, BlockFormatConfig(formats=formats, max_elements=2**30, **kw))
    seen = {}

    def keep(module, args, out):  # what the layer saw, for the direct computation
        seen["x"] = args[0].detach()
        out.register_hook(lambda g: seen.__setitem__("dy", g))

    h = model[0].register_forward_hook(keep)
    with probe.watching():
        model(x).square().sum().backward()
    h.remove()
    return probe, seen


def test_each_gemm_operand_is_quantized_along_the_dimension_its_gemm_reduces():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 16))
    probe, seen = _probe_one_step(model, torch.randn(64, 64) * 3)
    layer = probe.result().layers[0]
    w = model[0].weight.detach()
    operands = {("x", "forward"): (seen["x"], -1), ("w", "forward"): (w, -1), ("dy", "grad_input"): (seen["dy"], -1),
                ("w", "grad_input"): (w, 0), ("dy", "grad_weight"): (seen["dy"], 0), ("x", "grad_weight"): (seen["x"], 0)}
    assert set(operands) == set(OPERANDS) == set(layer.operands)
    for key, (t, axis) in operands.items():
        for fmt in ("mxfp4", "nvfp4", "fp8_e4m3_rowwise"):
            expect = _direct_sqnr(t, _direct(t, fmt, axis), axis)[0]
            assert layer.operands[key][fmt].sqnr_db == pytest.approx(expect, rel=1e-9), (key, fmt)
    assert not model[0]._forward_hooks and not model[2]._forward_hooks  # the probe's hooks are gone


def test_a_layer_with_in_features_48_is_not_applicable_for_mx_and_fits_nvfp4():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 32), nn.ReLU(), nn.Linear(32, 16))
    probe, _ = _probe_one_step(model, torch.randn(32, 48))
    prof = probe.result()
    first = prof.layers[0]
    for fmt in ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp4"):
        cell = first.operands[("x", "forward")][fmt]
        assert cell.status == "n/a" and cell.reason == "in_features 48 is not a multiple of 32"
        assert first.tensor_cell("w", fmt).status == "n/a"
        assert first.operands[("dy", "grad_input")][fmt].status == "ok"  # out_features 32 fits
    assert first.tensor_cell("x", "nvfp4").status == "ok" and prof.layers[1].tensor_cell("x", "mxfp4").status == "ok"
    assert ("0", "mxfp4", "in_features 48 is not a multiple of 32") in prof.not_applicable()


def test_only_the_configured_steps_are_measured_and_a_disabled_probe_does_nothing():
    model = nn.Sequential(nn.Linear(32, 32))
    probe = BlockFormatProbe(model, BlockFormatConfig(formats=("mxfp4",), steps=2))
    for _ in range(3):
        with probe.watching():
            model(torch.randn(32, 32)).sum().backward()
    prof = probe.result()
    assert prof.steps == 2 and prof.layers[0].operands[("x", "forward")]["mxfp4"].elements == 2 * 32 * 32
    off = BlockFormatProbe(model, None)
    with off.watching():
        model(torch.randn(4, 32))
    assert off.result() is None and not model[0]._forward_hooks


def test_config_canonicalizes_aliases_and_refuses_unknown_formats():
    assert BlockFormatConfig(formats=("nvfp4", "mxfp8", "e4m3", "rowwise")).formats == (
        "fp8_e4m3", "fp8_e4m3_rowwise", "mxfp8_e4m3", "nvfp4")
    assert BlockFormatConfig.coerce("none") is None and BlockFormatConfig.coerce("all").formats == WHAT_IF_FORMATS
    with pytest.raises(ConfigError, match="--formats fp12: unknown format"):
        BlockFormatConfig.coerce("mxfp4,fp12")


@pytest.mark.cuda  # host syncs are a GPU matter
def test_the_probe_hooks_make_no_host_sync_on_a_gpu():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32)).cuda()
    probe = BlockFormatProbe(model, BlockFormatConfig(max_elements=1024))  # sampled: the argmax row path too
    x = torch.randn(256, 64, device="cuda")
    with probe.watching():
        out = model(x)
        torch.cuda.set_sync_debug_mode("error")
        try:
            out.square().sum().backward()  # the grad hooks
            model(x)  # the forward hooks
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert probe.result().layers[0].tensor_cell("x", "nvfp4").status == "ok"


# ---------------------------------------------------------------------------------------------------
# a planted bad layer: flagged, named in the advice, in the report and doctor.json
# ---------------------------------------------------------------------------------------------------

class Planted(nn.Module):
    """Three 64-wide layers; ``mid`` has one weight 1e7x its others: under NVFP4 its tensor scale clamps every
    other block's e4m3 scale at 2**-6, and its rows without the outlier flush to zero."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.mid, self.out = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64)
        with torch.no_grad():
            self.mid.weight.clamp_(-0.1, 0.1)[3, 5] = 1e6

    def forward(self, x):
        return self.out(torch.tanh(self.mid(torch.tanh(self.inp(x)))))


def test_a_layer_with_a_huge_weight_outlier_is_flagged_for_nvfp4_and_named_in_the_advice():
    model = Planted()
    probe = BlockFormatProbe(model, BlockFormatConfig(formats=("nvfp4", "mxfp8_e4m3", "fp8_e4m3_rowwise")))
    with probe.watching():
        F.cross_entropy(model(torch.randn(64, 64)), torch.randint(0, 64, (64,))).backward()
    prof = probe.result()
    mid = next(lr for lr in prof.layers if lr.name == "mid")
    assert mid.tensor_cell("w", "nvfp4").sqnr_db < prof.medians()["nvfp4"]["w"] - 10
    assert mid.tensor_cell("w", "nvfp4").tensor_sqnr_db > 30  # the whole-tensor SQNR hides it: the outlier dominates
    flagged = {(d["layer"], d["format"], d["tensor"]) for d in prof.flagged()}
    assert ("mid", "nvfp4", "w") in flagged
    assert not any(layer == "mid" and t == "w" for layer, f, t in flagged if f != "nvfp4")  # per-row scales cope
    recs = [r for r in _block_formats(types.SimpleNamespace(block_formats=prof)) if r["kind"] == "block-format-filter"]
    nv = next(r["text"] for r in recs if "for nvfp4" in r["text"])
    assert nv.startswith("keep mid") and "mid w" in nv and "dB vs median" in nv
    ranges = [r["text"] for r in _block_formats(types.SimpleNamespace(block_formats=prof))
              if r["kind"] == "block-format-range"]
    assert any(t.startswith("nvfp4:") and "mid w" in t for t in ranges)


@pytest.mark.slow
def test_diagnose_writes_the_section_to_doctor_json_and_the_report(tmp_path):
    model = Planted()
    batch = (torch.randn(64, 64), torch.randint(0, 64, (64,)))
    report = diagnose(model, batch, F.cross_entropy, precision="bf16-mixed", steps=1, lr=1e-6, out=str(tmp_path))
    d = json.loads((tmp_path / "doctor.json").read_text())
    bf = d["block_formats"]
    assert bf["formats"] == list(WHAT_IF_FORMATS) and bf["steps"] == 1
    assert [lr["layer"] for lr in bf["layers"]] == ["inp", "mid", "out"]
    assert bf["tensors"]["mid"]["nvfp4"]["w"]["status"] == "ok" and bf["axes"]["dy/grad_weight"] == "tokens"
    assert any(f["layer"] == "mid" and f["format"] == "nvfp4" for f in bf["flagged"])
    assert (tmp_path / "block_formats.png").stat().st_size > 0
    text = (tmp_path / "report.txt").read_text()
    assert "6. Block formats, what-if" in text and "keep mid" in text
    assert json.dumps(to_jsonable(report.to_dict()), allow_nan=False)
    off = diagnose(model, batch, F.cross_entropy, precision="bf16-mixed", steps=1, block_formats=None)
    assert off.to_dict()["block_formats"] is None and "6. Block formats" not in off.render()


@pytest.mark.slow
def test_cli_doctor_block_formats_on_the_builtin_mlp(cli, tmp_path):
    code, out, err = cli("doctor", "--dataset", "digits", "--model", "mlp", "--width", "32", "--depth", "1",
                         "--batch-size", "32", "--steps", "2", "--formats", "mxfp8,nvfp4,e4m3", "--out", tmp_path,
                         "--no-plots")
    assert code == 0, err
    assert "6. Block formats, what-if" in out and "mxfp8" in out and "nvfp4" in out
    d = json.loads((tmp_path / "doctor.json").read_text())["block_formats"]
    assert d["formats"] == ["fp8_e4m3", "mxfp8_e4m3", "nvfp4"]
    assert [lr["layer"] for lr in d["layers"]] == ["body.0", "head"]
    assert d["tensors"]["body.0"]["mxfp8_e4m3"]["x"]["status"] in ("ok", "exact")  # digits: 64 features fit MX
    assert d["tensors"]["head"]["mxfp8_e4m3"]["dy"]["status"] == "n/a"  # 10 classes do not


def test_cli_doctor_refuses_an_unknown_format(cli, tmp_path):
    code, _, err = cli("doctor", "--dataset", "digits", "--formats", "mxfp4,fp12", "--out", tmp_path)
    assert code == 2 and "--formats fp12: unknown format" in err and "Traceback" not in err
