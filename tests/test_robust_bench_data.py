"""Issue 11, bench and data: nothing lost, nothing silent.

- A run whose loss is non-finite (``--lr 1e30``) is a row, not a crash of the report; results.json is
  written even when plotting fails, and after every finished run (so an interrupted bench keeps them).
- SIGINT / SIGTERM to ``mixprec bench`` stops the running worker, writes the finished rows and exits
  130 / 143 with one line (real subprocesses: the worker's pid must be gone afterwards).
- Data mistakes say what is wrong: a --data-dir that is a file, a valid IDX file with no samples (unreadable
  files and folders, as an unprivileged user for real: tests/test_permissions.py).
- Hostile bench flags (non-finite seconds, absurd repeats, an --out that is a file or not writable)
  exit 2 with one line before any run, and change nothing the user had.

CLI cases assert the exit code, a one-line message on stderr and no traceback.
"""

import gzip
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from mixprec.train.data import DataError, load_dataset, read_idx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HANGS_IN_BF16 = os.path.join(ROOT, "tests", "userpkg", "faults.py") + ":hangs_in_bf16"
TINY = ["--dataset", "synthetic", "--synthetic-train", "128", "--synthetic-test", "32", "--model", "mlp",
        "--width", "16", "--depth", "1", "--batch-size", "32", "--epochs", "1", "--warmup-steps", "1",
        "--peak-seconds", "0.05", "--no-plots", "--no-plan"]  # the planner column: tests/test_bench.py


def one_line(err: str) -> str:
    """The single non-empty line of ``err`` (fails if there are more, or a traceback)."""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert "Traceback" not in err and len(lines) == 1, err
    return lines[0]


def snapshot(path) -> dict:
    """Every file under ``path`` (or the file itself) with its bytes and mode: to prove nothing changed."""
    path = str(path)
    if os.path.isfile(path):
        with open(path, "rb") as f:
            return {path: (f.read(), os.stat(path).st_mode)}
    out = {}
    for d, _, files in os.walk(path):
        out[d] = (None, os.stat(d).st_mode)
        for n in files:
            p = os.path.join(d, n)
            with open(p, "rb") as f:
                out[p] = (f.read(), os.stat(p).st_mode)
    return out


# ------------------------------------------------------------------------------------------ data


def idx_bytes(array: np.ndarray) -> bytes:
    magic = 0x0800 | array.ndim
    header = magic.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in array.shape)
    return header + array.astype(np.uint8).tobytes()


def write_idx_dir(directory, n_train=12, n_test=5):
    arrays = {
        "train-images-idx3-ubyte": np.zeros((n_train, 28, 28)),
        "train-labels-idx1-ubyte": np.zeros(n_train),
        "t10k-images-idx3-ubyte": np.zeros((n_test, 28, 28)),
        "t10k-labels-idx1-ubyte": np.zeros(n_test),
    }
    for name, array in arrays.items():
        (directory / name).write_bytes(idx_bytes(array))


def test_data_dir_that_is_a_file_says_it_is_a_file(tmp_path):
    f = tmp_path / "train-images-idx3-ubyte"
    f.write_bytes(b"not a folder")
    with pytest.raises(DataError) as e:
        load_dataset("mnist", data_dir=str(f))
    msg = str(e.value)
    assert "is a file, not a folder" in msg and str(f) in msg and "does not exist" not in msg


def test_data_dir_that_is_a_file_in_the_cli(cli, tmp_path):
    f = tmp_path / "data.txt"
    f.write_text("hello")
    before = snapshot(tmp_path)
    code, _, err = cli("train", "--dataset", "mnist", "--data-dir", f, "--epochs", "1")
    assert code == 2 and "is a file, not a folder" in one_line(err)
    assert snapshot(tmp_path) == before


