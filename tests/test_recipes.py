"""Recipe-level proofs through the trainer: master weights keep fp32's accuracy, bf16-true loses small
updates (and master weights or stochastic rounding fix it), scratch and native mechanisms train alike."""

import pytest
import torch

from mixprec.precision import RECIPES
from mixprec.train.config import TrainConfig
from mixprec.train.build import build_run
from mixprec.train.loop import train

pytestmark = pytest.mark.slow  # every test here trains on digits

DIGITS = dict(dataset="digits", model="mlp", width=64, depth=1, batch_size=32, log_every=0, progress="off")


@pytest.fixture(scope="module")
def fp32_accuracy():
    return train(TrainConfig.from_flags(**DIGITS, epochs=4, lr=0.05, momentum=0.9, precision="fp32")).summary["test_accuracy"]


@pytest.mark.parametrize("precision", [r for r in RECIPES if r not in ("fp32", "tf32")])
def test_every_low_precision_recipe_reaches_fp32_accuracy_within_1_point(precision, fp32_accuracy):
    s = train(TrainConfig.from_flags(**DIGITS, epochs=4, lr=0.05, momentum=0.9, precision=precision)).summary
    assert fp32_accuracy > 0.9
    assert abs(s["test_accuracy"] - fp32_accuracy) <= 0.01, (precision, s["test_accuracy"], fp32_accuracy)


def _fraction_of_weights_changed(precision: str, stochastic_rounding: bool = False) -> tuple[float, float]:
    cfg = TrainConfig.from_flags(**DIGITS, epochs=2, lr=1e-3, precision=precision, stochastic_rounding=stochastic_rounding)
    run = build_run(cfg)
    before = {k: v.clone() for k, v in run.model.state_dict().items() if k.endswith("weight")}
    result = train(run)
    after = run.model.state_dict()
    changed = sum(int((after[k] != v).sum()) for k, v in before.items())
    return changed / sum(v.numel() for v in before.values()), result.summary["final_train_loss"]


def test_lost_updates_in_bf16_true_and_their_fixes():
    """lr 1e-3: a typical update is far below half a bf16 ulp of its weight, so bf16-true rounds it away
    (only weights near zero, whose ulp is tiny, move). fp32 master weights accumulate the updates until
    they cross an ulp; stochastic rounding moves weights with the right probability."""
    lost, loss_true = _fraction_of_weights_changed("bf16-true")
    master, loss_master = _fraction_of_weights_changed("bf16-master")
    sr, loss_sr = _fraction_of_weights_changed("bf16-true", stochastic_rounding=True)
    assert lost < 0.2
    assert master > 0.5 and sr > 0.5
    assert loss_master < loss_true and loss_sr < loss_true


@pytest.mark.parametrize("precision,atol", [("bf16-mixed", 0.0), ("fp16-mixed", 5e-4), ("bf16-master", 0.0)])
def test_scratch_and_native_mechanisms_train_alike(precision, atol):
    """30 steps on digits. bf16: the scratch autocast runs the same ATen ops in the same dtypes as
    torch.autocast and the scaler matches GradScaler, so the losses are identical. fp16 on a CPU without
    fast fp16: scratch emulates (fp32 arithmetic on fp16-rounded operands and results) while native runs
    PyTorch's fp16 kernels, so the curves agree closely but not bit for bit."""
    curves = {}
    for impl in ("native", "scratch"):
        r = train(TrainConfig.from_flags(**DIGITS, epochs=1, max_steps=30, lr=0.1, momentum=0.9, precision=precision,
                              amp_impl=impl))
        curves[impl] = torch.tensor(r.history[0]["loss_curve"])
    assert curves["native"][-1] < curves["native"][0] - 0.5  # it trained
    torch.testing.assert_close(curves["scratch"], curves["native"], rtol=0, atol=atol)
