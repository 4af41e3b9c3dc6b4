"""What the watch reads of a loss scaler: ``torch.amp.GradScaler`` (and its subclass ``ShardedGradScaler``),
:class:`mixprec.DynamicLossScaler`, or none -- through :class:`mixprec.scaler_view.ScalerView`, the one wrapper
of scaler internals, and nothing else.

Besides the view's tensors (scale, found_inf), the watch needs to know when the scaler finished an iteration
without calling ``optimizer.step()`` (a skipped step, which no optimizer hook sees): the view's
:meth:`~mixprec.scaler_view.ScalerView.iteration` token, compared with :func:`iteration_changed`.

Nothing here syncs: tensors are handed back as they are. :class:`ScalerReader` builds the view once (a
scaler's kind and whether it is enabled never change) and offers the few reads an unsampled step needs
without building a whole :class:`ScalerState`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..scaler_view import ScalerView

__all__ = ["ScalerState", "ScalerReader", "scaler_kind", "read_scaler", "iteration_changed"]


@dataclasses.dataclass(frozen=True)
class ScalerState:
    """One look at a scaler, between two of its calls."""

    kind: str
    """``none``, ``torch`` (GradScaler, ShardedGradScaler) or ``mixprec`` (DynamicLossScaler)."""
    enabled: bool
    scale: torch.Tensor | None
    """The scale as a 0-dim device tensor (None before the first ``scale()`` call, or disabled)."""
    init_scale: float
    """The scale before the first ``scale()`` call (1 when disabled)."""
    found_inf: torch.Tensor | None
    """This iteration's inf/NaN check for the optimizer (0-dim, > 0 if any), None before it ran."""
    unscaled: bool
    """The optimizer's gradients were divided by the scale this iteration (checked and not fused)."""
    iteration: Any
    """The view's iteration token; :func:`iteration_changed` compares two."""


def scaler_kind(scaler: Any) -> str | None:
    """``none``, ``torch`` or ``mixprec``; None for an object the watch does not know."""
    if scaler is None:
        return "none"
    try:
        view = ScalerView(scaler)
    except TypeError:
        return None
    return "mixprec" if view.kind == "DynamicLossScaler" else "torch"


def read_scaler(scaler: Any, optimizer: torch.optim.Optimizer) -> ScalerState:
    """The scaler's state for ``optimizer`` now (no host-device sync)."""
    kind = scaler_kind(scaler)
    if kind in (None, "none") or not ScalerView(scaler).enabled:
        return ScalerState("none", False, None, 1.0, None, True, None)
    view = ScalerView(scaler)
    scale = view.scale()
    init = view.scale_value() if scale is None else float("nan")  # no tensor yet: the initial scale, no sync
    found = view.found_inf(optimizer)
    fused = bool(getattr(optimizer, "_step_supports_amp_scaling", False))
    return ScalerState(kind, True, scale, init, found, found is not None and not fused, view.iteration())


class ScalerReader:
    """One scaler, read for one optimizer: :meth:`state` (the whole look) and the per-step reads, cheap."""

    __slots__ = ("scaler", "optimizer", "kind", "enabled", "fused", "_view")

    def __init__(self, scaler: Any, optimizer: torch.optim.Optimizer) -> None:
        kind = scaler_kind(scaler)
        self.scaler, self.optimizer = scaler, optimizer
        self._view = ScalerView(scaler) if kind not in (None, "none") else None
        self.enabled = self._view is not None and self._view.enabled
        self.kind = kind if self.enabled else "none"
        self.fused = self.kind == "torch" and bool(getattr(optimizer, "_step_supports_amp_scaling", False))
        """GradScaler steps a fused optimizer even when skipping (the kernel reads ``found_inf``)."""

    def state(self) -> ScalerState:
        return read_scaler(self.scaler, self.optimizer)

    def scale(self) -> torch.Tensor | None:
        """The scale tensor (None when disabled or before the first ``scale()``). No sync."""
        return self._view.scale() if self.enabled else None

    def iteration(self) -> Any:
        """The view's iteration token (None when disabled). No sync."""
        return self._view.iteration() if self.enabled else None

    def found_inf(self) -> torch.Tensor | None:
        """This iteration's inf check for the optimizer, or None. No sync."""
        return self._view.found_inf(self.optimizer) if self.enabled else None


def iteration_changed(before: Any, now: Any) -> bool:
    """Whether the scaler ended an iteration between two looks (identity for objects, equality for counts)."""
    return before != now if isinstance(before, int) else before is not now
