"""Dynamic loss scaling for fp16 training, from scratch.

Why scale
---------
fp16 has 10 mantissa bits but only 5 exponent bits: its smallest subnormal is 2**-24 ~ 6e-8 and
its largest value 65504. Gradients of a well-trained network are often far below 2**-24 and would
flush to zero in fp16. The chain rule is linear, so multiplying the loss by ``S`` multiplies every
gradient by ``S``, lifting them into fp16's range; dividing the gradients by ``S`` again (in the
optimizer's precision) before the step gives the true update. Powers of two make both
multiplications exact.

Why dynamic (growth and backoff)
--------------------------------
The best ``S`` is the largest one for which no gradient overflows, and it drifts during training.
So: after each backward, check every gradient for inf/NaN. If there is one, the step is *skipped*
(the parameters are not touched) and ``S *= backoff_factor``; after ``growth_interval``
consecutive clean steps, ``S *= growth_factor`` (unless that would overflow float32). With
``hysteresis=1`` and no bounds this is exactly ``torch.amp.GradScaler``'s rule, and this class
then uses the same kernels (``torch._amp_foreach_non_finite_check_and_unscale_``,
``torch._amp_update_scale_``), so the two give bit-identical scales and parameters.

Hysteresis (DeepSpeed's ``delayed_shift``)
------------------------------------------
A single spike should not halve the scale. With ``hysteresis=h`` the scaler keeps a budget of
``h - 1`` overflows that are *tolerated*: the step is still skipped (an inf gradient is never
applied) but the scale is kept and the budget shrinks by one. When the budget is spent, each
further overflow backs off. Following DeepSpeed's ``DynamicLossScaler.update_scale``, the budget
is not refilled by the backoff; it is refilled to ``h - 1`` when the scale grows (the default,
DeepSpeed's ``consecutive_hysteresis=False``, so overflows need not be consecutive to use it up)
or after every clean step with ``consecutive_hysteresis=True`` (then exactly ``h - 1``
*consecutive* overflows are tolerated). Any overflow, tolerated or not, restarts the count of
clean steps towards growth. Growth itself follows GradScaler's counter (``growth_interval`` clean
steps), not DeepSpeed's, which grows one step later after an overflow.

Bounds
------
``min_scale`` / ``max_scale`` clamp the result of backoff / growth (Megatron's
``DynamicGradScaler`` does the same for ``min_scale``). The initial scale must lie within them.

Host-device syncs
-----------------
The scale, the growth counter and the hysteresis budget are 0-dim tensors on the device of the
first scaled loss; ``found_inf`` is a 0-dim float32 tensor. :meth:`scale`, :meth:`unscale_` and
:meth:`update` only launch device work. :meth:`step` syncs exactly once, reading ``found_inf`` to
decide whether to call ``optimizer.step()``. :meth:`get_scale` and :meth:`state_dict` sync too
(they return Python numbers); keep them out of the hot path.

Distributed
-----------
When ``torch.distributed`` is initialized, :meth:`unscale_` all-reduces ``found_inf`` with MAX over
the default process group after the local check (one collective per step per optimizer), so every
rank skips the same steps and keeps the same scale. The tensor lives on the scale's device, so use
a backend that supports it (gloo for CPU, nccl for CUDA).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["DynamicLossScaler", "OptState"]


class OptState(enum.Enum):
    """Where one optimizer is in the current iteration; reset to READY by ``update()``."""

    READY = 0
    UNSCALED = 1
    STEPPED = 2


@dataclass
class _PerOptimizer:
    stage: OptState = OptState.READY
    found_inf: torch.Tensor | None = None


_REQUIRED_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


class DynamicLossScaler:
    """Dynamic loss scaler with GradScaler semantics plus hysteresis and bounds.

    Usage (the same calls as ``torch.amp.GradScaler``)::

        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)          # optional, e.g. to clip true gradients
        clip_grad_norm_(params, 1.0)
        applied = scaler.step(optimizer)   # False when the step was skipped
        scaler.update()

    Each optimizer moves through ``READY -unscale_-> UNSCALED -step-> STEPPED -update-> READY``
    (``step`` unscales itself from READY); any other order raises a ``RuntimeError`` that names the
    fix. ``step`` before the first ``scale`` raises too: there would be no scale to unscale by.

    Args:
        init_scale: the first scale (a power of two keeps scaling exact).
        growth_factor: multiplies the scale after ``growth_interval`` consecutive clean steps; > 1.
        backoff_factor: multiplies the scale after an overflow the hysteresis does not absorb; < 1.
        growth_interval: clean steps needed before growing.
        hysteresis: 1 + the number of overflows tolerated without backing off (see module docs).
        min_scale, max_scale: optional bounds on the scale after backoff / growth.
        enabled: ``False`` makes every method a cheap no-op (``step`` just calls ``optimizer.step()``).
        consecutive_hysteresis: refill the hysteresis budget after every clean step instead of
            only when the scale grows.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 1,
        min_scale: float | None = None,
        max_scale: float | None = None,
        enabled: bool = True,
        consecutive_hysteresis: bool = False,
    ) -> None:
        self._enabled = bool(enabled)
        if not self._enabled:
            return
        if growth_factor <= 1.0:
            raise ValueError(f"DynamicLossScaler(growth_factor={growth_factor}): must be > 1.0")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"DynamicLossScaler(backoff_factor={backoff_factor}): must be in (0, 1)")
        if growth_interval < 1:
            raise ValueError(f"DynamicLossScaler(growth_interval={growth_interval}): must be >= 1")
        if hysteresis < 1:
            raise ValueError(f"DynamicLossScaler(hysteresis={hysteresis}): must be >= 1 (1 = no hysteresis)")
        lo = 0.0 if min_scale is None else min_scale
        hi = float("inf") if max_scale is None else max_scale
        if not (0.0 < init_scale and lo <= init_scale <= hi):
            raise ValueError(
                f"DynamicLossScaler(init_scale={init_scale}, min_scale={min_scale}, max_scale={max_scale}):"
                " init_scale must be positive and within [min_scale, max_scale]"
            )
        self._init_scale = float(init_scale)
        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = int(growth_interval)
        self._hysteresis = int(hysteresis)
        self._consecutive_hysteresis = bool(consecutive_hysteresis)
        self._min_scale = None if min_scale is None else float(min_scale)
        self._max_scale = None if max_scale is None else float(max_scale)
        self._init_growth_tracker = 0
        self._init_hysteresis_left = self._hysteresis - 1
        # Lazily created on the device of the first scaled loss (as GradScaler does).
        self._scale: torch.Tensor | None = None
        self._growth_tracker: torch.Tensor | None = None
        self._hysteresis_left: torch.Tensor | None = None
        self._per_optimizer: dict[int, _PerOptimizer] = {}
        self._found_inf: torch.Tensor | None = None
        self._skipped_steps = 0

    # ------------------------------------------------------------------ queries

    def is_enabled(self) -> bool:
        return self._enabled

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled). Syncs with the device."""
        if not self._enabled:
            return 1.0
        return self._init_scale if self._scale is None else float(self._scale.item())

    @property
    def skipped_steps(self) -> int:
        """How many ``step()`` calls skipped ``optimizer.step()`` because of inf/NaN gradients."""
        return self._skipped_steps if self._enabled else 0

    @property
    def found_inf(self) -> torch.Tensor | None:
        """0-dim float32 tensor from the last ``unscale_`` (> 0 if any rank saw inf/NaN), or None."""
        return self._found_inf if self._enabled else None

    # ------------------------------------------------------------------ the iteration

    def scale(self, loss: torch.Tensor | Iterable[torch.Tensor]) -> Any:
        """Return ``loss * scale`` (for a tensor, or elementwise for a list/tuple of tensors)."""
        if not self._enabled:
            return loss
        if isinstance(loss, torch.Tensor):
            if self._scale is None:
                self._lazy_init(loss.device)
            assert self._scale is not None
            return loss * self._scale.to(device=loss.device, non_blocking=True)
        if isinstance(loss, (list, tuple)):
            return type(loss)(self.scale(t) for t in loss)
        raise TypeError(
            f"scale({type(loss).__name__}): pass the loss tensor (or a list/tuple of tensors), "
            "e.g. scaler.scale(loss).backward()"
        )

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale in place and check them for inf/NaN.

        Optional: call it before clipping or inspecting gradients; otherwise ``step`` calls it.
        Gradients are unscaled in their own dtype (fp16, bf16, fp32...), grouped by device and
        dtype into one fused kernel each. No host sync; one all-reduce when distributed.
        """
        if not self._enabled:
            return
        self._require_scale("unscale_(optimizer)")
        state = self._per_optimizer.setdefault(id(optimizer), _PerOptimizer())
        if state.stage is OptState.UNSCALED:
            raise RuntimeError(
                "unscale_(optimizer): unscale_() has already been called on this optimizer since the "
                "last update(); call update() after step() before unscaling again"
            )
        if state.stage is OptState.STEPPED:
            raise RuntimeError(
                "unscale_(optimizer): step() was already called on this optimizer in this iteration; "
                "call unscale_() before step(), then update()"
            )
        assert self._scale is not None
        # fp32 reciprocal can be off by an ulp under some compile options: compute it in float64.
        inv_scale = self._scale.double().reciprocal().float()
        found_inf = self._unscale_grads(optimizer, inv_scale)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
        state.found_inf = found_inf
        state.stage = OptState.UNSCALED
        self._found_inf = found_inf

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> bool:
        """Unscale (unless ``unscale_`` was called) and call ``optimizer.step(*args, **kwargs)``
        unless a gradient is inf/NaN. Returns True if the step was applied.

        This is the one host-device sync per iteration: it reads ``found_inf``.
        """
        if not self._enabled:
            optimizer.step(*args, **kwargs)
            return True
        if "closure" in kwargs or (args and callable(args[0])):
            raise RuntimeError(
                "step(optimizer, closure): closures are not supported with loss scaling (the closure "
                "would re-run backward on an unscaled loss); call scaler.scale(loss).backward() yourself"
            )
        self._require_scale("step(optimizer)")
        state = self._per_optimizer.setdefault(id(optimizer), _PerOptimizer())
        if state.stage is OptState.STEPPED:
            raise RuntimeError(
                "step(optimizer): step() has already been called on this optimizer since the last "
                "update(); call update() once per iteration, after all step() calls"
            )
        if state.stage is OptState.READY:
            self.unscale_(optimizer)
        assert state.found_inf is not None
        applied = not bool(state.found_inf.item())  # the one host sync
        if applied:
            optimizer.step(*args, **kwargs)
        else:
            self._skipped_steps += 1
        state.stage = OptState.STEPPED
        return applied

    def update(self) -> None:
        """Update the scale from this iteration's inf checks (all optimizers), then reset every
        optimizer to READY. No host sync."""
        if not self._enabled:
            return
        self._require_scale("update()")
        found = [s.found_inf for s in self._per_optimizer.values() if s.found_inf is not None]
        if not found:
            raise RuntimeError(
                "update(): no gradients were unscaled or checked since the last update(); "
                "call scaler.step(optimizer) (or scaler.unscale_(optimizer)) before update()"
            )
        assert self._scale is not None and self._growth_tracker is not None
        found_inf = found[0]
        for f in found[1:]:
            found_inf = found_inf + f.to(self._scale.device, non_blocking=True)
        found_inf = found_inf.to(self._scale.device, non_blocking=True)

        if self._hysteresis == 1 and self._min_scale is None and self._max_scale is None:
            torch._amp_update_scale_(
                self._scale, self._growth_tracker, found_inf,
                self._growth_factor, self._backoff_factor, self._growth_interval,
            )
        else:
            self._update_general(found_inf > 0)
        self._per_optimizer.clear()

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state as plain Python values (syncs); ``{}`` when disabled.

        Keys: ``scale`` (float), ``growth_factor``, ``backoff_factor``, ``growth_interval``,
        ``_growth_tracker`` (clean steps since the last overflow or growth) -- the same five keys
        as ``torch.amp.GradScaler`` -- plus ``hysteresis``, ``consecutive_hysteresis``,
        ``_hysteresis_left`` (overflows still tolerated), ``min_scale``, ``max_scale`` (float or
        None) and ``skipped_steps``. Call it after ``update()``.
        """
        if not self._enabled:
            return {}
        return {
            "scale": self.get_scale(),
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": self._init_growth_tracker if self._growth_tracker is None
            else int(self._growth_tracker.item()),
            "hysteresis": self._hysteresis,
            "consecutive_hysteresis": self._consecutive_hysteresis,
            "_hysteresis_left": self._init_hysteresis_left if self._hysteresis_left is None
            else int(self._hysteresis_left.item()),
            "min_scale": self._min_scale,
            "max_scale": self._max_scale,
            "skipped_steps": self._skipped_steps,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a state from :meth:`state_dict` (no-op when disabled).

        A ``torch.amp.GradScaler`` state dict (its five keys) is accepted too; the keys it lacks
        keep this scaler's configuration, a full hysteresis budget and a zero skip count.
        """
        if not self._enabled:
            return
        if not isinstance(state_dict, Mapping):
            raise TypeError(
                f"load_state_dict({type(state_dict).__name__}): expected the dict returned by "
                "DynamicLossScaler.state_dict() (or torch.amp.GradScaler.state_dict())"
            )
        if len(state_dict) == 0:
            raise RuntimeError(
                "load_state_dict({}): the state dict is empty, probably saved from a disabled scaler; "
                "construct this scaler with enabled=False, or load a state saved while scaling was on"
            )
        missing = [k for k in _REQUIRED_KEYS if k not in state_dict]
        if missing:
            raise ValueError(
                f"load_state_dict(...): not a loss-scaler state dict, missing keys {missing} "
                f"(got keys {sorted(state_dict)}); pass the dict returned by DynamicLossScaler.state_dict()"
            )
        self._init_scale = float(state_dict["scale"])
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = int(state_dict["growth_interval"])
        self._init_growth_tracker = int(state_dict["_growth_tracker"])
        self._hysteresis = int(state_dict.get("hysteresis", self._hysteresis))
        self._consecutive_hysteresis = bool(state_dict.get("consecutive_hysteresis", self._consecutive_hysteresis))
        self._init_hysteresis_left = int(state_dict.get("_hysteresis_left", self._hysteresis - 1))
        self._min_scale = state_dict.get("min_scale", self._min_scale)
        self._max_scale = state_dict.get("max_scale", self._max_scale)
        self._skipped_steps = int(state_dict.get("skipped_steps", 0))
        if self._scale is not None:
            assert self._growth_tracker is not None and self._hysteresis_left is not None
            self._scale.fill_(self._init_scale)
            self._growth_tracker.fill_(self._init_growth_tracker)
            self._hysteresis_left.fill_(self._init_hysteresis_left)

    # ------------------------------------------------------------------ internals

    def _lazy_init(self, device: torch.device) -> None:
        self._scale = torch.full((), self._init_scale, dtype=torch.float32, device=device)
        self._growth_tracker = torch.full((), self._init_growth_tracker, dtype=torch.int32, device=device)
        self._hysteresis_left = torch.full((), self._init_hysteresis_left, dtype=torch.int32, device=device)

    def _require_scale(self, call: str) -> None:
        if self._scale is None:
            raise RuntimeError(
                f"{call}: scale() has not been called yet, so there is nothing to unscale; "
                "call scaler.scale(loss).backward() first in each iteration"
            )

    def _unscale_grads(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor) -> torch.Tensor:
        """Fused unscale + inf/NaN check per (device, dtype) group; returns found_inf on the
        scale's device."""
        groups: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                if g.is_sparse:
                    raise NotImplementedError(
                        f"unscale_(optimizer): a parameter of shape {tuple(p.shape)} has a sparse gradient; "
                        "DynamicLossScaler only unscales dense gradients (use e.g. nn.Embedding(sparse=False), "
                        "or torch.amp.GradScaler)"
                    )
                groups.setdefault(g.device, {}).setdefault(g.dtype, []).append(g)
        assert self._scale is not None
        found_inf = torch.zeros((), dtype=torch.float32, device=self._scale.device)
        with torch.no_grad():
            for device, by_dtype in groups.items():
                dev_found = torch.zeros((), dtype=torch.float32, device=device)
                dev_inv = inv_scale.to(device, non_blocking=True)
                for grads in by_dtype.values():
                    torch._amp_foreach_non_finite_check_and_unscale_(grads, dev_found, dev_inv)
                found_inf += dev_found.to(found_inf.device, non_blocking=True)
        return found_inf

    def _update_general(self, overflow: torch.Tensor) -> None:
        """Growth/backoff with hysteresis and bounds, as device tensor ops (no sync)."""
        scale, tracker, left = self._scale, self._growth_tracker, self._hysteresis_left
        assert scale is not None and tracker is not None and left is not None
        full = torch.full_like(left, self._hysteresis - 1)
        zero = torch.zeros_like(tracker)

        # Overflow: spend one tolerated overflow if any remain, else back off (budget stays empty).
        absorbed = left > 0
        backed = (scale.double() * self._backoff_factor).float()  # product in float64, as ATen does
        if self._min_scale is not None:
            backed = torch.clamp(backed, min=self._min_scale)
        scale_if_inf = torch.where(absorbed, scale, backed)
        left_if_inf = torch.where(absorbed, left - 1, left)

        # Clean step: count it; grow after growth_interval of them (only to a finite float32).
        counted = tracker + 1
        grow = counted >= self._growth_interval
        grown = (scale.double() * self._growth_factor).float()
        if self._max_scale is not None:
            grown = torch.clamp(grown, max=self._max_scale)
        scale_if_ok = torch.where(grow & torch.isfinite(grown), grown, scale)
        tracker_if_ok = torch.where(grow, zero, counted)
        left_if_ok = full if self._consecutive_hysteresis else torch.where(grow, full, left)

        scale.copy_(torch.where(overflow, scale_if_inf, scale_if_ok))
        tracker.copy_(torch.where(overflow, zero, tracker_if_ok))
        left.copy_(torch.where(overflow, left_if_inf, left_if_ok))
