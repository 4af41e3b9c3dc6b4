"""The model contract wired in: real models and data as people have them, through train, fit, bench and doctor.

Unit tests of the contract itself are in tests/test_contract.py. Hugging Face models come from tiny configs
with random weights (tests/userpkg/contract_models.py); nothing is downloaded.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from mixprec.train.api import fit
from mixprec.train.build import build_run
from mixprec.train.config import TrainConfig
from mixprec.train.contract import as_batch
from mixprec.train.data.sources import UserBatches, data_from_splits
from mixprec.train.loop import train

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from userpkg import contract_models as cm  # noqa: E402

M = "userpkg.contract_models"
M_FILE = str(ROOT / "tests" / "userpkg" / "contract_models.py")  # what bench's worker processes can import
QUIET = dict(log_every=0, progress="off")
RECIPES = ("fp32", "bf16-mixed", "fp16-mixed", "fp8-mixed")


@pytest.fixture
def corpus(tmp_path):
    """A small character corpus for --dataset text."""
    words = "the quick brown fox jumps over a lazy dog and runs far away from home".split()
    g = torch.Generator().manual_seed(0)
    lines = [" ".join(words[int(i)] for i in torch.randint(0, len(words), (12,), generator=g)) for _ in range(300)]
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(lines), encoding="utf-8")
    return str(path)


def _one_line(code, err, match):
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert code == 2 and "Traceback" not in err and len(lines) == 1, err
    assert match in lines[0], lines[0]


# ------------------------------------------------------------------- the probe: shifted labels, fast, no HF


class ShiftsInside(nn.Module):
    """What a Hugging Face causal LM does with ``labels``: the loss of logits[:, :-1] against labels[:, 1:]."""

    def __init__(self, vocab=11):
        super().__init__()
        self.emb, self.head = nn.Embedding(vocab, 8), nn.Linear(8, vocab)

    def forward(self, input_ids, labels=None):
        logits = self.head(self.emb(input_ids))
        loss = None
        if labels is not None:
            v = logits.shape[-1]
            loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, v), labels[:, 1:].reshape(-1))
        return {"logits": logits, "loss": loss}


def _lm_run(batches):
    config = TrainConfig.from_flags(model="ShiftsInside", dataset="user batch", precision="fp32", **QUIET)
    torch.manual_seed(0)
    return build_run(config, data=UserBatches(batches), model=ShiftsInside())


def test_a_model_that_shifts_its_labels_gets_no_token_accuracy_and_is_not_shifted_twice():
    ids = torch.randint(0, 11, (4, 9), generator=torch.Generator().manual_seed(0))
    # Hugging Face convention: labels are the inputs; the model's own loss trains it, token accuracy is off
    run = _lm_run([{"input_ids": ids, "labels": ids}])
    assert run.task.name == "lm" and run.task.aligned is False and run.objective.call.pass_targets
    assert any("token accuracy is not reported" in n for n in run.notes)
    # targets already the next tokens (--dataset text, nanoGPT data): passing them would shift twice
    run = _lm_run([(ids[:, :-1], ids[:, 1:])])
    assert run.task.aligned is True and run.objective.call.pass_targets is False
    assert any("shifted twice" in n for n in run.notes)
    out = run.objective.forward(run.model, as_batch((ids[:, :-1], ids[:, 1:])))
    assert out.loss is None  # labels not passed: the task's cross-entropy on aligned logits trains it


# ---------------------------------------------------------------------------- data: dtypes, several inputs


class FloatTargets(torch.utils.data.Dataset):
    """A map-style dataset of float targets (numpy float64, as a pandas column gives them)."""

    def __init__(self):
        import numpy as np

        self.x = np.random.default_rng(0).normal(size=(8, 3))
        self.y = np.array([-1.5, 0.25, 2.75, -0.5, 1.0, 0.0, 3.5, -2.25])

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def test_a_datasets_float_targets_are_kept_not_truncated():
    src = data_from_splits((FloatTargets(), FloatTargets()), "floats")
    assert src.task is None and src.num_classes == 1 and src.notes  # float64 inputs: said once
    x, y = next(iter(src.eval_batches(torch.arange(8), 8)))
    assert x.dtype == torch.float32 and y.dtype == torch.float32
    assert y.tolist() == [-1.5, 0.25, 2.75, -0.5, 1.0, 0.0, 3.5, -2.25]  # int() would have made -1, 0, 2...


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 4), nn.Linear(2, 4)

    def forward(self, x1, x2):
        return self.a(x1) + self.b(x2)


def test_several_inputs_reach_forward_in_order():
    from mixprec.train.step import train_step

    g = torch.Generator().manual_seed(0)
    split = (torch.randn(16, 3, generator=g), torch.randn(16, 2, generator=g), torch.randint(0, 4, (16,), generator=g))
    config = TrainConfig.from_flags(model="TwoInputs", dataset="two inputs", precision="fp32", batch_size=8, **QUIET)
    torch.manual_seed(0)
    run = build_run(config, data=data_from_splits((split, split), "two inputs"), model=TwoInputs())
    assert run.task.name == "classify"
    batch = next(iter(run.train_loader))
    assert len(batch) == 3 and [t.shape[1:] for t in batch[:2]] == [(3,), (2,)]
    loss, _ = train_step(run.ctx, *batch)
    assert math.isfinite(float(loss))


# ------------------------------------------------------------------------------- bad input, one line each


def test_an_output_mixprec_cannot_use_is_one_line(cli):
    code, _, err = cli("train", "--model", f"{M}:unusable_output", "--dataset", f"{M}:float64_int32_tensors",
                       "--max-steps", "1", "--log-every", "0", "--progress", "off")
    _one_line(code, err, "the model returned a dict with keys ['scores'] with neither 'logits' nor 'loss'")


def test_a_batch_dict_without_what_the_model_needs_is_one_line(cli):
    code, _, err = cli("train", "--model", f"{M}:needs_mask", "--dataset", f"{M}:bert_data_without_mask",
                       "--max-steps", "1", "--log-every", "0", "--progress", "off")
    _one_line(code, err, "NeedsMask.forward needs 'attention_mask', but the batch dict has keys "
                         "['input_ids', 'token_type_ids', 'labels']")


def test_targets_that_do_not_fit_the_task_are_one_line(cli):
    code, _, err = cli("train", "--model", f"{M}:linear5", "--dataset", f"{M}:float64_int32_tensors",
                       "--task", "binary", "--max-steps", "1", "--log-every", "0", "--progress", "off")
    _one_line(code, err, "--task binary needs one logit per target value, got targets (2,) (int64), logits (2, 3)")


# -------------------------------------------------------------------------------- tasks, end to end (fit)


@pytest.mark.slow
def test_binary_single_logit_with_float_targets_reports_the_hand_counted_accuracy():
    (x, y), (xt, yt) = cm.binary_tensors()
    model = cm.single_logit((6,))
    r = fit(model, ((x, y), (xt, yt)), precision="fp32", epochs=3, batch_size=32, lr=0.1, **QUIET)
    rec = r.history[-1]
    assert rec.task == "binary" and rec.metric == "test_accuracy" and r.summary.metric == "test_accuracy"
    with torch.no_grad():
        pred = model(xt).reshape(-1) > 0  # the instance was trained in place (fp32: same dtype and device)
    hits = int((pred == (yt > 0.5)).sum())
    tp, fp, fn = int((pred & (yt > 0.5)).sum()), int((pred & (yt < 0.5)).sum()), int((~pred & (yt > 0.5)).sum())
    assert rec.test_accuracy == hits / len(yt) and rec.test_accuracy > 0.9
    assert rec.test_f1 == pytest.approx(2 * tp / (2 * tp + fp + fn), abs=1e-12)


@pytest.mark.slow
def test_mse_regression_on_diabetes_reports_r2(capsys):
    metrics = pytest.importorskip("sklearn.metrics")
    (x, y), (xt, yt) = cm.diabetes()
    model = cm.mlp_regressor((10,), 1)
    r = fit(model, ((x, y), (xt, yt)), precision="fp32", epochs=20, batch_size=32, lr=0.05, **QUIET)
    out = capsys.readouterr().out
    assert "float64 inputs are trained as float32" in out and "task regression (inferred)" in out
    rec = r.history[-1]
    assert rec.task == "regression" and r.summary.metric == "test_r2" and "test R²" in out
    with torch.no_grad():
        pred = model(xt.float()).reshape(-1).double()
    assert rec.test_r2 == pytest.approx(metrics.r2_score(yt.numpy(), pred.numpy()), abs=1e-5)
    assert rec.test_mse == pytest.approx(metrics.mean_squared_error(yt.numpy(), pred.numpy()), rel=1e-5)
    assert rec.test_r2 > 0.3  # it learned something real (the targets' variance is 1)


@pytest.mark.slow
def test_float64_inputs_and_int32_labels_train_alike_from_tensors_and_datasets():
    flags = dict(precision="fp32", epochs=2, batch_size=16, lr=0.1, **QUIET)
    a = fit(f"{M}:linear5", cm.float64_int32_tensors(), **flags)
    b = fit(f"{M}:linear5", cm.float64_int32_datasets(), **flags)
    assert a.history[-1].task == b.history[-1].task == "classify"
    assert [h.loss_curve for h in a.history] == [h.loss_curve for h in b.history]  # bit for bit
    assert a.history[-1].test_accuracy == b.history[-1].test_accuracy > 0.6


@pytest.mark.slow
def test_nanogpt_forward_gets_the_targets_and_its_own_loss_trains_it(corpus, capsys):
    torch.manual_seed(0)
    from mixprec.train.data.text import text_data

    vocab = text_data(corpus, block_size=16).vocab_size
    model = cm.nanogpt(vocab, 16)
    r = fit(model, "text", precision="bf16-mixed", data_path=corpus, block_size=16, batch_size=8, max_steps=4,
            limit_test=16, **QUIET)
    assert "trained with NanoGPT's own loss" in capsys.readouterr().out
    assert model.calls_with_targets >= 4 + 1  # every step and the evaluation called forward(idx, targets)
    rec = r.history[-1]
    assert rec.task == "lm" and rec.metric == "test_loss" and rec.bits_per_char is not None
    assert rec.test_token_accuracy is not None  # nanoGPT's logits line up with its targets


# ------------------------------------------------------------------------- Hugging Face, every recipe


@pytest.mark.slow
def test_hugging_face_models_train_under_every_recipe(corpus, cli):
    pytest.importorskip("transformers")
    text = dict(dataset="text", data_path=corpus, block_size=16, limit_test=16)
    cases = {"llama": text, "gpt2": text, "bert": dict(dataset=f"{M}:bert_data")}
    for name, data in cases.items():
        for recipe in RECIPES:
            r = train(TrainConfig.from_flags(model=f"{M}:{name}", precision=recipe, batch_size=8, max_steps=2,
                                             epochs=1, **data, **QUIET))
            rec, s = r.history[-1], r.summary
            assert r.stopped is None and math.isfinite(rec.train_loss) and math.isfinite(rec.test_loss), (name, recipe)
            if name == "bert":
                assert (rec.task, s.metric) == ("classify", "test_accuracy") and 0 <= rec.test_accuracy <= 1
            else:
                assert (rec.task, s.metric) == ("lm", "test_loss") and rec.bits_per_char is not None
    # the CLI and its notes: BERT's own loss through labels=, the mask in the dict, the unused key named
    code, out, err = cli("train", "--model", f"{M}:bert", "--dataset", f"{M}:bert_data", "--max-steps", "2",
                         "--batch-size", "8", "--precision", "bf16-mixed", "--log-every", "0", "--progress", "off")
    assert code == 0, err
    assert "trained with BertForSequenceClassification's own loss" in out
    assert "'token_type_ids'" not in out  # BERT takes token_type_ids: nothing is left out
    # the API with a module instance and a GPT-2 dict batch where labels are the inputs (the HF convention)
    ids = torch.randint(0, 30, (6, 16), generator=torch.Generator().manual_seed(0))
    gpt = cm.gpt2(30, 16)
    r = fit(gpt, ({"input_ids": ids, "labels": ids}, {"input_ids": ids[:2], "labels": ids[:2]}),
            precision="fp16-mixed", batch_size=3, max_steps=2, **QUIET)
    assert r.history[-1].task == "lm" and r.history[-1].test_token_accuracy is None  # shifted inside: no accuracy
    assert r.history[-1].bits_per_token is not None


@pytest.mark.slow
def test_bench_on_a_llama_names_the_tasks_metric(corpus, tmp_path):
    pytest.importorskip("transformers")
    from mixprec.cli import main

    out = tmp_path / "bench"
    code = main(["bench", "--precisions", "fp32,bf16-mixed", "--repeats", "1", "--model", f"{M_FILE}:llama",
                 "--dataset", "text", "--data-path", corpus, "--block-size", "16", "--limit-test", "16",
                 "--batch-size", "8", "--max-steps", "4", "--epochs", "1", "--warmup-steps", "1",
                 "--peak-seconds", "0.05", "--device", "cpu", "--no-plots", "--no-plan", "--out", str(out)])
    doc = json.loads((out / "results.json").read_text())
    assert code == 0, [r.get("reason") for r in doc["runs"]]
    for row in doc["summary"]:
        assert row["task"] == "lm" and row["metric"] == "test_loss" and row["test_metric"]["median"] > 0
    assert all(r["summary"]["metric"] == "test_loss" for r in doc["runs"])
    assert "test loss / bits per char" in (out / "results.md").read_text()


@pytest.mark.slow
def test_doctor_on_bert_and_a_gpt2_dict_batch(cli, tmp_path):
    pytest.importorskip("transformers")
    from mixprec.doctor import diagnose

    code, out, err = cli("doctor", "--model", f"{M}:bert", "--dataset", f"{M}:bert_data", "--batch-size", "8",
                         "--steps", "2", "--no-plots", "--out", tmp_path / "doc")
    assert code == 0, err
    assert "1. Precision map" in out and (tmp_path / "doc" / "doctor.json").exists()
    ids = torch.randint(0, 30, (4, 16), generator=torch.Generator().manual_seed(0))
    report = diagnose(cm.gpt2(30, 16), {"input_ids": ids, "labels": ids}, precision="bf16-mixed", steps=2)
    losses = [r.loss for r in report.history.records]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)
    assert report.precision_map is not None and report.ranges.layers
