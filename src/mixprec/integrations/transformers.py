"""``MixprecCallback`` for the Hugging Face ``Trainer``: ``mixprec.watch`` over the Trainer's model and optimizer.

    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.add_callback(MixprecCallback(trainer=trainer, out="watch", every=100))
    trainer.train()

The Trainer hands its callbacks the model and the optimizer (``on_train_begin``), not the loss scaler, which
lives on its accelerator (``trainer.accelerator.scaler``, a ``torch.amp.GradScaler`` for fp16 on a GPU; None
for bf16, fp32 and on a CPU): pass ``trainer=`` so the callback can read it. Without it an fp16 run is watched
as if unscaled (its skipped steps show as steps without an optimizer step). The watch's hooks do the rest: the
model's forward (the Trainer calls ``model(**inputs)``; a model that returns its loss gives the replay its
seed), the optimizer's step hooks (on the torch optimizer inside accelerate's wrapper); ``on_step_end`` ends
each optimizer step (applied or skipped), ``on_log`` adds the Trainer's ``grad_norm`` to the step it logged,
``on_train_end`` writes the final reports.
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from ..watching.api import start
from ..watching.config import WatchConfig

__all__ = ["MixprecCallback"]


class MixprecCallback(TrainerCallback):
    """Watch a Hugging Face Trainer's run; keyword arguments are ``mixprec.watch``'s (``out``, ``every``...)."""

    def __init__(self, *, trainer: Any = None, **watch_kwargs: Any) -> None:
        WatchConfig(**watch_kwargs).validate()  # a bad setting fails here, not at step 0
        self.trainer = trainer
        self.kwargs = watch_kwargs
        self.watch = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        accelerator = getattr(self.trainer, "accelerator", None)
        scaler = getattr(accelerator, "scaler", None)
        self.watch = start(model, optimizer, scaler=scaler, driver="callbacks", source="transformers Trainer",
                           **self.kwargs)

    def on_step_end(self, args, state, control, **kwargs):
        if self.watch is not None:
            self.watch.close_step()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.watch is not None and logs and logs.get("grad_norm") is not None:
            self.watch.log(grad_norm=logs["grad_norm"])

    def on_train_end(self, args, state, control, **kwargs):
        if self.watch is not None:
            self.watch.close()