def test_valid_idx_file_with_no_samples_reads_as_empty(tmp_path):
    path = tmp_path / "empty"
    path.write_bytes(idx_bytes(np.zeros((0, 28, 28))))
    x = read_idx(path)
    assert x.shape == (0, 28, 28) and x.dtype == torch.uint8
    gz = tmp_path / "empty.gz"
    gz.write_bytes(gzip.compress(idx_bytes(np.zeros(0))))
    assert read_idx(gz).shape == (0,)


@pytest.mark.parametrize("n_train,n_test,empty", [(0, 5, "train-images-idx3-ubyte"),
                                                   (12, 0, "t10k-images-idx3-ubyte")])
def test_idx_split_with_no_samples_is_a_data_error(tmp_path, n_train, n_test, empty):
    write_idx_dir(tmp_path, n_train=n_train, n_test=n_test)
    with pytest.raises(DataError) as e:
        load_dataset("mnist", data_dir=str(tmp_path))
    msg = str(e.value)
    assert "no samples" in msg and str(tmp_path / empty) in msg


def test_empty_idx_split_in_the_cli(cli, tmp_path):
    write_idx_dir(tmp_path, n_train=0)
    before = snapshot(tmp_path)
    code, _, err = cli("train", "--dataset", "mnist", "--data-dir", tmp_path, "--epochs", "1")
    assert code == 2 and "no samples" in one_line(err)
    assert snapshot(tmp_path) == before


# ------------------------------------------------------------------------------------------ bench: rows


@pytest.mark.slow
def test_huge_lr_every_failure_is_a_row_and_results_json_is_written(cli, tmp_path):
    """``--lr 1e30``: fp32 stops on a non-finite loss; fp16-mixed skips every step after the first, which the
    trainer counts as a failed run (issue 11) — two failed rows, and the report survives both."""
    out = tmp_path / "b"
    code, stdout, err = cli("bench", *TINY, "--precisions", "fp32,amp", "--repeats", "1", "--lr", "1e30",
                            "--out", out)
    assert "Traceback" not in stdout + err
    assert code == 1, stdout + err  # a run failed
    doc = json.loads((out / "results.json").read_text())
    assert [r["recipe"] for r in doc["runs"]] == ["fp32", "fp16-mixed"]
    fp32, amp = doc["runs"]
    assert fp32["status"] == "failed" and "non-finite loss" in fp32["reason"]
    assert amp["status"] == "failed" and "were skipped" in amp["reason"]
    assert amp["summary"]["final_train_loss"] is None  # a NaN epoch loss, cleaned to null
    assert doc["progress"] == {"state": "complete", "finished": 2, "planned": 2}
    assert "[2/2] fp16-mixed seed 0: FAILED" in stdout
    cells = {name: [c.strip() for c in ln.strip().strip("|").split("|")]
             for name in ("recipe", "fp16-mixed") for ln in stdout.splitlines() if ln.startswith(f"| {name} ")}
    assert dict(zip(cells["recipe"], cells["fp16-mixed"]))["train loss"] == "—"
    assert (out / "results.md").exists() and (out / "runs" / "fp16-mixed-r0.json").exists()


@pytest.mark.slow
def test_results_json_is_written_when_plotting_fails(cli, tmp_path, monkeypatch):
    from mixprec.bench import plots

    def broken(*a, **k):
        raise RuntimeError("no canvas today")

    monkeypatch.setattr(plots, "write_plots", broken)
    out = tmp_path / "b"
    args = [a for a in TINY if a != "--no-plots"]
    code, stdout, err = cli("bench", *args, "--precisions", "fp32", "--repeats", "1", "--out", out)
    assert code == 0 and "Traceback" not in stdout + err
    doc = json.loads((out / "results.json").read_text())
    assert doc["plots"] == [] and doc["runs"][0]["status"] == "ok"
    assert "no canvas today" in doc["plots_error"]
    assert "plots failed: RuntimeError: no canvas today" in stdout


