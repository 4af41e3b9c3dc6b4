"""mixprec.watch through the Hugging Face Trainer and the Lightning Trainer (real libraries, tiny models, CPU).

On a CPU neither Trainer makes a loss scaler for ``bf16`` (accelerate makes none off a GPU; Lightning's
``bf16-mixed`` has none), so their planted faults run under bf16; fp16 with a GradScaler runs through
Lightning's ``MixedPrecision`` plugin, which can be given a CPU GradScaler.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from watch_models import BACKWARD, FORWARD, LossNet, Net, batches

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

FAULT_AT = 3


def _fault(out):
    rep = json.loads((out / "watch.json").read_text())
    return rep, rep["nonfinite"]["first_fault"], (out / "report.txt").read_text()


def _finite_grads(model):
    return all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def _hf_run(tmp_path, mode, guard=False):
    """``guard``: a callback drops non-finite gradients before the optimizer step (the Trainer still calls it)."""
    pytest.importorskip("accelerate")  # the Trainer needs it
    transformers = pytest.importorskip("transformers")
    from mixprec.integrations.transformers import MixprecCallback

    class Guard(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            if not _finite_grads(model):
                model.zero_grad(set_to_none=True)

    data = [{"x": x[i], "labels": y[i]} for x, y in batches(5, fault_at=FAULT_AT, mode=mode) for i in range(4)]
    torch.manual_seed(0)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), use_cpu=True, bf16=True, per_device_train_batch_size=4, max_steps=5,
        train_sampling_strategy="sequential", report_to=[], logging_steps=1, save_strategy="no",
        learning_rate=1e-2, disable_tqdm=True)
    trainer = transformers.Trainer(model=LossNet(), args=args, train_dataset=data,
                                   callbacks=[Guard()] if guard else None)
    out = tmp_path / "watch"
    trainer.add_callback(MixprecCallback(trainer=trainer, out=str(out), every=2, plots=False))
    trainer.train()
    return _fault(out)


@pytest.mark.parametrize("mode, phase", [(FORWARD, "forward"), (BACKWARD, "backward")])
def test_hf_trainer_names_the_planted_fault(tmp_path, mode, phase):
    rep, fault, text = _hf_run(tmp_path, mode)
    assert fault["step"] == FAULT_AT and fault["event"]["module"] == "boost" and fault["event"]["phase"] == phase
    assert f"step {FAULT_AT}, {phase} overflow" in text and f"{phase}: aten." in text
    assert rep["title"]["impl"] == "transformers Trainer" and rep["recipe"]["compute"] == "bf16"


def _skipped_by_the_loop(rep):
    return [s["step"] for s in rep["loss_scale_history"]["steps"] if s["skipped"]], rep["watch"]["dropped"]


@pytest.mark.parametrize("mode, phase", [(FORWARD, "forward"), (BACKWARD, "backward")])
def test_hf_trainer_with_a_guard_names_the_fault_it_dropped(tmp_path, mode, phase):
    """The guard resets the non-finite gradients; the Trainer's step then applies nothing: the watch counts an
    iteration ended without an update, names its fault, and advises in TrainingArguments' terms."""
    rep, fault, text = _hf_run(tmp_path, mode, guard=True)
    assert fault["step"] == FAULT_AT and fault["event"]["module"] == "boost" and fault["event"]["phase"] == phase
    assert _skipped_by_the_loop(rep) == ([FAULT_AT], 1) and rep["watch"]["steps"] == 5
    assert "max_grad_norm=1.0" in rep["recommendations"][0]["text"] and "--" not in rep["recommendations"][0]["text"]


def _lightning_run(tmp_path, mode, precision, guard=False):
    """``guard``: ``training_step`` returns None for a non-finite loss (Lightning skips backward), and
    ``on_before_optimizer_step`` drops non-finite gradients."""
    L = pytest.importorskip("lightning")
    from mixprec.integrations.lightning import MixprecCallback

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = Net()

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.cross_entropy(self(x).float(), y)
            return None if guard and not torch.isfinite(loss) else loss

        def on_before_optimizer_step(self, optimizer):
            if guard and not _finite_grads(self):
                optimizer.zero_grad(set_to_none=True)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-2)

    bs = batches(5, fault_at=FAULT_AT, mode=mode)
    loader = DataLoader(TensorDataset(torch.cat([b[0] for b in bs]), torch.cat([b[1] for b in bs])), batch_size=4)
    if precision == "16-mixed":
        from lightning.pytorch.plugins import MixedPrecision

        kw = {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**8))]}
    else:
        kw = {"precision": precision}
    out = tmp_path / "watch"
    torch.manual_seed(0)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=5, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[MixprecCallback(out=str(out), every=2, plots=False)], **kw)
    trainer.fit(Module(), train_dataloaders=loader)
    return _fault(out)


@pytest.mark.parametrize("mode, phase, precision", [(FORWARD, "forward", "bf16-mixed"),
                                                    (BACKWARD, "backward", "bf16-mixed"),
                                                    (BACKWARD, "backward", "16-mixed")])
def test_lightning_trainer_names_the_planted_fault(tmp_path, mode, phase, precision):
    rep, fault, text = _lightning_run(tmp_path, mode, precision)
    assert fault["step"] == FAULT_AT and fault["event"]["module"] == "net.boost" and fault["event"]["phase"] == phase
    assert f"step {FAULT_AT}, {phase} overflow" in text and "net.boost" in text
    hist = rep["loss_scale_history"]
    if precision == "16-mixed":  # the GradScaler skipped the step and backed off
        assert hist["summary"]["skipped"] == 1 and hist["steps"][FAULT_AT]["skipped"]
        assert hist["steps"][FAULT_AT]["next_scale"] == hist["steps"][FAULT_AT]["scale"] / 2
        assert rep["watch"]["scaler"] == "torch"
    else:
        assert hist["summary"]["skipped"] == 0 and rep["watch"]["scaler"] == "none"


@pytest.mark.parametrize("mode, phase, precision", [(FORWARD, "forward", "bf16-mixed"),
                                                    (BACKWARD, "backward", "bf16-mixed"),
                                                    (FORWARD, "forward", "16-mixed")])
def test_lightning_trainer_with_a_guard_names_the_fault_it_dropped(tmp_path, mode, phase, precision):
    rep, fault, text = _lightning_run(tmp_path, mode, precision, guard=True)
    assert fault["step"] == FAULT_AT and fault["event"]["module"] == "net.boost" and fault["event"]["phase"] == phase
    assert _skipped_by_the_loop(rep) == ([FAULT_AT], 1) and rep["watch"]["steps"] == 5
    assert "gradient_clip_val=1.0" in rep["recommendations"][0]["text"]


def test_callbacks_refuse_a_bad_setting_at_construction():
    L = pytest.importorskip("lightning")  # noqa: F841
    from mixprec.integrations.lightning import MixprecCallback
    from mixprec.watching import WatchError

    with pytest.raises(WatchError, match="every must be an integer >= 1"):
        MixprecCallback(every=0)
