"""The mechanisms behind a recipe's autocast and loss scaler: one small strategy class each.

A :class:`~mixprec.precision.Recipe` owns one :class:`Mechanism`, which decides what depends on whose code runs
the recipe (autocast context, loss scaler, skipping a loss-scaled step, options it cannot honour,
``torch.compile``); what the recipe means stays the recipe's.

- :class:`NativeMechanism` (``native``): ``torch.autocast`` + ``torch.amp.GradScaler`` (``ShardedGradScaler``
  across processes).
- :class:`ScratchMechanism` (``scratch``): :mod:`mixprec.autocast` + :class:`~mixprec.scaler.DynamicLossScaler`;
  per-module fp32 overrides, hysteresis, and emulation (low-precision values, fp32 arithmetic) of dtypes the
  device runs slowly.

A new mechanism is one subclass overriding the hooks it changes, registered in :data:`MECHANISMS`.
"""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar

import torch
from torch import nn

from . import hardware
from .errors import RecipeError
from .recipes import RecipeSpec, dtype_name
from .scaler import DynamicLossScaler, ScalerConfig
from .scaler_view import ScalerView

__all__ = ["Mechanism", "NativeMechanism", "ScratchMechanism", "MECHANISMS", "AMP_IMPLS", "auto_mechanism"]


class Mechanism:
    """How one recipe's forward casts and loss scaling run on one device; the base's hooks do nothing.

    ``caps``: what the device can do (:class:`~mixprec.hardware.Capabilities`, asked once by the recipe).
    """

    name: ClassVar[str]
    """Its ``--amp-impl`` name."""
    autocast_words: ClassVar[str]
    scaler_words: ClassVar[str]
    skips_on_device: ClassVar[bool] = False
    """Whether its scaler can skip a step on the device (with an optimizer that takes ``found_inf``)."""

    def __init__(self, spec: RecipeSpec, *, scaler: ScalerConfig, keep_fp32: tuple[str, ...],
                 caps: hardware.Capabilities, world_size: int = 1) -> None:
        self.spec = spec
        self.scaler_config = scaler
        self.keep_fp32 = keep_fp32
        self.caps = caps
        self.device = caps.device
        self.world_size = world_size
        self.emulate = False  # True where this mechanism runs the low dtype emulated (its values, fp32 arithmetic)

    def refuse_options(self) -> None:
        """Raise RecipeError for an option this mechanism cannot honour (called once, at build)."""

    def make_scaler(self) -> Any:
        """The loss scaler, disabled (a no-op with the same API) when the recipe has no loss scaling."""
        raise NotImplementedError

    def check_module(self, model: nn.Module) -> None:
        """Check the converted model against this mechanism's options (RecipeError on a mistake)."""

    def autocast(self, model: nn.Module | None) -> contextlib.AbstractContextManager:
        """The forward's autocast context (autocast recipes only)."""
        raise NotImplementedError

    def step_or_skip(self, scaler: Any, optimizer: torch.optim.Optimizer, *, hold: torch.Tensor | None = None,
                     on_device: bool = False) -> bool | torch.Tensor:
        """Loss-scaled recipes, after ``scaler.unscale_(optimizer)``: step unless the gradients had inf/NaN; returns
        whether it skipped. One host sync (the skip decision), or none with ``on_device`` where
        :attr:`skips_on_device` (then the answer is a 0-dim float32 flag). ``hold`` (0-dim, 0 or 1): skip whatever
        the gradients and leave the scaler's state as it was (a halted run, :mod:`mixprec.guard`)."""
        raise NotImplementedError

    def update(self, scaler: Any) -> None:
        """After :meth:`step_or_skip` (or the optimizer's step): the scaler's update."""
        scaler.update()

    def check_compile(self) -> None:
        """Raise RecipeError where ``torch.compile`` cannot help this mechanism."""

    def notes(self) -> list[str]:
        """Clauses for :meth:`Recipe.describe` on what it does differently with the checked model."""
        return []


