"""Precision recipes: the ONLY place that knows what a recipe name means.

A recipe is the answer to "in which dtype does each tensor live and each op run, and how are gradients
kept from underflowing?" Every recipe exposes the same hooks, so the training loop has no precision
branches (the nanoGPT habit: a disabled scaler is a no-op, not an ``if``)::

    model = recipe.convert_module(model)             # cast params where the recipe keeps them low
    opt = recipe.build_optimizer(model, make_opt)     # fp32 master copies where the recipe has them
    with recipe.autocast():                           # ops run in the low dtype per the cast policy
        loss = loss_fn(model(x), y)
    recipe.backward(loss)                             # loss x scale, backward
    result = recipe.step(opt, clip_norm)              # unscale, check, clip true grads, step/skip, update

| recipe        | compute          | params | loss scaling | master weights          |
|---------------|------------------|--------|--------------|-------------------------|
| fp32          | fp32 (TF32 off)  | fp32   | no           | —                       |
| tf32          | TF32 matmuls     | fp32   | no           | —                       |
| fp16-mixed    | autocast fp16    | fp32   | dynamic      | params are the master   |
| bf16-mixed    | autocast bf16    | fp32   | no           | params are the master   |
| fp16-master   | fp16             | fp16   | dynamic      | fp32 copy the optimizer steps |
| bf16-master   | bf16             | bf16   | no           | fp32 copy the optimizer steps |
| bf16-true     | bf16             | bf16   | no           | none (optional stochastic rounding) |
| fp8-mixed     | FP8 GEMMs + bf16 | fp32   | no           | params are the master   |

Two interchangeable mechanisms sit behind the autocast and scaler hooks (``impl``): ``native`` is
PyTorch's ``torch.autocast`` + ``torch.amp.GradScaler``; ``scratch`` is mixprec's own engine
(:mod:`mixprec.autocast`, :mod:`mixprec.scaler`). Master weights are always mixprec's
(:mod:`mixprec.master`): PyTorch has no native equivalent. ``auto`` picks native, except fp16 on a CPU
without fast fp16 kernels, where it picks scratch with emulation (fp16 values, fp32 arithmetic) because
PyTorch's CPU fp16 GEMM fallback is 100x+ slower than fp32.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from . import hardware
from .errors import NonFiniteError, RecipeError

__all__ = [
    "RECIPES",
    "ALIASES",
    "AMP_IMPLS",
    "RecipeSpec",
    "ScalerConfig",
    "RecipeConfig",
    "HardwareFacts",
    "StepResult",
    "Recipe",
    "resolve_recipe",
    "build_recipe",
]

AMP_IMPLS = ("auto", "native", "scratch")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RecipeSpec:
    """What a recipe name means, independent of device and mechanism."""

    name: str
    """Canonical name (what users type, after alias resolution)."""
    compute_dtype: torch.dtype
    """Dtype of the low-precision ops (matmuls, convs); fp32 for full-precision recipes."""
    param_dtype: torch.dtype
    """Dtype the model's parameters are stored in."""
    autocast: bool
    """Run the forward under an autocast context (cast policy per op)."""
    loss_scaling: bool
    """Dynamic loss scaling (needed when gradients can underflow: fp16's 5-bit exponent)."""
    master_weights: bool
    """Keep an fp32 copy of low-precision params for the optimizer to step."""
    tf32: bool = False
    """Allow TF32 tensor-core matmuls for fp32 tensors (GPUs of compute capability 8.0+)."""
    fp8: bool = False
    """Run eligible linear layers' three GEMMs in FP8 with per-tensor scaling (:mod:`mixprec.fp8`)."""
    summary: str
    """One line saying what the recipe does and why."""


_F32, _F16, _BF16 = torch.float32, torch.float16, torch.bfloat16

