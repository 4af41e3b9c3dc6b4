"""Issue 12: the user's own model, data and loss through train, bench and doctor (CLI and API)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT
from mixprec.errors import UsageError
from mixprec.train import fit
from mixprec.train.build import build_run
from mixprec.train.config import TrainConfig
from mixprec.train.loop import train

F = str(ROOT / "tests" / "userpkg" / "factories.py")
CNN, TRANSFORMER, TENSORS, DATASETS = f"{F}:cnn", f"{F}:transformer", f"{F}:digits_tensors", f"{F}:digits_datasets"
QUICK = ["--batch-size", "64", "--max-steps", "6", "--epochs", "1", "--log-every", "0", "--progress", "off",
         "--optimizer", "adamw", "--lr", "3e-3"]


def _one_line(code, err, match):
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert code == 2 and "Traceback" not in err and len(lines) == 1, err
    assert match in lines[0], lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("model", [CNN, TRANSFORMER])
@pytest.mark.parametrize("data", [TENSORS, DATASETS])
def test_user_models_and_data_train_from_the_cli(cli, tmp_path, model, data):
    m = tmp_path / "m.json"
    code, out, err = cli("train", "--model", model, "--dataset", data, "--precision", "bf16-mixed", *QUICK,
                         "--metrics-json", m)
    assert code == 0, err
    s = json.loads(m.read_text())["summary"]
    assert s["model"] == model and s["dataset"] == data and 0 <= s["test_accuracy"] <= 1


@pytest.mark.slow
def test_user_code_by_module_path(cli, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tests"))
    code, _, err = cli("train", "--model", "userpkg.factories:cnn", "--dataset", "userpkg.factories:digits_tensors",
                       *QUICK)
    assert code == 0, err


@pytest.mark.slow
def test_a_map_dataset_with_workers_gives_the_tensor_path_loss_curve():
    flags = dict(model=CNN, batch_size=64, epochs=2, max_steps=30, log_every=0, progress="off", lr=0.05)
    tensors = train(TrainConfig.from_flags(dataset=TENSORS, **flags))
    mapped = train(TrainConfig.from_flags(dataset=DATASETS, num_workers=2, **flags))
    a = [x for h in tensors.history for x in h["loss_curve"]]
    b = [x for h in mapped.history for x in h["loss_curve"]]
    assert len(a) == 30 and a == b
    assert tensors.summary["test_accuracy"] == mapped.summary["test_accuracy"]


@pytest.mark.slow
def test_dataloader_path_resumes_bit_identical(tmp_path):
    flags = dict(model=CNN, dataset=DATASETS, batch_size=64, epochs=2, log_every=0, progress="off", num_workers=2)
    full, part = tmp_path / "full", tmp_path / "part"
    train(TrainConfig.from_flags(out=str(full), **flags))
    train(TrainConfig.from_flags(out=str(part), max_steps=31, **flags))  # mid epoch 2 (23 steps per epoch)
    r = train(TrainConfig.from_flags(out=str(part), resume=str(part), **flags))
    a = torch.load(full / "last.pt", weights_only=True)["model"]
    b = torch.load(part / "last.pt", weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [h["steps"] for h in r.history] == [23, 23]


@pytest.mark.slow
def test_user_loss_by_reference(cli):
    code, _, err = cli("train", "--model", CNN, "--dataset", TENSORS, "--loss", f"{F}:smooth_l1", *QUICK)
    assert code == 0, err


# ----------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("flags, match", [
    (["--model", "no_such_module_xyz:f"], "cannot import 'no_such_module_xyz'"),
    (["--model", f"{F}:no_such_factory"], "has no attribute 'no_such_factory'"),
    (["--model", "/nowhere/model.py:f"], "no file"),
    (["--model", f"{F}:raises"], "raised ValueError: width must be even"),
    (["--model", f"{F}:not_a_module"], "not a torch.nn.Module"),
    (["--model", f"{F}:wrong_output"], "do not fit logits of shape (2, 1, 8, 3)"),
    (["--model", "resnet"], "unknown model"),
    (["--dataset", f"{F}:empty"], "split is empty"),
    (["--dataset", f"{F}:not_a_pair"], "return (train, test)"),
    (["--loss", f"{F}:not_scalar"], "scalar"),
    (["--loss", "mse"], "unknown --loss"),
    (["--model", "gpt"], "do not go together"),
    (["--dataset", "text", "--data-path", "/nowhere/corpus.txt"], "text corpus"),
    (["--num-workers", "-1"], "--num-workers"),
])
def test_bad_user_input_is_one_line(cli, flags, match):
    base = {"--model": CNN, "--dataset": TENSORS}
    for i in range(0, len(flags) - 1, 2):
        base.pop(flags[i], None)
    argv = [x for kv in base.items() for x in kv] + flags
    code, _, err = cli("train", *argv, *QUICK)
    _one_line(code, err, match)


def test_labels_beyond_the_models_classes_are_named(cli):
    code, _, err = cli("train", "--model", f"{F}:wrong_output", "--dataset", f"{F}:digits_tensors", *QUICK)
    _one_line(code, err, "do not fit logits of shape (2, 1, 8, 3)")


def test_non_utf8_text_names_the_file(cli, tmp_path):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9 ".encode("latin-1") * 100)
    code, _, err = cli("train", "--model", "gpt", "--dataset", "text", "--data-path", bad, "--block-size", "8",
                       *QUICK)
    _one_line(code, err, "not UTF-8")


@pytest.mark.slow
def test_user_files_are_not_written(cli, tmp_path):
    before = (ROOT / "tests" / "userpkg" / "factories.py").read_bytes()
    cli("train", "--model", CNN, "--dataset", TENSORS, *QUICK)
    assert (ROOT / "tests" / "userpkg" / "factories.py").read_bytes() == before


# ------------------------------------------------------------------------------------------------- the API


def test_fit_takes_a_module_instance_and_tensors():
    from userpkg.factories import UserCNN, digits_tensors

    model = UserCNN(1, 10)
    before = model.head.weight.detach().clone()
    r = fit(model, digits_tensors(), precision="bf16-mixed", max_steps=5, epochs=1, log_every=0, progress="off")
    assert r.summary["recipe"] == "bf16-mixed" and not torch.equal(before, model.head.weight.detach())


@pytest.mark.slow
def test_fit_takes_factories():
    from userpkg.factories import digits_datasets, transformer

    r = fit(transformer, digits_datasets, precision="fp32", max_steps=3, epochs=1, log_every=0, progress="off")
    assert r.history and r.summary["model"].endswith(":transformer")


def test_fit_uses_the_callables_it_is_handed_even_a_lambda():
    """fit trains in this process: a lambda or a notebook's function is used as handed, never imported again."""
    r = fit(lambda num_classes: torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, num_classes)), "digits",
            precision="fp32", max_steps=2, epochs=1, log_every=0, progress="off")
    assert r.history and r.summary["model"].endswith("<lambda>")