class NativeMechanism(Mechanism):
    """``torch.autocast`` + ``torch.amp.GradScaler`` (``ShardedGradScaler`` for several processes)."""

    name = "native"
    autocast_words = "torch.autocast"
    scaler_words = "torch.amp.GradScaler"

    def refuse_options(self) -> None:
        if self.keep_fp32:
            raise RecipeError(
                "--keep-fp32 needs per-module overrides, which torch.autocast lacks; add --amp-impl scratch"
            )
        if self.scaler_config.hysteresis != 1:
            raise RecipeError("--hysteresis is a feature of mixprec's scaler; add --amp-impl scratch")

    def make_scaler(self) -> torch.amp.GradScaler:
        """Several processes get ``ShardedGradScaler`` (all-reduces ``found_inf``, so every rank skips alike)."""
        c = self.scaler_config
        kw = dict(init_scale=c.init_scale, growth_factor=c.growth_factor, backoff_factor=c.backoff_factor,
                  growth_interval=c.growth_interval)
        if self.world_size > 1 and self.spec.loss_scaling:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            return ShardedGradScaler(self.device.type, **kw)
        return torch.amp.GradScaler(self.device.type, enabled=self.spec.loss_scaling, **kw)

    def __init__(self, spec: RecipeSpec, **kw: Any) -> None:
        super().__init__(spec, **kw)
        self._fp32_lstms: tuple[tuple[str, nn.Module], ...] = ()
        self._held_scale: torch.Tensor | None = None

    @property
    def fp32_lstms(self) -> tuple[str, ...]:
        """The ``nn.LSTM`` layers this CPU's torch.autocast cannot run in the compute dtype (they run in fp32)."""
        return tuple(name for name, _ in self._fp32_lstms)

    def check_module(self, model: nn.Module) -> None:
        """Find fp32 LSTMs: torch.autocast hands them to oneDNN in the compute dtype, which raises where oneDNN
        has no such kernel."""
        low = self.spec.compute_dtype
        if not (self.spec.autocast and self.device.type == "cpu" and low != torch.float32):
            return
        found = tuple((n or type(model).__name__, m) for n, m in model.named_modules()
                      if type(m) is nn.LSTM and m.proj_size == 0
                      and all(p.dtype == torch.float32 for p in m.parameters()))
        if found and not self.caps.autocast_runs_lstm(low):
            self._fp32_lstms = found

    def notes(self) -> list[str]:
        if not self._fp32_lstms:
            return []
        low = dtype_name(self.spec.compute_dtype)
        return [f"nn.LSTM {', '.join(self.fp32_lstms)} in fp32: torch.autocast runs LSTMs through oneDNN, which "
                f"has no {low} LSTM on this CPU (it would raise); --amp-impl scratch runs them in {low}"]

    def autocast(self, model: nn.Module | None) -> contextlib.AbstractContextManager:
        """torch.autocast; the LSTMs :meth:`check_module` found run in fp32 by hooks that live inside the context."""
        ac = torch.autocast(self.device.type, dtype=self.spec.compute_dtype)
        if not self._fp32_lstms or model is None:
            return ac
        from .autocast.fp32_forward import Fp32Forward

        stack = contextlib.ExitStack()
        stack.enter_context(ac)
        stack.callback(Fp32Forward("cpu").install(m for _, m in self._fp32_lstms).remove)
        return stack

    def step_or_skip(self, scaler: Any, optimizer: torch.optim.Optimizer, *, hold: torch.Tensor | None = None,
                     on_device: bool = False) -> bool:
        # The skip is read from the unscale_ the recipe ran (GradScaler.step's own read then finds it ready).
        # A skipped step never reaches the optimizer: GradScaler hands a fused optimizer its found_inf, and the
        # fused kernels skip only when it is exactly 1, but ShardedGradScaler sums it over ranks (2 when two
        # ranks overflow), so scaler.step would apply the inf step. update() needs only the unscale_'s check.
        # So the decision stays on the host whatever on_device says.
        view = ScalerView(scaler)
        if hold is None:
            skipped = view.skipped(optimizer)
            if not skipped:
                scaler.step(optimizer)
            return skipped
        found = view.found_inf(optimizer)
        assert found is not None, "step_or_skip: call scaler.unscale_(optimizer) first"
        code = int(((found > 0).float() + 2 * hold.to(found.device)).item())  # 1: inf/NaN, 2 or 3: held
        if code >= 2:
            scale = view.scale()
            assert scale is not None
            self._held_scale = scale.clone()
            return True
        if code == 0:
            scaler.step(optimizer)
        return code == 1

    def update(self, scaler: Any) -> None:
        """A held iteration keeps the scale (``update(new_scale=...)`` keeps the growth count too)."""
        held, self._held_scale = self._held_scale, None
        if held is None:
            scaler.update()
        else:
            scaler.update(new_scale=held)