RECIPES: dict[str, RecipeSpec] = {
    s.name: s
    for s in [
        RecipeSpec(name="fp32", compute_dtype=_F32, param_dtype=_F32, autocast=False, loss_scaling=False,
                   master_weights=False, summary="fp32 everywhere, TF32 off: the reference"),
        RecipeSpec(name="tf32", compute_dtype=_F32, param_dtype=_F32, autocast=False, loss_scaling=False,
                   master_weights=False, tf32=True,
                   summary="fp32 tensors, matmuls on TF32 tensor cores (10-bit mantissa) where the GPU has them"),
        RecipeSpec(name="fp16-mixed", compute_dtype=_F16, param_dtype=_F32, autocast=True, loss_scaling=True,
                   master_weights=False,
                   summary="autocast float16 + dynamic loss scaling (fp16's range is too narrow for small gradients)"),
        RecipeSpec(name="bf16-mixed", compute_dtype=_BF16, param_dtype=_F32, autocast=True, loss_scaling=False,
                   master_weights=False,
                   summary="autocast bfloat16, no loss scaling (bf16 has fp32's exponent range)"),
        RecipeSpec(name="fp16-master", compute_dtype=_F16, param_dtype=_F16, autocast=True, loss_scaling=True,
                   master_weights=True,
                   summary="fp16 params and compute, dynamic loss scaling, fp32 master weights in the optimizer"),
        RecipeSpec(name="bf16-master", compute_dtype=_BF16, param_dtype=_BF16, autocast=True, loss_scaling=False,
                   master_weights=True,
                   summary="bf16 params and compute, fp32 master weights in the optimizer"),
        RecipeSpec(name="bf16-true", compute_dtype=_BF16, param_dtype=_BF16, autocast=True, loss_scaling=False,
                   master_weights=False,
                   summary="bf16 params, compute and optimizer state; no fp32 copy (small updates can round away)"),
        RecipeSpec(name="fp8-mixed", compute_dtype=_BF16, param_dtype=_F32, autocast=True, loss_scaling=False,
                   master_weights=False, fp8=True,
                   summary="FP8 GEMMs in linear layers (e4m3 activations/weights, e5m2 gradients, per-tensor "
                           "power-of-two scales, so no loss scaling), other ops autocast bfloat16"),
    ]
}

ALIASES: dict[str, str] = {
    "32": "fp32", "32-true": "fp32", "float32": "fp32",
    "amp": "fp16-mixed", "16-mixed": "fp16-mixed", "fp16": "fp16-mixed",
    "bf16": "bf16-mixed", "bf16-mixed": "bf16-mixed",
}


def resolve_recipe(name: str) -> RecipeSpec:
    """Map a recipe name or alias to its spec; unknown names raise RecipeError listing the valid ones."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in RECIPES:
        aliases = ", ".join(f"{a}={c}" for a, c in ALIASES.items() if a != c)
        raise RecipeError(
            f"unknown precision {name!r}; choose one of: {', '.join(RECIPES)} (aliases: {aliases})"
        )
    return RECIPES[key]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScalerConfig:
    """Dynamic loss scaler settings (used only by recipes with loss scaling)."""

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
        """Raise ScalerConfigError (exit 2) naming the flag: the scaler's own validation, one for all callers."""
        from .scaler import validate_scaler_settings

        validate_scaler_settings(init_scale=self.init_scale, growth_factor=self.growth_factor,
                                 backoff_factor=self.backoff_factor, growth_interval=self.growth_interval,
                                 hysteresis=self.hysteresis)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RecipeConfig:
    """What a run asks of its precision: the recipe, its mechanism and its options (the config's recipe section)."""

    precision: str = "fp32"
    """Recipe name or alias (fp32, tf32, amp/fp16-mixed, bf16-mixed, fp16-master, bf16-master, bf16-true, fp8-mixed)."""
    amp_impl: str = "auto"
    """Mechanism behind the recipe: native (torch.autocast + GradScaler), scratch (mixprec engine), auto."""
    scaler: ScalerConfig = dataclasses.field(default_factory=ScalerConfig)
    """The dynamic loss scaler (recipes with loss scaling)."""
    stochastic_rounding: bool = False
    """Round updates into low-precision params stochastically (bf16-true, *-master)."""
    keep_fp32: tuple[str, ...] = ()
    """Module names or types kept in fp32 (scratch autocast)."""

    def validate(self) -> None:
        resolve_recipe(self.precision)
        if self.amp_impl not in AMP_IMPLS:
            raise RecipeError(f"unknown --amp-impl {self.amp_impl!r}; choose one of: {', '.join(AMP_IMPLS)}")
        self.scaler.validate()

    def for_recipe(self, name: str) -> tuple[RecipeConfig, list[str]]:
        """This config applied to recipe ``name`` (bench runs one config per recipe), and notes on what
        does not apply: ``--stochastic-rounding`` needs low-precision params, so an fp32-param recipe in
        the same comparison runs without it instead of failing the whole matrix."""
        spec = resolve_recipe(name)
        notes = []
        changes: dict[str, Any] = {"precision": spec.name}
        if self.stochastic_rounding and spec.param_dtype == torch.float32:
            changes["stochastic_rounding"] = False
            notes.append("--stochastic-rounding does not apply (fp32 params) and is off for this recipe")
        if not spec.loss_scaling and self.scaler != _DEFAULT_SCALER:
            changes["scaler"] = _DEFAULT_SCALER
            notes.append("the loss-scaler flags do not apply (no loss scaling) and are off for this recipe")
        return dataclasses.replace(self, **changes), notes


