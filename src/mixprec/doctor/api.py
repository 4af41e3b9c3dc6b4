"""Library API: diagnose a model, a batch and a loss function under a precision recipe.

``diagnose(model, batch, loss_fn=None, precision="fp16-mixed")`` trains a *copy* of the model for a few
steps with the trainer's own step (:func:`mixprec.train.step.train_step`: the recipe's autocast,
backward, unscale/step) on a run built by the trainer's one build path
(:func:`mixprec.train.build.build_run`, with the user's batches as its data source), and watches each step.
The model is called, and its loss taken, by the model contract (:mod:`mixprec.train.contract`) in every
pass — the step, the fp32 reference pass and the replays — so a batch may be ``(x, y)``, ``(x_1, ..., y)`` or a
dict, the output a tensor, a tuple or a ``ModelOutput``, and the loss the model's own:

1. step 0 runs under the dispatcher-level observer with the precision-map sink (every op, dtype, module);
2. before every step, an fp32 pass records per-layer ranges (:mod:`.ranges`) and the true gradients,
   which the real step's gradients are compared with (gradient elements lost to underflow);
3. a step whose loss, gradients or weights come out non-finite is replayed on a copy of the pre-step
   weights under the non-finite watch (:mod:`.nonfinite`, :mod:`.replay`), which names the first op that
   produced inf/nan; more replays classify it (a loss-scale overflow that a smaller scale avoids, or a
   fault) and, for the first fault, search the smallest set of modules to keep in fp32;
4. ``optimizer.step`` is hooked to count lost updates (:mod:`.lost_updates`);
5. the loss scale, skips and their causes are recorded (:mod:`.scale_history`);
6. the fp32 pass of the first steps also quantizes every linear layer's GEMM operands in each FP8/FP4
   format (:mod:`.block_formats`: SQNR, clamped block scales, underflow), a what-if table per layer.

The observation costs a lot more than training (an extra fp32 pass and a weight snapshot per step, a shadow
optimizer step, replays of failed steps, a Python call per op on step 0), which is why it lives here and
never in ``mixprec train``. :func:`diagnose_run` does the same for any
:class:`~mixprec.train.build.Run` (``mixprec doctor`` builds one from its flags).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..errors import NonFiniteError, UsageError, keywords_checked
from ..scaler import ScalerConfig
from ..train.build import Run, build_run, probe
from ..train.config import TrainConfig
from ..train.contract import Batch, Objective, as_batch, parse_output
from ..train.data.sources import UserBatches
from ..train.outputs import check_folder
from ..train.step import train_step
from .attribution import ModuleTracker
from .block_formats import BlockFormatConfig, BlockFormatProbe
from .lost_updates import LostUpdateMonitor, optimizer_param_names, same_optimizer
from .nonfinite import NonFiniteEvent
from .observer import OpObserver
from .precision_map import PrecisionMap, PrecisionMapSink
from .ranges import DEFAULT_FORMATS, RangeProfile, RangeProfiler
from .replay import ModelInputs, ReplayResult, max_finite_scale, minimal_fp32_set, replay_step
from .report import DoctorReport, GradientLoss
from .scale_history import ScaleHistory, StepRecord

__all__ = [
    "diagnose", "diagnose_run", "precision_map", "range_profile", "find_first_nonfinite",
    "FaultAnalysis", "DoctorError",
]


class DoctorError(UsageError):
    """A diagnose() call that cannot work as asked; the message names the fix."""


@dataclasses.dataclass
class FaultAnalysis:
    """A step whose loss, gradients or weights went non-finite: its first non-finite op, classified."""

    step: int
    event: NonFiniteEvent | None
    """The first op that produced inf/nan when the step was replayed (None: the replay stayed finite)."""
    classification: str
    """``scale overflow`` (finite at a smaller loss scale), ``forward overflow``, ``forward nan``,
    ``backward overflow``, ``backward nan``, ``optimizer step`` (forward and backward finite, the update
    was not), ``non-finite batch`` (the step's batch held inf/nan: the data, not the model; ``data`` names the
    tensors), ``non-finite inputs`` (the weights already were) or ``not reproduced``."""
    loss_scale: float = 1.0
    max_finite_scale: float | None = None
    """Scale overflows: the largest power of two at which the same step is finite."""
    replay: ReplayResult | None = None
    """Faults: the fp32 replay's minimal module set."""
    data: tuple[str, ...] = ()
    """A non-finite batch: its tensors that hold inf/nan, with their counts
    (:meth:`~mixprec.train.contract.Batch.nonfinite`)."""

    @property
    def is_fault(self) -> bool:
        return self.classification not in ("scale overflow", "not reproduced")

    def describe(self, short: bool = False) -> str:
        s = f"{self.classification}"
        if not short:
            s = f"step {self.step}, {s} at loss scale {self.loss_scale:g}"
        if self.data:
            s += f": the batch holds inf/nan ({'; '.join(self.data)}) — the data is at fault, not the model"
        elif self.event is not None:
            s += f": {self.event.describe()}"
        elif self.classification == "optimizer step":
            s += ": forward and backward were finite, the weights after the update were not"
        if self.max_finite_scale is not None:
            s += f"; finite at scale <= {self.max_finite_scale:g}"
        return s

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "classification": self.classification, "loss_scale": self.loss_scale,
                "event": None if self.event is None else self.event.to_dict(),
                "max_finite_scale": self.max_finite_scale,
                "replay": None if self.replay is None else self.replay.to_dict(), "data": list(self.data),
                "description": self.describe()}


