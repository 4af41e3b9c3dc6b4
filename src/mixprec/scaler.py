"""Dynamic loss scaling for fp16 training: :class:`DynamicLossScaler`, a drop-in for ``torch.amp.GradScaler``.

fp16's smallest subnormal is 2**-24, so small gradients flush to zero. The loss is multiplied by a power-of-two
scale ``S`` (every gradient is then multiplied by ``S``) and the gradients are divided by ``S`` again before the
step; powers of two make both exact. An overflowing step (inf/NaN in any gradient) is skipped, parameters
untouched, and ``S *= backoff_factor``; after ``growth_interval`` clean steps ``S *= growth_factor`` (unless that
overflows float32). Hysteresis (DeepSpeed's ``delayed_shift``) tolerates ``hysteresis - 1`` overflows (skipped,
scale kept) before backing off; the budget refills when the scale grows, or after every clean step with
``consecutive_hysteresis=True``. ``min_scale``/``max_scale`` clamp backoff/growth.

GradScaler-exact: with ``hysteresis=1`` and no bounds the update uses GradScaler's kernels, so scales and
parameters are bit-identical. An optimizer with ``_step_supports_amp_scaling`` (fused Adam/AdamW/SGD/Adagrad)
gets GradScaler's contract: ``step`` only checks and the optimizer divides by ``optimizer.grad_scale`` inside its
kernel (bit-identical for any scale). Unlike GradScaler a skipped step never calls ``optimizer.step()`` (fused SGD
with momentum would store uninitialised buffers on a skipped first step), and ``step`` returns whether it applied.

Host syncs: ``scale``, ``unscale_`` and ``update`` only launch device work; ``step`` syncs once (it reads
``found_inf``); ``step_on_device`` never does (the optimizer skips inside its kernels); ``get_scale`` and
``state_dict`` sync. ``hold`` makes an iteration leave everything as it was (a halted run, :mod:`mixprec.guard`).
When ``torch.distributed`` is initialised ``found_inf`` is all-reduced with MAX, so every rank skips the same
steps. Every setting goes through :func:`validate_scaler_settings` (:class:`~mixprec.errors.ScalerConfigError`
naming the flag, argument or key).
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .errors import ScalerConfigError
from .validate import F32_MAX, is_int, is_real

__all__ = ["DynamicLossScaler", "OptState", "ScalerConfig", "validate_scaler_settings"]


# ---------------------------------------------------------------------------------------------
# Settings
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScalerConfig:
    """Dynamic loss scaler settings; the one home of their defaults (GradScaler's)."""

    init_scale: float = 2.0**16
    """Scale of the first step."""
    growth_factor: float = 2.0
    """Multiply the scale by this after ``growth_interval`` consecutive finite steps."""
    backoff_factor: float = 0.5
    """Multiply the scale by this on a step with inf/nan gradients (the step is skipped)."""
    growth_interval: int = 2000
    """Number of consecutive finite steps before growing the scale."""
    hysteresis: int = 1
    """Overflows tolerated before backing off (scratch scaler only; 1 = GradScaler semantics)."""

    def validate(self) -> None:
        """Raise ScalerConfigError (exit 2) naming the flag."""
        validate_scaler_settings(init_scale=self.init_scale, growth_factor=self.growth_factor,
                                 backoff_factor=self.backoff_factor, growth_interval=self.growth_interval,
                                 hysteresis=self.hysteresis)


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


class _Unset:
    def __repr__(self) -> str:
        return "<not given>"


_UNSET: Any = _Unset()
_F32_MIN = 2.0**-149  # the smallest positive float32 (subnormal)
_INT32_MAX = 2**31 - 1


def _positive(x: Any) -> bool:
    return is_real(x) and math.isfinite(x) and x > 0


# setting -> (what it must be, test)
_RULES: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "init_scale": ("a finite number > 0", _positive),
    "growth_factor": ("a finite number > 1", lambda x: is_real(x) and math.isfinite(x) and x > 1),
    "backoff_factor": ("a number in (0, 1)", lambda x: is_real(x) and 0 < x < 1),
    "growth_interval": ("an int >= 1", lambda x: is_int(x) and x >= 1),
    "hysteresis": ("an int >= 1", lambda x: is_int(x) and x >= 1),
    "min_scale": ("None or a finite number > 0", lambda x: x is None or _positive(x)),
    "max_scale": ("None or a finite number > 0", lambda x: x is None or _positive(x)),
    "growth_tracker": ("an int >= 0", lambda x: is_int(x) and x >= 0),
    "hysteresis_left": ("an int >= 0", lambda x: is_int(x) and x >= 0),
    "skipped_steps": ("an int >= 0", lambda x: is_int(x) and x >= 0),
    "consecutive_hysteresis": ("True or False", lambda x: isinstance(x, bool)),
}
_FLOAT32_VALUES = ("init_scale", "min_scale", "max_scale")  # become float32 tensors
_INT32_VALUES = ("growth_interval", "hysteresis", "growth_tracker", "hysteresis_left")  # int32 counters
_FLAGS = {"init_scale": "--init-scale", "growth_factor": "--growth-factor", "backoff_factor": "--backoff-factor",
          "growth_interval": "--growth-interval", "hysteresis": "--hysteresis"}
