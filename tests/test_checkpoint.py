"""Checkpoints: atomic, validated on load, and resume that is bit-identical to an uninterrupted run."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT
from mixprec.errors import CheckpointError, OutputError
from mixprec.train.checkpoint import load_checkpoint, save_checkpoint
from mixprec.train.config import TrainConfig
from mixprec.train.loop import train
from mixprec.train.resume import check_resume

FIXTURE = Path(__file__).parent / "fixtures" / "main_d16a38d_bf16_digits_mlp.pt"  # written by an older mixprec
BASE = dict(dataset="digits", model="mlp", width=32, depth=1, batch_size=32, log_every=0, progress="off",
            optimizer="sgd", momentum=0.9, lr=0.05)


def _params(path):
    return torch.load(path, weights_only=True)["model"]


def _assert_identical(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "fp16-mixed", "bf16-master"])
def test_resume_mid_epoch_is_bit_identical(tmp_path, precision):
    full, part = tmp_path / "full", tmp_path / "part"
    train(TrainConfig.from_flags(**BASE, precision=precision, epochs=2, out=str(full)))
    # stop after 50 steps (mid-epoch 2 of 45 steps/epoch), then resume to the end
    train(TrainConfig.from_flags(**BASE, precision=precision, epochs=2, out=str(part), max_steps=50))
    ck = load_checkpoint(part)
    assert (ck["epoch"], ck["batch"], ck["global_step"]) == (1, 5, 50)
    train(TrainConfig.from_flags(**BASE, precision=precision, epochs=2, out=str(part), resume=str(part)))
    _assert_identical(_params(full / "last.pt"), _params(part / "last.pt"))
    a, b = torch.load(full / "last.pt", weights_only=True), torch.load(part / "last.pt", weights_only=True)
    assert a["recipe"]["scaler"] == b["recipe"]["scaler"]


@pytest.mark.slow
def test_killed_run_resumes_bit_identically(tmp_path):
    """SIGKILL a real training process after its first checkpoint, resume from the run itself (`--resume DIR`,
    no other flag), compare with an uninterrupted run."""
    args = ["train", "--dataset", "synthetic", "--synthetic-train", "16384", "--synthetic-shape", "64",
            "--model", "mlp", "--width", "64", "--depth", "1", "--batch-size", "16", "--epochs", "2",
            "--momentum", "0.9", "--log-every", "0", "--checkpoint-every", "50", "--progress", "off"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    full, killed = tmp_path / "full", tmp_path / "killed"
    r = subprocess.run([sys.executable, "-m", "mixprec", *args, "--out", str(full)], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    total = torch.load(full / "last.pt", weights_only=True)["global_step"]
    p = subprocess.Popen([sys.executable, "-m", "mixprec", *args, "--out", str(killed)], env=env, cwd=ROOT,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not (killed / "last.pt").exists() and time.time() < deadline and p.poll() is None:
        time.sleep(0.01)
    time.sleep(0.3)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert p.returncode == -signal.SIGKILL, "the run finished before it could be killed; make it longer"
    ck = load_checkpoint(killed)
    assert 0 < ck["global_step"] < total
    leftovers = [f for f in os.listdir(killed) if f not in ("last.pt", ".mixprec.lock")]  # the lock: stale now
    assert not [f for f in leftovers if not f.endswith(".tmp")]  # only last.pt (a killed write may leave a .tmp)
    r = subprocess.run([sys.executable, "-m", "mixprec", "train", "--resume", str(killed)],
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert os.listdir(killed) == ["last.pt"]  # the killed run's lock taken over and released, temporaries cleaned
    _assert_identical(_params(full / "last.pt"), _params(killed / "last.pt"))


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"),
                                   RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 64")])
def test_atomic_save_never_leaves_half_a_file(tmp_path, monkeypatch, error):
    path = tmp_path / "last.pt"
    save_checkpoint(path, {"x": torch.ones(3)})
    good = path.read_bytes()

    def boom(*a, **k):
        raise error

    monkeypatch.setattr(torch, "save", boom)
    with pytest.raises(OutputError, match="could not write the checkpoint .*last.pt.*intact"):
        save_checkpoint(path, {"x": torch.zeros(3)})
    assert path.read_bytes() == good
    assert os.listdir(tmp_path) == ["last.pt"]


def test_foreign_corrupt_and_mismatched_checkpoints_are_refused(tmp_path):
    foreign = tmp_path / "foreign.pt"
    torch.save({"state_dict": {}}, foreign)
    with pytest.raises(CheckpointError, match="not a mixprec checkpoint"):
        load_checkpoint(foreign)
    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(b"PK\x03\x04garbage")
    with pytest.raises(CheckpointError, match="not a readable checkpoint"):
        load_checkpoint(corrupt)
    stored = TrainConfig.from_dict(torch.load(FIXTURE, weights_only=True)["config"])
    with pytest.raises(CheckpointError, match="--model 'mlp' in the checkpoint vs 'cnn' now"):
        check_resume(stored.with_flags(model="cnn", resume=str(FIXTURE)))
    check_resume(stored.with_flags(resume=str(FIXTURE)))  # the same run: no error


def test_pickled_code_is_refused(tmp_path):
    evil = tmp_path / "evil.pt"
    torch.save({"format": "mixprec-checkpoint", "obj": TrainConfig()}, evil)
    with pytest.raises(CheckpointError, match="not a readable checkpoint"):
        load_checkpoint(evil)


def test_bad_resume_exits_2_and_leaves_the_run_untouched(cli, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    shutil.copy(FIXTURE, out / "last.pt")
    before = (out / "last.pt").read_bytes()
    code, _, err = cli("train", "--dataset", "digits", "--precision", "fp32", "--resume", out)
    assert code == 2 and "--precision 'bf16-mixed' in the checkpoint vs 'fp32' now" in err
    assert (out / "last.pt").read_bytes() == before


# ---------------------------------------------------------------------- refusals that say what is wrong

V1_FIXTURE = Path(__file__).parent / "fixtures" / "main_9dc6817_fp16_digits_mlp_v1.pt"  # a real version-1 file


def _copy(src: Path, folder: Path) -> Path:
    folder.mkdir()
    shutil.copy(src, folder / "last.pt")
    return folder


def test_a_checkpoint_whose_weights_do_not_fit_names_each_tensor_and_both_shapes(tmp_path):
    """The refusal used to end in torch's "Error(s) in loading state_dict for MLP:", the reasons cut off."""
    from mixprec.train.resume import resume_config

    ck = torch.load(FIXTURE, weights_only=True)
    ck["model"]["head.weight"] = torch.zeros(10, 9)  # the digest is recomputed: a file edited, then re-saved
    ck["model"]["extra.bias"] = torch.zeros(3)
    out = tmp_path / "run"
    save_checkpoint(out / "last.pt", {k: v for k, v in ck.items() if k not in ("format", "version", "digest")})
    before = (out / "last.pt").read_bytes()
    with pytest.raises(CheckpointError) as e:
        train(resume_config({"resume": str(out), "out": str(out)}))
    msg = str(e.value)
    assert "checkpoint does not fit this model: head.weight is [10, 9] in the checkpoint, [10, 8] in this model" in msg
    assert "the checkpoint's extra.bias is not in this model" in msg and "\n" not in msg
    assert "Error(s) in loading state_dict" not in msg
    assert (out / "last.pt").read_bytes() == before


