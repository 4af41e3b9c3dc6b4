"""A read-only view of a loss scaler's state: the one place that reads a scaler's internals.

GradScaler offers only syncing getters; :class:`ScalerView` reads the scale, growth counter and inf checks as
device tensors from the three scalers mixprec builds:

- ``torch.amp.GradScaler`` and ``ShardedGradScaler``: ``_scale``, ``_growth_tracker`` and
  ``_per_optimizer_states[id(opt)]["found_inf_per_device"]`` (device -> float32 tensor, 0-dim in GradScaler,
  shape ``(1,)`` in ShardedGradScaler; emptied by ``update``); none exists on a disabled scaler.
- :class:`mixprec.scaler.DynamicLossScaler`: ``_scale``, ``_growth_tracker``, ``_hysteresis_left`` and
  ``_per_optimizer[id(opt)].found_inf`` (0-dim, already summed over devices and ranks).

tests/test_scaler_view.py pins each against the scalers' public behaviour. Every method returns the scaler's
own tensors (no copy, no sync) unless its docstring says it syncs: never modify them; ``.clone()`` to keep one.
"""

from __future__ import annotations

from typing import Any

import torch

from .scaler import DynamicLossScaler

__all__ = ["ScalerView"]


class ScalerView:
    """Read-only view of a ``torch.amp.GradScaler`` (``ShardedGradScaler`` included) or a DynamicLossScaler."""

    __slots__ = ("_scaler", "_mixprec")

    def __init__(self, scaler: Any) -> None:
        if isinstance(scaler, DynamicLossScaler):
            self._mixprec = True
        elif isinstance(scaler, torch.amp.GradScaler):
            self._mixprec = False
        else:
            raise TypeError(f"ScalerView({type(scaler).__name__}): expected a torch.amp.GradScaler, a "
                            "ShardedGradScaler or a mixprec.scaler.DynamicLossScaler")
        self._scaler = scaler

    @property
    def scaler(self) -> Any:
        return self._scaler

    @property
    def kind(self) -> str:
        return type(self._scaler).__name__

    @property
    def enabled(self) -> bool:
        return bool(self._scaler.is_enabled())

    def scale(self) -> torch.Tensor | None:
        """0-dim float32 on the first scaled loss's device; ``None`` when disabled or before ``scale()``. No sync."""
        return self._scaler._scale if self.enabled else None

    def growth_tracker(self) -> torch.Tensor | None:
        """Clean steps counted towards the next growth (0-dim int32); ``None`` as for :meth:`scale`. No sync."""
        return self._scaler._growth_tracker if self.enabled else None

    def hysteresis_left(self) -> torch.Tensor | None:
        """Overflows still tolerated (0-dim int32); ``None`` for PyTorch's scalers and as for :meth:`scale`. No sync."""
        return self._scaler._hysteresis_left if self._mixprec and self.enabled else None

    def found_inf(self, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
        """The inf/NaN check of ``optimizer``'s gradients (0-dim float32, > 0 when any was inf/NaN); ``None``
        when disabled or not checked since the last ``update()``: read it between ``step()`` and ``update()``.
        No sync."""
        if not self.enabled:
            return None
        s = self._scaler
        if self._mixprec:
            state = s._per_optimizer.get(id(optimizer))
            return None if state is None else state.found_inf
        state = s._per_optimizer_states.get(id(optimizer))  # .get: the dict is a defaultdict; [] would add
        per_device = list(state["found_inf_per_device"].values()) if state else []
        if not per_device:
            return None
        found = per_device[0]
        for t in per_device[1:]:
            found = found + t.to(found.device, non_blocking=True)
        return found.reshape(())  # ShardedGradScaler's is shape (1,); a view, not a copy

    def iteration(self) -> Any:
        """A token that changes at least when an iteration ends with a skipped step (tells a skip from gradient
        accumulation without a sync). PyTorch's scalers: the per-optimizer state dict that every ``update()``
        replaces (compare with ``is``); DynamicLossScaler: the skips ``step`` counted on the host (compare with
        ``==``; ``step_on_device`` always calls the optimizer, whose ``found_inf`` tells its skips). No sync."""
        if self._mixprec:
            return self._scaler._skipped_steps
        return self._scaler._per_optimizer_states if self.enabled else None

    def skipped(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer``'s gradients had inf/NaN; False when not checked. Syncs."""
        found = self.found_inf(optimizer)
        return found is not None and found.item() > 0

    def scale_value(self) -> float:
        """The scale as a Python float (as ``get_scale()``). Syncs: call it at log points, not per step."""
        return float(self._scaler.get_scale())