# ------------------------------------------------------------------------------------------------------
# building a run for a user's module
# ------------------------------------------------------------------------------------------------------

def _optimizer_factory(optimizer: Any, lr: float) -> Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer]:
    if optimizer is None:
        return lambda params: torch.optim.SGD(list(params), lr=lr)
    if isinstance(optimizer, torch.optim.Optimizer):
        cls, defaults = type(optimizer), dict(optimizer.defaults)
        return lambda params: same_optimizer(cls, list(params), defaults)
    if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        return lambda params: optimizer(list(params), lr=lr)
    if callable(optimizer):
        return optimizer
    raise DoctorError(
        f"diagnose(..., optimizer={optimizer!r}): pass None (SGD with lr), an optimizer class, an optimizer "
        "instance (its class and defaults are reused over the recipe's tensors), or a function params -> optimizer"
    )


def _user_run(model: nn.Module, batch: Any, loss_fn: Callable | None, *, precision: str = "fp16-mixed",
              optimizer: Any = None, lr: float = 1e-2, device: str | torch.device | None = "auto",
              **flags: Any) -> Run:
    """A :class:`Run` over a deep copy of ``model`` (the caller's module is never modified) and the caller's
    batches, built by the trainer's one build path. ``flags`` are config flags (``amp_impl``, ``init_scale``...)."""
    device = "auto" if device is None else str(device)  # auto: as --device auto (cuda where available)
    config = TrainConfig.from_flags(precision=precision, lr=lr, device=device, model=type(model).__name__,
                                    dataset=UserBatches.name, **flags)
    return build_run(config, data=UserBatches(_batches(batch)), model=copy.deepcopy(model), loss_fn=loss_fn,
                     make_optimizer=_optimizer_factory(optimizer, lr))


def _is_batch(b: Any) -> bool:
    """One batch of the contract: a dict of tensors, or a tuple of >= 2 items whose first is a tensor."""
    if isinstance(b, Mapping):
        return bool(b) and any(isinstance(v, torch.Tensor) for v in b.values())
    return (isinstance(b, tuple) and len(b) >= 2 and isinstance(b[0], torch.Tensor) and b[0].dim() > 0)


def _batches(batch: Any) -> list[Any]:
    if _is_batch(batch):
        return [batch]
    try:
        out = [tuple(b) if isinstance(b, list) else b for b in batch]
    except TypeError:
        out = []
    if not out or not all(_is_batch(b) for b in out):
        raise DoctorError(
            "diagnose(model, batch, loss_fn): batch must be an (inputs, targets) tuple of tensors, an (input_1, "
            "..., input_n, targets) tuple, a dict of tensors (model(**batch), targets under 'labels'), or a list "
            "of them; loss_fn(model output, targets) must return a scalar loss (None: the model's own loss, else "
            "the task's)"
        )
    return out


def _cycle(batches: Any) -> Iterator[Any]:
    for epoch in itertools.count():
        if hasattr(batches, "set_epoch"):
            batches.set_epoch(epoch)
        n = 0
        for b in batches:
            n += 1
            yield b
        if n == 0:
            raise DoctorError("no batches to diagnose: the dataset is empty (check --limit-train)")


# ------------------------------------------------------------------------------------------------------
# the diagnosis
# ------------------------------------------------------------------------------------------------------

def _rng_state(device: torch.device) -> tuple:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    # a sum is finite exactly when every term is (an inf or nan term makes it inf or nan); a finite sum
    # that overflows float32 is rechecked element-wise
    for t in tensors:
        if not bool(torch.isfinite(t.detach().sum(dtype=torch.float32))) and not bool(torch.isfinite(t).all()):
            return False
    return True


