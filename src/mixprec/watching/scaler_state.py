"""What the watch reads of a loss scaler: ``torch.amp.GradScaler`` (and its subclass ``ShardedGradScaler``),
:class:`mixprec.DynamicLossScaler`, or none.

Neither scaler exposes its per-iteration state (the scale as a device tensor, this iteration's inf check, whether
the gradients were already unscaled) publicly, and reading them through ``get_scale()`` would sync with the
device. :func:`read_scaler` is the one place that reads those internals; everything else in the watch sees a
:class:`ScalerState`. (The project's shared wrapper of scaler internals replaces this function when it lands.)

Nothing here syncs: tensors are handed back as they are.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

__all__ = ["ScalerState", "scaler_kind", "read_scaler"]


@dataclasses.dataclass(frozen=True)
class ScalerState:
    """One look at a scaler, between two of its calls."""

    kind: str
    """``none``, ``torch`` (GradScaler, ShardedGradScaler) or ``mixprec`` (DynamicLossScaler)."""
    enabled: bool
    scale: torch.Tensor | None
    """The scale as a 0-dim device tensor (None before the first ``scale()`` call, or disabled)."""
    init_scale: float
    """The scale before the first ``scale()`` call."""
    found_inf: torch.Tensor | None
    """This iteration's inf/NaN check for the optimizer (0-dim, > 0 if any), None before it ran."""
    unscaled: bool
    """The optimizer's gradients were divided by the scale this iteration."""
    iteration: Any
    """An object the scaler replaces at every ``update()`` (GradScaler); compare with ``is``. None: mixprec."""
    skipped_steps: int | None
    """The scaler's own count of skipped steps (DynamicLossScaler); None where it keeps none."""


def scaler_kind(scaler: Any) -> str | None:
    """``none``, ``torch`` or ``mixprec``; None for an object the watch does not know."""
    from ..scaler import DynamicLossScaler

    if scaler is None:
        return "none"
    if isinstance(scaler, torch.amp.GradScaler):
        return "torch"
    if isinstance(scaler, DynamicLossScaler):
        return "mixprec"
    return None


def read_scaler(scaler: Any, optimizer: torch.optim.Optimizer) -> ScalerState:
    """The scaler's state for ``optimizer`` now (no host-device sync)."""
    kind = scaler_kind(scaler)
    if kind == "none" or kind is None or not scaler.is_enabled():
        return ScalerState("none", False, None, 1.0, None, True, None, None)
    if kind == "torch":
        states = scaler._per_optimizer_states
        st = states.get(id(optimizer))  # a defaultdict: .get() adds nothing
        per_device = list(st["found_inf_per_device"].values()) if st else []
        found = per_device[0] if len(per_device) == 1 else (sum(per_device) if per_device else None)
        unscaled = bool(st) and st["stage"].name == "UNSCALED"
        return ScalerState("torch", True, scaler._scale, float(scaler._init_scale), found, unscaled, states, None)
    st = scaler._per_optimizer.get(id(optimizer))
    unscaled = st is not None and st.stage.name == "UNSCALED"
    found = st.found_inf if st is not None else None
    return ScalerState("mixprec", True, scaler._scale, float(scaler._init_scale), found, unscaled, None,
                       scaler.skipped_steps)
