"""Permission errors for real: the CLI as an unprivileged user on folders that user may not read or write.

Root reads and writes anywhere, so a suite run as root that patched ``open`` or ``os.access`` would only
test the wording, never the branch that meets a real EACCES. Here each case runs ``python -m mixprec`` in
a fresh process as ``nobody`` (``setpriv --reuid=nobody --regid=nogroup --clear-groups``) on files and
folders owned by root that ``nobody`` may not read or write; run by any other user, the process simply
runs as that user (chmod then denies it the same way). A case is skipped, saying why, where that is
impossible: root without ``setpriv``, or an interpreter / source tree the unprivileged user cannot read.

Every case asserts exit 2, one line on stderr that says "permission denied" and names the path (not
"corrupt", not "not found"), and that nothing the user had changed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # each case is a fresh interpreter running the CLI

ROOT = Path(__file__).resolve().parents[1]
NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
BENCH = ["--dataset", "synthetic", "--synthetic-train", "16", "--synthetic-test", "8", "--model", "mlp",
         "--width", "8", "--depth", "1", "--batch-size", "8", "--epochs", "1", "--warmup-steps", "1",
         "--peak-seconds", "0.05", "--no-plots", "--no-plan"]
TRAIN = ["--dataset", "synthetic", "--synthetic-train", "16", "--synthetic-test", "8", "--model", "mlp",
         "--width", "8", "--depth", "1", "--batch-size", "8", "--epochs", "1", "--progress", "off"]


def _prefix() -> list[str]:
    """What runs a command as an unprivileged user; skips the test where nothing can."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root and setpriv (util-linux) is missing: cannot drop to an unprivileged user, "
                    "and root is never denied")
    return NOBODY


@pytest.fixture(scope="module")
def unprivileged():
    """``run(*cli_args) -> CompletedProcess`` as an unprivileged user, and a folder root owns for the fixtures.

    pytest's tmp_path lies under a root-only folder, so the cases get their own world-readable one under
    /tmp; the unprivileged user's HOME (caches) and cwd is a folder it owns.
    """
    prefix = _prefix()
    base = Path(tempfile.mkdtemp(prefix="mixprec-perm-"))
    base.chmod(0o755)
    home = base / "home"
    home.mkdir()
    if prefix:
        os.chown(home, *_nobody_ids())
    env = dict(os.environ, HOME=str(home), TMPDIR=str(home), MPLCONFIGDIR=str(home), OMP_NUM_THREADS="1")

    def run(*args, python=("-m", "mixprec")):
        return subprocess.run([*prefix, sys.executable, *python, *map(str, args)], capture_output=True,
                              text=True, timeout=300, env=env, cwd=home)

    probe = run(python=("-c", "import mixprec, os; print(os.geteuid())"))
    if probe.returncode != 0:
        shutil.rmtree(base)
        pytest.skip(f"the unprivileged user cannot import mixprec with {sys.executable} (interpreter or source "
                    f"tree not readable by it): {probe.stderr.strip().splitlines()[-1:]}")
    if prefix:
        assert probe.stdout.strip() != "0"  # the check below would prove nothing as root
    run.base = base
    yield run
    shutil.rmtree(base, ignore_errors=True)


def _nobody_ids() -> tuple[int, int]:
    import grp
    import pwd

    return pwd.getpwnam("nobody").pw_uid, grp.getgrnam("nogroup").gr_gid


@pytest.fixture
def folder(unprivileged):
    """A fresh folder (root's, world-readable, not writable by others) for one case; its name says nothing
    (the messages checked must not find their words in it)."""
    d = Path(tempfile.mkdtemp(prefix="case-", dir=unprivileged.base))
    d.chmod(0o755)
    yield d
    for p in [d, *d.rglob("*")]:  # give root's modes back so the folder can be removed
        p.chmod(0o755 if p.is_dir() else 0o644)


