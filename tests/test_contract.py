"""The model contract (train/contract.py) and tasks (train/tasks.py), unit level: no training here."""

from __future__ import annotations

import collections
import math

import pytest
import torch
from torch import nn

from mixprec.train.contract import (Batch, ContractError, ModelCall, as_batch, compute_loss, normalize_inputs,
                                    normalize_targets, parse_output)
from mixprec.train.tasks import check_fit, infer_task, make_task


class FakeModelOutput(collections.OrderedDict):
    """What transformers' ModelOutput is for the contract: an OrderedDict subclass without None values."""


def test_batches_of_every_shape():
    x, y = torch.zeros(4, 3), torch.arange(4)
    b = as_batch((x, y))
    assert b.args == (x,) and b.targets is y and len(b) == 4
    b = as_batch([x, x, y])
    assert len(b.args) == 2 and b.targets is y
    b = as_batch({"input_ids": x.long(), "attention_mask": x, "labels": y})
    assert b.args == () and set(b.kwargs) == {"input_ids", "attention_mask", "labels"} and b.targets is y
    with pytest.raises(ContractError, match="single tensor of shape"):
        as_batch(x)


@pytest.mark.parametrize("out, logits, loss", [
    ("tensor", "L", None),
    ("tuple_logits_loss", "L", "S"),
    ("tuple_loss_logits", "L", "S"),
    ("tuple_logits_none", "L", None),
    ("dict", "L", "S"),
    ("model_output_no_loss", "L", None),
    ("attrs", "L", "S"),
])
def test_outputs_of_every_shape(out, logits, loss):
    L, S = torch.randn(2, 5), torch.tensor(0.7)

    class Attrs:
        def __init__(self):
            self.logits, self.loss = L, S

    raw = {"tensor": L, "tuple_logits_loss": (L, S), "tuple_loss_logits": (S, L), "tuple_logits_none": (L, None),
           "dict": {"loss": S, "logits": L}, "model_output_no_loss": FakeModelOutput(logits=L),
           "attrs": Attrs()}[out]
    o = parse_output(raw)
    assert o.logits is L
    assert (o.loss is S) if loss else (o.loss is None)
    assert o.raw is raw


def test_outputs_mixprec_cannot_use_say_what_came_back():
    with pytest.raises(ContractError, match=r"returned a str; mixprec expects a tensor of logits"):
        parse_output("nope")
    with pytest.raises(ContractError, match=r"a tuple \(int, NoneType\) with no tensor"):
        parse_output((1, None))


class NanoGPTish(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 5)

    def forward(self, idx, targets=None):
        logits = self.lin(idx)
        loss = None if targets is None else nn.functional.cross_entropy(logits, targets)
        return logits, loss


class HFish(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, input_ids=None, attention_mask=None, labels=None):
        logits = self.lin(input_ids * attention_mask)
        out = FakeModelOutput(logits=logits)
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(logits, labels)
        return out


def test_targets_reach_a_forward_that_takes_them():
    m = NanoGPTish()
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 2, 3])
    o = ModelCall(m)(m, as_batch((x, y)))
    assert o.loss is not None
    torch.testing.assert_close(o.loss, nn.functional.cross_entropy(m.lin(x), y), rtol=0, atol=0)
    assert compute_loss(o, as_batch((x, y)), loss_fn=None, default=None) is o.loss  # the model's own wins


def test_dict_batches_pass_labels_when_taken_and_drop_what_forward_does_not_accept():
    m = HFish()
    batch = {"input_ids": torch.randn(4, 3), "attention_mask": torch.ones(4, 3), "labels": torch.tensor([0, 1, 0, 1]),
             "token_type_ids": torch.zeros(4, 3)}
    call = ModelCall(m)
    o = call(m, as_batch(batch))
    assert o.loss is not None and call.dropped == ("token_type_ids",)

    class NoLabels(nn.Module):
        def forward(self, input_ids):
            return input_ids.sum(-1, keepdim=True)

    call = ModelCall(NoLabels())
    args, kwargs = call.arguments(as_batch(batch))
    assert set(kwargs) == {"input_ids"} and call.dropped == ("attention_mask", "token_type_ids")


def test_a_batch_dict_without_what_the_model_needs_names_it():
    class Needs(nn.Module):
        def forward(self, input_ids, attention_mask):
            return input_ids

    with pytest.raises(ContractError, match=r"Needs.forward needs 'attention_mask', but the batch dict has keys "
                                            r"\['input_ids', 'labels'\]"):
        ModelCall(Needs()).arguments(as_batch({"input_ids": torch.zeros(2, 3), "labels": torch.zeros(2)}))


def test_explicit_loss_wins_over_the_models_own_and_gets_the_raw_output():
    m = NanoGPTish()
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 2, 3])
    b = as_batch((x, y))
    o = ModelCall(m)(m, b)
    got = compute_loss(o, b, loss_fn=lambda out, t: out[0].detach().sum() * 0 + 42.0, default=None)
    assert got.item() == 42.0


def test_no_loss_and_no_targets_is_one_line():
    o = parse_output(torch.zeros(2, 3))
    with pytest.raises(ContractError, match="returned no loss and the batch has no targets"):
        compute_loss(o, Batch((torch.zeros(2, 3),), {}, None), loss_fn=None, default=None)


