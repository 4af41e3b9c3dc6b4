"""mixprec tune (issue 33): each linear layer in the cheapest format that pays on the target and keeps the loss."""

import json
import math

import pytest
import torch

from conftest import ROOT
from mixprec.lowp.layer_formats import load
from mixprec.probes.block_formats import Cell, LayerBlockStats, OPERANDS
from mixprec.tune.api import MIN_GAIN, TuneError, _choose, _layer_times, ideal_sqnr_db, tune

SPIKY = f"{ROOT / 'tests' / 'userpkg' / 'spiky.py'}:model"


def _layer(name="l", out_features=64, in_features=64, **by_format):
    """A LayerBlockStats whose every operand has, per what-if format, the cell given (default: a clean one)."""
    formats = ("fp8_e4m3", "fp8_e5m2", "fp8_e4m3_rowwise")
    ops = {}
    for key in OPERANDS:
        ops[key] = {f: by_format.get(f, Cell("ok", sqnr_db=ideal_sqnr_db(f) - 3, underflow=0.0)) for f in formats}
    return LayerBlockStats(name, "Linear", in_features, out_features, (64, 64), ops)


CANDS = ("fp8-mixed", "fp8-rowwise", "bf16-mixed", "fp32")


def test_the_fastest_safe_format_that_pays_is_chosen():
    times = {"fp8-mixed": 0.8, "fp8-rowwise": 0.7, "bf16-mixed": 1.0, "fp32": 3.0}
    c = _choose(_layer(), 64, times, CANDS, "h100-sxm")
    assert c.format == "fp8-rowwise" and "pays 1.43x on h100-sxm" in c.reason and not c.unsafe
    # rowwise unsafe (its values flush): the next fastest, tensorwise
    bad = Cell("ok", sqnr_db=30.0, underflow=0.05)
    c = _choose(_layer(fp8_e4m3_rowwise=bad), 64, times, CANDS, "h100-sxm")
    assert c.format == "fp8-mixed" and "5.0% of values flush to zero" in c.unsafe["fp8-rowwise"]


def test_a_format_that_does_not_pay_leaves_the_layer_in_bf16():
    times = {"fp8-mixed": 1.0 / (MIN_GAIN - 0.01), "fp8-rowwise": 1.2, "bf16-mixed": 1.0, "fp32": 3.0}
    c = _choose(_layer(), 64, times, CANDS, "h100-sxm")
    assert c.format == "bf16" and "would not pay on h100-sxm" in c.reason
    # --min-gain 0: the fastest safe format, paying or not, and the reason says so
    c = _choose(_layer(), 64, times, CANDS, "h100-sxm", min_gain=0)
    assert c.format == "fp8-mixed" and "chosen for --min-gain 0" in c.reason


def test_unsafe_everywhere_and_misfits_say_why():
    noisy = Cell("ok", sqnr_db=3.0, underflow=0.0)
    times = {"fp8-mixed": 0.5, "fp8-rowwise": 0.5, "bf16-mixed": 1.0, "fp32": 3.0}
    c = _choose(_layer(fp8_e4m3=noisy, fp8_e4m3_rowwise=noisy), 64, times, CANDS, "h100-sxm")
    assert c.format == "bf16" and "fp8-mixed unsafe (x of forward: SQNR 3.0 dB" in c.reason
    c = _choose(_layer(out_features=10), 64, times, CANDS, "h100-sxm")
    assert c.format == "bf16" and "10 x 64 is not a multiple of 16" in c.reason and not c.pays


def test_without_bf16_a_layer_that_gains_nothing_stays_fp32():
    times = {"fp8-mixed": 1.0, "fp32": 1.0}
    assert _choose(_layer(), 64, times, ("fp8-mixed", "fp32"), "h100-sxm").format == "fp32"


@pytest.mark.slow
def test_the_planner_prices_fp8_as_paying_only_on_large_compiled_gemms():
    """The planner's view the tuner reads: compiled on an H100, FP8 pays on a large layer and not on a small one;
    eager, its casts cost more than its GEMMs save (the H200 measured 0.55x eager, 1.40x compiled)."""
    from mixprec.planning.targets import get_target

    h100 = get_target("h100-sxm")
    small, big = (1024, 1024, 512), (8192, 8192, 8192)
    compiled = _layer_times([small, big], ("fp8-mixed", "bf16-mixed"), h100, compile_fp8=True)
    eager = _layer_times([big], ("fp8-mixed", "bf16-mixed"), h100, compile_fp8=False)
    pays = {k: v["bf16-mixed"] / v["fp8-mixed"] for k, v in compiled.items()}
    assert pays[big] > 1.3 and pays[small] < MIN_GAIN
    assert eager[big]["bf16-mixed"] / eager[big]["fp8-mixed"] < 1


@pytest.mark.parametrize("flags, needle", [
    (["--candidates", "fp8-mixed,bf16-true"], "a layer can run fp32, bf16-mixed or an FP8/FP4 recipe"),
    (["--candidates", "fp12"], "--candidates fp12: unknown recipe"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--min-gain", "-1"], "--min-gain must be >= 0"),
    (["--plan-batch-size", "0"], "--plan-batch-size must be >= 1"),
    (["--target", "tpu-v5"], "unknown --target 'tpu-v5'"),
    (["--layer-formats", "old.json"], "tune writes a layer-formats file (--out), it does not read one"),
])
def test_bad_input_is_one_line_and_exit_2(cli, tmp_path, flags, needle):
    code, _, err = cli("tune", "--model", "mlp", "--width", "32", "--depth", "1", "--dataset", "digits", *flags,
                       "--out", tmp_path / "f.json")
    assert code == 2 and needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "f.json").exists()


