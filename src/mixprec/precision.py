"""Precision recipes: a recipe name becomes a :class:`Recipe`, the training loop's only view of precision.

Every recipe exposes the same hooks, so the loop has no precision branches (a disabled scaler is a no-op)::

    model = recipe.convert_module(model)             # cast params where the recipe keeps them low
    opt = recipe.build_optimizer(model, make_opt)     # fp32 master copies where the recipe has them
    with recipe.autocast():                           # ops run in the low dtype per the cast policy
        loss = loss_fn(model(x), y)
    recipe.backward(loss)                             # loss x scale, backward
    result = recipe.step(opt, clip_norm)              # unscale, check, clip true grads, step/skip, update

With a :class:`~mixprec.guard.StepGuard` (``guard=``, as ``mixprec train`` passes one) the two hooks read nothing
on the host where the optimizer can skip a step on the device; :meth:`Recipe.step_reads` says where one read stays.

What a name means is in :mod:`mixprec.recipes`, the autocast and scaler behind the hooks in
:mod:`mixprec.mechanisms`, the words in :mod:`mixprec.recipe_text`. This module joins them:
:class:`RecipeConfig` (what a run asks for), :func:`build_recipe` (device and mechanism resolved,
contradictions refused) and :class:`Recipe`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from . import hardware, recipe_text
from .errors import NonFiniteError, RecipeError, check_keywords
from .guard import StepGuard, nonfinite_grads
from .lowp.block import BlockLinear
from .lowp import layer_formats as lf_file
from .lowp.impls import FP8_IMPL_CHOICES, FP8_IMPLS, Fp8Impl, auto_fp8_impl
from .lowp.recipes import LinearRecipe, linear_recipe
from .mechanisms import AMP_IMPLS, MECHANISMS, Mechanism, auto_mechanism
from .memory import local_tensor
from .recipes import ALIASES, RECIPES, RecipeSpec, dtype_name, resolve_recipe
from .scaler import ScalerConfig
from .scaler_view import ScalerView

__all__ = [
    "RECIPES",
    "ALIASES",
    "AMP_IMPLS",
    "FP8_IMPL_CHOICES",
    "FP8_LAYERS",
    "LAYERS_SUFFIX",
    "RecipeSpec",
    "ScalerConfig",
    "RecipeConfig",
    "HardwareFacts",
    "StepResult",
    "Recipe",
    "resolve_recipe",
    "build_recipe",
    "layers_entry",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RecipeConfig:
    """What a run asks of its precision: the recipe, its mechanism and its options."""

    precision: str = "fp32"
    """Recipe name or alias (:data:`RECIPES`, :data:`ALIASES`)."""
    amp_impl: str = "auto"
    """Mechanism behind the recipe: native, scratch or auto (:mod:`mixprec.mechanisms`)."""
    scaler: ScalerConfig = dataclasses.field(default_factory=ScalerConfig)
    """The dynamic loss scaler (recipes with loss scaling)."""
    stochastic_rounding: bool = False
    """Round updates into low-precision params stochastically (bf16-true, *-master)."""
    keep_fp32: tuple[str, ...] = ()
    """Module names or types kept in fp32 (scratch autocast)."""
    fp8_impl: str = "auto"
    """Whose layers run the FP8/FP4 recipes' GEMMs: scratch, torchao, or auto (torchao where it has units)."""
    wgrad_hp: bool = False
    """fp8-rowwise, mxfp8, mxfp4, nvfp4: the weight-gradient GEMM in bf16."""
    mx_scale_rule: str | None = None
    """mxfp8, mxfp4: the e8m0 scale rule, rceil (None: the recipe's, rceil) or floor (the OCP spec's)."""
    fp4_hadamard: bool = False
    """nvfp4: random Hadamard transform of the weight-gradient GEMM's inputs (as TransformerEngine)."""
    fp4_stochastic_rounding: bool = False
    """nvfp4: round the output gradient to FP4 stochastically in the backward GEMMs (as TransformerEngine)."""
    fp8_layers: str = "auto"
    """fp8-mixed, fp8-rowwise: which eligible linear layers convert. auto: where the GEMMs are real, only those
    where FP8 pays (:func:`mixprec.lowp.convert.fp8_pays`; elsewhere every eligible layer, as the emulation is
    for numerics); all: every eligible layer."""
    layer_formats: str | None = None
    """A layer-formats file (:mod:`mixprec.lowp.layer_formats`): its layers run in their formats, the rest in this
    recipe's; the file wins over ``keep_fp32`` (a contradiction is an error) and the FP8 layer filter. The recipe
    must be an autocast recipe with fp32 params."""

    def validate(self) -> None:
        """Raise a UsageError subclass naming the flag."""
        resolve_recipe(self.precision)
        impls = ("auto", *MECHANISMS)  # read now: a mechanism registered after import counts too
        if self.amp_impl not in impls:
            raise RecipeError(f"unknown --amp-impl {self.amp_impl!r}; choose one of: {', '.join(impls)}")
        self.scaler.validate()
        if self.fp8_impl not in FP8_IMPL_CHOICES:
            raise RecipeError(f"unknown --fp8-impl {self.fp8_impl!r}; choose one of: {', '.join(FP8_IMPL_CHOICES)}")
        if self.mx_scale_rule not in (None, "rceil", "floor"):
            raise RecipeError(f"unknown --mx-scale-rule {self.mx_scale_rule!r}; choose rceil or floor")
        if self.fp8_layers not in FP8_LAYERS:
            raise RecipeError(f"unknown --fp8-layers {self.fp8_layers!r}; choose {' or '.join(FP8_LAYERS)}")
        if self.layer_formats is not None and not isinstance(self.layer_formats, str):
            raise RecipeError(f"--layer-formats takes a file's path, got {type(self.layer_formats).__name__}")

    def linear_options(self) -> dict[str, Any]:
        """The low-precision linear options as :func:`mixprec.lowp.recipes.linear_recipe` takes them."""
        return dict(wgrad_hp=self.wgrad_hp, mx_scale_rule=self.mx_scale_rule, hadamard=self.fp4_hadamard,
                    stochastic_rounding=self.fp4_stochastic_rounding)

    def for_recipe(self, name: str) -> tuple[RecipeConfig, list[str]]:
        """This config applied to recipe ``name`` (bench's matrix, plan's entries), with the options that do not
        apply to it turned off, and a note for each. ``name`` may be :func:`layers_entry`'s ``<base>+layers``: the
        base with this config's layer-formats file; any other name runs uniformly, without the file."""
        layered = name.endswith(LAYERS_SUFFIX)
        spec = resolve_recipe(name[: -len(LAYERS_SUFFIX)] if layered else name)
        if layered and self.layer_formats is None:
            raise RecipeError(f"{name}: the {LAYERS_SUFFIX} entry needs --layer-formats FILE")
        lowp = _file_lowp(self) if layered else ()
        notes = []
        changes: dict[str, Any] = {"precision": spec.name, "layer_formats": self.layer_formats if layered else None}
        if self.stochastic_rounding and spec.param_dtype == torch.float32:
            changes["stochastic_rounding"] = False
            notes.append("--stochastic-rounding does not apply (fp32 params) and is off for this recipe")
        if not spec.loss_scaling and self.scaler != _DEFAULT_SCALER:
            changes["scaler"] = _DEFAULT_SCALER
            notes.append("the loss-scaler flags do not apply (no loss scaling) and are off for this recipe")
        for flag, field in _LINEAR_FLAGS:
            default = getattr(_DEFAULTS, field)
            if getattr(self, field) != default and not _linear_option_applies(spec, field, self, lowp):
                changes[field] = default
                notes.append(f"{flag} does not apply to {spec.name} and is off for this recipe")
        return dataclasses.replace(self, **changes), notes


