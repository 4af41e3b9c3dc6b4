"""One writer per output folder: a second run on an ``--out`` that a live run is writing is refused, naming it.

The holder is another process for real: a forked child that takes the folder's lock (fast), or a real
``mixprec train`` (slow). Its death by SIGKILL is real too: the kernel drops its ``flock``, and the next run
takes the folder over with a note naming the dead holder.
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT
from mixprec.errors import ConfigError
from mixprec.train import outputs
from mixprec.train.outputs import LOCK_NAME, OutputLock

TINY = ["--dataset", "synthetic", "--synthetic-train", "32", "--synthetic-test", "8", "--model", "mlp",
        "--width", "8", "--depth", "1", "--batch-size", "16", "--progress", "off", "--log-every", "0"]
BENCH = ["--dataset", "synthetic", "--synthetic-train", "16", "--synthetic-test", "8", "--model", "mlp",
         "--width", "8", "--depth", "1", "--batch-size", "8", "--epochs", "1", "--warmup-steps", "1",
         "--peak-seconds", "0.05", "--no-plots", "--no-plan"]


class Holder:
    """A forked child process that holds ``folder``'s lock until killed."""

    def __init__(self, folder: Path, command: str = "mixprec train") -> None:
        r, w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the child: take the lock, say so, wait to be killed
            try:
                os.close(r)
                held = OutputLock.acquire(folder, command=command)  # kept: a dropped lock is released
                os.write(w, b"1")
                time.sleep(120)
                held.release()
            finally:
                os._exit(0)
        os.close(w)
        assert os.read(r, 1) == b"1", "the child could not take the lock"
        os.close(r)

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)


@pytest.fixture
def holder(tmp_path):
    made = []

    def start(folder: Path, command: str = "mixprec train") -> Holder:
        folder.mkdir(exist_ok=True)
        h = Holder(folder, command)
        made.append(h)
        return h

    yield start
    for h in made:
        try:
            h.kill()
        except (ProcessLookupError, ChildProcessError):
            pass


def _one_line(err: str) -> str:
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_a_second_train_on_a_live_out_is_refused_even_with_overwrite(cli, tmp_path, holder):
    out = tmp_path / "run"
    h = holder(out)
    (out / "last.pt").write_bytes(b"the live run's checkpoint")
    for extra in ([], ["--overwrite"]):  # without --overwrite the live run is named, not "another run's last.pt"
        code, stdout, err = cli("train", *TINY, "--epochs", "1", "--out", out, *extra)
        line = _one_line(err)
        assert code == 2, err
        assert f"--out {out} is being written by another run (mixprec train, pid {h.pid} on host " \
               f"{socket.gethostname()}, started " in line
        assert "never a live run's" in line and "epoch" not in stdout
    assert sorted(os.listdir(out)) == [LOCK_NAME, "last.pt"]  # nothing written; the holder's lock intact
    assert (out / "last.pt").read_bytes() == b"the live run's checkpoint"
    assert f"pid={h.pid} " in (out / LOCK_NAME).read_text()


@pytest.mark.slow
def test_a_killed_holders_lock_is_taken_over_with_a_note_and_released_at_the_end(cli, tmp_path, holder):
    out = tmp_path / "run"
    h = holder(out)
    h.kill()  # SIGKILL: no cleanup ran, the text stays; the kernel dropped the flock
    assert f"pid={h.pid} " in (out / LOCK_NAME).read_text()
    code, _, err = cli("train", *TINY, "--epochs", "1", "--max-steps", "1", "--out", out)
    assert code == 0, err
    assert (f"mixprec: note: --out {out}: took over the lock of a run that ended without releasing it "
            f"(mixprec train, pid {h.pid} on host {socket.gethostname()}") in err
    assert sorted(os.listdir(out)) == ["last.pt"]  # released (and removed) when the run ended


def test_one_process_may_build_several_runs_on_one_folder(tmp_path):
    """The lock is per process: the API's build-train-build on one folder is not a second writer."""
    a = OutputLock.acquire(tmp_path, command="test")
    b = OutputLock.acquire(tmp_path, command="test")
    a.release()
    assert (tmp_path / LOCK_NAME).exists()  # b still holds it
    b.release()
    b.release()  # idempotent
    assert not (tmp_path / LOCK_NAME).exists()