class ScratchMechanism(Mechanism):
    """mixprec's autocast + DynamicLossScaler; emulates the compute dtype where it is slow
    (:attr:`~mixprec.hardware.Capabilities.slow_dtypes`)."""

    name = "scratch"
    autocast_words = "mixprec autocast"
    scaler_words = "DynamicLossScaler"
    skips_on_device = True

    def __init__(self, spec: RecipeSpec, **kw: Any) -> None:
        super().__init__(spec, **kw)
        self.emulate = _emulable(spec, self.caps.slow_dtypes)

    def make_scaler(self) -> DynamicLossScaler:
        c = self.scaler_config
        return DynamicLossScaler(init_scale=c.init_scale, growth_factor=c.growth_factor,
                                 backoff_factor=c.backoff_factor, growth_interval=c.growth_interval,
                                 hysteresis=c.hysteresis, enabled=self.spec.loss_scaling)

    def check_module(self, model: nn.Module) -> None:
        if not (self.keep_fp32 and self.spec.autocast):
            return
        from .autocast.keep_fp32 import resolve_keep_fp32

        try:  # a name the model lacks is the user's mistake: say so now, not at the first forward
            resolve_keep_fp32(self.keep_fp32, model)
        except (ValueError, TypeError) as e:
            raise RecipeError(f"--keep-fp32: {e}") from None

    def autocast(self, model: nn.Module | None) -> contextlib.AbstractContextManager:
        from .autocast import autocast

        return autocast(self.spec.compute_dtype, device_type=self.device.type, emulate=self.emulate,
                        keep_fp32=self.keep_fp32, model=model)

    def step_or_skip(self, scaler: Any, optimizer: torch.optim.Optimizer, *, hold: torch.Tensor | None = None,
                     on_device: bool = False) -> bool | torch.Tensor:
        if hold is not None:
            scaler.hold(hold)
        if on_device:
            return scaler.step_on_device(optimizer)
        return not scaler.step(optimizer)

    def check_compile(self) -> None:
        """The scratch autocast's TorchFunctionMode breaks a compiled graph at every op."""
        if not self.spec.autocast:
            return
        low = dtype_name(self.spec.compute_dtype)
        instead = {"fp16": "compile bf16-mixed instead",
                   "bf16": "its native bf16 matmuls are a slow fallback, so compile fp32 instead"}[low]
        raise RecipeError(
            f"--compile with {self.spec.name} [scratch]: torch.compile breaks its graph at every op of "
            f"mixprec's autocast (no fusion, different {low} rounding); use --amp-impl native"
            + (f" — on this CPU {low} is only fast emulated: {instead}" if self.emulate else ""))


MECHANISMS: dict[str, type[Mechanism]] = {m.name: m for m in (NativeMechanism, ScratchMechanism)}

AMP_IMPLS: tuple[str, ...] = ("auto", *MECHANISMS)


def auto_mechanism(spec: RecipeSpec, caps: hardware.Capabilities) -> str:
    """``--amp-impl auto``: native, except a compute dtype the device runs slowly (not FP8/FP4), which gets scratch."""
    return ScratchMechanism.name if _emulable(spec, caps.slow_dtypes) else NativeMechanism.name


def _emulable(spec: RecipeSpec, slow: frozenset[torch.dtype]) -> bool:
    return spec.autocast and spec.fp8 is None and spec.compute_dtype in slow