FIT_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
print("TOP-LEVEL RAN", flush=True)
import torch
from mixprec.train import fit

def make_opt(params, lr):
    return torch.optim.SGD(params, lr=lr)

r = fit("mlp", "digits", precision="fp32", optimizer=make_opt, max_steps=2, width=16, depth=1, log_every=0,
        progress="off")
print("OPTIMIZER", r.summary["optimizer"] if "optimizer" in r.summary else "", flush=True)
"""


@pytest.mark.slow
def test_fit_in_a_script_without_a_main_guard_runs_its_top_level_once(tmp_path):
    """A script without ``if __name__ == "__main__":`` passing its own optimizer factory: the top level (fit
    included) ran twice when fit re-imported the script by path to name the factory; from ``python -c`` (no file,
    as in a notebook) fit refused the factory."""
    code = FIT_SCRIPT.format(tests=str(ROOT / "tests"))
    script = tmp_path / "train_me.py"
    script.write_text(code)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for argv in ([sys.executable, str(script)], [sys.executable, "-c", code]):
        r = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        assert r.stdout.count("TOP-LEVEL RAN") == 1, r.stdout


@pytest.mark.slow
def test_bench_runs_user_code_in_its_workers(cli, tmp_path):
    code, out, err = cli("bench", "--model", TRANSFORMER, "--dataset", DATASETS, "--precisions", "fp32,bf16-mixed",
                         "--repeats", "1", "--batch-size", "64", "--max-steps", "6", "--warmup-steps", "1",
                         "--no-plots", "--no-plan", "--out", tmp_path / "b")
    assert code == 0, out + err
    doc = json.loads((tmp_path / "b" / "results.json").read_text())
    assert [r["status"] for r in doc["runs"]] == ["ok", "ok"]


@pytest.mark.slow
def test_compare_api_on_user_code(tmp_path):
    from mixprec.bench import compare

    c = compare(CNN, TENSORS, precisions=["fp32", "bf16-mixed"], repeats=1, out=str(tmp_path / "c"),
                batch_size=64, max_steps=6, warmup_steps=1, plots=False)
    assert c.exit_code == 0 and [r.recipe for r in c.rows] == ["fp32", "bf16-mixed"]
    assert "| fp32 |" in c.table() and (tmp_path / "c" / "results.json").exists()


@pytest.mark.slow
def test_doctor_cli_on_user_code(cli, tmp_path):
    code, out, err = cli("doctor", "--model", CNN, "--dataset", TENSORS, "--precision", "fp16-mixed", "--steps", "3",
                         "--no-plots", "--out", tmp_path / "d")
    assert code == 0, err
    assert (tmp_path / "d" / "doctor.json").exists()


@pytest.mark.slow
def test_doctor_api_on_a_user_transformer():
    from mixprec.doctor import diagnose
    from userpkg.factories import UserTransformer, digits_tensors

    (x, y), _ = digits_tensors()
    report = diagnose(UserTransformer(8, 10), (x[:32], y[:32]), torch.nn.functional.cross_entropy,
                      precision="bf16-mixed", steps=2)
    assert report.precision_map is not None and report.title["recipe"] == "bf16-mixed"


def test_build_run_offers_only_declared_arguments(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("import torch\nseen = {}\n"
                   "def make(num_classes, **kw):\n    seen.update(kw, num_classes=num_classes)\n"
                   "    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, num_classes))\n")
    run = build_run(TrainConfig.from_flags(model=f"{src}:make", dataset="digits"))
    import sys

    mod = next(m for n, m in sys.modules.items() if n.startswith("mixprec_user_") and hasattr(m, "seen")
               and m.__file__ == str(src))
    assert mod.seen["num_classes"] == 10 and mod.seen["input_shape"] == (1, 8, 8)
    assert {"vocab_size", "block_size"} <= set(mod.seen) and run.model is not None


USER_MODELS = """
import torch


