"""Out of memory in a training step (mixprec.train.oom): one line naming the step, the phase, the recipe, the batch
size and what fits (the planner's largest batch, with --grad-accum keeping the effective batch), exit 3, the last
checkpoint intact — in forward, backward and the optimizer step, and under torchrun on every rank.

A CPU that runs out of memory is usually killed rather than raising, so the error is planted where PyTorch raises it
(tests/userpkg/oom.py: the model's forward, its backward, the optimizer's step)."""

import dataclasses
import os
import re
import signal
import socket
import subprocess
import sys
import threading

import pytest
import torch

import mixprec.planning.fits as planning_fits
import mixprec.train.oom as oom
from conftest import ROOT
from mixprec.planning.api import Planner
from mixprec.train.checkpoint import load_checkpoint
from mixprec.train.config import TrainConfig

PLANTED = ["--dataset", "digits", "--model", "tests/userpkg/oom.py:model", "--optimizer", "tests/userpkg/oom.py:sgd",
           "--batch-size", "64", "--epochs", "1", "--log-every", "0", "--progress", "off", "--checkpoint-every", "2"]


class _Run:
    """What oom's advice reads of a run."""

    def __init__(self, batch_size, grad_accum=1, world_size=1):
        self.config = TrainConfig.from_flags(batch_size=batch_size, grad_accum=grad_accum)
        self.world_size = world_size

        class _Recipe:
            name = "bf16-mixed"

        self.recipe = _Recipe()


@pytest.mark.parametrize("batch, accum, fits, expected", [
    (512, 1, 384, "at most batch 384 fits: --batch-size 256 --grad-accum 2 keeps the effective batch of 512"),
    (96, 1, 40, "at most batch 40 fits: --batch-size 32 --grad-accum 3 keeps the effective batch of 96"),
    (64, 2, 48, "at most batch 48 fits: --batch-size 32 --grad-accum 4 keeps the effective batch of 128"),
    (7, 1, 3, "at most batch 3 fits: --batch-size 1 --grad-accum 7 keeps the effective batch of 7"),
    (64, 1, 64, "batch 64 fits, so other allocations hold the memory (another process, fragmentation); try "
                "--batch-size 32 --grad-accum 2, which keeps the effective batch of 64"),
    (64, 1, 0, "not even one sample fits with bf16-mixed on this device"),
    (64, 1, "no answer within 5 s", "the planner could not say which batch fits (no answer within 5 s); lower "
                                    "--batch-size and raise --grad-accum by the same factor to keep the effective "
                                    "batch of 64"),
])
def test_what_fits_keeps_the_effective_batch(batch, accum, fits, expected):
    assert expected in oom._what_fits(_Run(batch, accum), fits)


def test_the_effective_batch_under_torchrun_counts_every_rank():
    assert "keeps the effective batch of 512 per rank (1024 in all)" in oom._what_fits(_Run(512, world_size=2), 300)


def test_a_planner_that_does_not_answer_in_time_is_not_waited_for(monkeypatch):
    release = threading.Event()
    monkeypatch.setattr(planning_fits, "_plan_largest", lambda run: release.wait(60) and 7)
    try:
        assert planning_fits.largest_batch(object(), budget_s=0.05) == "no answer within 0.05 s"
    finally:
        release.set()
    monkeypatch.setattr(planning_fits, "_plan_largest", lambda run: 1 / 0)
    assert planning_fits.largest_batch(object(), budget_s=5) == "ZeroDivisionError: division by zero"


@pytest.mark.slow
@pytest.mark.parametrize("phase, said", [("forward", "forward"), ("backward", "backward"),
                                         ("step", "optimizer step")])
def test_out_of_memory_in_a_step_is_one_line_exit_3_and_the_checkpoint_intact(cli, tmp_path, monkeypatch, phase,
                                                                                said):
    monkeypatch.setattr(planning_fits, "_target", _tight_target())
    monkeypatch.setenv("MIXPREC_TEST_OOM", f"{phase}:3")
    code, _, err = cli("train", *PLANTED, "--out", tmp_path / "run")
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert code == oom.EXIT_CODE == 3 and len(lines) == 1 and "Traceback" not in err, err
    m = re.fullmatch(r"mixprec train: error: step 3 \(epoch 0, batch 3\) ran out of memory in its (.+) with fp32 at "
                     r"--batch-size 64 on cpu \(.+\): the planner predicts that at most batch (\d+) fits: "
                     r"--batch-size (\d+) --grad-accum (\d+) keeps the effective batch of 64; the last checkpoint, "
                     r"(.+) \(step 2\), is intact", lines[0])
    assert m and m.group(1) == said, lines[0]
    fits, b, k = map(int, m.group(2, 3, 4))
    assert b <= fits < 64 and b * k == 64
    assert m.group(5) == str(tmp_path / "run" / "last.pt")
    ck = load_checkpoint(tmp_path / "run")  # intact: digest-checked, the step-2 state
    monkeypatch.delenv("MIXPREC_TEST_OOM")
    assert cli("train", *PLANTED, "--max-steps", "2", "--out", tmp_path / "two")[0] == 0
    two = load_checkpoint(tmp_path / "two")
    assert ck["global_step"] == two["global_step"] == 2
    assert all(torch.equal(ck["model"][n], two["model"][n]) for n in two["model"])


def _tight_target():
    """The run's target with a little less memory than the plan's peak at batch 64 (the planner then answers below
    64, as it would on a device that batch 64 does not fit)."""
    real = planning_fits._target

    def tight(device):
        t = real(device)
        config = TrainConfig.from_flags(dataset="digits", model="mlp", width=32, depth=1, batch_size=64)
        trace, _, _ = Planner(config=config, target=t).trace("fp32")
        return dataclasses.replace(t, memory_bytes=trace.peak_bytes - 4096)

    return tight


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("planted", ["backward:3", "forward:3:1"])
def test_every_rank_stops_with_exit_3_under_torchrun(tmp_path, planted):
    """Out of memory on every rank (the same step everywhere), or on rank 1 alone (rank 0 waits for it in a
    collective): each rank writes its line and exits 3 — none is killed by torchrun's SIGTERM, none hangs."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), "-m", "mixprec", "train", *PLANTED, "--strategy", "ddp",
           "--out", str(tmp_path / "run")]
    env = dict(os.environ, OMP_NUM_THREADS="1", MIXPREC_TEST_OOM=planted)
    p = subprocess.Popen(cmd, env=env, cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         start_new_session=True)
    try:
        text = p.communicate(timeout=240)[0]
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert re.findall(r"^\s+exitcode\s+: (-?\d+)", text, re.M) == ["3", "3"], text[-4000:]
    lines = re.findall(r"^mixprec train: error: (.*)$", text, re.M)
    assert len(lines) == 2 and "]: Traceback" not in text, text[-4000:]  # no rank's traceback, only torchrun's
    if planted == "backward:3":
        assert sorted(re.search(r"on rank (\d) of 2", ln).group(1) for ln in lines) == ["0", "1"]
    else:
        own = next(ln for ln in lines if ln.startswith("step 3"))
        assert "ran out of memory in its forward" in own and "on rank 1 of 2" in own
        assert f"rank 0 of 2 stopped with rank 1: {own}" in lines
    assert all("keeps the effective batch of 64 per rank (128 in all)" in ln for ln in lines)
    assert load_checkpoint(tmp_path / "run")["global_step"] == 2
