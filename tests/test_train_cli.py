"""End-to-end runs of `mixprec train` / `python train.py` on small real (digits) and synthetic data."""

import json
import re

import pytest
import torch

from conftest import FASHION_DIR, ROOT, run_cli_subprocess
from mixprec.precision import RECIPES

TINY = ["--dataset", "digits", "--model", "mlp", "--width", "32", "--depth", "1", "--batch-size", "32",
        "--max-steps", "12", "--log-every", "4"]
LOG_LINE = re.compile(r"^Epoch: \d+, Batch: \d+, Loss: \d+\.\d{4}$")


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["native", "scratch"])
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_every_recipe_trains_end_to_end(cli, tmp_path, recipe, impl):
    m = tmp_path / "m.json"
    code, out, err = cli("train", "--precision", recipe, "--amp-impl", impl, *TINY, "--metrics-json", m)
    assert code == 0, err
    logs = [ln for ln in out.splitlines() if ln.startswith("Epoch:")]
    assert logs and all(LOG_LINE.match(ln) for ln in logs)
    assert f"| {recipe} |" in out
    d = json.loads(m.read_text())
    s = d["summary"]
    assert s["recipe"] == recipe and s["impl"] == impl
    assert 0.0 <= s["test_accuracy"] <= 1.0 and s["peak_memory_bytes"] > 0
    assert {"config", "environment", "epochs", "summary", "recipe"} <= set(d)
    assert d["environment"]["torch"] == torch.__version__
    ep = d["epochs"][0]
    assert {"train_loss", "test_accuracy", "epoch_time_s", "memory", "loss_curve", "skipped_steps"} <= set(ep)
    assert len(ep["loss_curve"]) == ep["steps"] == 12


@pytest.mark.slow
def test_tutorial_log_line_every_100_batches_by_default(cli):
    code, out, _ = cli("train", "--dataset", "synthetic", "--synthetic-train", "6464", "--synthetic-test", "64",
                       "--epochs", "1", "--progress", "off")
    assert code == 0
    logs = [ln for ln in out.splitlines() if ln.startswith("Epoch:")]
    assert [ln.split(",")[1].strip() for ln in logs] == [f"Batch: {b}" for b in range(0, 101, 100)]
    assert all(LOG_LINE.match(ln) for ln in logs)


@pytest.mark.slow
def test_summary_table_has_tutorial_columns(cli):
    code, out, _ = cli("train", *TINY)
    assert code == 0
    assert "| recipe | peak memory | avg epoch time | test accuracy | skipped steps | final loss scale |" in out


@pytest.mark.slow
def test_piped_output_has_no_progress_bar(tmp_path):
    r = run_cli_subprocess("train", *TINY)
    assert r.returncode == 0, r.stderr
    assert "\x1b[" not in r.stdout and "training" not in r.stdout


@pytest.mark.parametrize("args,needle", [
    (["--precision", "fp64"], "unknown precision 'fp64'"),
    (["--model", "resnet"], "unknown model 'resnet'"),
    (["--dataset", "cifar"], "unknown dataset"),
    (["--dataset", "fashion-mnist", "--data-dir", "/nonexistent"], "apt-get install dataset-fashion-mnist"),
    (["--lr", "-1"], "--lr"),
    (["--checkpoint-every", "5"], "--out"),
    (["--precision", "bf16-mixed", "--stochastic-rounding"], "--stochastic-rounding"),
    (["--model", "transformer", "--d-model", "30", "--n-heads", "4"], "--n-heads"),
    (["--resume", "/nonexistent/dir"], "no checkpoint found"),
])
def test_bad_input_exits_2_with_a_helpful_message(cli, args, needle):
    code, _, err = cli("train", "--dataset", "digits", "--max-steps", "1", *args)
    assert code == 2
    assert needle in err and "Traceback" not in err


def test_cuda_requested_without_cuda_exits_2(cli):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    code, _, err = cli("train", "--device", "cuda", *TINY)
    assert code == 2 and "--device cpu" in err


@pytest.mark.slow
def test_bad_input_in_a_fresh_process_prints_no_traceback():
    r = run_cli_subprocess("train", "--precision", "fp12")
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and "fp16-mixed" in r.stderr


@pytest.mark.slow
def test_root_train_py_shim_runs_like_the_tutorial():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "train.py", "--precision", "fp32", *TINY], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert any(LOG_LINE.match(ln) for ln in r.stdout.splitlines())


@pytest.mark.slow
def test_nonfinite_loss_without_scaler_stops_and_saves_last_good_state(cli, tmp_path):
    code, out, err = cli("train", "--precision", "bf16-mixed", "--dataset", "digits", "--model", "mlp",
                         "--lr", "1e18", "--epochs", "3", "--out", tmp_path, "--log-every", "0")
    assert code == 1
    m = re.search(r"non-finite loss at step (\d+)", err)
    assert m, err
    assert "--lr" in err and "doctor" in err
    ck = torch.load(tmp_path / "last.pt", weights_only=True)
    assert ck["global_step"] <= int(m.group(1))
    assert all(torch.isfinite(v).all() for v in ck["model"].values())


@pytest.mark.slow
@pytest.mark.skipif(not (FASHION_DIR / "train-images-idx3-ubyte.gz").exists(),
                    reason="Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)")
def test_tutorial_amp_run_on_fashion_mnist_reaches_80_percent(tmp_path):
    """The issue's acceptance run: `python train.py --precision amp`, 5 epochs of SimpleNet."""
    import subprocess
    import sys

    m = tmp_path / "m.json"
    r = subprocess.run([sys.executable, "train.py", "--precision", "amp", "--metrics-json", str(m)], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    s = json.loads(m.read_text())["summary"]
    assert s["epochs"] == 5 and s["test_accuracy"] >= 0.80, s