def one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert "Traceback" not in err and len(lines) == 1, err
    return lines[0]


def snapshot(path: Path) -> dict:
    """Every file and folder under ``path`` with its bytes and mode (read as root)."""
    out = {}
    for p in sorted([path, *path.rglob("*")]):
        out[str(p)] = (None if p.is_dir() else p.read_bytes(), p.stat().st_mode)
    return out


def write_idx_dir(directory: Path, n_train: int = 12, n_test: int = 5) -> None:
    """A valid MNIST-layout folder of uncompressed IDX files."""
    arrays = {"train-images-idx3-ubyte": np.zeros((n_train, 28, 28)), "train-labels-idx1-ubyte": np.zeros(n_train),
              "t10k-images-idx3-ubyte": np.zeros((n_test, 28, 28)), "t10k-labels-idx1-ubyte": np.zeros(n_test)}
    for name, a in arrays.items():
        header = (0x0800 | a.ndim).to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in a.shape)
        (directory / name).write_bytes(header + a.astype(np.uint8).tobytes())


# ------------------------------------------------------------------------------------------ data


def test_unreadable_idx_file_is_permission_denied_not_corrupt(unprivileged, folder):
    write_idx_dir(folder)
    path = folder / "t10k-images-idx3-ubyte"
    path.chmod(0o600)  # root's file: the unprivileged user may not read it
    before = snapshot(folder)
    p = unprivileged("train", "--dataset", "mnist", "--data-dir", folder, *TRAIN[2:])
    line = one_line(p.stderr)
    assert p.returncode == 2, p.stderr
    assert "permission denied" in line.lower() and str(path) in line
    assert "corrupt" not in line and "apt-get" not in line
    assert snapshot(folder) == before


def test_unreadable_data_dir_is_permission_denied_not_missing(unprivileged, folder):
    d = folder / "mnist"
    d.mkdir()
    write_idx_dir(d)
    d.chmod(0o700)  # root's folder: the unprivileged user may not list or enter it
    p = unprivileged("train", "--dataset", "mnist", "--data-dir", d, *TRAIN[2:])
    line = one_line(p.stderr)
    assert p.returncode == 2, p.stderr
    assert "permission denied" in line.lower() and str(d) in line and "not found" not in line


# ------------------------------------------------------------------------------------------ outputs


def test_bench_out_in_a_read_only_folder_exits_2_before_any_run(unprivileged, folder):
    (folder / "old.txt").write_text("keep me")
    before = snapshot(folder)
    p = unprivileged("bench", *BENCH, "--out", folder / "b")
    assert p.returncode == 2, p.stderr
    assert f"--out {folder / 'b'}: cannot create the folder: Permission denied" in one_line(p.stderr)
    assert "[1/" not in p.stdout  # no run started
    assert snapshot(folder) == before


def test_bench_out_folder_that_refuses_writes_exits_2(unprivileged, folder):
    (folder / "old.txt").write_text("keep me")
    before = snapshot(folder)
    p = unprivileged("bench", *BENCH, "--out", folder)
    assert p.returncode == 2, p.stderr
    assert f"--out {folder}: cannot write into the folder: Permission denied" in one_line(p.stderr)
    assert "[1/" not in p.stdout
    assert snapshot(folder) == before


@pytest.mark.parametrize("flag", ["--out", "--metrics-json"])
def test_train_output_in_a_read_only_folder_is_refused_before_the_first_step(unprivileged, folder, flag):
    (folder / "old.txt").write_text("keep me")
    before = snapshot(folder)
    target = folder / ("run" if flag == "--out" else "m.json")
    p = unprivileged("train", *TRAIN, flag, target)
    line = one_line(p.stderr)
    assert p.returncode == 2, p.stderr
    assert line.startswith(f"mixprec train: error: {flag}") and str(folder) in line and "Permission denied" in line
    assert "epoch" not in p.stdout.lower()  # refused before training
    assert snapshot(folder) == before
