"""``mixprec.plan(...)``: memory and step time of each recipe on a target, before running anything.

For each recipe: trace one steady-state step (:mod:`.trace`), price its ops on the target (:mod:`.roofline`; on
the cpu target GEMMs, convolutions and attention are timed on this CPU: :mod:`.kernels`), and find the largest
batch that fits. Data, batch and model builder are shared; each recipe gets its own fake model and trace.

Largest batch: at each phase's peak (forward, backward, optimizer) the bytes that grow with the batch
(activations, temporaries outside the optimizer step) scale linearly with it, the rest is fixed; the largest
batch is the largest ``B`` with every phase's ``fixed + B / traced_batch * growing`` within the target's memory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from ..errors import UsageError, check_keywords
from ..precision import layers_entry
from .kernels import KernelTimes
from .roofline import Execution, StepTime, efficiency_for, step_time
from .targets import Target, get_target
from .trace import (FakeModelSource, StepTrace, TraceError, _target_capabilities, file_recipes, planning_fake_mode,
                    trace_step)

__all__ = ["RecipePlan", "Plan", "plan", "PlanError", "Planner", "TaskLoss"]


class PlanError(UsageError):
    """A plan that cannot be made as asked; the message names the fix."""


@dataclasses.dataclass(frozen=True)
class RecipePlan:
    """One recipe's predicted memory and time on the target."""

    recipe: str
    label: str
    memory: dict[str, int]
    """Exact bytes per category over the step, plus ``temporary`` (alive at the peak, in no category)."""
    at_peak: dict[str, int]
    """Bytes alive at the peak per category (they add up to ``peak_bytes``)."""
    peak_bytes: int
    batch_size: int
    max_batch_size: int
    """The largest batch whose predicted peak fits the target's memory (0: not even one sample)."""
    fits: bool
    flops: dict[str, int]
    """FLOPs of the step by the dtype its GEMMs run in."""
    step_time_s: float
    time: StepTime
    notes: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"recipe": self.recipe, "label": self.label, "memory": self.memory, "at_peak": self.at_peak,
                "peak_bytes": self.peak_bytes, "batch_size": self.batch_size,
                "max_batch_size": self.max_batch_size, "fits": self.fits, "flops": self.flops,
                "step_time_s": self.step_time_s, "time": self.time.to_dict(), "notes": list(self.notes)}


@dataclasses.dataclass(frozen=True)
class Plan:

    target: Target
    recipes: tuple[RecipePlan, ...]
    model: str
    batch_size: int
    traced: str
    """``fake`` or ``real`` (``--fallback-real``, on a small batch)."""
    efficiency_source: str

    def by_name(self, name: str) -> RecipePlan:
        return next(r for r in self.recipes if r.recipe == name)

    def verdict(self) -> str:
        from .report import verdict

        return verdict(self)

    def to_dict(self) -> dict[str, Any]:
        from .report import DEVICE_BRANCH_LIMIT

        return {"schema": "mixprec.plan/1", "target": self.target.to_dict(), "model": self.model,
                "batch_size": self.batch_size, "traced": self.traced, "efficiency": self.efficiency_source,
                "limits": [DEVICE_BRANCH_LIMIT] if self.target.kind != "cpu" else [],
                "recipes": [r.to_dict() for r in self.recipes], "verdict": self.verdict()}


def _max_batch(trace: StepTrace, memory_bytes: int) -> int:
    best = None
    for phase, peak in trace.phase_peak.items():
        grow = trace.batch_bytes.get(phase, 0)
        fixed = peak - grow
        if fixed > memory_bytes:
            return 0
        if grow > 0:
            b = int((memory_bytes - fixed) / (grow / trace.batch_size))
            best = b if best is None else min(best, b)
    return best if best is not None else 10**9


def _scaled(trace: StepTrace, batch_size: int) -> StepTrace:
    """A small-batch trace (``--fallback-real``) with what grows scaled to ``batch_size``."""
    k = batch_size / trace.batch_size
    phase_peak = {p: int(v + (k - 1) * trace.batch_bytes.get(p, 0)) for p, v in trace.phase_peak.items()}
    at_peak = dict(trace.at_peak)
    for c in ("activations", "temporary"):
        at_peak[c] = int(at_peak[c] * k)
    totals = dict(trace.totals)
    totals["activations"] = int(totals["activations"] * k)
    peak = max(phase_peak.values())
    return dataclasses.replace(trace, batch_size=batch_size, phase_peak=phase_peak, at_peak=at_peak,
                               totals=totals, peak_bytes=peak,
                               batch_bytes={p: int(v * k) for p, v in trace.batch_bytes.items()})


