"""``mixprec.watch(model, optimizer, ...)``: check the call, then start a :class:`~.core.Watch`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import check_keywords
from .config import WatchConfig, WatchError, check_watch_args, unwrap_model
from .core import Watch

__all__ = ["watch"]


def watch(model: nn.Module, optimizer: torch.optim.Optimizer, *, scaler: Any = None, out: str | None = None,
          every: int = 100, on_fault: str = "record", **options: Any) -> Watch:
    """Watch ``model`` and ``optimizer`` in the caller's own training loop (the loop does not change).

    Use as ``with mixprec.watch(model, opt, scaler=scaler, out="watch") as w:`` around the loop, or call
    ``w.close()`` at the end. ``w.log(loss=..., grad_norm=...)`` is optional. A loop that skips non-finite
    steps itself is watched as it is: each iteration it ends without a step is counted and its fault named.

    Args:
        scaler: the loop's ``torch.amp.GradScaler``, ``ShardedGradScaler`` or ``mixprec.DynamicLossScaler``;
            None for bf16/fp32 loops (a disabled scaler counts as none).
        out: folder for watch.json, report.txt, steps.csv, PNGs, TensorBoard scalars and capture.pt.
        every: sample every N optimizer steps (step 0 first).
        on_fault: ``record`` (report, the loop goes on as it would) or ``raise`` (stop at the fault with
            :class:`~mixprec.errors.NonFiniteError`).
        options: the other :class:`~.config.WatchConfig` fields (``check``, ``formats``, ``localize``,
            ``max_captures``, ``collapse_below``, ``skip_run``, ``lost_updates``, ``plots``, ``tensorboard``...).

    Raises:
        WatchError: a model without parameters, an optimizer that does not step the model's parameters, an
            unknown scaler, a bad setting or an ``out`` that cannot be written; nothing is installed then.
    """
    return start(model, optimizer, scaler=scaler, out=out, every=every, on_fault=on_fault, **options)


def start(model: nn.Module, optimizer: Any, *, scaler: Any = None, driver: str = "hooks", source: str = "user loop",
          **settings: Any) -> Watch:
    """:func:`watch` for the integrations: ``driver="callbacks"`` leaves ending steps to the caller."""
    fields = set(WatchConfig.__dataclass_fields__)
    check_keywords("mixprec.watch", settings, fields | {"model", "optimizer", "scaler"}, error=WatchError)
    config = WatchConfig(**{k: (tuple(v) if k == "formats" else v) for k, v in settings.items()})
    config.validate()
    opt = check_watch_args(model, optimizer, scaler)
    return Watch(unwrap_model(model), opt, scaler=scaler, config=config, driver=driver, source=source)