_DEFAULT_SCALER = RecipeConfig().scaler
"""The scaler settings nobody asked to change (a scaler flag on a recipe without a scaler is refused)."""


@dataclasses.dataclass(frozen=True)
class HardwareFacts:
    """What this device does with a recipe's dtypes: one source for :meth:`Recipe.describe` and bench's
    preflight."""

    matmul_dtype: str
    """``fp32``, ``tf32``, ``bf16`` or ``fp16``: what the matmuls actually run in (the MFU peak's dtype)."""
    fast: bool
    """Whether this device has native fast kernels for that dtype."""
    note: str
    """One clause saying so, and why."""


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What one optimizer step did."""

    skipped: bool
    """True when the step was skipped because gradients were inf/nan (loss-scaled recipes only)."""
    grad_norm: torch.Tensor | None
    """Total L2 norm of the true (unscaled) gradients before clipping, as a 0-dim tensor (not synced);
    None unless clipping was asked for."""


class Recipe:
    """A resolved recipe on a device with a mechanism; the training loop's only view of precision.

    Build with :func:`build_recipe`. Hooks, in the order the loop calls them: :meth:`run_context` (once,
    around the whole run), :meth:`convert_module`, :meth:`build_optimizer`, then per step
    :meth:`autocast`, :meth:`backward`, :meth:`step`. :meth:`state_dict` / :meth:`load_state_dict`
    cover the scaler and master weights for checkpoints. :meth:`fsdp_policy` is what the recipe means for
    FSDP2; :meth:`hardware_facts` what the device does with its dtypes.
    """

    def __init__(self, spec: RecipeSpec, config: RecipeConfig, *, device: torch.device, impl: str,
                 emulate_fp16: bool, seed: int = 0, world_size: int = 1) -> None:
        self.spec = spec
        self.config = config
        self.device = device
        self.impl = impl
        # emulation is a feature of the scratch autocast; native fp16 runs PyTorch's real (slow) fp16 kernels
        self.emulate = emulate_fp16 and spec.compute_dtype == torch.float16 and impl == "scratch"
        self.world_size = world_size
        self._seed = seed
        self._model: nn.Module | None = None
        self.fp8_conversion = None  # mixprec.fp8.Fp8Conversion once convert_module has run (fp8 recipes)
        self.master = None  # mixprec.master.MasterWeights when spec.master_weights (or bf16-true + SR)
        self.scaler = self._make_scaler()

    # -- construction -------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def has_loss_scaling(self) -> bool:
        return self.spec.loss_scaling

    @property
    def stochastic_rounding(self) -> bool:
        return self.config.stochastic_rounding

    @property
    def keep_fp32(self) -> tuple[str, ...]:
        return tuple(self.config.keep_fp32)

    @property
    def low_dtype(self) -> torch.dtype | None:
        """The dtype low-precision ops run in, or None for full-precision recipes."""
        return None if self.spec.compute_dtype == torch.float32 else self.spec.compute_dtype

    def _make_scaler(self):
        """The loss scaler for one or many processes (disabled, hence a no-op, without loss scaling).

        Every rank must skip the same steps: mixprec's scaler all-reduces ``found_inf`` itself when a
        process group exists; for the native mechanism several processes get PyTorch's
        ``ShardedGradScaler`` (GradScaler plus that all-reduce; it also accepts DTensor gradients).
        """
        c = self.config.scaler
        kw = dict(init_scale=c.init_scale, growth_factor=c.growth_factor, backoff_factor=c.backoff_factor,
                  growth_interval=c.growth_interval)
        if self.impl == "native":
            if self.world_size > 1 and self.spec.loss_scaling:
                from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

                return ShardedGradScaler(self.device.type, **kw)
            return torch.amp.GradScaler(self.device.type, enabled=self.spec.loss_scaling, **kw)
        from .scaler import DynamicLossScaler

        return DynamicLossScaler(hysteresis=c.hysteresis, enabled=self.spec.loss_scaling, **kw)

    def fsdp_policy(self, *, for_norm: bool = False):
        """The FSDP2 ``MixedPrecisionPolicy`` this recipe means.

        Autocast recipes with fp32 params all-gather the params in the compute dtype, reduce-scatter
        gradients in fp32 and leave output dtypes to autocast. Emulated fp16 needs fp32 tensors holding fp16
        values, so it gathers fp32 and lets the autocast round. Normalization layers (``for_norm``) stay fp32,
        as autocast keeps norms fp32. The sharded fp32 params are FSDP's master copy, so recipes with master
        weights of their own (or stochastic rounding) are refused with the recipe that means the same there.
        """
        from torch.distributed.fsdp import MixedPrecisionPolicy

        s = self.spec
        if s.master_weights or self.stochastic_rounding:
            raise RecipeError(
                f"--strategy fsdp with {s.name}{' --stochastic-rounding' if self.stochastic_rounding else ''}: "
                "FSDP keeps the sharded fp32 params as the master copy itself; use --precision "
                f"{'fp16' if s.compute_dtype == torch.float16 else 'bf16'}-mixed (params all-gathered in the low "
                "dtype), or --strategy ddp to keep this recipe"
            )
        low = s.autocast and s.param_dtype == torch.float32 and s.compute_dtype != torch.float32
        gather = s.compute_dtype if low and not self.emulate and not for_norm else None
        return MixedPrecisionPolicy(param_dtype=gather, reduce_dtype=torch.float32, output_dtype=None)

    def check_compile(self) -> None:
        """Refuse ``--compile`` where it cannot help: under ``torch.compile`` the scratch autocast's
        TorchFunctionMode breaks the graph at every op (nothing fuses) and emulated fp16 rounds differently."""
        if self.spec.autocast and self.impl == "scratch":
            raise RecipeError(
                f"--compile with {self.name} [scratch]: torch.compile breaks its graph at every op of mixprec's "
                "autocast (no fusion, different fp16 rounding); use --amp-impl native"
                + (" — on this CPU fp16 is only fast emulated, so compile bf16-mixed instead" if self.emulate else ""))

    # -- hooks ---------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def run_context(self) -> Iterator[None]:
        """Set process-wide matmul precision for the run (TF32 on or off) and restore it on exit."""
        prev = torch.get_float32_matmul_precision()
        prev_cudnn = torch.backends.cudnn.allow_tf32
        # TF32 exists only on CUDA tensor cores. On CPU, "high" would switch oneDNN's fp32 GEMMs to a
        # reduced-precision (bf16x3/tf32) mode that is slower on CPUs without AMX, so tf32 runs as fp32 there.
        tf32 = self.spec.tf32 and hardware.has_tf32(self.device)
        torch.set_float32_matmul_precision("high" if tf32 else "highest")
        torch.backends.cudnn.allow_tf32 = tf32
        try:
            yield
        finally:
            torch.set_float32_matmul_precision(prev)
            torch.backends.cudnn.allow_tf32 = prev_cudnn

    def convert_module(self, model: nn.Module) -> nn.Module:
        """Move the model to the device and cast its floating params/buffers to the recipe's param dtype."""
        model = model.to(self.device)
        if self.spec.param_dtype != torch.float32:
            model = model.to(self.spec.param_dtype)
        if self.keep_fp32 and self.spec.autocast:
            from .autocast.keep_fp32 import resolve_keep_fp32

            try:  # a name the model lacks is the user's mistake: say so now, not at the first forward
                resolve_keep_fp32(self.keep_fp32, model)
            except (ValueError, TypeError) as e:
                raise RecipeError(f"--keep-fp32: {e}") from None
        if self.spec.fp8:
            from .fp8 import convert_to_fp8, plan_fp8_conversion

            self.fp8_conversion = plan_fp8_conversion(model)
            model = convert_to_fp8(model)
        self._model = model
        return model

    def build_optimizer(
        self, model: nn.Module, make_optimizer: Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer]
    ) -> torch.optim.Optimizer:
        """Create the optimizer over the tensors it should step: fp32 master copies or the params."""
        needs_master = self.spec.master_weights or (
            self.stochastic_rounding and self.spec.param_dtype != torch.float32
        )
        if needs_master:
            from .master import MasterWeights

            gen = torch.Generator(device=self.device)
            gen.manual_seed(self._seed + 0x5EED)
            self.master = MasterWeights(
                model,
                rounding="stochastic" if self.stochastic_rounding else "nearest",
                generator=gen,
                # bf16-true + stochastic rounding: the fp32 copy is re-read from the bf16 params before each
                # step, so no fp32 state carries over; only the rounding of the update is stochastic.
                resync=not self.spec.master_weights,
            )
            return make_optimizer(self.master.master_params)
        return make_optimizer([p for p in model.parameters()])

    def autocast(self) -> contextlib.AbstractContextManager:
        """Context for the forward pass (and loss)."""
        if not self.spec.autocast:
            return contextlib.nullcontext()
        if self.impl == "native":
            return torch.autocast(self.device.type, dtype=self.spec.compute_dtype)
        from .autocast import autocast

        return autocast(
            self.spec.compute_dtype,
            device_type=self.device.type,
            emulate=self.emulate,
            keep_fp32=self.keep_fp32,
            model=self._model,
        )

    def backward(self, loss: torch.Tensor, *, step: int | None = None) -> None:
        """Backward of the (scaled) loss.

        Recipes without loss scaling cannot skip a bad step, so a non-finite loss raises NonFiniteError
        *before* backward, leaving model and optimizer in their last good state. This reads the loss on
        the host: one device sync per step (loss-scaled recipes have theirs in :meth:`step` instead).
        Under several processes every rank must stop at the same step (a rank that raised while the others
        entered backward would leave their collectives waiting), so a non-finite flag is all-reduced first
        and every rank's loss is poisoned when any rank's is bad.
        """
        if not self.spec.loss_scaling:
            if self.world_size > 1:
                loss = _agree_on_finite(loss)
            if not math.isfinite(loss.item()):  # .item(): 0.2 µs vs 5 µs for isfinite
                raise NonFiniteError(
                    f"non-finite loss ({loss.item()}) at step {step} with recipe {self.name}, which has no loss "
                    "scaler to skip it",
                    step=step,
                    what="loss",
                )
        self.scaler.scale(loss).backward()

    def step(self, optimizer: torch.optim.Optimizer, clip_norm: float | None = None) -> StepResult:
        """Unscale, check for inf/nan, clip the *true* gradients, step or skip, update the scale.

        With master weights the low-precision model grads are first copied into the fp32 masters, so
        unscaling and clipping happen in fp32. Host syncs: one for loss-scaled recipes (the skip decision);
        one more when clipping without a loss scaler (a non-finite norm must stop the run before the step).
        """
        if self.master is not None:
            self.master.copy_grads_to_master()  # re-reads the masters first when master.resync
        self.scaler.unscale_(optimizer)  # no-op when loss scaling is off
        grad_norm = None
        if clip_norm is not None:
            params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
            grad_norm = torch.nn.utils.clip_grad_norm_(params, clip_norm, error_if_nonfinite=False)
            if not self.spec.loss_scaling and not bool(torch.isfinite(grad_norm)):
                raise NonFiniteError(
                    f"non-finite gradient norm ({float(grad_norm)}) with recipe {self.name}, which has no loss "
                    "scaler to skip the step; the step was not applied",
                    what="gradient",
                )
        skipped = self._step_or_skip(optimizer)
        self.scaler.update()
        if self.master is not None:
            self.master.write_back()
        return StepResult(skipped=skipped, grad_norm=grad_norm)

    def _step_or_skip(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step unless the unscaled grads had inf/nan; returns True when skipped."""
        if not self.spec.loss_scaling:
            self.scaler.step(optimizer)  # a disabled scaler just steps
            return False
        if self.impl == "native":
            # GradScaler records the per-device found_inf of the unscale_ above; this private accessor has
            # been stable since torch 1.6 and is what GradScaler.step itself reads. Its .item() is the
            # step's one sync (GradScaler.step's own read then finds the value ready).
            found = sum(v.item() for v in self.scaler._found_inf_per_device(optimizer).values())
            self.scaler.step(optimizer)
            return found > 0
        return not self.scaler.step(optimizer)

    def loss_scale(self) -> float:
        """Current loss scale (the initial one before the first step; 1.0 without loss scaling).
        Reads the device: call at log points, not per step."""
        return float(self.scaler.get_scale()) if self.spec.loss_scaling else 1.0

    # -- checkpoints ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "impl": self.impl,
            "scaler": self.scaler.state_dict(),
            "master": None if self.master is None else self.master.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        if state.get("master") is not None and self.master is not None:
            self.master.load_state_dict(state["master"])

    # -- reporting -----------------------------------------------------------------------------------
    def hardware_facts(self) -> HardwareFacts:
        """What this device does with the recipe's dtypes (see :class:`HardwareFacts`)."""
        return _hardware_facts(self.spec, self.device, self.emulate)

    def facts(self) -> dict[str, Any]:
        """The recipe's numerics as plain data (reports and JSON)."""
        s = self.spec
        return {"compute": _dtype_name(s.compute_dtype), "params": _dtype_name(s.param_dtype),
                "loss_scaling": s.loss_scaling, "master_weights": s.master_weights, "emulated": self.emulate,
                "stochastic_rounding": self.stochastic_rounding}

    def nonfinite_remedies(self) -> str:
        """What to try when this recipe's run went non-finite (never suggests the recipe itself)."""
        s = self.spec
        tips = ["lower --lr", "add --clip-grad-norm 1.0"]
        if s.param_dtype != torch.float32 and not s.master_weights:
            tips.append(f"keep fp32 master weights (--precision {_dtype_name(s.compute_dtype)}-master)")
        if s.compute_dtype == torch.float16 and not s.loss_scaling:
            tips.append("use a loss-scaled recipe (fp16-mixed)")
        if s.compute_dtype != torch.float32 and s.name != "bf16-mixed":
            tips.append("try bf16-mixed (fp32's exponent range)")
        elif s.compute_dtype != torch.float32:
            tips.append("compare with --precision fp32: if it diverges too, precision is not the cause")
        else:
            tips.append("this recipe computes in fp32, so precision is not the cause")
        tips.append("run `mixprec doctor` to locate the first non-finite op")
        return ", ".join(tips)

    @property
    def label(self) -> str:
        """``name [impl]`` for autocast recipes (where the mechanism matters), else the name."""
        return f"{self.name} [{self.impl}]" if self.spec.autocast else self.name

    def describe(self) -> str:
        """One line: what the recipe does on this device and why."""
        s = self.spec
        mech = {
            "native": "torch.autocast + torch.amp.GradScaler" if s.loss_scaling else "torch.autocast",
            "scratch": "mixprec autocast + DynamicLossScaler" if s.loss_scaling else "mixprec autocast",
        }[self.impl] if s.autocast else "no autocast"
        parts = [f"{s.name} [{self.impl}]: {s.summary}; {mech}"]
        if s.loss_scaling:
            c = self.config.scaler
            parts.append(
                f"loss scale starts at {c.init_scale:g}, x{c.growth_factor:g} after {c.growth_interval} finite "
                f"steps, x{c.backoff_factor:g} on overflow"
            )
        if s.master_weights:
            parts.append("optimizer steps fp32 master copies, params rounded to "
                         f"{_dtype_name(s.param_dtype)} after each step"
                         + (" stochastically" if self.stochastic_rounding else ""))
        elif self.master is not None or (self.stochastic_rounding and s.param_dtype != torch.float32):
            parts.append("updates rounded stochastically into bf16 params")
        if s.compute_dtype != torch.float32 or s.tf32:
            parts.append(self.hardware_facts().note)
        if s.fp8 and self.fp8_conversion is not None:
            c = self.fp8_conversion
            parts.append(f"{len(c.converted)} linear layer(s) in FP8"
                         + (f", kept out: {', '.join(n for n, _ in c.skipped)}" if c.skipped else ""))
        return "; ".join(parts)


def _agree_on_finite(loss: torch.Tensor) -> torch.Tensor:
    """``loss``, or NaN on every rank when any rank's loss is non-finite (one scalar all-reduce, no sync)."""
    import torch.distributed as dist

    bad = (~torch.isfinite(loss.detach())).to(torch.float32)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return torch.where(bad > 0, torch.full_like(loss, float("nan")), loss)


def _hardware_facts(spec: RecipeSpec, dev: torch.device, emulate: bool) -> HardwareFacts:
    where = hardware.describe_device(dev)
    if spec.fp8:
        if hardware.has_fp8_matmul(dev):
            return HardwareFacts("bf16", True, f"FP8 GEMMs are REAL here (torch._scaled_mm on {where}); other "
                                               "ops bf16; MFU is measured against the bf16 peak (no FP8 peak)")
        return HardwareFacts(
            "bf16", hardware.has_fast_bf16(dev),
            f"no FP8 matmuls on this device ({where}; they need CUDA compute capability 8.9+), so FP8 is EMULATED: "
            "operands scaled and rounded to e4m3/e5m2 and held in bf16 (exactly), GEMMs in bf16 with fp32 "
            "accumulation, other ops bf16 — FP8 numerics at bf16 GEMM speed plus amax and rounding passes; MFU is "
            "measured against the bf16 peak")
    if spec.compute_dtype == torch.float32:
        if spec.tf32 and hardware.has_tf32(dev):
            return HardwareFacts("tf32", True, "fp32 tensors, TF32 tensor-core matmuls")
        if spec.tf32:
            return HardwareFacts("fp32", True, f"{dev.type} has no TF32 tensor cores, so this runs exactly as fp32")
        return HardwareFacts("fp32", True, "fp32 matmuls, the reference")
    if spec.compute_dtype == torch.bfloat16:
        if dev.type == "cuda":
            return HardwareFacts("bf16", True, "bf16 tensor cores")
        if hardware.has_fast_bf16(dev):
            return HardwareFacts("bf16", True, f"fast bf16 matmuls on this CPU ({where})")
        return HardwareFacts("bf16", False, f"this CPU has no native bf16 matmul instructions (no AVX512-BF16/"
                                            f"AMX-BF16: {where}); bf16 matmuls are converted in software and "
                                            "likely SLOWER than fp32")
    if hardware.has_fast_fp16(dev):
        return HardwareFacts("fp16", True, "fp16 tensor cores" if dev.type == "cuda"
                             else f"fast fp16 matmuls on this CPU ({where})")
    if emulate:
        return HardwareFacts("fp32", False, f"this CPU has no fast fp16 kernels (no AVX512-FP16/AMX-FP16: {where}), "
                                            "so fp16 is EMULATED: operands and results rounded to fp16, arithmetic "
                                            "in fp32 (fp16 numerics at fp32 speed); MFU is measured against the "
                                            "fp32 peak")
    return HardwareFacts("fp16", False, f"WARNING: this CPU has no fast fp16 kernels (no AVX512-FP16/AMX-FP16: "
                                        f"{where}); native fp16 matmuls are a scalar fallback, 100x+ slower than "
                                        "fp32 — use --amp-impl scratch or auto (emulated fp16) or bf16-mixed")


def _dtype_name(dt: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dt]


def build_recipe(
    recipe: RecipeConfig | str = "fp32",
    *,
    device: torch.device | str = "cpu",
    seed: int = 0,
    world_size: int = 1,
    **options: Any,
) -> Recipe:
    """Resolve a recipe for a device and mechanism; contradictions raise RecipeError (exit 2).

    Args:
        recipe: a :class:`RecipeConfig`, or a recipe name or alias (``amp``, ``bf16``...) with the
            config's other fields as keyword ``options`` (``amp_impl``, ``scaler``, ``stochastic_rounding``,
            ``keep_fp32``).
        device: where the run trains.
        seed: seeds stochastic rounding.
        world_size: processes in the run (the loss scaler then agrees on skips across them).

    ``amp_impl``: ``native`` (torch.autocast + GradScaler), ``scratch`` (mixprec's engine), or ``auto``
    (native, except fp16 on a CPU without fast fp16, which gets scratch emulation).
    """
    if isinstance(recipe, str):
        options = {k: v for k, v in options.items() if v is not None}
        if "keep_fp32" in options:
            options["keep_fp32"] = tuple(options["keep_fp32"])
        recipe = RecipeConfig(precision=recipe, **options)
    elif not isinstance(recipe, RecipeConfig) or options:
        raise RecipeError(f"build_recipe({recipe!r}): pass a recipe name (e.g. 'bf16-mixed') or a RecipeConfig"
                          + (" without extra options" if options else ""))
    recipe.validate()
    spec = resolve_recipe(recipe.precision)
    device = torch.device(device)
    fast_fp16 = hardware.has_fast_fp16(device)
    impl = recipe.amp_impl
    if impl == "auto":
        impl = "scratch" if (spec.compute_dtype == torch.float16 and not fast_fp16) else "native"
    _refuse_contradictions(spec, recipe, impl, device)
    return Recipe(spec, recipe, device=device, impl=impl, emulate_fp16=not fast_fp16, seed=seed,
                  world_size=world_size)


def _refuse_contradictions(spec: RecipeSpec, config: RecipeConfig, impl: str, device: torch.device) -> None:
    if device.type == "cuda" and spec.compute_dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported(
        including_emulation=False
    ):
        raise RecipeError(
            f"{spec.name} needs bfloat16, which {torch.cuda.get_device_name(device)} does not support natively "
            "(compute capability < 8.0); use --precision fp16-mixed on this GPU"
        )
    if config.stochastic_rounding and spec.param_dtype == torch.float32:
        raise RecipeError(
            f"--stochastic-rounding rounds updates into low-precision params, but {spec.name} keeps fp32 params; "
            "use it with bf16-true, bf16-master or fp16-master"
        )
    if not spec.loss_scaling and config.scaler != _DEFAULT_SCALER:
        raise RecipeError(
            f"--init-scale/--growth-factor/--backoff-factor/--growth-interval/--hysteresis set the dynamic loss "
            f"scaler, which {spec.name} does not have; drop them, or use a loss-scaled recipe (fp16-mixed, fp16-master)"
        )
    if config.keep_fp32 and impl == "native":
        raise RecipeError(
            "--keep-fp32 needs per-module overrides, which torch.autocast lacks; add --amp-impl scratch"
        )
    if config.scaler.hysteresis != 1 and impl == "native":
        raise RecipeError("--hysteresis is a feature of mixprec's scaler; add --amp-impl scratch")
