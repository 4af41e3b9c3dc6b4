"""Issue 11 — nothing lost, nothing silent: `mixprec train` against careless and unlucky users.

Every CLI case asserts the exit code, a one-line message, no traceback, and that files the user had are unchanged.
"""

import hashlib
import json
import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import mixprec.train.loop as loop_mod
from conftest import run_cli_subprocess
from mixprec.errors import CheckpointError, RecipeError
from mixprec.precision import build_recipe
from mixprec.train.checkpoint import load_checkpoint, save_checkpoint
from mixprec.train.config import TrainConfig
from mixprec.train.loop import train
from mixprec.train.resume import resume_config

TINY = ["--dataset", "digits", "--model", "mlp", "--width", "32", "--depth", "1", "--batch-size", "256",
        "--log-every", "0", "--progress", "off"]  # 6 steps per epoch
FLAGS = dict(dataset="digits", model="mlp", width=32, depth=1, batch_size=256, log_every=0, progress="off")
FIXTURE = Path(__file__).parent / "fixtures" / "main_d16a38d_bf16_digits_mlp.pt"


def _digest(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def _one_line_error(code, err, expect_code=2, match=""):
    assert code == expect_code, err
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert "Traceback" not in err and len(lines) == 1, err
    assert match in lines[0], lines[0]


def _params(path):
    return torch.load(os.path.join(path, "last.pt"), weights_only=True)["model"]


# ------------------------------------------------------------------------------------------ data loss


@pytest.mark.slow
def test_a_crash_during_the_end_of_epoch_evaluation_resumes_into_that_evaluation(tmp_path, monkeypatch):
    full, part = tmp_path / "full", tmp_path / "part"
    ref = train(TrainConfig.from_flags(**FLAGS, epochs=2, out=str(full)))

    def killed(*a, **k):
        raise KeyboardInterrupt  # what SIGINT/SIGTERM/SIGKILL leave: the checkpoint of the last step, no eval

    with monkeypatch.context() as m:
        m.setattr(loop_mod, "evaluate", killed)
        with pytest.raises(KeyboardInterrupt):
            train(TrainConfig.from_flags(**FLAGS, epochs=2, out=str(part), checkpoint_every=6))
    ck = load_checkpoint(part)
    assert (ck["epoch"], ck["batch"], ck["global_step"]) == (0, 6, 6) and ck["partial"]["n_steps"] == 6
    resumed = train(TrainConfig.from_flags(**FLAGS, epochs=2, out=str(part), checkpoint_every=6, resume=str(part)))
    assert [h["epoch"] for h in resumed.history] == [0, 1]  # the lost evaluation was redone, then epoch 1 ran
    assert [h["steps"] for h in resumed.history] == [6, 6]
    for a, b in zip(ref.history, resumed.history):
        assert a["train_loss"] == b["train_loss"] and a["test_accuracy"] == b["test_accuracy"]
    for k, v in _params(full).items():
        assert torch.equal(v, _params(part)[k]), k


@pytest.mark.slow
def test_mid_epoch_resume_reports_the_whole_epoch(tmp_path):
    ref = train(TrainConfig.from_flags(**FLAGS, epochs=1))
    out = tmp_path / "o"
    train(TrainConfig.from_flags(**FLAGS, epochs=1, out=str(out), max_steps=4))
    resumed = train(TrainConfig.from_flags(**FLAGS, epochs=1, out=str(out), resume=str(out), overwrite=False))
    rec = resumed.history[-1]
    assert rec["steps"] == 6 and rec["loss_curve"] == ref.history[0]["loss_curve"]
    assert rec["train_loss"] == ref.history[0]["train_loss"]


@pytest.mark.parametrize("flags, match", [
    (["--resume", ""], "--resume is empty"),
    (["--out", ""], "--out is empty"),
    (["--metrics-json", ""], "--metrics-json is empty"),
])
def test_empty_paths_are_refused(cli, tmp_path, monkeypatch, flags, match):
    monkeypatch.chdir(tmp_path)
    code, _, err = cli("train", *TINY, "--epochs", "1", *flags)
    _one_line_error(code, err, match=match)
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_out_holding_another_runs_checkpoint_needs_resume_or_overwrite(cli, tmp_path):
    out = tmp_path / "o"
    assert cli("train", *TINY, "--epochs", "1", "--out", out)[0] == 0
    before = _digest(out / "last.pt")
    code, _, err = cli("train", *TINY, "--epochs", "1", "--seed", "1", "--out", out)
    _one_line_error(code, err, match="already holds a checkpoint")
    assert _digest(out / "last.pt") == before
    assert cli("train", *TINY, "--epochs", "2", "--out", out, "--resume", out)[0] == 0
    assert cli("train", *TINY, "--epochs", "1", "--seed", "1", "--out", out, "--overwrite")[0] == 0


@pytest.mark.slow
@pytest.mark.parametrize("target", ["checkpoint", "folder"])
def test_metrics_json_cannot_destroy_the_checkpoint_or_be_a_folder(cli, tmp_path, target):
    out = tmp_path / "o"
    assert cli("train", *TINY, "--epochs", "1", "--out", out)[0] == 0
    before = _digest(out / "last.pt")
    path = out / "last.pt" if target == "checkpoint" else out
    code, _, err = cli("train", *TINY, "--epochs", "2", "--out", out, "--resume", out, "--metrics-json", path)
    _one_line_error(code, err, match="--metrics-json")
    assert _digest(out / "last.pt") == before


@pytest.mark.parametrize("make", ["file_as_folder", "below_a_file", "read_only_filesystem"])
def test_unwritable_outputs_are_refused_before_the_first_step(cli, tmp_path, make, monkeypatch, mount_tmpfs):
    blocker = tmp_path / "f"
    blocker.write_text("mine")
    if make == "file_as_folder":
        flags = ["--out", blocker]
    elif make == "below_a_file":
        flags = ["--metrics-json", blocker / "m.json"]
    else:  # a real read-only filesystem (EROFS even for root); read-only folders: tests/test_permissions.py
        flags = ["--out", mount_tmpfs("ro,size=64k") / "run"]
    steps = []
    monkeypatch.setattr(loop_mod, "accumulate_step", lambda *a, **k: steps.append(1))
    code, _, err = cli("train", *TINY, "--epochs", "1", *flags)
    _one_line_error(code, err, match="Read-only file system" if make == "read_only_filesystem" else "--")
    assert steps == [] and blocker.read_text() == "mine"


@pytest.mark.slow
def test_nonfinite_weights_are_never_saved_and_never_exit_0(cli, tmp_path):
    out = tmp_path / "o"
    code, out_text, err = cli("train", *TINY, "--precision", "fp16-master", "--lr", "1e38", "--epochs", "2",
                              "--out", out)
    assert code == 1 and "non-finite" in err and "Traceback" not in err
    if (out / "last.pt").exists():
        assert all(torch.isfinite(v).all() for v in _params(out).values() if v.is_floating_point())


@pytest.mark.slow
def test_a_stop_before_the_first_save_does_not_promise_a_checkpoint(cli, tmp_path):
    """--weight-decay 3e38 --lr 100 makes the weights non-finite at step 1, before anything was saved: the
    message used to say OUT/last.pt "keeps the last finite state saved before", a file that is not there."""
    out = tmp_path / "o"
    bad = ["--weight-decay", "3e38", "--lr", "100", "--epochs", "1"]
    code, _, err = cli("train", *TINY, *bad, "--out", out)
    _one_line_error(code, err, expect_code=1, match="non-finite loss at step 1")
    assert "no state of this run is on disk (none had been saved yet)" in err
    assert "keeps the last finite state" not in err and "was left as it was" not in err
    assert not (out / "last.pt").exists()

    shutil.copy(FIXTURE, out / "last.pt")  # an earlier run's checkpoint that --overwrite was to replace
    code, _, err = cli("train", *TINY, *bad, "--out", out, "--overwrite")
    _one_line_error(code, err, expect_code=1, match="no state of this run is on disk")
    assert f"{out}/last.pt is still the earlier run's file that --overwrite was to replace" in err
    assert _digest(out / "last.pt") == _digest(FIXTURE)


@pytest.mark.slow
def test_a_run_that_skips_nearly_every_step_fails_and_keeps_its_state(cli, tmp_path):
    out = tmp_path / "o"
    code, _, err = cli("train", *TINY, "--precision", "fp16-mixed", "--lr", "1e30", "--epochs", "2", "--out", out)
    assert code == 1 and "were skipped" in err and "Traceback" not in err
    assert (out / "last.pt").exists()


@pytest.mark.slow
def test_stopping_on_consecutive_skips_writes_last_pt(cli, tmp_path):
    out = tmp_path / "o"
    code, _, err = cli("train", *TINY, "--precision", "fp16-mixed", "--lr", "1e30", "--epochs", "2",
                       "--max-consecutive-skips", "3", "--out", out)
    assert code == 1 and "in a row were skipped" in err
    ck = load_checkpoint(out)
    assert ck["global_step"] == 4 and ck["counters"]["consecutive_skips"] == 3


# ------------------------------------------------------------------------------- tracebacks → one line


@pytest.mark.parametrize("flags, match", [
    (["--lr", "1e39"], "--lr"),
    (["--seed", str(10**24)], "--seed"),
    (["--width", "100000000"], "does not fit in memory"),
    (["--momentum", "nan"], "--momentum"),
    (["--weight-decay", "nan"], "--weight-decay"),
    (["--precision", "bf16-mixed", "--init-scale", "1024"], "loss scaler"),
    (["--growth-interval", "0", "--precision", "amp"], "--growth-interval"),
])
def test_bad_values_are_one_line_errors(cli, flags, match):
    code, _, err = cli("train", *TINY, "--epochs", "1", *flags)
    _one_line_error(code, err, match=match)


def test_build_recipe_none_is_a_usage_error():
    with pytest.raises(RecipeError, match="recipe name"):
        build_recipe(None)


def _good_checkpoint(tmp_path):
    """A copy of a real checkpoint (written by an older mixprec: tests/fixtures) and its contents."""
    out = tmp_path / "o"
    out.mkdir()
    shutil.copy(FIXTURE, out / "last.pt")
    return out, torch.load(out / "last.pt", weights_only=True)


@pytest.mark.parametrize("field, value", [
    ("epoch", "0"), ("batch", -1), ("global_step", 1.5), ("model", [1, 2]), ("optimizer", {"state": []}),
    ("recipe", "fp32"), ("rng", {"torch": torch.zeros(3)}), ("config", None), ("history", {}),
    ("counters", {"skipped_total": "x"}),
])
def test_hand_edited_checkpoints_name_the_bad_field(tmp_path, field, value):
    out, ck = _good_checkpoint(tmp_path)
    ck[field] = value
    ck.pop("digest")
    save_checkpoint(out / "last.pt", {k: v for k, v in ck.items() if k not in ("format", "version")})
    with pytest.raises(CheckpointError, match=repr(field)):
        load_checkpoint(out)


def test_a_flipped_bit_in_a_weight_fails_the_digest(tmp_path):
    out, ck = _good_checkpoint(tmp_path)
    w = next(iter(ck["model"].values()))
    w.view(torch.int32).view(-1)[0] ^= 1
    torch.save(ck, out / "last.pt")
    with pytest.raises(CheckpointError, match="integrity"):
        load_checkpoint(out)


@pytest.mark.parametrize("content, match", [
    (b"", "is empty (0 bytes), not a mixprec checkpoint"),
    (b"\x00" * 10, "neither a zip archive (what torch.save writes) nor a pickle (it starts with bytes 00 00 00 00)"),
    (bytes(np.random.default_rng(21).integers(0, 256, 4096, dtype=np.uint8)), "neither a zip archive"),
    (b"PK\x03\x04garbage", "not a readable checkpoint (a zip archive)"),
])
def test_empty_and_garbage_last_pt(cli, tmp_path, content, match):
    """Random bytes are called what they are, never "pickled Python objects" (torch's weights-only unpickler
    says weights_only about anything that is not a zip); a damaged zip is named as one."""
    (tmp_path / "last.pt").write_bytes(content)
    code, _, err = cli("train", *TINY, "--epochs", "1", "--resume", tmp_path)
    _one_line_error(code, err, match=match)
    assert (tmp_path / "last.pt").read_bytes() == content


def test_a_malicious_pickle_is_refused_without_inviting_weights_only_false(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    torch.save({"format": "mixprec-checkpoint", "evil": Evil()}, tmp_path / "last.pt")
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tmp_path)
    assert "pickled Python objects" in str(e.value) and "weights_only=False" not in str(e.value)
    pickle.dump({"format": "mixprec-checkpoint", "evil": Evil()}, (tmp_path / "last.pt").open("wb"))  # bare pickle
    with pytest.raises(CheckpointError, match="not a readable checkpoint \\(a pickle\\): it holds pickled Python"):
        load_checkpoint(tmp_path)


def test_resume_position_past_the_end_of_an_epoch_is_refused(tmp_path):
    out, ck = _good_checkpoint(tmp_path)
    ck["batch"] = 99
    ck.pop("digest")
    save_checkpoint(out / "last.pt", {k: v for k, v in ck.items() if k not in ("format", "version")})
    with pytest.raises(CheckpointError, match="past the end"):
        train(resume_config({"resume": str(out), "out": str(out)}))


@pytest.mark.parametrize("flags, match", [(["--lr", "0.5"], "--lr"), (["--amp-impl", "scratch"], "--amp-impl"),
                                          (["--momentum", "0.9"], "--momentum")])
@pytest.mark.slow
def test_resume_refuses_changed_numerics_and_names_them(cli, tmp_path, flags, match):
    out = tmp_path / "o"
    assert cli("train", *TINY, "--epochs", "1", "--out", out)[0] == 0
    before = _digest(out / "last.pt")
    code, _, err = cli("train", *TINY, "--epochs", "2", "--out", out, "--resume", out, *flags)
    _one_line_error(code, err, match=match)
    assert _digest(out / "last.pt") == before


@pytest.mark.slow
def test_stale_temporaries_of_killed_saves_are_cleaned(tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / ".last.pt.abc123.tmp").write_bytes(b"half")
    (out / "mine.txt").write_text("keep")
    train(TrainConfig.from_flags(**FLAGS, epochs=1, out=str(out)))
    assert sorted(os.listdir(out)) == ["last.pt", "mine.txt"]


@pytest.mark.slow
def test_bf16_mixed_nonfinite_advice_does_not_recommend_itself(cli):
    code, _, err = cli("train", *TINY, "--precision", "bf16-mixed", "--lr", "1e38", "--epochs", "2")
    assert code == 1 and "Traceback" not in err
    assert "try bf16-mixed" not in err and "--precision bf16-mixed" not in err


@pytest.mark.slow
def test_metrics_json_write_failure_is_one_line(cli, tmp_path, monkeypatch):
    import mixprec.jsonio as jsonio

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(jsonio.tempfile, "mkstemp", full)
    code, _, err = cli("train", *TINY, "--epochs", "1", "--metrics-json", tmp_path / "m.json")
    _one_line_error(code, err, expect_code=1, match="No space left")


@pytest.mark.slow
def test_train_py_shim_gets_the_same_errors(tmp_path):
    r = run_cli_subprocess("train", *TINY, "--epochs", "1", "--resume", "")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "--resume is empty" in r.stderr
    assert json.dumps  # the shim is exercised in test_train_cli; this guards the subprocess path


def test_keep_fp32_naming_a_missing_module_is_one_line(cli):
    code, _, err = cli("train", *TINY, "--epochs", "1", "--amp-impl", "scratch", "--precision", "bf16-mixed",
                       "--keep-fp32", "nosuch")
    _one_line_error(code, err, match="--keep-fp32")


def test_autocast_refuses_unknown_devices_and_unpaired_exit():
    from mixprec.autocast import autocast

    with pytest.raises(ValueError, match="tpu"):
        autocast(torch.bfloat16, device_type="tpu")
    with pytest.raises(RuntimeError, match="without a matching __enter__"):
        autocast(torch.bfloat16, device_type="cpu").__exit__(None, None, None)


def test_diagnose_on_cuda_without_cuda_is_a_usage_error():
    from mixprec.doctor import diagnose
    from mixprec.errors import UsageError

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(UsageError, match="CUDA"):
        diagnose(torch.nn.Linear(4, 2), (torch.randn(8, 4), torch.randint(0, 2, (8,))), torch.nn.functional.cross_entropy,
                 device="cuda")


def test_each_log_line_is_one_write_so_ranks_cannot_split_it():
    """Under torchrun the ranks share one terminal; rank 1's stop line once landed between rank 0's epoch line and
    its newline (``print`` writes them separately when unbuffered)."""
    from mixprec.train.report import Reporter

    class Writes:
        def __init__(self):
            self.calls = []

        def write(self, s):
            self.calls.append(s)

        def flush(self):
            pass

    stream = Writes()
    reporter = Reporter(progress="off", stream=stream)
    reporter.log("epoch 0: train loss 2.3141")
    reporter.log("epoch 1: train loss 2.1")
    assert stream.calls == ["epoch 0: train loss 2.3141\n", "epoch 1: train loss 2.1\n"]