def _replay_call(objective: Objective, batch: Batch) -> tuple[Callable, ModelInputs, Any]:
    """The replays' ``(loss_fn, x, y)`` for one batch: the forward the model contract makes
    (:class:`~mixprec.doctor.replay.ModelInputs`) and a loss that takes it by the contract's rule."""
    args, kwargs = objective.call.arguments(batch)
    return (lambda out, _y: objective.loss(parse_output(out), batch)), ModelInputs(tuple(args), dict(kwargs)), \
        batch.targets


def _locate(run: Run, pre_step: nn.Module, batch: Batch, rng: tuple, step: int, scale: float, bad_params: bool,
            *, bisect: bool, search: bool) -> FaultAnalysis:
    """Find and classify the first non-finite op of a failed step by replaying it on ``pre_step``.

    The replay runs the step's forward and scaled backward on a copy of the weights before the step, with
    the step's RNG state (same dropout masks) and loss scale, under the non-finite watch. ``bisect``: find
    the largest finite loss scale for backward overflows; ``search``: the minimal fp32 module set for faults.
    A batch that already holds inf/nan is the data's fault: it is named, and nothing is replayed.
    """
    bad = batch.nonfinite()
    if bad:
        return FaultAnalysis(step, None, "non-finite batch", loss_scale=scale, data=tuple(bad))
    autocast = run.recipe.autocast
    loss_fn, x, y = _replay_call(run.objective, batch)
    base = list(run.recipe.keep_fp32)
    ev = replay_step(pre_step, autocast, loss_fn, x, y, scale=scale, fp32=base, rng=rng)
    if ev is None:
        kind = "optimizer step" if bad_params else "not reproduced"
        return FaultAnalysis(step, None, kind, loss_scale=scale)
    ev.step = step
    if not ev.inputs_finite:
        return FaultAnalysis(step, ev, "non-finite inputs", loss_scale=scale)
    if ev.phase == "backward" and scale > 1 and bisect:
        mfs = max_finite_scale(pre_step, autocast, loss_fn, x, y, scale=scale, fp32=base, rng=rng)
        if mfs is not None:
            return FaultAnalysis(step, ev, "scale overflow", loss_scale=scale, max_finite_scale=mfs)
    kind = "overflow" if ev.output.n_nan == 0 else "nan"
    analysis = FaultAnalysis(step, ev, f"{ev.phase} {kind}", loss_scale=scale)
    if search:
        analysis.replay = minimal_fp32_set(pre_step, autocast, loss_fn, x, y, scale=1.0, base=base, rng=rng)
    return analysis


class _Watch:
    """The observers one diagnosis attaches to a run, and what they found so far."""

    def __init__(self, run: Run, formats: Iterable[str], block_formats: BlockFormatConfig | None) -> None:
        self.tracker = ModuleTracker(run.model)
        self.blocks = BlockFormatProbe(run.model, block_formats)
        self.map_sink = PrecisionMapSink(run.recipe.low_dtype)
        self.profiler = RangeProfiler(run.model, formats)
        self.monitor = LostUpdateMonitor(run.optimizer, optimizer_param_names(run.optimizer, run.model))
        self.history = ScaleHistory()
        self.faults: list[FaultAnalysis] = []
        self.grad_loss = GradientLoss()
        self.pmap: PrecisionMap | None = None


def diagnose_run(
    run: Run,
    *,
    steps: int = 8,
    formats: Iterable[str] = DEFAULT_FORMATS,
    block_formats: BlockFormatConfig | Sequence[str] | str | None = BlockFormatConfig(),
    replay: bool = True,
    max_analyzed: int = 3,
    title: dict[str, Any] | None = None,
    log: Callable[[str], None] | None = None,
) -> DoctorReport:
    """Train ``run`` for ``steps`` steps on its training batches with every check on; returns the report.

    Args:
        steps: optimizer steps to observe; the run's batches are cycled if there are fewer (a shuffling
            loader is re-shuffled per pass).
        block_formats: the what-if formats of the block-format section (a
            :class:`~mixprec.doctor.block_formats.BlockFormatConfig`, format names, ``"all"``), or None to skip it.
        replay: classify non-finite steps and search the minimal fp32 module set (replays a copy).
        max_analyzed: classify at most this many non-finite steps (the rest keep their first op as cause).
        title: extra facts for the report header (model name, dataset...).
    """
    if steps < 1:
        raise DoctorError(f"--steps must be >= 1, got {steps}")
    watch = _Watch(run, formats, BlockFormatConfig.coerce(block_formats))
    scale = run.recipe.loss_scale()  # the initial scale: no step has run
    run.model.train()
    with run.recipe.run_context(), watch.monitor:
        for step, raw in zip(range(steps), _cycle(run.train_loader)):
            scale, stop = _observe_step(run, watch, step, as_batch(raw).to(run.device), scale,
                                        replay=replay, max_analyzed=max_analyzed, log=log)
            if stop:
                break
    return _report(run, watch, scale, title)