_DEFAULTS = RecipeConfig()
_DEFAULT_SCALER = _DEFAULTS.scaler
_LINEAR_FLAGS = (("--fp8-impl", "fp8_impl"), ("--wgrad-hp", "wgrad_hp"), ("--mx-scale-rule", "mx_scale_rule"),
                 ("--fp4-hadamard", "fp4_hadamard"), ("--fp4-stochastic-rounding", "fp4_stochastic_rounding"),
                 ("--fp8-layers", "fp8_layers"))
FP8_LAYERS = ("auto", "all")
"""What ``--fp8-layers`` accepts (:attr:`RecipeConfig.fp8_layers`)."""
LAYERS_SUFFIX = "+layers"
"""A bench row's or plan entry's name for a base recipe with the layer-formats file (:func:`layers_entry`)."""
_OPTION_KEYWORDS = {"fp4_hadamard": "hadamard", "fp4_stochastic_rounding": "stochastic_rounding"}


def _linear_option_applies(spec: RecipeSpec, field: str, config: RecipeConfig, lowp: tuple[str, ...] = ()) -> bool:
    """Whether linear option ``field`` applies to ``spec``'s linear recipe or one of ``lowp`` (a layer-formats
    file's linear recipe names)."""
    if field == "fp8_layers":
        return spec.fp8 is not None
    if field == "fp8_impl":
        return spec.fp8 is not None or bool(lowp)
    keyword = _OPTION_KEYWORDS.get(field, field)
    return any(_option_fits(name, keyword, getattr(config, field)) for name in ((spec.fp8,) if spec.fp8 else ()) + lowp)


def _option_fits(name: str, keyword: str, value: Any) -> bool:
    try:
        linear_recipe(name, **{keyword: value})
    except RecipeError:
        return False
    return True