def _recipe_plan(trace: StepTrace, target: Target, *, tf32: bool, notes: list[str], scaled_ops: float,
                 kernel_times: KernelTimes | None, execution: Execution | None = None) -> RecipePlan:
    dtype_map = {"fp32": "tf32"} if tf32 and "tf32" in target.peak_flops else {}
    ops = trace.ops
    untimed = kernel_times.untimed if kernel_times is not None else 0
    measured = _measured(ops, target, kernel_times)
    t = step_time(ops, target, dtype_map=dtype_map, kernel_times=measured, execution=execution)
    if kernel_times is not None and kernel_times.untimed > untimed:
        notes = notes + [f"{kernel_times.untimed - untimed} distinct GEMM/convolution/attention calls priced by the "
                         f"roofline, not timed on this CPU: the plan's {kernel_times.total_budget_s:.0f} s "
                         "kernel-timing budget was spent"]
    if scaled_ops != 1.0:  # fallback: the small batch's time scaled by the work (GEMMs and bytes grow with it)
        t = dataclasses.replace(t, total_s=t.total_s * scaled_ops, gemm_s=t.gemm_s * scaled_ops,
                                memory_s=t.memory_s * scaled_ops, timed_s=t.timed_s * scaled_ops,
                                flops_by_dtype={k: int(v * scaled_ops) for k, v in t.flops_by_dtype.items()})
    memory = dict(trace.totals)
    memory["temporary"] = trace.at_peak["temporary"]
    max_b = _max_batch(trace, target.memory_bytes)
    return RecipePlan(recipe=trace.recipe, label=trace.label, memory=memory, at_peak=trace.at_peak,
                      peak_bytes=trace.peak_bytes, batch_size=trace.batch_size, max_batch_size=max_b,
                      fits=trace.peak_bytes <= target.memory_bytes, flops=t.flops_by_dtype,
                      step_time_s=t.total_s, time=t, notes=tuple(notes + trace.notes))


def _measured(ops, target: Target, kernel_times: KernelTimes | None) -> dict | None:
    """The timed kernels of ``ops``; a call the roofline prices above :attr:`KernelTimes.longest_s` is not timed."""
    if kernel_times is None:
        return None
    eff = efficiency_for(target)

    def priced_s(op) -> float:
        return op.flops / (target.peak(op.dtype) * eff.for_dtype(op.dtype))

    return kernel_times.measure(op.kernel for op in ops
                                if op.kernel is not None and priced_s(op) <= kernel_times.longest_s)


def plan(
    *,
    precisions: Iterable[str] | str = ("fp32", "bf16-mixed"),
    target: str | Target = "cpu",
    config=None,
    model: nn.Module | Callable[[], nn.Module] | None = None,
    batch: Any = None,
    loss_fn: Callable | None = None,
    make_optimizer: Callable | None = None,
    fallback_real: bool = False,
    fallback_batch_size: int = 2,
    **flags: Any,
) -> Plan:
    """Predict memory by category, peak, largest batch, FLOPs by dtype and step time of each recipe; with a
    layer-formats file (``layer_formats=`` FILE, ``--layer-formats``) one entry more, ``<base>+layers``, the
    first recipe asked that can carry the file (:func:`mixprec.precision.layers_entry`) with the file applied.

    ``config`` is made from ``flags`` (train's flag names) when not given. ``model``: a module (copied as fake
    tensors) or a zero-argument factory (called under fake tensors). ``fallback_real``: a model that cannot be built
    under fake tensors is built for real once; a step that cannot be traced runs for real on the CPU on
    ``fallback_batch_size`` samples and is scaled. Without it either is a :class:`~.trace.TraceError`.
    """
    from ..train.config import TrainConfig

    own = {"precisions", "target", "config", "model", "batch", "loss_fn", "make_optimizer", "fallback_real",
           "fallback_batch_size"}
    check_keywords("plan", flags, (set(TrainConfig().flags()) - {"precision"}) | own, hints={"precision": "precisions"})
    precisions = [p.strip() for p in (precisions.split(",") if isinstance(precisions, str) else precisions)
                  if p.strip()]
    if not precisions:
        raise PlanError("plan(precisions=[]): name at least one recipe, e.g. --precisions fp32,bf16-mixed")
    if isinstance(model, str):  # a model name or module:factory, as --model takes it
        flags["model"], model = model, None
    planner = Planner(config=config or TrainConfig.from_flags(**flags), target=target, model=model, batch=batch,
                      loss_fn=loss_fn, make_optimizer=make_optimizer, fallback_real=fallback_real)
    names = [_canonical(p) for p in precisions]
    layered = layers_entry(planner.config.recipe, names)
    names += [layered] if layered else []
    traced, scale = "fake", 1.0
    try:
        results = [planner.trace(name) for name in names]
    except TraceError as e:
        if not fallback_real:
            raise
        small = _slice_batch(planner.batch, fallback_batch_size)
        n = len(planner.batch)
        results = [(_scaled(tr, n), notes + [f"traced for real on {len(small)} samples ({e}); what grows with the "
                                             "batch scaled to the asked batch"], tf)
                   for tr, notes, tf in planner.trace_real(names, small)]
        traced, scale = "real", n / len(small)
    plans = tuple(planner.recipe_plan(tr, tf32=tf, notes=notes, scaled_ops=scale) for tr, notes, tf in results)
    return Plan(target=planner.target, recipes=plans, model=planner.model_name, batch_size=len(planner.batch),
                traced=traced, efficiency_source=_efficiency_source(planner.target))


