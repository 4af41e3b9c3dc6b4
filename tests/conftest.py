import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")

# Keep tests deterministic and light on a shared 2-core machine.
torch.set_num_threads(min(2, torch.get_num_threads()))


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