@pytest.mark.slow
def test_uniform_fp8_leaves_the_band_where_the_tuned_file_stays(cli, tmp_path):
    """The second demonstration: a layer whose input carries a row 2**20 times the rest (tests/userpkg/spiky.py).
    tune keeps that layer in bf16 (per-tensor e4m3 flushes the other rows) and the others in fp8-mixed; a short
    bench run puts uniform fp8-mixed outside fp32's seed band and the tuned file inside it."""
    f = tmp_path / "spiky.json"
    code, out, err = cli("tune", "--model", SPIKY, "--dataset", "digits", "--target", "h100-sxm", "--steps", "2",
                         "--candidates", "fp8-mixed,bf16-mixed", "--min-gain", "0", "--out", f)
    assert code == 0, err
    formats = {n: e["format"] for n, e in json.loads(f.read_text())["layers"].items()}
    assert formats == {"fc1": "fp8-mixed", "spiky": "bf16", "fc2": "fp8-mixed", "head": "bf16"}
    assert "x of forward" in load(f).layers["spiky"][1]
    code, out, err = cli("bench", "--model", SPIKY, "--dataset", "digits", "--precisions", "fp32,fp8-mixed",
                         "--layer-formats", f, "--repeats", "2", "--max-steps", "40", "--epochs", "2",
                         "--batch-size", "64", "--optimizer", "adamw", "--lr", "3e-3", "--no-plots", "--no-plan",
                         "--warmup-steps", "1", "--out", tmp_path / "b")
    assert code == 0, out + err
    rows = {r["recipe"]: r for r in json.loads((tmp_path / "b" / "results.json").read_text())["summary"]}
    assert rows["fp8-mixed"]["parity"]["verdict"] == "no" and rows["fp8-mixed+layers"]["parity"]["verdict"] == "yes"
    assert rows["fp8-mixed"]["final_train_loss"] > 2 > 0.5 > rows["fp8-mixed+layers"]["final_train_loss"]


@pytest.mark.slow
def test_a_wide_gpt_gets_fp8_where_it_pays_and_plans_no_slower_than_uniform(tmp_path):
    """The first demonstration, planned: a GPT of width 1024 priced on an H100 at 2048 tokens per step. Some of
    its layers pay in FP8 and some do not; the tuned file plans no slower than any uniform recipe (the loss check
    of this model is benchmarks/tune_demo.py's: a CPU run of this width is too slow for the suite)."""
    import mixprec

    f = tmp_path / "gpt.json"
    flags = dict(model="gpt", dataset="text", d_model=1024, n_layers=1, n_heads=8, block_size=64, batch_size=4)
    t = tune(target="h100-sxm", steps=1, plan_batch_size=32, out=str(f), **flags)
    chosen = t.formats()
    low = {n for n, fmt in chosen.items() if fmt.startswith("fp8")}
    assert low and len(low) < len(chosen) - 1, chosen  # some pay, some do not (the head cannot hold FP8 blocks)
    plans = mixprec.plan(precisions=["bf16-mixed", "fp8-mixed", "fp8-rowwise"], target="h100-sxm",
                         layer_formats=str(f), **{**flags, "batch_size": 32})
    times = {r.recipe if not r.label.endswith("+layers") else "tuned": r.step_time_s for r in plans.recipes}
    tuned = min(v for k, v in times.items() if "layers" in k) if "tuned" not in times else times["tuned"]
    assert tuned <= min(v for k, v in times.items() if k != "tuned") * 1.0001, times
    assert all(math.isfinite(v) for v in times.values())


def test_tune_needs_no_gpu_and_writes_nothing_on_a_bad_candidate(tmp_path):
    with pytest.raises(TuneError):
        tune(model="mlp", dataset="digits", candidates="bf16-master", out=str(tmp_path / "f.json"))
    assert not (tmp_path / "f.json").exists() and not torch.cuda.is_initialized()


@pytest.mark.slow
def test_a_file_with_no_low_precision_layer_plans_for_a_gpu(tmp_path):
    """A file whose layers are all bf16 (no FP8 candidate): planning it for a GPU target works (the planner once
    asked for mixprec's FP8 layers for a recipe and file that had none, and refused its own setting; tune's
    whole-model refinement hit it whenever a start held no FP8 layer)."""
    import mixprec

    f = tmp_path / "small.json"
    flags = dict(model="mlp", width=32, depth=1, dataset="digits", batch_size=32)
    t = tune(target="h100-sxm", steps=1, candidates="bf16-mixed,fp32", out=str(f), **flags)
    assert set(t.formats().values()) == {"bf16"}
    p = mixprec.plan(precisions=["bf16-mixed"], target="h100-sxm", layer_formats=str(f), **flags)
    assert [r.label.split(" ")[0] for r in p.recipes] == ["bf16-mixed", "bf16-mixed+layers"]