class Planner:
    """What every recipe of a plan shares, made once, and one trace per recipe (:meth:`trace`). ``data``: the
    config's data if already loaded."""

    def __init__(self, *, config, target: str | Target = "cpu", model=None, batch=None, loss_fn=None,
                 make_optimizer=None, data=None, fallback_real: bool = False) -> None:
        from ..train.build import loss_from_config, optimizer_factory

        config.validate()
        self.config = config
        self.target = get_target(target)
        self.build, self.model_name, self.batch, data = _inputs(config, model, batch, data)
        self.notes: list[str] = []
        want = config.optim.batch_size
        if batch is None and len(self.batch) < want:  # a plan is of the step asked for: its tensors are fake
            self.notes.append(f"the data holds {len(self.batch)} samples: the batch of {want} is planned from them, "
                              "repeated")
            self.batch = _repeat_batch(self.batch, want)
        self.loss_fn = loss_fn or loss_from_config(config.model)
        self.default_loss = TaskLoss(config, data, self.batch)
        self.make_optimizer = make_optimizer or optimizer_factory(config.optim)
        self.fake_mode = planning_fake_mode()
        self.models = FakeModelSource(self.build, self.fake_mode, fallback_real=fallback_real,
                                      real=model if isinstance(model, nn.Module) else None)
        self.kernel_times = KernelTimes() if self.target.kind == "cpu" else None

    def trace(self, name: str) -> tuple[StepTrace, list[str], bool]:
        """``(trace, notes, tf32)`` of recipe ``name`` (canonical) under fake tensors; raises TraceError."""
        return self._trace(name, self.batch, self.models, self.fake_mode)

    def trace_real(self, names, batch) -> list[tuple[StepTrace, list[str], bool]]:
        models = FakeModelSource(self.build, None)
        return [self._trace(name, batch, models, None) for name in names]

    def _trace(self, name, batch, models, fake_mode):
        """``name``: a canonical recipe name, or ``<base>+layers`` (:func:`~mixprec.precision.layers_entry`)."""
        recipe_config, notes = self.config.recipe.for_recipe(name)
        tr = trace_step(recipe_config=recipe_config, target=self.target, models=models, fake_mode=fake_mode,
                        batch=batch, make_optimizer=self.make_optimizer, loss_fn=self.loss_fn,
                        default_loss=self.default_loss, clip_grad_norm=self.config.optim.clip_grad_norm)
        return dataclasses.replace(tr, recipe=name), self.notes + list(notes), _tf32(recipe_config.precision)

    def recipe_plan(self, trace: StepTrace, *, tf32: bool, notes: list[str], scaled_ops: float = 1.0) -> RecipePlan:
        return _recipe_plan(trace, self.target, tf32=tf32, notes=notes, scaled_ops=scaled_ops,
                            kernel_times=self.kernel_times, execution=self.execution(trace))

    def execution(self, trace: StepTrace) -> Execution:
        """How the traced step would run on a GPU target: its host reads, compiled or not, whose FP8 layers."""
        recipe_config, _ = self.config.recipe.for_recipe(trace.recipe)
        return Execution(syncs=trace.syncs, compiled=_compiles(self.config.run.compile, recipe_config, self.target),
                         torchao=_torchao_layers(recipe_config, self.target), lowp_layers=trace.lowp_layers,
                         module_calls=trace.module_calls, untraced_ops=trace.saved_outputs)

    def step_time(self, ops, *, dtype_map: dict[str, str] | None = None) -> StepTime:
        return step_time(ops, self.target, dtype_map=dtype_map,
                         kernel_times=_measured(ops, self.target, self.kernel_times))


