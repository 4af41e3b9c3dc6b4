"""Golden-loss run: 30 SGD steps on digits, fixed seed, losses against a stored file.

Tolerances are tight but not exact: BLAS/oneDNN pick different kernels (summation orders) on different CPU
models. fp32 agrees to ~1e-5; bf16-mixed rounds GEMM outputs to bf16, so a different accumulation order can
flip an occasional last bit — 5e-4 still separates it from fp32, whose curve differs by up to 2.6e-3.
Regenerate with `python tests/golden/regen.py` only after an intended numerics change.
"""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "golden"))
from regen import GOLDEN, RECIPES, losses  # noqa: E402

TOL = {"fp32": dict(rtol=1e-5, atol=2e-5), "bf16-mixed": dict(rtol=0, atol=5e-4)}


@pytest.mark.slow
@pytest.mark.parametrize("precision", RECIPES)
def test_losses_match_golden(precision):
    golden = json.loads(GOLDEN.read_text())["losses"]
    got = torch.tensor(losses(precision), dtype=torch.float64)
    torch.testing.assert_close(got, torch.tensor(golden[precision], dtype=torch.float64), **TOL[precision])


def test_golden_curves_are_distinguishable():
    """The bf16 tolerance must be able to tell bf16-mixed from fp32, or the test above proves nothing."""
    golden = json.loads(GOLDEN.read_text())["losses"]
    diff = (torch.tensor(golden["fp32"]) - torch.tensor(golden["bf16-mixed"])).abs().max().item()
    assert diff > 2 * TOL["bf16-mixed"]["atol"]