def _file_lowp(config: RecipeConfig, layers: lf_file.LayerFormats | None = None) -> tuple[str, ...]:
    """The linear recipe names of the low-precision formats in ``config``'s layer-formats file."""
    if config.layer_formats is None:
        return ()
    layers = layers or lf_file.load(config.layer_formats)
    return tuple(RECIPES[f].fp8 for f in lf_file.LOWP_FORMATS if f in layers.formats())


def _base_problem(spec: RecipeSpec, layers: lf_file.LayerFormats) -> str | None:
    """Why ``spec`` cannot carry the layer-formats file (its layers run inside the recipe's autocast), or None."""
    if not (spec.autocast and spec.param_dtype == torch.float32):
        return (f"{spec.name} has no autocast with fp32 params for the file's layers to run in; use one of "
                + ", ".join(n for n, s in RECIPES.items() if s.autocast and s.param_dtype == torch.float32))
    low = dtype_name(spec.compute_dtype)
    for fmt, names in layers.by_format().items():
        more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
        if fmt in lf_file.DTYPE_FORMATS and fmt not in ("fp32", low):
            return (f"it puts {names[0]}{more} in {fmt}, but {spec.name}'s autocast runs {low}: a layer runs in the "
                    "autocast's dtype or fp32")
        if fmt in lf_file.LOWP_FORMATS and low != "bf16":
            return (f"it puts {names[0]}{more} in {fmt}, whose layers need bf16 around them, but {spec.name}'s "
                    f"autocast runs {low}")
    return None


def layers_entry(config: RecipeConfig, precisions: Iterable[str]) -> str | None:
    """bench's and plan's extra entry for ``config``'s layer-formats file: ``<base>+layers``, the base being the
    first of ``precisions`` that can carry the file (an autocast recipe with fp32 params whose dtype agrees with
    the file's entries); None without a file. RecipeError (one line) when none can."""
    if config.layer_formats is None:
        return None
    layers = lf_file.load(config.layer_formats)
    names = [resolve_recipe(p).name for p in precisions]
    problems = [(name, _base_problem(resolve_recipe(name), layers)) for name in names]
    base = next((name for name, why in problems if why is None), None)
    if base is not None:
        return base + LAYERS_SUFFIX
    fit = "fp16-mixed" if "fp16" in layers.formats() else "bf16-mixed"
    raise lf_file.LayerFormatsError(
        f"--layer-formats {layers.path}: none of the recipes asked ({', '.join(names)}) can carry the file "
        f"({problems[-1][0]}: {problems[-1][1]}); add {fit} to --precisions")


