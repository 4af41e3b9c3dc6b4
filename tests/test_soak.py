"""The soak: a 400-step run SIGKILLed at ten moments drawn from a seeded schedule -- mid-step (in the forward, or
between backward and update), mid-save (half the checkpoint written, or written but not renamed) and
mid-evaluation -- and resumed with ``--resume DIR`` after each kill, ends bit-identical to the same run never
interrupted: weights, optimizer state, loss scaler and master weights, RNG, counters and every epoch's losses.
For fp32, fp16-mixed and bf16-master in one process, and for 2-process DDP (three kills).

The kills come from the test side (tests/killpoints.py: a fork server whose children stop at the kill point and
wait for the SIGKILL); the seed of the schedule is in each test's name, so a failure reruns exactly. The run is
a tiny MLP on synthetic data with a checkpoint every 25 steps and an evaluation every 100.
"""

import os
import random
import socket

import pytest
import torch

import killpoints
from mixprec.train.checkpoint import load_checkpoint

pytestmark = pytest.mark.slow

SEED = 2113
"""The kill schedule's seed (in every test id): change it to soak other moments."""

STEPS_PER_EPOCH, EPOCHS = 100, 4
RUN = ["train", "--dataset", "synthetic", "--synthetic-shape", "16", "--synthetic-test", "64", "--model", "mlp",
       "--width", "16", "--depth", "1", "--batch-size", "8", "--epochs", EPOCHS, "--momentum", "0.9", "--lr", "0.05",
       "--checkpoint-every", "25", "--log-every", "0", "--progress", "off"]
TIMEOUT = 120


def _schedule(seed: int, kills: int) -> list[tuple[str, int]]:
    """``kills`` (phase, global step) pairs, steps increasing, every phase present when there are enough kills."""
    rng = random.Random(seed)
    phases = (list(killpoints.PHASES) * 2)[:kills] if kills >= len(killpoints.PHASES) else \
        rng.sample(killpoints.PHASES, kills)
    rng.shuffle(phases)
    steps = sorted(rng.sample(range(1, STEPS_PER_EPOCH * EPOCHS), kills))
    return list(zip(phases, steps))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _segment(args, log, world: int, kill=None, kill_rank=0):
    """One launch of the run: ``world`` processes (rank env as torchrun sets it); the kill point, if any, armed in
    ``kill_rank``. Returns (what the kill point reported or None, exit codes). On a port another process took
    in between (the log says so), the launch is retried."""
    for _ in range(3):
        port = str(_free_port())
        procs, conns = [], []
        for rank in range(world):
            env = {} if world == 1 else dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                                              LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
            p, c = killpoints.start(args, f"{log}.rank{rank}", env=env, kill=kill if rank == kill_rank else None)
            procs.append(p)
            conns.append(c)
        try:
            reached = killpoints.wait(procs, conns[kill_rank], TIMEOUT)
        finally:
            for p in procs:  # SIGKILL, at the kill point (or nothing left to kill)
                p.kill()
                p.join()
        codes = [p.exitcode for p in procs]
        text = "".join(open(f"{log}.rank{r}").read() for r in range(world))
        if reached is not None or "address already in use" not in text.lower():
            return reached, codes, text
    pytest.fail("no free port in 3 tries")


def _soak(tmp_path, extra, *, world: int, kills: int, seed: int):
    ref, out = tmp_path / "ref", tmp_path / "soak"
    _, codes, text = _segment([*RUN, *extra, "--out", ref], tmp_path / "ref.log", world)
    assert codes == [0] * world, text[-3000:]
    schedule = _schedule(seed, kills)
    killed = []
    for i, (phase, at) in enumerate(schedule):
        resume = (out / "last.pt").exists()
        done = load_checkpoint(out)["global_step"] if resume else 0
        args = ["train", "--resume", out] if resume else [*RUN, *extra, "--out", out]
        rank = 0 if phase.startswith("save") else random.Random(seed + i).randrange(world)
        reached, codes, text = _segment(args, tmp_path / f"seg{i}.log", world,
                                        kill={"phase": phase, "at": at, "done": done}, kill_rank=rank)
        assert reached is not None, (f"kill {i} ({phase} at step {at}, from step {done}) was never reached",
                                     codes, text[-3000:])
        assert codes == [-9] * world, (codes, text[-3000:])
        killed.append(reached)
        if phase.startswith("save"):  # killed mid-save: its temporary file is left (the next start clears it)
            assert [f for f in os.listdir(out) if f.endswith(".tmp")], (reached, os.listdir(out))
        if (out / "last.pt").exists():
            load_checkpoint(out)  # intact after every kill (digest-checked)
    _, codes, text = _segment(["train", "--resume", out], tmp_path / "last.log", world)
    assert codes == [0] * world, text[-3000:]
    assert "resumed from" in text
    assert not [f for f in os.listdir(out) if f.endswith(".tmp")]  # killed saves' leftovers were cleared
    _assert_same_run(load_checkpoint(ref), load_checkpoint(out))
    return killed


def _assert_same_run(a, b):
    assert a["global_step"] == b["global_step"] == STEPS_PER_EPOCH * EPOCHS
    for part in ("model", "rng", "recipe", "counters", "epoch", "batch"):
        _equal(a[part], b[part], part)
    _equal(a["optimizer"]["state"], b["optimizer"]["state"], "optimizer")
    keys = ("epoch", "steps", "train_loss", "test_loss", "test_accuracy", "loss_curve", "skipped_steps", "loss_scale")
    assert [{k: h[k] for k in keys} for h in a["history"]] == [{k: h[k] for k in keys} for h in b["history"]]


def _equal(x, y, where):
    if isinstance(x, torch.Tensor):
        assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y), where
    elif isinstance(x, dict):
        assert x.keys() == y.keys(), where
        for k in x:
            _equal(x[k], y[k], f"{where}.{k}")
    elif isinstance(x, (list, tuple)):
        assert len(x) == len(y), where
        for i, (u, v) in enumerate(zip(x, y)):
            _equal(u, v, f"{where}[{i}]")
    else:
        assert x == y, (where, x, y)


@pytest.mark.parametrize("precision", ["fp32", "fp16-mixed", "bf16-master"])
@pytest.mark.parametrize("seed", [SEED], ids=lambda s: f"seed{s}")
def test_ten_kills_and_resumes_end_bit_identical(tmp_path, precision, seed):
    killed = _soak(tmp_path, ["--precision", precision, "--synthetic-train", 8 * STEPS_PER_EPOCH], world=1, kills=10,
                   seed=seed)
    assert len(killed) == 10


@pytest.mark.parametrize("seed", [SEED], ids=lambda s: f"seed{s}")
def test_three_kills_of_a_2_process_ddp_run_end_bit_identical(tmp_path, seed):
    killed = _soak(tmp_path, ["--precision", "bf16-mixed", "--strategy", "ddp", "--synthetic-train",
                              2 * 8 * STEPS_PER_EPOCH], world=2, kills=3, seed=seed)
    assert len(killed) == 3