def test_version_1_checkpoints_are_refused_with_the_fix(cli, tmp_path):
    """Version 1 carried no digest, so a file edited and re-tagged as version 1 slipped past the integrity
    check. Decision: version-1 files are refused (the fix: finish the run with the mixprec that wrote it,
    or start a new one); tests/fixtures holds a real one, written by main at 9dc6817."""
    run = _copy(V1_FIXTURE, tmp_path / "v1")
    before = (run / "last.pt").read_bytes()
    assert torch.load(run / "last.pt", weights_only=True)["version"] == 1 and b"digest" not in before
    code, out, err = cli("train", "--resume", run)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert "is a version-1 checkpoint, which carries no integrity digest" in lines[0]
    assert "finish that run with the mixprec that wrote it, or start a new run" in lines[0]
    assert "epoch" not in out and (run / "last.pt").read_bytes() == before

    edited = torch.load(FIXTURE, weights_only=True)  # the attack: change a weight, re-tag as version 1
    edited["model"]["head.bias"] += 1.0
    edited["version"] = 1
    torch.save(edited, tmp_path / "retagged.pt")
    with pytest.raises(CheckpointError, match="is a version-1 checkpoint, which carries no integrity digest"):
        load_checkpoint(tmp_path / "retagged.pt")
    edited["version"] = 2  # the same edit without a digest at all
    del edited["digest"]
    torch.save(edited, tmp_path / "nodigest.pt")
    with pytest.raises(CheckpointError, match="carries no integrity digest"):
        load_checkpoint(tmp_path / "nodigest.pt")


@pytest.mark.slow
def test_a_stop_at_an_epochs_first_step_ends_the_run_there(tmp_path):
    """fp32 at --lr 1e6: the loss of step 4 (epoch 1, batch 0) is not finite. The run stops there and keeps the
    position; it used to go on with the next epochs (each failing at its first step) and save epoch 3's."""
    out = tmp_path / "out"
    result = train(TrainConfig.from_flags(dataset="synthetic", synthetic_train=512, synthetic_test=64,
                                          synthetic_shape=(1, 8, 8), model="mlp", width=32, depth=1, epochs=4,
                                          batch_size=128, lr=1e6, log_every=0, progress="off", out=str(out)))
    assert result.stopped and "(epoch 1, batch 0)" in result.stopped
    assert len(result.history) == 1
    ck = load_checkpoint(out)
    assert (ck["epoch"], ck["batch"], ck["global_step"]) == (1, 0, 4)