class TaskLoss:
    """The step's default loss, resolved as ``mixprec train`` resolves it: ``--task``, else the data's task, else
    the one the first traced output and the batch's real targets imply (:func:`~mixprec.train.tasks.infer_task`)."""

    def __init__(self, config, data, batch) -> None:
        self._asked = config.model.task
        self._hint = getattr(data, "task", None) if data is not None else None
        self._targets = batch.targets if isinstance(batch.targets, torch.Tensor) else None
        self.task = None

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        from torch.utils._python_dispatch import _disable_current_modes

        from ..train.tasks import infer_task, make_task

        if self.task is None:
            with _disable_current_modes():  # the real targets' values are read outside the fake mode
                name = self._asked if self._asked != "auto" else infer_task(logits, self._targets, hint=self._hint)
                self.task = make_task(name, targets=self._targets)
        return self.task.default_loss(logits, targets)


def _inputs(config, model, batch, data=None) -> tuple[Callable[[], nn.Module], str, Any, Any]:
    """The model builder, the model's name, the batch and the data (None when the model and batch were given)."""
    from ..train.build import load_data, model_from_config
    from ..train.contract import as_batch

    seed = config.run.seed
    if data is None and (batch is None or model is None):
        data = load_data(config.data, seed=seed, block_size=config.model.block_size)
    if batch is None:
        loader = data.loader(config.optim.batch_size, seed=seed, rank=0, world_size=1, num_workers=0,
                             device=torch.device("cpu"))
        batch = next(iter(loader))
    if isinstance(model, nn.Module):
        import copy

        module = model
        return (lambda: copy.deepcopy(module)), type(module).__name__, as_batch(batch), data
    if callable(model):
        return model, getattr(model, "__name__", type(model).__name__), as_batch(batch), data

    def build() -> nn.Module:
        torch.manual_seed(seed)
        return model_from_config(config.model, data)

    return build, config.model.name, as_batch(batch), data


def _efficiency_source(target: Target) -> str:
    from .roofline import GPU_HOST

    source = efficiency_for(target).source
    return source if target.kind == "cpu" else f"{source}; host dispatch {GPU_HOST.source}"


def _compiles(setting: Any, recipe_config, target: Target) -> bool:
    """Whether a run with ``--compile setting`` compiles: on, off, or auto (FP8/FP4 recipes on CUDA where every
    GEMM runs on real units: :meth:`mixprec.precision.Recipe.compiles`, answered for the target)."""
    if setting == "auto":
        lins = [lin for lin in (_linear_recipe(recipe_config), *file_recipes(recipe_config)) if lin is not None]
        caps = _target_capabilities(target)
        return target.kind == "cuda" and bool(lins) and all(caps.lowp_units(lin.name) for lin in lins)
    return setting in (True, "on")





def _torchao_layers(recipe_config, target: Target) -> bool:
    """Whether the run's low-precision layers are torchao's: ``--fp8-impl torchao``, or auto where the target has
    units for the recipe and torchao is installed here (:func:`mixprec.lowp.impls.auto_fp8_impl`)."""
    from ..lowp.impls import auto_fp8_impl

    lin = _linear_recipe(recipe_config)
    if lin is None or target.kind == "cpu" or recipe_config.fp8_impl == "scratch":
        return False
    return recipe_config.fp8_impl == "torchao" or auto_fp8_impl(lin, _target_capabilities(target)) == "torchao"


def _linear_recipe(recipe_config):
    """The low-precision linear recipe of an FP8/FP4 recipe config, else None."""
    from ..lowp.recipes import linear_recipe
    from ..precision import resolve_recipe

    spec = resolve_recipe(recipe_config.precision)
    return None if spec.fp8 is None else linear_recipe(spec.fp8, **recipe_config.linear_options())


def _canonical(name: str) -> str:
    from ..precision import resolve_recipe

    return resolve_recipe(name).name


def _tf32(name: str) -> bool:
    from ..precision import resolve_recipe

    return resolve_recipe(name).tf32


def _repeat_batch(batch, n: int):
    """``batch`` grown to ``n`` samples by repeating it."""
    from ..train.contract import Batch

    k = len(batch)

    def grow(t):
        if not (isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == k):
            return t
        return t.repeat(-(-n // k), *([1] * (t.dim() - 1)))[:n]

    return Batch(tuple(grow(a) for a in batch.args), {key: grow(v) for key, v in batch.kwargs.items()},
                 grow(batch.targets))


def _slice_batch(batch, n: int):
    from ..train.contract import Batch

    def s(t):
        return t[:n] if isinstance(t, torch.Tensor) and t.dim() > 0 else t

    return Batch(tuple(s(a) for a in batch.args), {k: s(v) for k, v in batch.kwargs.items()}, s(batch.targets))
