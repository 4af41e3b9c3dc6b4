"""A batch that holds inf/nan is named as data, not as numerics (mixprec.train.baddata): in train's stop message
(a non-finite loss without a loss scaler; an epoch whose mean loss is nan, where the batch is fetched again by its
position; too many skipped steps) and in the doctor's fault analysis. Weights gone bad keep the recipe's remedies."""

import math
import re

import torch
import torch.nn.functional as F
from torch import nn

from mixprec.doctor import diagnose, find_first_nonfinite
from mixprec.probes.advice import recommend
from mixprec.train import fit
from mixprec.train.baddata import batch_at
from mixprec.train.build import build_run
from mixprec.train.config import TrainConfig
from mixprec.train.contract import Batch, as_batch
from mixprec.train.data.sources import data_from_splits

FLAGS = dict(width=16, depth=1, batch_size=64, epochs=1, log_every=0, progress="off", device="cpu")


def _data(bad=(300,), value=float("nan")):
    """512 training samples (8 batches of 64), ``bad`` of them holding one ``value``."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(512, 1, 8, 8, generator=g), torch.randint(0, 10, (512,), generator=g)
    for i in bad:
        x[i, 0, 3, 3] = value
    return (x, y), (torch.randn(64, 1, 8, 8, generator=g), torch.randint(0, 10, (64,), generator=g))


def _run(data):
    return build_run(TrainConfig.from_flags(model="mlp", dataset="user data", precision="fp32", **FLAGS),
                     data=data_from_splits(data, "data"))


def _first_bad_position(data, epoch=0) -> int:
    """Where the loop meets the first bad batch: the loader's own order, read independently of batch_at."""
    run = _run(data)
    run.train_loader.set_epoch(epoch)
    return next(i for i, b in enumerate(run.train_loader) if not torch.isfinite(as_batch(b).args[0]).all())


def test_a_batch_names_its_nonfinite_tensors_with_their_counts():
    x = torch.zeros(4, 3)
    x[0, 0], x[1, 1] = float("nan"), float("inf")
    assert Batch((x, torch.ones(4, 2)), {}, torch.tensor([0, 1, 2, 3])).nonfinite() == \
        ["input 0: 1 nan, 1 inf of 12 values"]
    y = torch.full((4,), float("-inf"))
    assert Batch((torch.ones(4, 3),), {}, y).nonfinite() == ["the targets: 0 nan, 4 inf of 4 values"]
    labels = torch.full((2,), float("nan"))
    d = as_batch({"pixel_values": torch.ones(2, 3), "labels": labels})  # the targets are the labels: named once
    assert d.nonfinite() == ["'labels': 2 nan, 0 inf of 2 values"]
    assert Batch((torch.ones(2),), {}, torch.tensor([1, 2])).nonfinite() == []


def test_a_batch_is_fetched_again_by_its_position():
    run = _run(_data(bad=()))
    run.train_loader.set_epoch(1)
    seen = [as_batch(b) for b in run.train_loader]
    again = batch_at(run.train_loader, 1, 3, count=2)
    assert len(again) == 2
    for a, b in zip(again, seen[3:5]):
        assert torch.equal(a.args[0], b.args[0]) and torch.equal(a.targets, b.targets)


def test_a_nan_batch_stops_fp32_naming_the_batch_not_the_model(tmp_path):
    data = _data()
    k = _first_bad_position(data)
    result = fit("mlp", data, precision="fp32", out=str(tmp_path / "run"), **FLAGS)
    msg = result.stopped
    assert msg.startswith(f"non-finite loss at step {k} (epoch 0, batch {k}) with fp32: the batch holds inf/nan "
                          f"(batch {k} input 0: 1 nan, 0 inf of 4096 values): the data is at fault, not the model")
    assert "Remedies" not in msg and "gives the same batch at epoch 0, batch" in msg
    assert f"the last good state (before step {k}) is saved" in msg
    assert torch.load(tmp_path / "run" / "last.pt", weights_only=True)["global_step"] == k


def test_a_nan_batch_under_a_loss_scaler_is_named_when_the_epoch_ends():
    """fp16-mixed skips the bad step; the epoch's mean loss is nan, and only then does the run stop: the batch of
    the first non-finite step is fetched again by its position and named."""
    data = _data()
    k = _first_bad_position(data)
    result = fit("mlp", data, precision="fp16-mixed", **FLAGS)
    assert result.history[0]["skipped_steps"] == 1 and math.isnan(result.history[0]["train_loss"])
    assert result.stopped.startswith(
        f"epoch 0: the mean training loss is nan; step {k} was the first with a non-finite loss, and its batch holds "
        f"inf/nan (batch {k} input 0: 1 nan, 0 inf of 4096 values): the data is at fault"), result.stopped


def test_skipped_steps_on_bad_data_name_the_last_batch():
    result = fit("mlp", _data(bad=range(512), value=float("inf")), precision="fp16-mixed", max_consecutive_skips=2,
                 **FLAGS)
    assert re.match(r"stopped at step 2: 2 optimizer steps in a row were skipped .*; the last one's batch holds "
                    r"inf/nan \(batch 1 input 0: 0 nan, 64 inf of 4096 values\): the data is at fault", result.stopped)


def test_weights_gone_bad_keep_the_recipes_remedies():
    result = fit("mlp", _data(bad=()), precision="fp32", lr=1e30, **FLAGS)
    assert "Remedies" in result.stopped and "the data is at fault" not in result.stopped, result.stopped


# ------------------------------------------------------------------------------------------------- doctor

class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc(x)


def _batch(nan=True):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g)
    if nan:
        x[3, 5] = float("nan")
    return x, y


def test_doctor_names_a_nan_batch_as_data():
    report = diagnose(_Net(), _batch(), F.cross_entropy, precision="bf16-mixed", steps=2, device="cpu",
                      block_formats=None)
    fault = report.first_fault()
    assert fault.classification == "non-finite batch" and fault.data == ("input 0: 1 nan, 0 inf of 512 values",)
    assert "the data is at fault, not the model" in fault.describe()
    rec = recommend(report)[0]
    assert rec["kind"] == "not-precision" and "the batch of step 0 holds inf/nan (input 0: 1 nan" in rec["text"]
    fa = find_first_nonfinite(_Net(), _batch(), F.cross_entropy, precision="fp16-mixed", device="cpu")
    assert fa is not None and fa.classification == "non-finite batch"
    assert find_first_nonfinite(_Net(), _batch(nan=False), F.cross_entropy, device="cpu") is None
