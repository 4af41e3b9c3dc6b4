"""The watch's settings, and the checks a ``mixprec.watch(...)`` call goes through before anything is touched."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import torch
from torch import nn

from ..errors import UsageError
from ..formats import get_format
from ..probes.loss_scale import scaler_kind
from ..probes.ranges import DEFAULT_FORMATS
from ..probes.subsample import DEFAULT_SAMPLE_ELEMENTS
from ..validate import is_int, is_real

__all__ = ["WatchConfig", "WatchError", "unwrap_model", "unwrap_optimizer", "check_watch_args"]


class WatchError(UsageError):
    """A ``mixprec.watch(...)`` call that cannot work as asked; the message names the fix."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class WatchConfig:
    every: int = 100
    """Sample every N optimizer steps (step 0 included): per-layer ranges, lost updates, gradient norms."""
    out: str | None = None
    """Folder for watch.json, report.txt, steps.csv, the PNG plots, TensorBoard scalars and captures."""
    on_fault: str = "record"
    """``record``: report a fault and let the loop go on as it would; ``raise``: stop the run with
    :class:`~mixprec.errors.NonFiniteError` (a fault the replay classifies as one, a loss-scale collapse, or a
    run of skipped steps; a loss-scale overflow that a smaller scale avoids never raises)."""
    check: str = "exact"
    """Without a loss scaler: ``exact`` reads the finite flag before every optimizer step (one read a step: a
    fault is caught, replayed and captured before the update changes the weights); ``deferred`` keeps it on the
    device until the next sample reads it (no read a step: for loops that skip non-finite steps themselves, whose
    skipped iterations are still replayed and named; a non-finite step the loop applies is only counted, and finite
    gradients whose fp32 reduction overflows count as non-finite: the exact re-check needs them)."""
    formats: tuple[str, ...] = DEFAULT_FORMATS
    """Formats the sampled ranges are projected onto."""
    localize: bool = True
    """Replay a non-finite step on a copy of the model to name its first non-finite op (and the fp32 set)."""
    max_localized: int = 3
    """Replay at most this many non-finite steps (scale overflows count; the search stops at the first fault)."""
    max_captures: int = 1
    """Flight-recorder captures kept on disk (capture.pt, then capture-2.pt, ...); 0 keeps none."""
    collapse_below: float = 1.0
    """A loss scale below this triggers the recorder (scaled loops only)."""
    skip_run: int = 10
    """This many skipped steps in a row trigger the recorder (scaled loops only)."""
    lost_updates: bool = True
    """Measure lost updates on sampled steps (a shadow fp32 optimizer step over copies of the stepped tensors)."""
    sample_elements: int = DEFAULT_SAMPLE_ELEMENTS
    """A sampled step reads a tensor of more elements than this (an activation, a gradient, a stepped tensor)
    through a fixed strided subsample of about this many (:mod:`mixprec.probes.subsample`): histogram and
    lost-update fractions become estimates, the largest magnitude and whether any value is non-finite stay exact;
    0 reads every tensor whole. Faults are never sampled."""
    plots: bool = True
    """Write the PNG plots (with matplotlib): at close, on a trigger, and at samples at most every plot_seconds."""
    plot_seconds: float = 300.0
    """Least wall time between two PNG rewrites at samples."""
    tensorboard: bool | None = None
    """Write TensorBoard scalars into out/tensorboard: None writes them when tensorboard is installed."""

    def validate(self) -> None:
        if not (is_int(self.every) and self.every >= 1):
            raise WatchError(f"mixprec.watch(..., every={self.every!r}): every must be an integer >= 1 (sample "
                             "every N optimizer steps; the default is 100)")
        if self.on_fault not in ("record", "raise"):
            raise WatchError(f"mixprec.watch(..., on_fault={self.on_fault!r}): choose on_fault='record' (report and "
                             "go on) or on_fault='raise' (stop the run at the fault)")
        if self.check not in ("exact", "deferred"):
            raise WatchError(f"mixprec.watch(..., check={self.check!r}): choose check='exact' (read the finite flag "
                             "before every step) or check='deferred' (read it at the next sample)")
        for name in ("max_localized", "max_captures", "skip_run", "sample_elements"):
            v = getattr(self, name)
            if not (is_int(v) and v >= (1 if name == "skip_run" else 0)):
                raise WatchError(f"mixprec.watch(..., {name}={v!r}): {name} must be an integer >= "
                                 f"{1 if name == 'skip_run' else 0}")
        for name in ("collapse_below", "plot_seconds"):
            v = getattr(self, name)
            if not (is_real(v) and math.isfinite(v) and v >= 0):
                raise WatchError(f"mixprec.watch(..., {name}={v!r}): {name} must be a finite number >= 0")
        for f in self.formats:
            try:
                get_format(f)
            except (KeyError, ValueError, UsageError) as e:
                raise WatchError(f"mixprec.watch(..., formats={self.formats!r}): {e}") from None
        if self.out is not None:
            _check_writable(self.out)