@pytest.mark.parametrize("script,status,needle", [
    ('echo "[1, 2]" > "$4"', "failed", "worker exited with status 0 without a result"),
    ('echo "{not json" > "$4"; exit 3', "failed", "worker exited with status 3 without a result"),
    ("echo '{\"status\": \"ok\"}' > \"$4\"", "ok", None),
    ("echo '{\"status\": \"odd\", \"summary\": 5, \"history\": 7}' > \"$4\"; echo boom; exit 1", "failed",
     "last log line: boom"),
])
def test_whatever_a_worker_leaves_is_a_row(tmp_path, monkeypatch, script, status, needle):
    """A worker's result file may be missing, not JSON, not an object, or an object of nonsense: each is a
    row with the spec's recipe and seed, and the report reads it."""
    from mixprec.bench import runner
    from mixprec.bench.aggregate import aggregate
    from mixprec.bench.console import progress_line
    from mixprec.bench.report import table

    fake = tmp_path / "python"  # stands in for the interpreter: argv is -m mixprec.bench.worker SPEC OUT
    fake.write_text(f"#!/bin/sh\n{script}\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))
    spec = runner.RunSpec(recipe="bf16-mixed", repeat=1, seed=7, config={}, warmup_steps=0)
    (r,) = runner.execute_matrix([spec], str(tmp_path / "o"))
    assert (r.status, r.recipe, r.repeat, r.seed) == (status, "bf16-mixed", 1, 7)
    assert r.reason is None if needle is None else needle in r.reason, r.reason
    progress_line(1, 1, r)
    rows = aggregate(["fp32", "bf16-mixed"], [r], flops_per_step=None, peaks={}, matmul_dtype={})
    assert f"| {1 if status == 'ok' else 0}/1" in table(rows).splitlines()[3]


def test_a_worker_that_cannot_start_is_a_row(tmp_path, monkeypatch):
    from mixprec.bench import runner

    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-such-python"))
    spec = runner.RunSpec(recipe="fp32", repeat=0, seed=0, config={}, warmup_steps=0)
    (r,) = runner.execute_matrix([spec], str(tmp_path / "o"))
    assert r.status == "failed" and r.reason.startswith("could not run the worker:") and r.recipe == "fp32"


# ------------------------------------------------------------------------------------ bench: signals


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            state = next(ln for ln in f if ln.startswith("State:"))
    except (OSError, StopIteration):
        return False
    return "zombie" not in state


def _workers_for(out, module: str = "mixprec.bench.worker") -> list[int]:
    """Live ``module`` processes (a worker, or the planner ``mixprec.bench.predict``) working for the bench whose
    --out is ``out`` (from /proc)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().decode(errors="replace")
        except OSError:
            continue
        if module in cmd and str(out) in cmd and _pid_alive(int(entry)):
            pids.append(int(entry))
    return pids


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc to find the worker")
@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_stops_the_worker_and_keeps_the_finished_runs(tmp_path, sig, code):
    out = tmp_path / "b"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "src"), env.get("PYTHONPATH", "")])
    proc = subprocess.Popen([sys.executable, "-m", "mixprec", "bench", *TINY, "--model", HANGS_IN_BF16,
                             "--precisions", "fp32,bf16-mixed", "--repeats", "1", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    log = out / "logs" / "bf16-mixed-r0.log"
    pid = None
    try:
        deadline = time.monotonic() + 120
        while pid is None and time.monotonic() < deadline and proc.poll() is None:
            m = re.search(r"hanging on purpose \(pid (\d+)", log.read_text() if log.exists() else "")
            pid = int(m.group(1)) if m else None
            time.sleep(0.1)
        assert pid is not None and _workers_for(out) == [pid], "the hanging worker never started"
        running = json.loads((out / "results.json").read_text())  # already there: even SIGKILL keeps it
        assert running["progress"] == {"state": "running", "finished": 1, "planned": 2}
        assert [r["recipe"] for r in running["runs"]] == ["fp32"]
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=60)
        left = _workers_for(out)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        for w in _workers_for(out):  # whatever the verdict, leave nothing behind
            os.kill(w, signal.SIGKILL)
    assert left == [] and not _pid_alive(pid), "the worker outlived bench"
    assert proc.returncode == code, (stdout, stderr)
    line = one_line(stderr)
    assert f"interrupted by {sig.name}" in line and "bf16-mixed seed 0" in line
    assert "1 finished run" in line and str(out / "results.json") in line and "checkpoint" not in line
    assert "Traceback" not in stdout
    doc = json.loads((out / "results.json").read_text())
    assert doc["progress"] == {"state": f"interrupted by {sig.name}", "finished": 1, "planned": 2}
    assert [(r["recipe"], r["status"]) for r in doc["runs"]] == [("fp32", "ok")]
    assert (out / "runs" / "fp32-r0.json").exists()
    assert f"Interrupted by {sig.name}: 1 of 2 runs finished" in (out / "results.md").read_text()


# ---------------------------------------------------------------------------------- bench: bad input


@pytest.mark.parametrize("args,needle", [
    (["--timeout", "nan"], "--timeout must be a positive number, got nan"),
    (["--timeout", "inf"], "--timeout must be a positive number, got inf"),
    (["--timeout", "-1"], "--timeout must be a positive number, got -1.0"),
    (["--peak-seconds", "inf"], "--peak-seconds must be a positive number, got inf"),
    (["--peak-seconds", "nan"], "--peak-seconds must be a positive number, got nan"),
    (["--peak-seconds", "0"], "--peak-seconds must be a positive number, got 0.0"),
    (["--warmup-steps", "-1"], "--warmup-steps must be an integer >= 0, got -1"),
    (["--repeats", "100000"], "--repeats 100000: at most 1000"),
])
def test_hostile_bench_flags_exit_2_before_any_run(cli, tmp_path, args, needle):
    out = tmp_path / "b"
    code, stdout, err = cli("bench", *TINY, "--out", out, *args)
    assert code == 2 and needle in one_line(err), err
    assert not out.exists() and "Traceback" not in stdout


def test_repeats_not_an_int_is_argparse_exit_2(capsys, tmp_path):
    from mixprec.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", *TINY, "--out", str(tmp_path / "b"), "--repeats", "1e9"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "invalid int value: '1e9'" in err and "Traceback" not in err


def test_out_that_is_a_file_exits_2_and_leaves_it_alone(cli, tmp_path):
    f = tmp_path / "results"
    f.write_text("my precious notes\n")
    before = snapshot(tmp_path)
    code, _, err = cli("bench", *TINY, "--out", f)
    assert code == 2 and f"--out {f} is a file, not a folder" in one_line(err)
    assert snapshot(tmp_path) == before




@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc to find the planner")
def test_a_killed_bench_takes_its_hanging_planner_with_it(tmp_path):
    """bench plans its recipes in a child process before the runs; a model that hangs under tracing keeps the
    child busy, and a SIGKILLed bench cannot stop it: the planner ends itself when its parent is gone."""
    out = tmp_path / "b"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "src"), env.get("PYTHONPATH", "")])
    args = [a for a in TINY if a != "--no-plan"]
    proc = subprocess.Popen([sys.executable, "-m", "mixprec", "bench", *args, "--model", HANGS_IN_BF16,
                             "--precisions", "fp32,bf16-mixed", "--repeats", "1", "--out", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=ROOT)
    log = out / "logs" / "plan.log"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and "hanging on purpose" not in (log.read_text() if log.exists() else ""):
            time.sleep(0.1)
        planners = _workers_for(out, "mixprec.bench.predict")
        assert len(planners) == 1, "the planner never reached the hanging forward"
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 10
        while _pid_alive(planners[0]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _pid_alive(planners[0]), "the planner outlived its bench"
    finally:
        if proc.poll() is None:
            proc.kill()
        for w in _workers_for(out, "mixprec.bench.predict"):
            os.kill(w, signal.SIGKILL)