_STATE_KEYS = {"init_scale": "scale", "growth_tracker": "_growth_tracker", "hysteresis_left": "_hysteresis_left"}


def _labeller(names: str | Mapping[str, str], what: str) -> Callable[[str], str]:
    def label(key: str) -> str:
        if names == "flags":
            name = _FLAGS.get(key, key)
        elif names == "state":
            name = f"state_dict[{_STATE_KEYS.get(key, key)!r}]"
        elif isinstance(names, Mapping):
            name = names.get(key, key)
        else:
            name = key  # "args"
        return f"{what}: {name}" if what else name

    if not (names in ("flags", "args", "state") or isinstance(names, Mapping)):
        raise ValueError(f"validate_scaler_settings(names={names!r}): use 'flags', 'args', 'state' or a dict")
    return label


def _check_one(key: str, value: Any, label: Callable[[str], str]) -> None:
    rule, ok = _RULES[key]
    if not ok(value):
        raise ScalerConfigError(f"{label(key)} must be {rule}, got {value!r}")
    if key in _FLOAT32_VALUES and value is not None and not _F32_MIN <= value <= F32_MAX:
        raise ScalerConfigError(
            f"{label(key)} must fit in float32 ({_F32_MIN:.3g} to {F32_MAX:.4g}), got {value!r}")
    if key in _INT32_VALUES and value > _INT32_MAX:
        raise ScalerConfigError(f"{label(key)} must be at most {_INT32_MAX}, got {value!r}")


def _check_together(given: Mapping[str, Any], label: Callable[[str], str]) -> None:
    lo, hi = given.get("min_scale"), given.get("max_scale")
    if lo is not None and hi is not None and lo > hi:
        raise ScalerConfigError(f"{label('min_scale')} must be <= max_scale, got {lo!r} > {hi!r}")
    init = given.get("init_scale")
    if init is not None and not (lo or 0.0) <= init <= (math.inf if hi is None else hi):
        bounds = f"[{0 if lo is None else repr(lo)}, {'inf' if hi is None else repr(hi)}]"
        raise ScalerConfigError(f"{label('init_scale')} must lie within {bounds}, got {init!r}")
    h, left = given.get("hysteresis"), given.get("hysteresis_left")
    if h is not None and left is not None and left > h - 1:
        raise ScalerConfigError(
            f"{label('hysteresis_left')} must be an int in [0, hysteresis - 1 = {h - 1}], got {left!r}")


def validate_scaler_settings(
    *,
    init_scale: Any = _UNSET,
    growth_factor: Any = _UNSET,
    backoff_factor: Any = _UNSET,
    growth_interval: Any = _UNSET,
    hysteresis: Any = _UNSET,
    min_scale: Any = None,
    max_scale: Any = None,
    growth_tracker: Any = _UNSET,
    hysteresis_left: Any = _UNSET,
    skipped_steps: Any = _UNSET,
    consecutive_hysteresis: Any = _UNSET,
    names: str | Mapping[str, str] = "flags",
    what: str = "",
) -> None:
    """Check the settings passed, each alone and then together; raise ScalerConfigError on the first bad one.

    Scales must be finite, > 0 and fit in float32; counts must be real ints (``2.5``, ``"10"``, ``True``
    are refused, not truncated). ``names`` says how the message names a setting: ``"flags"``
    (``--init-scale``), ``"args"`` (``init_scale``), ``"state"`` (``state_dict['scale']``) or a dict of
    overrides; ``what`` prefixes the message.
    """
    values = {"init_scale": init_scale, "growth_factor": growth_factor, "backoff_factor": backoff_factor,
              "growth_interval": growth_interval, "hysteresis": hysteresis, "min_scale": min_scale,
              "max_scale": max_scale, "growth_tracker": growth_tracker, "hysteresis_left": hysteresis_left,
              "skipped_steps": skipped_steps, "consecutive_hysteresis": consecutive_hysteresis}
    given = {k: v for k, v in values.items() if v is not _UNSET}
    label = _labeller(names, what)
    for key, value in given.items():
        _check_one(key, value, label)
    _check_together(given, label)