def make_model(num_classes):
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, num_classes))


def make_data():
    from sklearn.datasets import load_digits
    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16
    y = torch.tensor(d.target)
    return (x[:256], y[:256]), (x[256:320], y[256:320])
"""


@pytest.mark.slow
def test_compare_runs_functions_from_a_module_on_the_callers_sys_path(tmp_path, monkeypatch):
    """``sys.path.insert(0, d); import user_models as um; compare(um.make_model, ...)``: every worker failed with
    "cannot import 'user_models'"; the workers now see the caller's sys.path."""
    from mixprec.bench import compare

    d = tmp_path / "mine"
    d.mkdir()
    (d / "user_models_for_compare.py").write_text(USER_MODELS)
    monkeypatch.syspath_prepend(str(d))
    import user_models_for_compare as um

    c = compare(um.make_model, um.make_data, precisions=["fp32"], repeats=1, out=str(tmp_path / "c"),
                batch_size=64, max_steps=2, warmup_steps=1, plots=False, predict=False)
    assert c.exit_code == 0 and [r["status"] for r in c.doc["runs"]] == ["ok"]


def test_compare_refuses_main_functions_before_any_run(tmp_path):
    """A function of a notebook cell or a script's top level (``__main__``) cannot be imported by a worker: one
    line naming the fix, and nothing is written."""
    from mixprec.bench import compare

    def make_model(num_classes):
        return torch.nn.Linear(64, num_classes)

    make_model.__module__, make_model.__qualname__ = "__main__", "make_model"
    with pytest.raises(UsageError, match=r"__main__.*move it to a module.*mixprec\.train\.fit") as e:
        compare(make_model, "digits", precisions=["fp32"], out=str(tmp_path / "c"))
    assert "\n" not in str(e.value) and not (tmp_path / "c").exists()
