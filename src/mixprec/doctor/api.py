"""Library API: diagnose a model, a batch and a loss function under a precision recipe.

:func:`diagnose` trains a *copy* of the model for a few steps on a run built by the trainer's one build path
(:func:`mixprec.train.build.build_run`, the user's batches as its data), with the trainer's own step
(:func:`mixprec.train.step.train_step`), and runs the probes (:mod:`mixprec.probes`) over each step:

1. step 0 under the dispatcher-level observer: the precision map;
2. before every step, an fp32 pass: per-layer ranges and the true gradients (gradient elements lost to
   underflow), and on the first steps the block-format what-if table;
3. a step whose loss, gradients or weights come out non-finite is replayed on a copy of the pre-step weights:
   its first non-finite op, classified (:func:`mixprec.probes.replay.locate`);
4. ``optimizer.step`` hooked for lost updates; the loss scale, skips and their causes recorded.

Every pass calls the model and takes its loss by the model contract (:mod:`mixprec.train.contract`).
:func:`diagnose_run` does the same for any :class:`~mixprec.train.build.Run` (``mixprec doctor`` builds one).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..errors import NonFiniteError, UsageError, keywords_checked
from ..probes.attribution import ModuleTracker
from ..probes.block_formats import BlockFormatConfig, BlockFormatProbe
from ..probes.lost_updates import LostUpdateMonitor, optimizer_param_names, same_optimizer
from ..probes.nonfinite import all_finite
from ..probes.observer import OpObserver
from ..probes.precision_map import PrecisionMap, PrecisionMapSink
from ..probes.ranges import DEFAULT_FORMATS, GradientLoss, RangeProfile, RangeProfiler
from ..probes.replay import FaultAnalysis, ModelInputs, locate, replay_step, rng_state
from ..probes.scale_history import ScaleHistory, StepRecord
from ..scaler import ScalerConfig
from ..train.build import Run, build_run, probe
from ..train.config import TrainConfig
from ..train.contract import Batch, Objective, as_batch, parse_output
from ..train.data.sources import UserBatches
from ..train.outputs import check_folder
from ..train.step import train_step
from .report import DoctorReport

__all__ = ["diagnose", "diagnose_run", "precision_map", "range_profile", "find_first_nonfinite", "FaultAnalysis",
           "DoctorError"]


class DoctorError(UsageError):
    """A diagnose() call that cannot work as asked; the message names the fix."""


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

def _replay_call(objective: Objective, batch: Batch) -> tuple[Callable, ModelInputs, Any]:
    """The replays' ``(loss_fn, x, y)`` for one batch: the forward the model contract makes (as
    :class:`~mixprec.probes.replay.ModelInputs`) and a loss that takes it by the contract's rule."""
    args, kwargs = objective.call.arguments(batch)
    return (lambda out, _y: objective.loss(parse_output(out), batch)), ModelInputs(tuple(args), dict(kwargs)), \
        batch.targets


def _locate(run: Run, pre_step: nn.Module, batch: Batch, rng: tuple, step: int, scale: float, bad_params: bool,
            *, bisect: bool, search: bool) -> FaultAnalysis:
    """The first non-finite op of a failed step, classified: the step's forward and scaled backward replayed on
    ``pre_step`` (the weights before it) with its RNG state and loss scale (:func:`mixprec.probes.replay.locate`).
    A batch that already holds inf/nan is the data's fault: it is named, and nothing is replayed."""
    bad = batch.nonfinite()
    if bad:
        return FaultAnalysis(step, None, "non-finite batch", loss_scale=scale, data=tuple(bad))
    autocast = run.recipe.autocast
    loss_fn, x, y = _replay_call(run.objective, batch)
    base = list(run.recipe.keep_fp32)
    ev = replay_step(pre_step, autocast, loss_fn, x, y, scale=scale, fp32=base, rng=rng)
    if ev is None:
        return FaultAnalysis(step, None, "optimizer step" if bad_params else "not reproduced", loss_scale=scale)
    return locate(ev, pre_step, autocast, loss_fn, x, y, step=step, scale=scale, fp32=base, rng=rng, bisect=bisect,
                  search=search)


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
            :class:`~mixprec.probes.block_formats.BlockFormatConfig`, format names, ``"all"``), or None to skip it.
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
    rng = rng_state(run.device)
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
    bad_params = not skipped and not stopped and not all_finite(run.model.parameters())
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
def find_first_nonfinite(model: nn.Module, batch: Any, loss_fn: Callable | None = None, *,
                         precision: str = "fp16-mixed", amp_impl: str = "auto", loss_scale: float = 1.0,
                         replay: bool = True, device: str | torch.device | None = "auto") -> FaultAnalysis | None:
    """First non-finite op of one forward + ``(loss * loss_scale)`` backward under the recipe, classified.

    Returns None when the step is finite. Nothing is trained; ``model`` is not modified.
    """
    run = _user_run(model, batch, loss_fn, precision=precision, amp_impl=amp_impl, device=device)
    first = _first_batch(run)
    with run.recipe.run_context():
        fa = _locate(run, run.model, first, rng_state(run.device), 0, loss_scale, False, bisect=replay,
                     search=replay)
    return None if fa.classification == "not reproduced" else fa