def test_dtypes_normalised_the_same_for_every_container():
    assert normalize_inputs(torch.zeros(2, dtype=torch.float64)).dtype == torch.float32
    assert normalize_inputs({"a": torch.zeros(2, dtype=torch.float64), "b": torch.zeros(2, dtype=torch.int32)})[
        "b"].dtype == torch.int32  # inputs that are ids keep their dtype
    for dt in (torch.int8, torch.int16, torch.int32, torch.uint8, torch.bool):
        assert normalize_targets(torch.zeros(2, dtype=dt)).dtype == torch.int64
    assert normalize_targets(torch.zeros(2, dtype=torch.float64)).dtype == torch.float32
    assert normalize_targets(torch.zeros(2, dtype=torch.bfloat16)).dtype == torch.bfloat16


@pytest.mark.parametrize("logits, targets, task", [
    (torch.randn(8, 10), torch.randint(0, 10, (8,)), "classify"),
    (torch.randn(8, 1), torch.randint(0, 2, (8,)).float(), "binary"),
    (torch.randn(8), torch.randint(0, 2, (8,)), "binary"),
    (torch.randn(8, 4), torch.randint(0, 2, (8, 4)).float(), "multilabel"),
    (torch.randn(8, 1), torch.randn(8), "regression"),
    (torch.randn(8, 3), torch.randn(8, 3), "regression"),
    (torch.randn(2, 6, 30), torch.randint(0, 30, (2, 6)), "lm"),
])
def test_tasks_inferred_from_targets_and_logits(logits, targets, task):
    assert infer_task(logits, targets) == task
    check_fit(task, logits, targets)


def test_targets_that_do_not_fit_the_task_are_one_line():
    with pytest.raises(ContractError, match=r"targets go from 0 to 12 but the model outputs 10 classes"):
        check_fit("classify", torch.randn(3, 10), torch.tensor([0, 12, 3]))
    with pytest.raises(ContractError, match=r"--task binary needs targets that are 0 or 1"):
        check_fit("binary", torch.randn(3, 1), torch.tensor([0.0, 0.5, 1.0]))
    with pytest.raises(ContractError, match=r"--task classify needs integer class indices"):
        check_fit("classify", torch.randn(3, 10), torch.randn(3))
    with pytest.raises(ContractError, match=r"do not fit logits of shape \(3, 10\)"):
        infer_task(torch.randn(3, 10), torch.randn(3))


def _run_metrics(task_name, logits, targets, **kw):
    task = make_task(task_name, targets=targets, **kw)
    sums = task.sums(logits, targets).tolist()
    loss = float(task.default_loss(logits, targets))
    return task.finish(sums, len(targets), loss)


def test_binary_single_logit_accuracy_and_f1_against_a_hand_count():
    logits = torch.tensor([2.0, -1.0, 0.5, -3.0, 1.0, -0.2])
    targets = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    # predictions (logit > 0): 1 0 1 0 1 0 -> correct: y n? 1=1 ok, 0=0 ok, 1!=0, 0!=1, 1=1 ok, 0=0 ok -> 4/6
    # tp = 2 (idx 0, 4), fp = 1 (idx 2), fn = 1 (idx 3) -> F1 = 4 / (4 + 1 + 1)
    m = _run_metrics("binary", logits.reshape(6, 1), targets)
    assert m["accuracy"] == pytest.approx(4 / 6, abs=0)
    assert m["f1"] == pytest.approx(4 / 6, abs=1e-12)


def test_regression_metrics_match_scikit_learn():
    sklearn_metrics = pytest.importorskip("sklearn.metrics")
    g = torch.Generator().manual_seed(0)
    y = torch.randn(50, 2, generator=g, dtype=torch.float64)
    pred = y + 0.3 * torch.randn(50, 2, generator=g, dtype=torch.float64)
    m = _run_metrics("regression", pred, y)
    assert m["r2"] == pytest.approx(sklearn_metrics.r2_score(y.numpy(), pred.numpy()), rel=1e-12)
    assert m["mse"] == pytest.approx(sklearn_metrics.mean_squared_error(y.numpy(), pred.numpy()), rel=1e-12)
    assert m["mae"] == pytest.approx(sklearn_metrics.mean_absolute_error(y.numpy(), pred.numpy()), rel=1e-12)


def test_regression_loss_does_not_broadcast_b1_against_b():
    logits, targets = torch.tensor([[1.0], [2.0], [3.0]]), torch.tensor([1.0, 2.0, 4.0])
    loss = make_task("regression", targets=targets).default_loss(logits, targets)
    assert float(loss) == pytest.approx(1 / 3)  # a broadcast (3,1)-(3,) would average a 3x3 matrix


def test_classify_ignores_ignore_index_in_accuracy():
    logits = torch.tensor([[5.0, 0.0], [0.0, 5.0], [5.0, 0.0]])
    targets = torch.tensor([0, -100, 1])
    assert _run_metrics("classify", logits, targets)["accuracy"] == 0.5  # sample 0 hit, 1 ignored, 2 missed


def test_lm_metrics_follow_from_the_loss():
    logits, targets = torch.randn(2, 5, 7), torch.randint(0, 7, (2, 5))
    m = _run_metrics("lm", logits, targets, unit="char")
    assert m["perplexity"] == pytest.approx(math.exp(m["loss"]))
    assert m["bits_per_char"] == pytest.approx(m["loss"] / math.log(2))
    assert 0 <= m["token_accuracy"] <= 1
    m = _run_metrics("lm", logits, targets, aligned=False)
    assert m["token_accuracy"] is None and "bits_per_token" in m
