"""Layer-formats files (issue 33): each named linear layer in a format of its own, the rest in the recipe's.

The file's reading and writing, every bad input as one line (exit 2), its layers really running their formats (the
same output and gradients, bit for bit, as the uniform recipe's layer), the contradictions it refuses, and
train, plan and bench applying it."""

import contextlib
import io
import json

import pytest
import torch
from torch import nn

from conftest import DEVICES
from mixprec.autocast.fp32_forward import Fp32Forward
from mixprec.cli import main
from mixprec.errors import RecipeError
from mixprec.lowp import layer_formats as lf
from mixprec.lowp.block import BlockLinear
from mixprec.lowp.fp8 import Fp8Linear
from mixprec.precision import RECIPES, build_recipe, layers_entry

TRAIN = ["--model", "mlp", "--width", "64", "--depth", "2", "--dataset", "synthetic", "--synthetic-shape", "1,8,8",
         "--synthetic-train", "64", "--synthetic-test", "32", "--epochs", "1", "--batch-size", "32", "--device", "cpu",
         "--log-every", "0", "--progress", "off"]
"""A run whose model (``mlp``: body.0 64->64, body.3 64->64, head 64->10) fits the MX and NVFP4 blocks."""


class Tiny(nn.Module):
    def __init__(self, width: int = 64):
        super().__init__()
        self.a = nn.Linear(64, width)
        self.b = nn.Linear(width, 64)
        self.c = nn.Linear(64, 64)
        self.d = nn.Linear(64, 32)
        self.e = nn.Linear(32, 32)
        self.head = nn.Linear(32, 32)

    def forward(self, x):
        for m in (self.a, self.b, self.c, self.d, self.e):
            x = torch.relu(m(x))
        return self.head(x)


def _file(tmp_path, layers, model=None, name="layers.json", **kw):
    return lf.save(tmp_path / name, layers, model=model or Tiny(), model_name="tiny", target="h100-sxm", **kw).path