def test_a_second_bench_on_a_live_out_is_refused_before_anything_runs(cli, tmp_path, holder):
    out = tmp_path / "bench"
    h = holder(out, command="mixprec bench")
    (out / "results.json").write_text("{}")  # what a live bench has written so far
    for flags in (["--out", out], ["--resume", out]):
        code, stdout, err = cli("bench", *BENCH, *flags) if flags[0] == "--out" else cli("bench", *flags)
        line = _one_line(err)
        assert code == 2 and f"is being written by another run (mixprec bench, pid {h.pid} on host" in line, err
        assert "[1/" not in stdout
    assert sorted(os.listdir(out)) == [LOCK_NAME, "results.json"] and (out / "results.json").read_text() == "{}"


def test_without_flock_the_lock_text_decides(tmp_path, monkeypatch, capsys):
    """On a filesystem without flock (some FUSE mounts): a live pid on this host refuses, another host refuses
    with how to clear it, a dead pid on this host is taken over with a note."""
    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(outputs.fcntl, "flock", no_flock)
    lock = tmp_path / LOCK_NAME
    host = socket.gethostname()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock.write_text(f"host={host} pid={live.pid} started=2026-01-01T00:00:00 command=mixprec train\n")
        with pytest.raises(ConfigError, match=f"being written by another run \\(mixprec train, pid {live.pid} on host"):
            OutputLock.acquire(tmp_path)
    finally:
        live.kill()
        live.wait()
    lock.write_text("host=elsewhere pid=1 started=2026-01-01T00:00:00 command=mixprec bench\n")
    with pytest.raises(ConfigError, match=f"if that run is gone, delete {lock}"):
        OutputLock.acquire(tmp_path)
    lock.write_text(f"host={host} pid={live.pid} started=2026-01-01T00:00:00 command=mixprec train\n")  # dead now
    held = OutputLock.acquire(tmp_path, command="test")
    assert f"took over the stale lock of mixprec train, pid {live.pid} on host {host}" in capsys.readouterr().err
    assert f"pid={os.getpid()} " in lock.read_text()
    held.release()
    assert not lock.exists()


@pytest.mark.slow
def test_two_real_train_processes_on_one_out(tmp_path):
    """A live `mixprec train` and a second one started on its --out with --overwrite: the second exits 2 naming
    the first; after the first is killed (SIGKILL mid-run), the second takes the folder over and finishes."""
    out = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "mixprec", "train", *TINY, "--synthetic-train", "4096", "--epochs", "50",
           "--checkpoint-every", "20", "--out", str(out)]
    first = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 240
        while not (out / "last.pt").exists():  # it is writing the folder
            assert first.poll() is None and time.time() < deadline, first.stderr.read() if first.poll() else "slow"
            time.sleep(0.2)
        second = subprocess.run([*cmd[:-2], "--epochs", "1", "--out", str(out), "--overwrite"], cwd=ROOT, env=env,
                                capture_output=True, text=True, timeout=240)
        line = _one_line(second.stderr)
        assert second.returncode == 2 and f"being written by another run (mixprec train, pid {first.pid} " in line
        assert first.poll() is None  # the live run was not disturbed
    finally:
        first.kill()
        first.wait()
    second = subprocess.run([*cmd[:-2], "--epochs", "1", "--out", str(out), "--overwrite"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=240)
    assert second.returncode == 0, second.stderr
    assert f"took over the lock of a run that ended without releasing it (mixprec train, pid {first.pid}" in \
        second.stderr
    assert not (out / LOCK_NAME).exists()


def test_a_doctor_on_a_live_out_is_refused_before_anything_runs(cli, tmp_path, holder):
    out = tmp_path / "doctor"
    h = holder(out, command="mixprec doctor")
    code, stdout, err = cli("doctor", *TINY, "--steps", "1", "--no-plots", "--out", out)
    line = _one_line(err)
    assert code == 2 and f"is being written by another run (mixprec doctor, pid {h.pid} on host" in line, err
    assert "observing" not in stdout
    assert sorted(os.listdir(out)) == [LOCK_NAME]