def _check_writable(out: Any) -> None:
    """``out`` is, or can become, a folder this process writes into (nothing is created here)."""
    try:
        path = os.path.abspath(os.fspath(out))
    except TypeError:
        raise WatchError(f"mixprec.watch(..., out={out!r}): out must be a folder path (a str or os.PathLike)") from None
    probe = path
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise WatchError(f"mixprec.watch(..., out={out!r}): {probe} is a file, not a folder; pass a folder the run "
                         "can write into")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise WatchError(f"mixprec.watch(..., out={out!r}): {probe} is not writable by this process; pass a folder "
                         "the run can write into")


def unwrap_model(model: Any) -> Any:
    """The module inside ``DistributedDataParallel`` (and ``DataParallel``): the watch hooks, samples and replays
    the rank's own module, so a replay of a step (or the doctor's fp32 search) runs no collective."""
    seen = 0
    while isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)) and seen < 8:
        model, seen = model.module, seen + 1
    return model


def unwrap_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside framework wrappers (accelerate's AcceleratedOptimizer, LightningOptimizer)."""
    seen = 0
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer) and seen < 8:
        optimizer, seen = optimizer.optimizer, seen + 1
    return optimizer


def check_watch_args(model: Any, optimizer: Any, scaler: Any) -> torch.optim.Optimizer:
    """Refuse what cannot be watched, before anything is installed; returns the (unwrapped) optimizer."""
    if not isinstance(model, nn.Module) or not any(True for _ in model.parameters()):
        what = "has no parameters" if isinstance(model, nn.Module) else f"is a {type(model).__name__}"
        raise WatchError(f"mixprec.watch(model, ...): the model {what}; pass the nn.Module the optimizer trains")
    opt = unwrap_optimizer(optimizer)
    if not isinstance(opt, torch.optim.Optimizer):
        raise WatchError(f"mixprec.watch(model, optimizer): optimizer is a {type(optimizer).__name__}, not a "
                         "torch.optim.Optimizer; pass the optimizer whose step() the loop calls")
    stepped = [p for g in opt.param_groups for p in g["params"]]
    own = {id(p) for p in model.parameters()}
    trainable = [p for p in model.parameters() if p.requires_grad]
    masters = len(stepped) == len(trainable) and all(a.shape == b.shape for a, b in zip(stepped, trainable))
    if not any(id(p) in own for p in stepped) and not masters:
        raise WatchError("mixprec.watch(model, optimizer): the optimizer steps none of the model's parameters; "
                         "pass the optimizer built over this model (e.g. torch.optim.AdamW(model.parameters())) "
                         "and the model it trains")
    if scaler_kind(scaler) is None:
        raise WatchError(f"mixprec.watch(..., scaler={type(scaler).__name__}): unknown loss scaler; pass the "
                         "torch.amp.GradScaler, ShardedGradScaler or mixprec.DynamicLossScaler the loop steps "
                         "with, or None for bf16/fp32 loops")
    return opt