@dataclasses.dataclass(frozen=True)
class HardwareFacts:
    """What this device does with a recipe's dtypes (for :meth:`Recipe.describe` and bench's preflight)."""

    matmul_dtype: str
    """``fp32``, ``tf32``, ``bf16`` or ``fp16``: what the matmuls actually run in (the MFU peak's dtype)."""
    fast: bool
    note: str


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What one :meth:`Recipe.step` did."""

    skipped: bool | torch.Tensor
    """The step was skipped: inf/nan gradients (loss-scaled recipes), or with a guard a fault or a halted run. A
    0-dim float32 device flag (1.0: skipped) where the step skipped on the device (a guard and a fused
    optimizer): read it only where the host reads anyway."""
    grad_norm: torch.Tensor | None
    """L2 norm of the unscaled gradients before clipping (0-dim, not synced); None without clipping."""


class Recipe:
    """A resolved recipe on a device with a mechanism; the training loop's only view of precision.

    Build with :func:`build_recipe`. Hooks, in the order the loop calls them: :meth:`run_context` (once),
    :meth:`convert_module`, :meth:`build_optimizer`, then per step :meth:`autocast`, :meth:`backward`,
    :meth:`step`.
    """

    def __init__(self, spec: RecipeSpec, config: RecipeConfig, *, caps: hardware.Capabilities, mechanism: Mechanism,
                 seed: int = 0, world_size: int = 1, fp8: Fp8Impl | None = None,
                 layer_formats: lf_file.LayerFormats | None = None,
                 layer_impls: dict[str, Fp8Impl] | None = None) -> None:
        self.spec = spec
        self.config = config
        self.caps = caps
        """What the device can do, asked once when the recipe was built (:func:`mixprec.hardware.capabilities`)."""
        self.device = caps.device
        self.mechanism = mechanism
        self.fp8 = fp8
        self.layer_formats = layer_formats
        """The layer-formats file (:mod:`mixprec.lowp.layer_formats`), loaded once when the recipe was built."""
        self.layer_impls = dict(layer_impls or {})
        """The file's low-precision format -> the :class:`Fp8Impl` that runs its layers (one per format)."""
        self.world_size = world_size
        self._seed = seed
        self._model: nn.Module | None = None
        self.fp8_conversion = None  # mixprec.lowp.convert.Fp8Conversion once convert_module has run (fp8 recipes)
        self.master = None  # mixprec.master.MasterWeights when spec.master_weights (or bf16-true + SR)
        self.scaler = mechanism.make_scaler()
        """Disabled without loss scaling; read its state through :class:`mixprec.scaler_view.ScalerView`."""

    # -- what it is ----------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def entry_name(self) -> str:
        """What a bench row or plan entry calls it: the name, ``<name>+layers`` with a layer-formats file."""
        return self.name + LAYERS_SUFFIX if self.layer_formats is not None else self.name

    @property
    def impl(self) -> str:
        return self.mechanism.name

    @property
    def emulate(self) -> bool:
        """Whether the low dtype runs emulated (its values, fp32 arithmetic)."""
        return self.mechanism.emulate

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

    def fsdp_policy(self, *, for_norm: bool = False):
        """The FSDP2 ``MixedPrecisionPolicy`` this recipe means: params all-gathered in the compute dtype (fp32
        when emulated, and for norms), gradients reduced in fp32. FSDP's sharded fp32 params are the master copy,
        so recipes with master weights of their own (or stochastic rounding) are refused."""
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
        """Refuse ``--compile`` where the mechanism cannot benefit from it."""
        self.mechanism.check_compile()

    def compiles(self, asked: str) -> tuple[bool, str]:
        """Whether ``--compile asked`` (on, off, auto) compiles this recipe here, and auto's reason in a clause.

        ``auto`` compiles the FP8/FP4 recipes on CUDA where every GEMM runs on real low-precision units: eager,
        their scaling and casting are many small kernels that cost more than the GEMMs save (torchao and
        torchtitan compile them for that reason); emulated GEMMs and the other recipes stay eager."""
        if asked != "auto":
            return asked == "on", ""
        impls = [i for i in (self.fp8, *self.layer_impls.values()) if i is not None]
        if not impls:
            return False, ""
        if self.device.type != "cuda" or not all(i.real() for i in impls):
            return False, f"--compile auto: eager ({self.name}'s GEMMs are emulated here, so compiling buys nothing)"
        try:
            self.check_compile()
        except RecipeError as e:
            return False, f"--compile auto: eager ({e})"
        return True, (f"--compile auto: compiled ({self.name}'s scaling and casts fuse only under torch.compile; "
                      "--compile off keeps it eager)")

    # -- hooks ---------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def run_context(self) -> Iterator[None]:
        """Set process-wide matmul precision for the run (TF32 on or off) and restore it on exit."""
        prev = torch.get_float32_matmul_precision()
        prev_cudnn = torch.backends.cudnn.allow_tf32
        # TF32 exists only on CUDA tensor cores. On CPU, "high" would switch oneDNN's fp32 GEMMs to a
        # reduced-precision (bf16x3/tf32) mode that is slower on CPUs without AMX, so tf32 runs as fp32 there.
        tf32 = self.spec.tf32 and self.caps.tf32
        torch.set_float32_matmul_precision("high" if tf32 else "highest")
        torch.backends.cudnn.allow_tf32 = tf32
        try:
            yield
        finally:
            torch.set_float32_matmul_precision(prev)
            torch.backends.cudnn.allow_tf32 = prev_cudnn

    def convert_module(self, model: nn.Module) -> nn.Module:
        """Move the model to the device, cast it to the param dtype, give the layer-formats file's layers their
        formats and, for FP8 recipes, swap the other eligible linear layers."""
        model = model.to(self.device)
        if self.spec.param_dtype != torch.float32:
            model = model.to(self.spec.param_dtype)
        self.mechanism.check_module(model)
        own: tuple[str, ...] = ()
        if self.layer_formats is not None:
            model = self._apply_layer_formats(model)
            own = tuple(self.layer_formats.layers)
        if self.fp8 is not None:
            model, self.fp8_conversion = self.fp8.convert(model, own)
        self._model = model
        return model

    def _apply_layer_formats(self, model: nn.Module) -> nn.Module:
        """Check the file against the model and the options, then swap its low-precision layers (one
        implementation per format) and hook its fp32 ones (:class:`~mixprec.autocast.fp32_forward.Fp32Forward`);
        its bf16/fp16 layers stay as they are, in the autocast's dtype. Nothing is changed before every check
        passed."""
        from .autocast.fp32_forward import Fp32Forward

        lf = self.layer_formats
        modules = lf.check_model(model)
        by_format = lf.by_format()
        for name, (fmt, _) in lf.layers.items():
            _refuse_kept(self.keep_fp32, name, modules[name], fmt, lf.path)
            impl = self.layer_impls.get(fmt)
            problem = impl.layer_problem(modules[name]) if impl is not None else None
            if problem:
                raise lf_file.LayerFormatsError(f"--layer-formats {lf.path}: {name} cannot run {fmt}: {problem}; "
                                                "give it another format")
        for fmt, impl in self.layer_impls.items():
            model = impl.convert_layers(model, by_format[fmt])
        if by_format.get("fp32"):
            Fp32Forward(self.device.type).install(model.get_submodule(n) for n in by_format["fp32"])
        return model

    def build_optimizer(
        self, model: nn.Module, make_optimizer: Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer]
    ) -> torch.optim.Optimizer:
        """The optimizer over fp32 master copies or the params."""
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
        if not self.spec.autocast:
            return contextlib.nullcontext()
        return self.mechanism.autocast(self._model)

    def backward(self, loss: torch.Tensor, *, step: int | None = None, guard: StepGuard | None = None) -> None:
        """Backward of the (scaled) loss.

        Without loss scaling a non-finite loss raises NonFiniteError before backward (on every rank when any
        rank's is bad), leaving model and optimizer in their last good state; that reads the loss: one sync.
        With a ``guard`` nothing is read: the guard notes the loss and :meth:`step` skips the step.
        """
        if not self.spec.loss_scaling and guard is not None:
            guard.note_loss(loss)
        elif not self.spec.loss_scaling:
            if self.world_size > 1:
                loss = _agree_on_finite(loss)
            if not math.isfinite(loss.item()):  # the step's one host read; isfinite on the float launches nothing
                raise NonFiniteError(
                    f"non-finite loss ({loss.item()}) at step {step} with recipe {self.name}, which has no loss "
                    "scaler to skip it",
                    step=step,
                    what="loss",
                )
        self.scaler.scale(loss).backward()

    def step(self, optimizer: torch.optim.Optimizer, clip_norm: float | None = None, *,
             guard: StepGuard | None = None, step: int | None = None) -> StepResult:
        """Unscale, check for inf/nan, clip the true gradients, step or skip, update the scale (in fp32 with master
        weights). Host syncs: one with loss scaling (the skip); one when clipping without it (the norm).

        With a ``guard`` (and the global ``step``): a non-finite loss or gradient of a recipe without loss scaling
        skips the step and halts the run instead of raising, a halted run skips the step whole, and the skip is
        decided on the device — no sync — where the optimizer takes ``found_inf`` (:meth:`step_reads`)."""
        if self.master is not None:
            self.master.copy_grads_to_master()  # re-reads the masters first when master.resync
        self.scaler.unscale_(optimizer)  # no-op when loss scaling is off
        grad_norm = None
        if clip_norm is not None:
            params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
            grad_norm = torch.nn.utils.clip_grad_norm_(params, clip_norm, error_if_nonfinite=False)
            if guard is None and not self.spec.loss_scaling and not bool(torch.isfinite(grad_norm)):
                raise NonFiniteError(
                    f"non-finite gradient norm ({float(grad_norm)}) with recipe {self.name}, which has no loss "
                    "scaler to skip the step; the step was not applied",
                    what="gradient",
                )
        hold = None
        if guard is not None:
            if step is None:
                raise ValueError("Recipe.step(..., guard=...): pass the step's number too (step=...)")
            skipped, hold = self._guarded_step(optimizer, guard, grad_norm, step)
        elif self.spec.loss_scaling:
            skipped = self.mechanism.step_or_skip(self.scaler, optimizer)
        else:
            self.scaler.step(optimizer)  # a disabled scaler just steps
            skipped = False
        self.mechanism.update(self.scaler)
        if self.master is not None:
            stochastic = self.master.rounding == "stochastic" and not self.master.resync
            self.master.write_back(unless=hold if stochastic else None)
        return StepResult(skipped=skipped, grad_norm=grad_norm)

    def _guarded_step(self, optimizer: torch.optim.Optimizer, guard: StepGuard, grad_norm: torch.Tensor | None,
                      step: int) -> tuple[bool | torch.Tensor, torch.Tensor]:
        """Step or skip under a guard; returns the skip (a bool where it was read, else the device flag) and the
        flag under which the step must leave everything as it was."""
        on_device = guard.skips_on_device(optimizer)
        if self.spec.loss_scaling:
            hold = guard.halted
            skipped = self.mechanism.step_or_skip(self.scaler, optimizer, hold=hold, on_device=on_device)
            found = ScalerView(self.scaler).found_inf(optimizer)
            assert found is not None
            guard.skip(found, step)
            if skipped is False:
                guard.stepped(optimizer)
            return skipped, hold
        # no loss scaling: 2 where a loss was non-finite, 1 where only a gradient was, agreed across ranks
        if grad_norm is not None:
            code = (~torch.isfinite(local_tensor(grad_norm).detach())).float().to(guard.device)
        else:
            code = torch.zeros((), dtype=torch.float32, device=guard.device)
            nonfinite_grads((p for g in optimizer.param_groups for p in g["params"]), code)
        loss_flag = guard.take_loss_flag()
        if loss_flag is not None:
            code = torch.maximum(code, loss_flag.to(code.device))
        if self.world_size > 1:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                dist.all_reduce(code, op=dist.ReduceOp.MAX)
        skip = guard.fault(code, step)
        if on_device:
            try:
                optimizer.found_inf = skip  # the fused kernels skip on exactly 1.0 and restore their step counts
                optimizer.step()
            finally:
                optimizer.__dict__.pop("found_inf", None)
            return skip, skip
        skipped = bool(skip.item())  # the one read: this optimizer cannot skip on the device
        if not skipped:
            optimizer.step()
            guard.stepped(optimizer)
        return skipped, skip

    def step_reads(self, optimizer: torch.optim.Optimizer) -> str | None:
        """Why a guarded step of this recipe with ``optimizer`` still reads a value on the host every step (a clause
        for the run's notes), or None where it reads nothing (after the optimizer's first applied step, which makes
        its state)."""
        if self.spec.loss_scaling and not self.mechanism.skips_on_device:
            return (f"one host read per step: {self.label}'s {self.mechanism.scaler_words} decides on the host "
                    "whether to skip a step (it reads found_inf; across ranks ShardedGradScaler sums it, and a fused "
                    "optimizer skips only on exactly 1); --amp-impl scratch skips on the device")
        if not getattr(optimizer, "_step_supports_amp_scaling", False):
            what = "inf/nan gradients" if self.spec.loss_scaling else "a non-finite loss or gradient"
            return (f"one host read per step: whether to skip it for {what}, since {type(optimizer).__name__} is "
                    "not a fused optimizer, which alone skips a step on the device (mixprec's sgd and adamw are "
                    "fused over plain fp32 tensors)")
        return None

    def loss_scale(self) -> float:
        """Current loss scale (1.0 without loss scaling). Syncs: call at log points, not per step."""
        return float(self.scaler.get_scale()) if self.spec.loss_scaling else 1.0

    # -- checkpoints ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "impl": self.impl,
            "scaler": self.scaler.state_dict(),
            "master": None if self.master is None else self.master.state_dict(),
            "rounding_generators": {name: g.get_state() for name, g in self._rounding_generators().items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        if state.get("master") is not None and self.master is not None:
            self.master.load_state_dict(state["master"])
        mine = self._rounding_generators()
        for name, gen_state in (state.get("rounding_generators") or {}).items():
            if name in mine:  # a checkpoint of this recipe: every stochastic-rounding layer continues its stream
                mine[name].set_state(gen_state)

    def _rounding_generators(self) -> dict[str, torch.Generator]:
        """The converted layers' stochastic-rounding generators by module name (made now if need be), so a
        resumed run draws the numbers the uninterrupted one would."""
        if self._model is None:
            return {}
        return {name: m.rounding_generator() for name, m in self._model.named_modules()
                if isinstance(m, BlockLinear) and m.recipe.stochastic_rounding}

    # -- reporting -----------------------------------------------------------------------------------
    def hardware_facts(self) -> HardwareFacts:
        matmul_dtype, fast, case = _matmul_facts(self.spec, self.caps, self.emulate, self.fp8)
        return HardwareFacts(matmul_dtype, fast, recipe_text.hardware_note(case, self.caps, fp8=self.fp8))

    def facts(self) -> dict[str, Any]:
        """The recipe's numerics as plain data (reports and JSON)."""
        s = self.spec
        return {"compute": dtype_name(s.compute_dtype), "params": dtype_name(s.param_dtype),
                "loss_scaling": s.loss_scaling, "master_weights": s.master_weights, "emulated": self.emulate,
                "stochastic_rounding": self.stochastic_rounding,
                "fp8_impl": None if self.fp8 is None else self.fp8.name}

    def nonfinite_remedies(self) -> str:
        return recipe_text.nonfinite_remedies(self.spec)

    @property
    def label(self) -> str:
        """``name [impl]`` for autocast recipes, else the name (``name+layers`` with a layer-formats file)."""
        return f"{self.entry_name} [{self.impl}]" if self.spec.autocast else self.entry_name

    def describe(self) -> str:
        """One line: what the recipe does on this device and why."""
        line = recipe_text.describe(self.spec, self.mechanism, scaler=self.config.scaler,
                                    stochastic_rounding=self.stochastic_rounding,
                                    device_note=self.hardware_facts().note, fp8_conversion=self.fp8_conversion,
                                    fp8=self.fp8)
        if self.layer_formats is None:
            return line
        return f"{line}; {recipe_text.layer_formats_clause(self.layer_formats, self.layer_impls, self.spec)}"


def _agree_on_finite(loss: torch.Tensor) -> torch.Tensor:
    """``loss``, or NaN on every rank when any rank's loss is non-finite (one scalar all-reduce, no sync)."""
    import torch.distributed as dist

    bad = (~torch.isfinite(loss.detach())).to(torch.float32)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return torch.where(bad > 0, torch.full_like(loss, float("nan")), loss)


def _matmul_facts(spec: RecipeSpec, caps: hardware.Capabilities, emulate: bool,
                  fp8: Fp8Impl | None) -> tuple[str, bool, str]:
    """``(matmul dtype, fast, case of recipe_text.HARDWARE_NOTES)``."""
    dev = caps.device
    if fp8 is not None:
        if fp8.real():
            return "bf16", True, "fp8-real"
        return "bf16", caps.fast_bf16, "fp8-emulated" if spec.fp8 == "tensorwise" else "lowp-emulated"
    if spec.compute_dtype == torch.float32:
        if spec.tf32 and caps.tf32:
            return "tf32", True, "tf32"
        return "fp32", True, "tf32-absent" if spec.tf32 else "fp32"
    if spec.compute_dtype == torch.bfloat16:
        if dev.type == "cuda":
            return "bf16", True, "bf16-gpu"
        if emulate:
            return "fp32", False, "bf16-emulated"
        if caps.fast_bf16:
            return "bf16", True, "bf16-cpu"
        return "bf16", False, "bf16-slow" if caps.bf16_kernels else "bf16-fallback"
    if emulate:
        return "fp32", False, "fp16-emulated"
    if caps.fast_fp16:
        return "fp16", True, "fp16-gpu" if dev.type == "cuda" else "fp16-cpu"
    return "fp16", False, "fp16-slow"


def build_recipe(
    recipe: RecipeConfig | str = "fp32",
    *,
    device: torch.device | str | None = "auto",
    seed: int = 0,
    world_size: int = 1,
    for_target: bool = False,
    capabilities: hardware.Capabilities | None = None,
    **options: Any,
) -> Recipe:
    """Resolve a recipe for a device and mechanism; contradictions raise RecipeError (exit 2).

    ``recipe``: a :class:`RecipeConfig`, or a name or alias with the config's other fields as keyword
    ``options``. ``device``: ``auto`` (or None) as ``--device auto``; it must exist here unless ``for_target``,
    a device being planned for: then nothing is asked of it, and the recipe must never run (only its
    device-free answers -- ``spec``, ``facts()``, ``label``, ``low_dtype``, ``impl``, ``fsdp_policy()`` -- mean
    anything). What the device can do is asked here once (:func:`mixprec.hardware.capabilities`; or given as
    ``capabilities``) and passed down; nothing below asks the hardware again.
    """
    if isinstance(recipe, str):
        check_keywords("build_recipe", options, {f.name for f in dataclasses.fields(RecipeConfig)} - {"precision"}
                       | {"device", "seed", "world_size", "for_target", "capabilities"})
        options = {k: v for k, v in options.items() if v is not None}
        if "keep_fp32" in options:
            options["keep_fp32"] = tuple(options["keep_fp32"])
        recipe = RecipeConfig(precision=recipe, **options)
    elif not isinstance(recipe, RecipeConfig) or options:
        raise RecipeError(f"build_recipe({recipe!r}): pass a recipe name (e.g. 'bf16-mixed') or a RecipeConfig"
                          + (" without extra options" if options else ""))
    recipe.validate()
    spec = resolve_recipe(recipe.precision)
    device = hardware.resolve_device("auto") if device is None or device == "auto" else torch.device(device)
    missing = None if for_target else hardware.missing_device(device)
    if missing is not None:
        raise RecipeError(
            f"build_recipe({recipe.precision!r}, device={str(device)!r}): {missing}; build it for a device this "
            "machine has (device='cpu', or --device auto), or pass for_target=True to plan for one it lacks")
    layers = None
    if recipe.layer_formats is not None:
        layers = lf_file.load(recipe.layer_formats)
        why = _base_problem(spec, layers)
        if why is not None:
            raise lf_file.LayerFormatsError(f"--layer-formats {layers.path}: {why}")
    caps = capabilities or hardware.capabilities(device, target=for_target)
    impl = auto_mechanism(spec, caps) if recipe.amp_impl == "auto" else recipe.amp_impl
    with warnings.catch_warnings():
        if for_target:  # GradScaler("cuda") on a machine without CUDA warns that it disables itself
            warnings.simplefilter("ignore", UserWarning)
        mechanism = MECHANISMS[impl](spec, scaler=recipe.scaler, keep_fp32=tuple(recipe.keep_fp32), caps=caps,
                                     world_size=world_size)
        _refuse_contradictions(spec, recipe, caps)
        mechanism.refuse_options()
        planned = for_target and capabilities is None
        lowp = [f for f in lf_file.LOWP_FORMATS if layers is not None and f in layers.formats()]
        fp8 = _fp8_impl(spec, recipe, caps, impl, seed, for_target=planned, lowp=tuple(RECIPES[f].fp8 for f in lowp))
        layer_impls = {f: _layer_impl(f, recipe, caps, impl, seed, for_target=planned, path=layers.path)
                       for f in lowp}
        return Recipe(spec, recipe, caps=caps, mechanism=mechanism, seed=seed, world_size=world_size, fp8=fp8,
                      layer_formats=layers, layer_impls=layer_impls)


def _fp8_impl(spec: RecipeSpec, config: RecipeConfig, caps: hardware.Capabilities, amp_impl: str, seed: int, *,
              for_target: bool = False, lowp: tuple[str, ...] = ()) -> Fp8Impl | None:
    """The low-precision linear implementation of an FP8/FP4 recipe (None for the others, which refuse its flags);
    ``for_target``: ``auto`` takes scratch's layers without asking the device. ``lowp``: the linear recipes of a
    layer-formats file's layers, to which the linear flags apply too (each where it can)."""
    typed = [(flag, field) for flag, field in _LINEAR_FLAGS if getattr(config, field) != getattr(_DEFAULTS, field)]
    if spec.fp8 is None and not lowp:
        if typed:
            raise RecipeError(f"{', '.join(f for f, _ in typed)} set(s) the FP8/FP4 linear layers, which {spec.name} "
                              "does not have; drop it, or use --precision fp8-mixed, fp8-rowwise, mxfp8, mxfp4 or "
                              "nvfp4")
        return None
    if lowp:
        unused = [flag for flag, field in typed if not _linear_option_applies(spec, field, config, lowp)]
        if unused == ["--fp8-layers"]:
            raise RecipeError(f"--fp8-layers picks the layers {spec.name}'s own FP8 conversion takes, and it has none "
                              "(the layer-formats file's layers run as the file says); drop it")
        if unused:
            formats = [n for n, s in RECIPES.items() if s.fp8 in lowp]
            raise RecipeError(f"{', '.join(unused)} applies to none of the low-precision layers here (the "
                              f"layer-formats file's {', '.join(formats)}" + (f", {spec.name}'s" if spec.fp8 else "")
                              + "); drop it")
    if spec.fp8 is None:
        return None
    lin = _linear(spec.fp8, config, lenient=bool(lowp))
    if config.fp8_impl == "auto":
        name = "scratch" if for_target else auto_fp8_impl(lin, caps)
    else:
        name = config.fp8_impl
    impl = FP8_IMPLS[name](lin, caps, seed=seed, layers=config.fp8_layers)
    impl.refuse(amp_impl, spec.name)
    return impl


def _linear(name: str, config: RecipeConfig, *, lenient: bool = False) -> LinearRecipe:
    """Linear recipe ``name`` with the config's options; ``lenient``: only those it has a variant for (a recipe
    beside a layer-formats file's, where each option applies where it can)."""
    options = config.linear_options()
    if lenient:
        options = {k: v for k, v in options.items() if v in (False, None) or _option_fits(name, k, v)}
    return linear_recipe(name, **options)


def _layer_impl(fmt: str, config: RecipeConfig, caps: hardware.Capabilities, amp_impl: str, seed: int, *,
                for_target: bool, path: str) -> Fp8Impl:
    """The implementation that runs a layer-formats file's ``fmt`` layers: what the uniform recipe ``fmt`` would
    take (``--fp8-impl``, auto's choice), converting exactly the named layers."""
    lin = _linear(RECIPES[fmt].fp8, config, lenient=True)
    if config.fp8_impl == "auto":
        name = "scratch" if for_target else auto_fp8_impl(lin, caps)
    else:
        name = config.fp8_impl
    impl = FP8_IMPLS[name](lin, caps, seed=seed, layers="all")
    try:
        impl.refuse(amp_impl, fmt)
    except RecipeError as e:
        raise lf_file.LayerFormatsError(f"--layer-formats {path}: its {fmt} layers: {e}") from None
    return impl


def _refuse_kept(keep_fp32: Iterable[Any], name: str, module: nn.Module, fmt: str, path: str) -> None:
    """A layer the file gives a low format while ``--keep-fp32`` keeps it (by name, a parent's name, or its class)
    in fp32 is a contradiction; ``fp32`` in the file agrees."""
    if fmt == "fp32":
        return
    for k in keep_fp32:
        hit = (isinstance(k, type) and isinstance(module, k)) or (isinstance(k, str) and (
            k == name or name.startswith(k + ".") or k == type(module).__name__))
        if hit:
            raise lf_file.LayerFormatsError(
                f"--keep-fp32 {k} and --layer-formats {path} contradict: the file puts {name} in {fmt}, "
                f"--keep-fp32 keeps it in fp32; give it \"fp32\" in the file or drop {k} from --keep-fp32")


def _refuse_contradictions(spec: RecipeSpec, config: RecipeConfig, caps: hardware.Capabilities) -> None:
    """What this recipe cannot do with these options on this device, whatever the mechanism."""
    if caps.device.type == "cuda" and spec.compute_dtype == torch.bfloat16 and not caps.fast_bf16:
        raise RecipeError(
            f"{spec.name} needs bfloat16, which {caps.description} does not support natively "
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
