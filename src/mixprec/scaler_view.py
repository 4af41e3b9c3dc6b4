"""A read-only view of a loss scaler's state: the one place that reads a scaler's internals.

``torch.amp.GradScaler`` keeps its scale, growth counter and per-optimizer inf checks in private attributes
and offers only syncing getters (``get_scale()`` returns a Python float). Code that must read that state
without a host sync -- the recipe's skip decision, a monitor that logs the scale as a device tensor -- goes
through :class:`ScalerView`, which reads the same state from the three scalers mixprec builds:

- ``torch.amp.GradScaler`` and its subclass
  ``torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler`` (whose ``unscale_`` all-reduces the
  inf check across ranks before recording it): attributes ``_scale``, ``_growth_tracker`` (0-dim tensors,
  ``None`` until the first ``scale()``) and ``_per_optimizer_states[id(optimizer)]["found_inf_per_device"]``
  (a dict device -> one-element float32 tensor, 0-dim in GradScaler and shape ``(1,)`` in ShardedGradScaler,
  filled by ``unscale_``/``step`` and emptied by ``update``); none of them exists on a disabled scaler.
- :class:`mixprec.scaler.DynamicLossScaler`: ``_scale``, ``_growth_tracker``, ``_hysteresis_left`` and
  ``_per_optimizer[id(optimizer)].found_inf`` (one 0-dim float32 tensor on the scale's device, already
  summed over devices and ranks).

tests/test_scaler_view.py pins each of these against the scalers' public behaviour, so a torch release
that renames or reshapes one fails there, not in a training run.

Every method returns the scaler's own tensors (no copy, no host sync) unless its docstring says it syncs:
read them, never modify them, and ``.clone()`` one to keep a value past the next step.
"""

from __future__ import annotations

from typing import Any

import torch

from .scaler import DynamicLossScaler

__all__ = ["ScalerView"]


class ScalerView:
    """Read-only view of ``scaler``: a ``torch.amp.GradScaler`` (``ShardedGradScaler`` included) or a
    :class:`~mixprec.scaler.DynamicLossScaler`.

    Raises:
        TypeError: for any other object.
    """

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
        """The scaler this view reads."""
        return self._scaler

    @property
    def kind(self) -> str:
        """The scaler's class name: ``GradScaler``, ``ShardedGradScaler`` or ``DynamicLossScaler``."""
        return type(self._scaler).__name__

    @property
    def enabled(self) -> bool:
        """Whether the scaler scales at all (a disabled one is a no-op and has no state)."""
        return bool(self._scaler.is_enabled())

    def scale(self) -> torch.Tensor | None:
        """The current scale: a 0-dim float32 tensor on the device of the first scaled loss; ``None`` when
        disabled or before the first ``scale()`` (the scaler has not chosen its device yet). No sync."""
        return self._scaler._scale if self.enabled else None

    def growth_tracker(self) -> torch.Tensor | None:
        """Clean steps counted towards the next growth: a 0-dim int32 tensor beside the scale; ``None`` as
        for :meth:`scale`. No sync."""
        return self._scaler._growth_tracker if self.enabled else None

    def hysteresis_left(self) -> torch.Tensor | None:
        """Overflows the scaler still tolerates without backing off (0-dim int32): DynamicLossScaler only,
        ``None`` for PyTorch's scalers (they have no hysteresis) and as for :meth:`scale`. No sync."""
        return self._scaler._hysteresis_left if self._mixprec and self.enabled else None

    def found_inf(self, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
        """The inf/NaN check of ``optimizer``'s gradients since the last ``update()``: a 0-dim float32 tensor,
        > 0 when any gradient (on any rank, for the scalers that all-reduce it) was inf or NaN.

        ``None`` when the scaler is disabled or has not checked this optimizer since the last ``update()``
        (``update()`` forgets the checks, in PyTorch's scalers as in mixprec's): read it between
        ``unscale_()``/``step()`` and ``update()``. No sync; gradients on several devices cost one small
        add per extra device, onto the first one's.
        """
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
        """A token that changes at least when an iteration ends with a skipped step, so a caller that sees no
        ``optimizer.step()`` can tell a skip from gradient accumulation without a sync. PyTorch's scalers: their
        per-optimizer state dict, which every ``update()`` replaces (compare with ``is``; holding it keeps its
        id from being reused). DynamicLossScaler: its count of skipped steps (compare with ``==``). No sync."""
        if self._mixprec:
            return self._scaler.skipped_steps
        return self._scaler._per_optimizer_states if self.enabled else None

    def skipped(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer``'s gradients had inf/NaN (so its step is skipped); False when not checked
        (see :meth:`found_inf`). Syncs once: reads the check on the host."""
        found = self.found_inf(optimizer)
        return found is not None and found.item() > 0

    def scale_value(self) -> float:
        """The scale as a Python float (the initial scale before the first ``scale()``, 1.0 when disabled).
        Syncs: call it at log points, not per step."""
        return float(self._scaler.get_scale())