def _cli(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def _mlp_file(tmp_path, layers, **model):
    doc = {"schema": lf.SCHEMA, "model": {"name": "mlp", **model}, "target": "h100-sxm",
           "layers": {n: {"format": f, "reason": "test"} for n, f in layers.items()}}
    path = tmp_path / "mlp.json"
    path.write_text(json.dumps(doc))
    return path


# ------------------------------------------------------------------------------------------- the file

def test_save_and_load_round_trip(tmp_path):
    model = Tiny()
    path = _file(tmp_path, {"a": ("fp8-rowwise", "pays 1.3x"), "head": "bf16"}, model=model,
                 thresholds={"sqnr_db": 25})
    got = lf.load(path)
    assert got.layers == {"a": ("fp8-rowwise", "pays 1.3x"), "head": ("bf16", "")}
    assert got.model == {"name": "tiny", "fingerprint": lf.fingerprint(model), "linear_layers": 6}
    assert got.target == "h100-sxm" and got.raw["thresholds"] == {"sqnr_db": 25} and got.raw["schema"] == lf.SCHEMA
    assert got.by_format() == {"bf16": ["head"], "fp8-rowwise": ["a"]}
    assert got.check_model(model) == {"a": model.a, "head": model.head}


def test_the_fingerprint_is_the_linear_layers_names_and_shapes():
    with torch.device("meta"):
        meta = Tiny()
    assert lf.fingerprint(Tiny()) == lf.fingerprint(meta) != lf.fingerprint(Tiny(width=32))
    converted = build_recipe("mxfp8", device="cpu").convert_module(Tiny())
    assert isinstance(converted.a, BlockLinear) and lf.fingerprint(converted) == lf.fingerprint(Tiny())


def test_the_formats_are_the_dtypes_and_the_low_precision_recipes():
    assert lf.DTYPE_FORMATS == ("fp32", "bf16", "fp16")
    assert set(lf.LOWP_FORMATS) == {name for name, spec in RECIPES.items() if spec.fp8 is not None}


def test_save_refuses_what_load_would(tmp_path):
    with pytest.raises(lf.LayerFormatsError, match="unknown format 'fp6'; choose one of: fp32, bf16"):
        _file(tmp_path, {"a": "fp6"})
    with pytest.raises(lf.LayerFormatsError, match="the model has no module 'z'"):
        _file(tmp_path, {"z": "bf16"})
    assert not (tmp_path / "layers.json").exists()


BAD_FILES = {
    "missing": (None, "no such file"),
    "not json": ("{nope", "not JSON (Expecting property name"),
    "other schema": (json.dumps({"schema": "mixprec.plan/1", "layers": {}}),
                     "schema is 'mixprec.plan/1', not 'mixprec.layer-formats/1'"),
    "no layers": (json.dumps({"schema": lf.SCHEMA}), 'no "layers" object'),
    "bad entry": (json.dumps({"schema": lf.SCHEMA, "layers": {"body.0": "mxfp8"}}),
                  "layer 'body.0': expected {\"format\": ..., \"reason\": ...}"),
    "unknown format": (json.dumps({"schema": lf.SCHEMA, "layers": {"body.0": {"format": "fp6"}}}),
                       "unknown format 'fp6'; choose one of: fp32, bf16, fp16, fp8-mixed, fp8-rowwise, mxfp8, mxfp4, "
                       "nvfp4"),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_a_bad_file_is_one_line_exit_2(tmp_path, case):
    text, needle = BAD_FILES[case]
    path = tmp_path / "f.json"
    if text is not None:
        path.write_text(text)
    code, out, err = _cli(["train", *TRAIN, "--precision", "bf16-mixed", "--layer-formats", path])
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"mixprec train: error: --layer-formats {path}: ") and needle in err, err


MISFITS = {
    "a module it lacks": ({"body.9": "mxfp8"}, {}, "the model has no module 'body.9' (did you mean body.3?); name its"),
    "made for another model": ({"body.9": "mxfp8"}, {"fingerprint": "0123456789abcdef"},
                               "the model has no module 'body.9' (did you mean body.3?); the file was made for another "
                               "model (mlp, fingerprint 0123456789abcdef; this one's is "),
    "another model, same names": ({"body.0": "mxfp8"}, {"fingerprint": "0123456789abcdef"},
                                  "the file was made for another model (mlp, fingerprint 0123456789abcdef"),
    "not a linear layer": ({"body.1": "fp32"}, {}, "'body.1' is a ReLU, not a linear layer"),
    "a block the layer lacks": ({"head": "mxfp8"}, {}, "head cannot run mxfp8: in_features=64, out_features=10: "
                                "mxfp8's blocks along the reduced dimensions need multiples of 32"),
    "another dtype than the autocast's": ({"body.0": "fp16"}, {}, "it puts body.0 in fp16, but bf16-mixed's "
                                          "autocast runs bf16"),
}


@pytest.mark.parametrize("case", list(MISFITS))
def test_a_file_that_does_not_fit_the_model_or_recipe_is_one_line_exit_2(tmp_path, case):
    layers, model, needle = MISFITS[case]
    path = _mlp_file(tmp_path, layers, **model)
    code, out, err = _cli(["train", *TRAIN, "--precision", "bf16-mixed", "--layer-formats", path])
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert needle in err, err


@pytest.mark.parametrize("precision, needle", [
    ("fp32", "fp32 has no autocast with fp32 params for the file's layers to run in; use one of fp16-mixed, "
             "bf16-mixed, fp8-mixed"),
    ("bf16-true", "bf16-true has no autocast with fp32 params"),
    ("fp16-mixed", "it puts a in mxfp8, whose layers need bf16 around them, but fp16-mixed's autocast runs fp16"),
])
def test_the_base_must_be_an_autocast_recipe_with_fp32_params_in_the_files_dtype(tmp_path, precision, needle):
    path = _file(tmp_path, {"a": "mxfp8", "b": "fp32"})
    with pytest.raises(lf.LayerFormatsError, match="--layer-formats .*: " + needle.replace("(", r"\(")
                       .replace(")", r"\)")):
        build_recipe(precision, device="cpu", layer_formats=path)


# ------------------------------------------------------------------------------------- the layers' formats

def _layer_run(recipe, model, name, x):
    """The output of layer ``name`` for ``x`` under ``recipe``'s autocast, and its weight's gradient."""
    layer = model.get_submodule(name)
    with recipe.autocast():
        y = layer(x)
    y.float().square().sum().backward()
    return y.detach(), layer.weight.grad


@pytest.mark.parametrize("device", DEVICES)
def test_the_files_layers_run_their_formats_bit_for_bit_as_the_uniform_recipes(tmp_path, device):
    """Each low-precision layer is the layer (and implementation) the uniform recipe makes, with the same output
    and weight gradient bit for bit; the bf16 layer is bf16-mixed's; the fp32 layer is the fp32 layer itself."""
    torch.manual_seed(0)
    model = Tiny()
    path = _file(tmp_path, {"a": "mxfp8", "b": "fp32", "c": "bf16", "d": "nvfp4", "e": "fp8-rowwise"}, model=model)
    recipe = build_recipe("bf16-mixed", device=device, layer_formats=path)
    mixed = recipe.convert_module(_copy(model))
    assert type(mixed.b) is type(mixed.c) is type(mixed.head) is nn.Linear
    assert (mixed.a.recipe.name, mixed.d.recipe.name) == ("mxfp8", "nvfp4")
    if device == "cpu":
        assert type(mixed.a) is type(mixed.d) is type(mixed.e) is BlockLinear and mixed.e.recipe.name == "rowwise"
    assert recipe.label == "bf16-mixed+layers [native]" and set(recipe.layer_impls) == {"mxfp8", "nvfp4",
                                                                                        "fp8-rowwise"}
    for name, uniform in (("a", "mxfp8"), ("d", "nvfp4"), ("e", "fp8-rowwise"), ("c", "bf16-mixed")):
        x = torch.randn(40, mixed.get_submodule(name).in_features, device=device)
        ref = build_recipe(uniform, device=device, **({"fp8_layers": "all"} if uniform == "fp8-rowwise" else {}))
        theirs = ref.convert_module(_copy(model))
        assert type(mixed.get_submodule(name)) is type(theirs.get_submodule(name)), name
        y, dw = _layer_run(recipe, mixed, name, x)
        y_ref, dw_ref = _layer_run(ref, theirs, name, x)
        assert y.dtype == torch.bfloat16 and torch.equal(y, y_ref) and torch.equal(dw, dw_ref), name
    x = torch.randn(8, 64, device=device)
    y, _ = _layer_run(recipe, mixed, "b", x)  # fp32 under the bf16 autocast: the fp32 layer itself
    w, bias = model.b.weight.to(device), model.b.bias.to(device)
    assert y.dtype == torch.float32 and torch.equal(y, torch.nn.functional.linear(x, w, bias))
    with recipe.autocast():
        assert mixed(torch.randn(4, 64, device=device)).dtype == torch.bfloat16
    d = recipe.describe()
    assert f"--layer-formats {path} (tiny, tuned for h100-sxm): 1 linear layer(s) in fp32, 1 in bf16, " in d
    assert "the others as bf16-mixed" in d
    if device == "cpu":
        assert "1 in mxfp8 [scratch, EMULATED: they need Blackwell" in d


def _copy(model):
    new = Tiny()
    new.load_state_dict(model.state_dict())
    return new


def test_the_file_wins_over_the_base_recipes_fp8_layer_filter(tmp_path):
    """fp8-mixed's own conversion takes the layers the file leaves, but not the classifier by default; the file
    converts the classifier, keeps c in bf16 and b in fp32."""
    path = _file(tmp_path, {"head": "fp8-mixed", "b": "fp32", "c": "bf16", "d": "mxfp4"})
    recipe = build_recipe("fp8-mixed", device="cpu", layer_formats=path)
    model = recipe.convert_module(Tiny())
    assert [type(m) for m in (model.a, model.b, model.c, model.d, model.e, model.head)] == [
        Fp8Linear, nn.Linear, nn.Linear, BlockLinear, Fp8Linear, Fp8Linear]
    assert recipe.fp8_conversion.converted == ("a", "e") and recipe.fp8_conversion.skipped == ()
    plain = build_recipe("fp8-mixed", device="cpu").convert_module(Tiny())
    assert type(plain.head) is nn.Linear  # the default filter, without the file
    assert "1 in bf16 (kept out of fp8-mixed's conversion)" in recipe.describe()


def test_fp32_layers_run_under_fp32_forward_hooks_under_either_autocast(tmp_path):
    path = _file(tmp_path, {"b": "fp32"})
    for impl in ("native", "scratch"):
        recipe = build_recipe("bf16-mixed", device="cpu", amp_impl=impl, layer_formats=path)
        model = recipe.convert_module(Tiny())
        hooks = list(model.b._forward_pre_hooks.values())
        assert len(hooks) == 1 and isinstance(hooks[0].__self__, Fp32Forward) and not model.a._forward_pre_hooks
        seen = {}
        model.b.register_forward_hook(lambda m, args, out: seen.update(x=args[0].dtype, y=out.dtype))
        with recipe.autocast():
            model(torch.randn(4, 64))
        assert seen == {"x": torch.float32, "y": torch.float32}, impl


def test_keep_fp32_contradicts_a_low_format_and_agrees_with_fp32(tmp_path):
    low, same = _file(tmp_path, {"a": "fp8-rowwise"}), _file(tmp_path, {"a": "fp32"}, name="fp32.json")
    for keep in ("a", "Linear"):
        recipe = build_recipe("bf16-mixed", device="cpu", amp_impl="scratch", keep_fp32=(keep,), layer_formats=low)
        with pytest.raises(lf.LayerFormatsError, match=f"--keep-fp32 {keep} and --layer-formats {low} contradict: "
                                                       "the file puts a in fp8-rowwise"):
            recipe.convert_module(Tiny())
    recipe = build_recipe("bf16-mixed", device="cpu", amp_impl="scratch", keep_fp32=("a",), layer_formats=same)
    assert type(recipe.convert_module(Tiny()).a) is nn.Linear


def test_the_linear_flags_apply_to_the_files_formats_where_they_can(tmp_path):
    path = _file(tmp_path, {"a": "nvfp4", "b": "mxfp8"})
    recipe = build_recipe("bf16-mixed", device="cpu", fp4_hadamard=True, mx_scale_rule="floor", layer_formats=path)
    nv, mx = recipe.layer_impls["nvfp4"].recipe, recipe.layer_impls["mxfp8"].recipe
    assert nv.hadamard and nv.scale_rule is None and mx.scale_rule == "floor" and not mx.hadamard
    with pytest.raises(RecipeError, match="--wgrad-hp applies to none of the low-precision layers here"):
        build_recipe("bf16-mixed", device="cpu", wgrad_hp=True, layer_formats=_file(tmp_path, {"a": "fp8-mixed"},
                                                                                    name="t.json"))
    with pytest.raises(RecipeError, match="--fp8-layers picks the layers bf16-mixed's own FP8 conversion takes"):
        build_recipe("bf16-mixed", device="cpu", fp8_layers="all", layer_formats=path)
    with pytest.raises(lf.LayerFormatsError, match="its nvfp4 layers: --fp8-impl torchao with nvfp4: torchao has no"):
        build_recipe("bf16-mixed", device="cpu", fp8_impl="torchao", layer_formats=path)


# ------------------------------------------------------------------------------------- bench's and plan's entry

def test_the_extra_entry_takes_the_first_recipe_that_can_carry_the_file(tmp_path):
    from mixprec.precision import RecipeConfig

    fp8 = RecipeConfig(layer_formats=_file(tmp_path, {"a": "mxfp8"}))
    assert layers_entry(fp8, ["fp32", "fp16-mixed", "bf16-mixed", "fp8-mixed"]) == "bf16-mixed+layers"
    assert layers_entry(RecipeConfig(), ["bf16-mixed"]) is None
    half = RecipeConfig(layer_formats=_file(tmp_path, {"a": "fp16"}, name="h.json"))
    assert layers_entry(half, ["fp32", "bf16-mixed", "amp"]) == "fp16-mixed+layers"
    with pytest.raises(lf.LayerFormatsError, match=r"none of the recipes asked \(fp32, fp16-mixed\) can carry the "
                                                   r"file .*; add bf16-mixed to --precisions"):
        layers_entry(fp8, ["fp32", "amp"])
    config, _ = fp8.for_recipe("bf16-mixed+layers")
    assert (config.precision, config.layer_formats) == ("bf16-mixed", fp8.layer_formats)
    assert fp8.for_recipe("bf16-mixed")[0].layer_formats is None  # the uniform rows run without the file


@pytest.mark.slow
def test_plan_adds_one_entry_for_the_file(tmp_path):
    import mixprec

    path = _mlp_file(tmp_path, {"body.0": "fp8-rowwise", "body.3": "fp32"})
    p = mixprec.plan(precisions=["fp32", "bf16-mixed"], target="h100-sxm", model="mlp", width=64, depth=2,
                     dataset="synthetic", synthetic_shape=(1, 8, 8), synthetic_train=64, synthetic_test=32,
                     batch_size=32, layer_formats=str(path))
    assert [r.recipe for r in p.recipes] == ["fp32", "bf16-mixed", "bf16-mixed+layers"]
    assert p.by_name("bf16-mixed+layers").label == "bf16-mixed+layers [native]"
    assert p.by_name("bf16-mixed+layers").flops["fp32"] > p.by_name("bf16-mixed").flops.get("fp32", 0)
    code, out, err = _cli(["plan", *TRAIN, "--precisions", "fp32,bf16-mixed", "--target", "h100-sxm",
                           "--layer-formats", path, "--json", tmp_path / "plan.json"])
    assert code == 0, err
    doc = json.loads((tmp_path / "plan.json").read_text())
    assert [r["recipe"] for r in doc["recipes"]] == ["fp32", "bf16-mixed", "bf16-mixed+layers"]
    assert "bf16-mixed+layers [native]" in out


# ------------------------------------------------------------------------------------- train and bench

def test_fit_takes_the_file_as_a_python_argument(tmp_path):
    from mixprec.train import fit

    torch.manual_seed(0)
    model = Tiny()
    path = _file(tmp_path, {"a": "mxfp8", "head": "fp32"}, model=model)
    x, y = torch.randn(64, 64), torch.randint(0, 32, (64,))
    fit(model, ((x, y), (x[:16], y[:16])), precision="bf16-mixed", layer_formats=path, epochs=1, batch_size=32,
        log_every=0, progress="off", device="cpu")
    assert type(model.a) is BlockLinear and type(model.head) is nn.Linear and model.head._forward_pre_hooks


@pytest.mark.slow
def test_train_through_the_cli_and_a_resume_that_changes_the_file_is_refused(tmp_path):
    path = _mlp_file(tmp_path, {"body.0": "mxfp8", "body.3": "fp32"})
    code, out, err = _cli(["train", *TRAIN, "--precision", "bf16-mixed", "--layer-formats", path, "--out",
                           tmp_path / "run", "--metrics-json", tmp_path / "m.json"])
    assert code == 0, err
    assert f"--layer-formats {path} (mlp, tuned for h100-sxm): 1 linear layer(s) in fp32, 1 in mxfp8" in out
    other = tmp_path / "other.json"
    other.write_text(path.read_text())
    code, out, err = _cli(["train", "--resume", tmp_path / "run", "--epochs", "2", "--layer-formats", other])
    assert code == 2 and "--layer-formats" in err and str(other) in err, err


@pytest.mark.slow
def test_bench_adds_one_row_for_the_file(tmp_path):
    path = _mlp_file(tmp_path, {"body.0": "mxfp8", "body.3": "fp32"})
    small = [a for a in TRAIN if a not in ("--log-every", "0", "--progress", "off")]
    small[small.index("--synthetic-train") + 1] = "128"
    code, out, err = _cli(["bench", *small, "--precisions", "fp32,bf16-mixed", "--repeats", "2", "--warmup-steps",
                           "1", "--peak-seconds", "0.05", "--no-plots", "--layer-formats", path, "--out",
                           tmp_path / "b"])
    assert code == 0, out + err
    doc = json.loads((tmp_path / "b" / "results.json").read_text())
    rows = {r["recipe"]: r for r in doc["summary"]}
    assert list(rows) == ["fp32", "bf16-mixed", "bf16-mixed+layers"]
    layered = rows["bf16-mixed+layers"]
    assert layered["runs_ok"] == 2 and layered["parity"]["verdict"] in ("yes", "no") and layered["parity"]["steps"] > 0
    runs = [r for r in doc["runs"] if r["recipe"] == "bf16-mixed+layers"]
    assert len(runs) == 2 and all("1 in mxfp8 [scratch" in r["describe"] for r in runs)
    assert not any("--layer-formats" in r["describe"] for r in doc["runs"] if r["recipe"] != "bf16-mixed+layers")
    assert "preflight: bf16-mixed+layers [native]: " in out
    assert doc["prediction"]["recipes"]["bf16-mixed+layers"].get("step_time_s"), doc["prediction"]["recipes"]
