"""``MixprecCallback`` for the Lightning ``Trainer``: ``mixprec.watch`` over the LightningModule and its optimizer.

    trainer = L.Trainer(callbacks=[MixprecCallback(out="watch", every=100)], precision="bf16-mixed")

The callback finds the optimizer in ``trainer.optimizers`` and the loss scaler on the precision plugin
(``trainer.precision_plugin.scaler``: a ``torch.amp.GradScaler`` for ``16-mixed``, None for bf16 and fp32).
Lightning calls ``optimizer.step(closure)`` when nothing is scaled, so the gradients do not exist yet when the
optimizer's step pre-hook runs: the callback's ``on_before_optimizer_step`` (after backward and unscaling,
before the step) does the watch's check instead, and ``on_train_batch_end`` ends the step (applied or
skipped). ``on_before_backward`` hands the watch the loss. The replay re-runs the LightningModule's forward,
so ``training_step`` should call ``self(...)``; one that only calls submodules still gets the telemetry and
the triggers, without a replay.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import Callback

from ..watching.api import start
from ..watching.config import WatchConfig

__all__ = ["MixprecCallback"]


class MixprecCallback(Callback):
    """Watch a Lightning Trainer's run; keyword arguments are ``mixprec.watch``'s (``out``, ``every``...)."""

    def __init__(self, **watch_kwargs: Any) -> None:
        WatchConfig(**watch_kwargs).validate()  # a bad setting fails here, not at step 0
        self.kwargs = watch_kwargs
        self.watch = None

    def on_train_start(self, trainer, pl_module):
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.watch = start(pl_module, trainer.optimizers[0], scaler=scaler, driver="callbacks",
                           source="lightning Trainer", **self.kwargs)

    def on_before_backward(self, trainer, pl_module, loss):
        if self.watch is not None:
            self.watch.log(loss=loss)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self.watch is not None:
            self.watch.before_step()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.watch is not None and self.watch.step_finished():
            self.watch.close_step()

    def on_train_end(self, trainer, pl_module):
        self._close()

    def on_exception(self, trainer, pl_module, exception):
        self._close()

    def _close(self) -> None:
        if self.watch is not None:
            self.watch.close()
