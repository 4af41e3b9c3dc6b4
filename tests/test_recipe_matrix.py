"""Every recipe x every built-in model x every --amp-impl trains two steps through the CLI, or says why not.

A combination may be refused (exit 2 with a one-line message naming the fix), but it must never end in
an exception: each one runs ``mixprec train`` in-process at tiny sizes (8x8 synthetic images, widths of
a few units) so that even PyTorch's real fp16 kernels on a CPU without fast fp16 finish at once.

Only command-line flags are used, so the test does not depend on the trainer's internals.
"""

from __future__ import annotations

import pytest

from mixprec.precision import AMP_IMPLS, RECIPES
from mixprec.train.models import MODELS

DATA = ["--dataset", "synthetic", "--synthetic-train", "8", "--synthetic-test", "4",
        "--synthetic-shape", "1x8x8", "--batch-size", "4"]
RUN = ["--epochs", "1", "--max-steps", "2", "--log-every", "0", "--progress", "off", "--device", "cpu"]
MODEL_SIZES = {
    "simplenet": [],
    "mlp": ["--width", "8", "--depth", "1"],
    "cnn": ["--channels", "2"],
    "transformer": ["--d-model", "8", "--n-heads", "2", "--n-layers", "1", "--patch-size", "4"],
}


def test_the_matrix_covers_every_model():
    assert set(MODEL_SIZES) == set(MODELS)


@pytest.mark.parametrize("impl", AMP_IMPLS)
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_recipe_model_impl_trains_or_refuses_in_one_line(cli, one_thread, recipe, model, impl):
    code, out, err = cli("train", "--precision", recipe, "--amp-impl", impl, "--model", model,
                         *MODEL_SIZES[model], *DATA, *RUN)
    assert "Traceback" not in out + err
    if code == 2:  # refused: one line naming the problem
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("mixprec train: error:"), err
    else:
        assert code == 0, err
        assert f"| {recipe} |" in out  # the summary table was printed