def _observe_step(run: Run, watch: _Watch, step: int, batch: Batch, scale: float, *, replay: bool,
                  max_analyzed: int, log: Callable[[str], None] | None) -> tuple[float, bool]:
    """One watched step; returns the next step's loss scale and whether the diagnosis must stop."""
    with watch.blocks.watching():
        ref_grads = watch.profiler.observe(run.objective, batch)
    pre_step = copy.deepcopy(run.model) if len(watch.faults) < max_analyzed else None
    rng = _rng_state(run.device)
    stopped = False
    observe = step == 0  # the precision map: one step under the dispatcher-level observer
    watch.tracker.new_step()
    with watch.tracker if observe else contextlib.nullcontext(), \
            OpObserver(watch.tracker, [watch.map_sink]) if observe else contextlib.nullcontext():
        try:
            loss, res = train_step(run.ctx, batch, step=step)
            loss_value, skipped, next_scale = float(loss), res.skipped, run.recipe.loss_scale()
        except NonFiniteError:
            loss_value, skipped, next_scale, stopped = float("nan"), True, scale, True
    if observe:
        watch.pmap = watch.map_sink.result(run.model)
    bad_params = not skipped and not stopped and not _all_finite(run.model.parameters())
    cause = None
    if skipped or stopped or bad_params or not math.isfinite(loss_value):
        cause = "non-finite loss or gradients (not analysed: --steps past the first faults)"
        if pre_step is not None:
            fa = _locate(run, pre_step, batch, rng, step, scale, bad_params, bisect=replay,
                         search=replay and not any(f.is_fault for f in watch.faults))
            watch.faults.append(fa)
            cause = fa.describe(short=True)
    if not skipped and not stopped:
        watch.grad_loss.add(run.model, ref_grads)
    watch.history.add(StepRecord(step=step, loss=loss_value, scale=scale, next_scale=next_scale,
                                 skipped=bool(skipped), cause=cause, stopped=stopped))
    if log is not None:
        log(f"doctor step {step}: loss {loss_value:.4f}, scale {scale:g}"
            + (" SKIPPED" if skipped else "") + (f" ({cause})" if cause else ""))
    return next_scale, stopped or bad_params


def _report(run: Run, watch: _Watch, scale: float, title: dict[str, Any] | None) -> DoctorReport:
    recipe, model = run.recipe, run.model
    order = [n for n, _ in model.named_modules()]
    return DoctorReport(
        title={**(title or {}), "recipe": recipe.name, "impl": recipe.impl, "describe": recipe.describe(),
               "device": str(run.device), "steps": len(watch.history.records),
               "params": sum(p.numel() for p in model.parameters())},
        recipe_spec=recipe.facts(),
        precision_map=watch.pmap,
        ranges=watch.profiler.result(),
        loss_scale=scale,
        gradient_loss=watch.grad_loss,
        faults=watch.faults,
        lost_updates=watch.monitor.result(order),
        history=watch.history,
        block_formats=watch.blocks.result(),
    )