# ---------------------------------------------------------------------------------------------
# The scaler
# ---------------------------------------------------------------------------------------------


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
    """Dynamic loss scaler with GradScaler semantics plus hysteresis and bounds (see the module docs).

    Usage (the same calls as ``torch.amp.GradScaler``)::

        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)          # optional, e.g. to clip true gradients
        clip_grad_norm_(params, 1.0)
        applied = scaler.step(optimizer)   # False when the step was skipped
        scaler.update()

    Each optimizer moves through ``READY -unscale_-> UNSCALED -step-> STEPPED -update-> READY``
    (``step`` unscales itself from READY); any other order raises a ``RuntimeError`` that names the
    fix. ``enabled=False`` makes every method a no-op (``step`` just calls ``optimizer.step()``); the
    settings are validated even then.
    """

    def __init__(
        self,
        init_scale: float = ScalerConfig.init_scale,
        growth_factor: float = ScalerConfig.growth_factor,
        backoff_factor: float = ScalerConfig.backoff_factor,
        growth_interval: int = ScalerConfig.growth_interval,
        hysteresis: int = ScalerConfig.hysteresis,
        min_scale: float | None = None,
        max_scale: float | None = None,
        enabled: bool = True,
        consecutive_hysteresis: bool = False,
    ) -> None:
        validate_scaler_settings(
            init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
            growth_interval=growth_interval, hysteresis=hysteresis, min_scale=min_scale, max_scale=max_scale,
            names="args", what="DynamicLossScaler",
        )
        self._enabled = bool(enabled)
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
        self._skipped_steps = 0  # counted on the host (step); step_on_device counts in _device_skips
        self._device_skips: torch.Tensor | None = None
        self._hold: torch.Tensor | None = None

    # ------------------------------------------------------------------ queries and settings

    def is_enabled(self) -> bool:
        return self._enabled

    def get_scale(self) -> float:
        """The current scale (the initial one before the first ``scale()``, 1.0 when disabled). Syncs."""
        if not self._enabled:
            return 1.0
        return self._init_scale if self._scale is None else float(self._scale.item())

    def get_growth_factor(self) -> float:
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        """Used from the next ``update()`` on."""
        validate_scaler_settings(growth_factor=new_factor, names="args", what="set_growth_factor")
        self._growth_factor = float(new_factor)

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        """Used from the next ``update()`` on."""
        validate_scaler_settings(backoff_factor=new_factor, names="args", what="set_backoff_factor")
        self._backoff_factor = float(new_factor)

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Used from the next ``update()`` on (the clean steps counted so far still count)."""
        validate_scaler_settings(growth_interval=new_interval, names="args", what="set_growth_interval")
        self._growth_interval = int(new_interval)

    @property
    def skipped_steps(self) -> int:
        """How many steps were skipped for inf/NaN gradients (held ones not counted). Syncs once a step was
        taken by ``step_on_device``."""
        if not self._enabled:
            return 0
        return self._skipped_steps + (0 if self._device_skips is None else int(self._device_skips.item()))

    @property
    def found_inf(self) -> torch.Tensor | None:
        """0-dim float32 tensor from the last inf/NaN check (> 0 if any rank saw inf/NaN), or None."""
        return self._found_inf if self._enabled else None

    # ------------------------------------------------------------------ the iteration

    def scale(self, loss: torch.Tensor | Iterable[torch.Tensor]) -> Any:
        """``loss * scale``; elementwise for nested lists/tuples, lazily (a ``map``) for other iterables."""
        if not self._enabled:
            return loss
        if isinstance(loss, torch.Tensor):
            if self._scale is None:
                self._lazy_init(loss.device)
            assert self._scale is not None
            return loss * self._scale.to(device=loss.device, non_blocking=True)
        if isinstance(loss, (list, tuple)):
            return type(loss)(self.scale(t) for t in loss)
        if isinstance(loss, Iterable) and not isinstance(loss, (str, bytes)):
            return map(self.scale, loss)
        raise TypeError(
            f"scale({type(loss).__name__}): pass the loss tensor (or a list/tuple of tensors), "
            "e.g. scaler.scale(loss).backward()"
        )

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale in place (in their own dtype) and check them for
        inf/NaN. Optional (before clipping); otherwise ``step`` calls it. No host sync."""
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
        self._record_found_inf(state, self._unscale_grads(optimizer, inv_scale))
        state.stage = OptState.UNSCALED

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> bool:
        """Unscale (unless ``unscale_`` was called) and call ``optimizer.step(*args, **kwargs)`` unless a
        gradient is inf/NaN; return whether the step was applied. The one host sync per iteration."""
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
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            return self._step_unscaling_inside(optimizer, state, args, kwargs)
        if state.stage is OptState.READY:
            self.unscale_(optimizer)
        applied = self._applied(state)
        if applied:
            optimizer.step(*args, **kwargs)
        state.stage = OptState.STEPPED
        return applied

    def step_on_device(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """``step`` without the host read, for an optimizer that skips on the device (``_step_supports_amp_scaling``:
        PyTorch's fused Adam/AdamW/SGD/Adagrad): it is always called, with ``found_inf`` 1.0 on a step to skip, and
        its kernels skip it (restoring their step counts). Returns that 0-dim float32 flag; skips are counted on
        the device. No host sync.

        A fused SGD with momentum stores uninitialised buffers when its first step is skipped: use ``step`` until
        the optimizer has its state."""
        if not self._enabled:
            raise RuntimeError("step_on_device(optimizer): this scaler is disabled; call optimizer.step() instead")
        if not getattr(optimizer, "_step_supports_amp_scaling", False):
            raise RuntimeError(
                f"step_on_device({type(optimizer).__name__}): it cannot skip a step on the device (no "
                "_step_supports_amp_scaling; PyTorch's fused optimizers have it); call step(optimizer) instead")
        self._require_scale("step_on_device(optimizer)")
        state = self._per_optimizer.setdefault(id(optimizer), _PerOptimizer())
        if state.stage is OptState.STEPPED:
            raise RuntimeError(
                "step_on_device(optimizer): step() has already been called on this optimizer since the last "
                "update(); call update() once per iteration, after all step() calls"
            )
        _refuse_grad_scaler_argument(optimizer)
        assert self._scale is not None
        unscaled = state.stage is OptState.UNSCALED
        if not unscaled:  # check only (a multiplier of 1): the optimizer divides by grad_scale itself
            self._record_found_inf(state, self._unscale_grads(optimizer, torch.ones_like(self._scale)))
        assert state.found_inf is not None
        found = state.found_inf > 0
        skip = found.float() if self._hold is None else torch.maximum(found.float(), self._hold)
        counted = found if self._hold is None else found & (self._hold == 0)
        self._device_skips = counted.long() if self._device_skips is None else self._device_skips + counted
        preset = getattr(optimizer, "grad_scale", None)
        try:
            optimizer.grad_scale = preset if unscaled else (
                self._scale.clone() if preset is None else self._scale * preset)
            optimizer.found_inf = skip
            optimizer.step()
        finally:
            for name in ("grad_scale", "found_inf"):
                optimizer.__dict__.pop(name, None)
        state.stage = OptState.STEPPED
        return skip

    def hold(self, flag: torch.Tensor) -> None:
        """This iteration only (until ``update``): skip the step whatever the gradients, and leave the scale, growth
        count, hysteresis budget and skip count as they are where ``flag`` (0-dim float32 on the scale's device,
        0 or 1) is 1 — a run that halted and has not read it yet (:class:`mixprec.guard.StepGuard`). No sync."""
        if self._enabled:
            self._hold = flag

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Update the scale from this iteration's inf checks, then reset every optimizer to READY. No sync.

        ``new_scale`` sets the scale instead: a number (validated) or a one-element tensor on the scale's
        device type without grad (copied; not checked, that would sync). Growth count and budget are kept.
        A held iteration (:meth:`hold`) changes nothing.
        """
        if not self._enabled:
            return
        self._require_scale("update()")
        hold, self._hold = self._hold, None
        assert self._scale is not None and self._growth_tracker is not None and self._hysteresis_left is not None
        state = (self._scale, self._growth_tracker, self._hysteresis_left)
        saved = None if hold is None else [t.clone() for t in state]
        if new_scale is not None:
            self._set_scale(new_scale)
        else:
            self._update_from_found_inf()
        if saved is not None:
            keep = hold > 0
            for t, s in zip(state, saved):
                torch.where(keep, s, t, out=t)
        self._per_optimizer.clear()

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The state as Python values (syncs; ``{}`` when disabled); call it after ``update()``.

        GradScaler's five keys (``scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``,
        ``_growth_tracker``) plus ``hysteresis``, ``consecutive_hysteresis``, ``_hysteresis_left``
        (overflows still tolerated), ``min_scale``, ``max_scale`` and ``skipped_steps``.
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
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` or a GradScaler's (the keys it lacks keep this scaler's settings,
        a full hysteresis budget and no skips). Validated first: a bad state changes nothing."""
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
            raise ScalerConfigError(
                f"load_state_dict(...): not a loss-scaler state dict, missing keys {missing} "
                f"(got keys {sorted(state_dict)}); pass the dict returned by DynamicLossScaler.state_dict()"
            )
        new = self._settings_from(state_dict)
        validate_scaler_settings(**new, names="state", what="load_state_dict")
        self._init_scale = float(new["init_scale"])
        self._growth_factor = float(new["growth_factor"])
        self._backoff_factor = float(new["backoff_factor"])
        self._growth_interval = int(new["growth_interval"])
        self._init_growth_tracker = int(new["growth_tracker"])
        self._hysteresis = int(new["hysteresis"])
        self._consecutive_hysteresis = new["consecutive_hysteresis"]
        self._init_hysteresis_left = int(new.get("hysteresis_left", self._hysteresis - 1))
        self._min_scale = None if new["min_scale"] is None else float(new["min_scale"])
        self._max_scale = None if new["max_scale"] is None else float(new["max_scale"])
        self._skipped_steps = int(new["skipped_steps"])
        self._device_skips = None
        if self._scale is not None:
            assert self._growth_tracker is not None and self._hysteresis_left is not None
            self._scale.fill_(self._init_scale)
            self._growth_tracker.fill_(self._init_growth_tracker)
            self._hysteresis_left.fill_(self._init_hysteresis_left)

    def __getstate__(self) -> dict[str, Any]:
        """Pickle/deepcopy between iterations; the tensors are re-created on the next scaled loss's device."""
        state = self.__dict__.copy()
        if self._scale is not None:
            if self._per_optimizer:
                raise RuntimeError(
                    "pickle/deepcopy(DynamicLossScaler): possible only between iterations, i.e. before "
                    "this iteration's first unscale_()/step() or after update(); move it after update()"
                )
            sd = self.state_dict()
            state.update(_init_scale=sd["scale"], _init_growth_tracker=sd["_growth_tracker"],
                         _init_hysteresis_left=sd["_hysteresis_left"], _scale=None, _growth_tracker=None,
                         _hysteresis_left=None, _skipped_steps=sd["skipped_steps"], _device_skips=None)
        return state

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

    def _record_found_inf(self, state: _PerOptimizer, found_inf: torch.Tensor) -> None:
        """Make the local inf check global (MAX over ranks) and keep it for step() and update()."""
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
        state.found_inf = found_inf
        self._found_inf = found_inf

    def _applied(self, state: _PerOptimizer) -> bool:
        """Whether this optimizer's gradients were finite and the iteration is not held (the one host sync);
        counts a skip."""
        assert state.found_inf is not None
        if self._hold is None:
            applied = not bool(state.found_inf.item())
            if not applied:
                self._skipped_steps += 1
            return applied
        code = int(((state.found_inf > 0).float() + 2 * self._hold).item())  # 1: inf/NaN, 2 or 3: held
        self._skipped_steps += int(code == 1)
        return code == 0

    def _step_unscaling_inside(self, optimizer: torch.optim.Optimizer, state: _PerOptimizer,
                               args: tuple, kwargs: dict) -> bool:
        """GradScaler's contract for ``_step_supports_amp_scaling`` optimizers, minus the call on a skipped step."""
        _refuse_grad_scaler_argument(optimizer)
        assert self._scale is not None
        unscaled = state.stage is OptState.UNSCALED
        if not unscaled:  # check only (a multiplier of 1): the optimizer divides by grad_scale itself
            self._record_found_inf(state, self._unscale_grads(optimizer, torch.ones_like(self._scale)))
        preset = getattr(optimizer, "grad_scale", None)
        applied = self._applied(state)
        try:
            if applied:
                optimizer.grad_scale = preset if unscaled else (
                    self._scale.clone() if preset is None else self._scale * preset)
                optimizer.found_inf = state.found_inf
                optimizer.step(*args, **kwargs)
        finally:
            for name in ("grad_scale", "found_inf"):
                optimizer.__dict__.pop(name, None)
        state.stage = OptState.STEPPED
        return applied

    def _set_scale(self, new_scale: Any) -> None:
        assert self._scale is not None
        if not isinstance(new_scale, torch.Tensor):
            validate_scaler_settings(init_scale=new_scale, min_scale=self._min_scale, max_scale=self._max_scale,
                                     names={"init_scale": "new_scale"}, what="update")
            self._scale.fill_(float(new_scale))
            return
        if new_scale.numel() != 1 or new_scale.requires_grad or new_scale.device.type != self._scale.device.type:
            raise ValueError(
                "update(new_scale=...): new_scale should be a float or a 1-element tensor with "
                f"requires_grad=False on {self._scale.device.type}; got shape {tuple(new_scale.shape)}, "
                f"requires_grad={new_scale.requires_grad}, device {new_scale.device}"
            )
        self._scale.copy_(new_scale.detach().reshape(()))

    def _update_from_found_inf(self) -> None:
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

    def _settings_from(self, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        """A state dict's values under validate_scaler_settings' names (this scaler's where GradScaler's lack them)."""
        get = state_dict.get
        new = {
            "init_scale": state_dict["scale"],
            "growth_factor": state_dict["growth_factor"],
            "backoff_factor": state_dict["backoff_factor"],
            "growth_interval": state_dict["growth_interval"],
            "growth_tracker": state_dict["_growth_tracker"],
            "hysteresis": get("hysteresis", self._hysteresis),
            "consecutive_hysteresis": get("consecutive_hysteresis", self._consecutive_hysteresis),
            "min_scale": get("min_scale", self._min_scale),
            "max_scale": get("max_scale", self._max_scale),
            "skipped_steps": get("skipped_steps", 0),
        }
        if "_hysteresis_left" in state_dict:
            new["hysteresis_left"] = state_dict["_hysteresis_left"]
        return new

    def _unscale_grads(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor) -> torch.Tensor:
        """Fused unscale + inf/NaN check per (device, dtype) group; found_inf on the scale's device."""
        groups: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                if g.is_sparse:  # nn.Embedding(sparse=True): unscale and check the stored values, as GradScaler
                    if g.dtype is torch.float16:
                        # duplicate indices are summed when the optimizer applies the gradient, and in fp16 the
                        # sum can overflow where no single value does: check the coalesced values
                        p.grad = g = g.coalesce()
                    g = g._values()
                elif g.layout is not torch.strided:
                    raise NotImplementedError(
                        f"unscale_(optimizer): a parameter of shape {tuple(p.shape)} has a {g.layout} gradient; "
                        "DynamicLossScaler unscales dense and sparse COO gradients (as torch.amp.GradScaler does)"
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


def _refuse_grad_scaler_argument(optimizer: torch.optim.Optimizer) -> None:
    if "grad_scaler" in inspect.signature(optimizer.step).parameters:
        raise RuntimeError(
            f"step({type(optimizer).__name__}): its step() takes a grad_scaler argument, GradScaler's "
            "deprecated contract, which DynamicLossScaler does not support; make step() read "
            "self.grad_scale and self.found_inf instead (PyTorch's current contract)"
        )
