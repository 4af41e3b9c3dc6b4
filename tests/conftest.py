import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")

# One intra-op thread, here and in every process a test starts (bench workers and its planner, torchrun ranks,
# `python -m mixprec` subprocesses inherit OMP_NUM_THREADS): the suite's models are tiny, so a second thread buys
# little even on an idle machine, while on a busy one (CI neighbours, a shared 2-core VM) OpenMP's spinning threads
# made each process several times slower. Set OMP_NUM_THREADS before pytest to run the children otherwise.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

# A CPU with bf16 kernels (AVX-512 or newer), here and in every process a test starts, whichever CPU runs the
# suite, so `--amp-impl auto` means the same for bf16 on every machine (an AVX2-only CPU runs the same native
# bf16 steps, only slower). The tests of the other answer (bf16 emulated: tests/test_precision.py,
# tests/test_recipe_matrix.py) patch mixprec.hardware.has_bf16_kernels.
os.environ["MIXPREC_CPU_BF16_KERNELS"] = "1"


# ------------------------------------------------------------------------------ devices

HAS_CUDA = torch.cuda.is_available() and torch.version.hip is None

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
"""Parametrize a device test over ``cpu`` and, where present, ``cuda``: ``@pytest.mark.parametrize("device",
DEVICES)``. The CPU case stays in CI; the CUDA case carries the ``cuda`` marker and is skipped without a GPU."""


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (none here; run benchmarks/gpu_check.sh on a GPU machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def spawn_two(worker, *args, timeout: float, what: str) -> None:
    """Run ``worker(rank, *args)`` in 2 spawned processes; kill both and fail the test after ``timeout`` s."""
    import time

    import torch.multiprocessing as mp

    ctx = mp.start_processes(worker, args=args, nprocs=2, join=False, start_method="spawn")
    deadline = time.time() + timeout
    while not ctx.join(timeout=1):
        if time.time() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"{what} did not finish in {timeout:g} s")


def run_cli_subprocess(*args, timeout=300, env=None):
    """Run `python -m mixprec ARGS` in a fresh interpreter; returns CompletedProcess (text)."""
    e = dict(os.environ)
    e.setdefault("OMP_NUM_THREADS", "1")
    if env:
        e.update(env)
    return subprocess.run([sys.executable, "-m", "mixprec", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=e, cwd=ROOT)


@pytest.fixture
def cli(capsys):
    """Run the CLI in-process: returns (exit code, stdout, stderr)."""
    from mixprec.cli import main

    def run(*args):
        code = main([str(a) for a in args])
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.fixture
def one_thread():
    """One intra-op thread for tests on tiny tensors: faster, and immune to a busy shared machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def mount_tmpfs(tmp_path):
    """``mount_tmpfs(options)`` mounts a fresh tmpfs (e.g. ``"ro"``, ``"size=64k"``) and returns its path: a real
    read-only or full filesystem, so those branches run for real (EROFS, ENOSPC). Skipped where mounting is not
    allowed (not root, or a sandbox without the capability); unmounted afterwards."""
    mounted = []

    def mount(options: str) -> Path:
        where = tmp_path / f"mnt{len(mounted)}"
        where.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "mixprec-test", str(where)], capture_output=True,
                           text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip() or 'mount failed'})")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


# ------------------------------------------------------------------------------ the fast tier stays fast

FAST_TIER_LIMIT_S = 2.0
"""A test not marked slow whose setup and call take longer than this is named at the end of the run, so that
end-to-end tests do not creep into ``make test-fast``. A note, not a failure: a busy machine stretches times."""

_unmarked_durations: dict[str, float] = {}


def pytest_runtest_logreport(report):
    if report.when in ("setup", "call") and "slow" not in report.keywords:
        _unmarked_durations[report.nodeid] = _unmarked_durations.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    long = sorted(((d, n) for n, d in _unmarked_durations.items() if d > FAST_TIER_LIMIT_S), reverse=True)
    if long:
        terminalreporter.section("tests not marked slow that took over %gs" % FAST_TIER_LIMIT_S)
        for d, n in long:
            terminalreporter.write_line(f"{d:6.1f}s {n}")
        terminalreporter.write_line("end-to-end tests get @pytest.mark.slow (time them alone first: a busy machine "
                                    "stretches times)")