@keywords_checked
def diagnose(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
    *,
    precision: str = "fp16-mixed",
    steps: int = 8,
    optimizer: Any = None,
    lr: float = 1e-2,
    amp_impl: str = "auto",
    init_scale: float = ScalerConfig.init_scale,
    growth_interval: int = ScalerConfig.growth_interval,
    stochastic_rounding: bool = False,
    keep_fp32: tuple[str, ...] = (),
    clip_grad_norm: float | None = None,
    device: str | torch.device | None = "auto",
    formats: Iterable[str] = DEFAULT_FORMATS,
    block_formats: BlockFormatConfig | Sequence[str] | str | None = BlockFormatConfig(),
    replay: bool = True,
    out: str | None = None,
) -> DoctorReport:
    """Diagnose ``model`` on ``batch`` under a precision recipe (see the module docstring).

    Args:
        model: any ``nn.Module``; a deep copy is trained, the original is left untouched.
        batch: ``(inputs, targets)``, ``(input_1, ..., input_n, targets)``, a dict of tensors (``model(**batch)``,
            targets under ``labels``), or a list of them (cycled over ``steps``).
        loss_fn: ``loss_fn(model output, targets) -> scalar``; None: the loss the model returns, else the
            task's default (inferred from the targets and the output).
        precision: a recipe name (``fp16-mixed``, ``bf16-mixed``, ``bf16-true``, ...; see mixprec.precision).
        optimizer: None (SGD with ``lr``), an optimizer class, an optimizer instance (class and defaults
            reused over the recipe's tensors, which may be fp32 master copies), or ``params -> optimizer``.
        init_scale, growth_interval: the dynamic loss scaler (fp16 recipes); defaults are
            :class:`~mixprec.scaler.ScalerConfig`'s.
        device: where the copy trains; ``auto`` (the default) picks as ``--device auto`` does (cuda where
            available, :func:`mixprec.hardware.resolve_device`).
        formats: formats the range profile projects onto.
        block_formats: the block-format what-if section's formats or config (None: skip it).
        replay: classify non-finite steps and search the minimal fp32 module set.
        out: also write doctor.json and the PNG plots into this folder.
    """
    block_formats = BlockFormatConfig.coerce(block_formats)  # a bad format name fails before anything is built
    if out is not None:
        check_folder(out, "out")  # before the diagnosis, as the CLI's --out
    run = _user_run(model, batch, loss_fn, precision=precision, optimizer=optimizer, lr=lr, device=device,
                    amp_impl=amp_impl, init_scale=init_scale, growth_interval=growth_interval,
                    stochastic_rounding=stochastic_rounding, keep_fp32=tuple(keep_fp32),
                    clip_grad_norm=clip_grad_norm)
    report = diagnose_run(run, steps=steps, formats=formats, block_formats=block_formats, replay=replay,
                          title={"model": type(model).__name__, "data": run.data.name})
    if out is not None:
        report.write(out)
    return report


# ------------------------------------------------------------------------------------------------------
# the individual checks
# ------------------------------------------------------------------------------------------------------

def _first_batch(run: Run) -> Batch:
    """The run's first training batch, through the data protocol (its loader), on the run's device."""
    run.train_loader.set_epoch(0)
    raw = next(iter(run.train_loader), None)
    if raw is None:
        raise DoctorError("no batches to diagnose: the batch list is empty")
    return as_batch(raw).to(run.device)


@keywords_checked
def precision_map(model: nn.Module, batch: Any, loss_fn: Callable | None = None, *, precision: str = "fp16-mixed",
                  amp_impl: str = "auto", device: str | torch.device | None = "auto") -> PrecisionMap:
    """The precision map of one training step (forward, backward, optimizer step) of a copy of ``model``."""
    run = _user_run(model, batch, loss_fn, precision=precision, amp_impl=amp_impl, device=device)
    first = _first_batch(run)
    tracker = ModuleTracker(run.model)
    sink = PrecisionMapSink(run.recipe.low_dtype)
    with run.recipe.run_context(), tracker, OpObserver(tracker, [sink]):
        try:
            train_step(run.ctx, first, step=0)
        except NonFiniteError:
            pass  # the map of what ran so far is still the answer
    return sink.result(run.model)


def range_profile(model: nn.Module, batch: Any, loss_fn: Callable | None = None, *,
                  formats: Iterable[str] = DEFAULT_FORMATS) -> RangeProfile:
    """Per-layer fp32 ranges of activations and gradients over the given batch(es); no training."""
    data = UserBatches(_batches(batch))
    objective = _objective(model, data, loss_fn)
    profiler = RangeProfiler(model, formats)
    for raw in data.batches:
        profiler.observe(objective, as_batch(raw))
    return profiler.result()


def _objective(model: nn.Module, data: UserBatches, loss_fn: Callable | None) -> Objective:
    """How the contract calls ``model`` on ``data`` (the probe of a run, without building one)."""
    config = TrainConfig.from_flags(model=type(model).__name__, dataset=data.name)
    return probe(model, data, config, loss_fn)[0]


@keywords_checked
def find_first_nonfinite(model: nn.Module, batch: Any, loss_fn: Callable | None = None, *, precision: str = "fp16-mixed",
                         amp_impl: str = "auto", loss_scale: float = 1.0, replay: bool = True,
                         device: str | torch.device | None = "auto") -> FaultAnalysis | None:
    """First non-finite op of one forward + ``(loss * loss_scale)`` backward under the recipe, classified.

    Returns None when the step is finite. Nothing is trained; ``model`` is not modified.
    """
    run = _user_run(model, batch, loss_fn, precision=precision, amp_impl=amp_impl, device=device)
    first = _first_batch(run)
    with run.recipe.run_context():
        fa = _locate(run, run.model, first, _rng_state(run.device), 0, loss_scale, False, bisect=replay,
                     search=replay)
    return None if fa.classification == "not reproduced" else fa
