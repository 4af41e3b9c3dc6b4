"""What a probe reads of a loop's loss scaler (``torch.amp.GradScaler``, ``ShardedGradScaler``,
:class:`mixprec.DynamicLossScaler` or none): a thin layer over :class:`mixprec.scaler_view.ScalerView`, the one
reader of scaler internals. Nothing here syncs unless its docstring says so.
"""

from __future__ import annotations

from typing import Any

import torch

from ..scaler_view import ScalerView

__all__ = ["ScalerReader", "scaler_kind", "iteration_changed"]


def scaler_kind(scaler: Any) -> str | None:
    """``none``, ``torch`` or ``mixprec``; None for an object that is not a loss scaler."""
    if scaler is None:
        return "none"
    try:
        view = ScalerView(scaler)
    except TypeError:
        return None
    return "mixprec" if view.kind == "DynamicLossScaler" else "torch"


class ScalerReader:
    """One scaler, read for one optimizer; a disabled scaler (or none) reads as ``kind == "none"``."""

    __slots__ = ("scaler", "optimizer", "kind", "enabled", "fused", "_view")

    def __init__(self, scaler: Any, optimizer: torch.optim.Optimizer) -> None:
        kind = scaler_kind(scaler)
        self.scaler, self.optimizer = scaler, optimizer
        self._view = ScalerView(scaler) if kind not in (None, "none") else None
        self.enabled = self._view is not None and self._view.enabled
        self.kind = kind if self.enabled else "none"
        self.fused = self.kind != "none" and bool(getattr(optimizer, "_step_supports_amp_scaling", False))
        """The optimizer takes ``found_inf``: GradScaler steps it even when skipping (the kernel reads it), as
        DynamicLossScaler.step_on_device does (mixprec train); its ``step`` hands it over on applied steps."""

    def scale(self) -> torch.Tensor | None:
        """The scale tensor (None when disabled or before the first ``scale()``)."""
        return self._view.scale() if self.enabled else None

    @property
    def init_scale(self) -> float:
        """The scale before the first ``scale()`` call (1 when disabled, NaN once a scale tensor exists)."""
        if not self.enabled:
            return 1.0
        return self._view.scale_value() if self._view.scale() is None else float("nan")

    def scale_or_init(self) -> torch.Tensor | float:
        """The scale tensor, else the initial scale as a number."""
        t = self.scale()
        return t if t is not None else self.init_scale

    def iteration(self) -> Any:
        """The view's iteration token (None when disabled); :func:`iteration_changed` compares two."""
        return self._view.iteration() if self.enabled else None

    def found_inf(self) -> torch.Tensor | None:
        """This iteration's inf check for the optimizer (0-dim, > 0 if any), None before it ran."""
        return self._view.found_inf(self.optimizer) if self.enabled else None

    @property
    def unscaled(self) -> bool:
        """The optimizer's gradients were divided by the scale this iteration (checked and not fused); True when
        there is no scaling."""
        if not self.enabled:
            return True
        return self.found_inf() is not None and not bool(getattr(self.optimizer, "_step_supports_amp_scaling", False))


def iteration_changed(before: Any, now: Any) -> bool:
    """Whether the scaler ended an iteration between two looks (identity for objects, equality for counts)."""
    return before != now if isinstance(before, int) else before is not now
