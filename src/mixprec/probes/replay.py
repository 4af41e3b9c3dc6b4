"""Replay a failing step on a copy of the model to explain it, and classify what it finds (:class:`FaultAnalysis`).

Replays run on a deep copy with the failing step's weights, batch, autocast and RNG state, under the non-finite
watch (:mod:`.nonfinite`), so the observed run is never disturbed:

* :func:`replay_step`: the first op that produced inf/nan, or None;
* :func:`max_finite_scale`: the largest power of two ``<= S`` at which the step is finite (a loss-scale overflow
  that the scaler's backoff handles; bisection over the exponent);
* :func:`minimal_fp32_set`: a 1-minimal set of modules whose fp32 execution (:class:`Fp32Modules`: weights and
  inputs in fp32, both autocasts off inside) makes the step finite -- greedy (add the module of the first
  non-finite op until finite), then pruned; none when the values are non-finite even in fp32;
* :func:`locate`: the three above, as the doctor and the watch classify a failed step.

A replay computes on :func:`step_device` (the first accelerator among the model's and the inputs' tensors) and
forks the generator of every CUDA device they touch (:func:`cuda_devices`): the caller's RNG is left as it was.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from ..autocast.fp32_forward import Fp32Forward
from .attribution import ModuleTracker, display_path
from .nonfinite import NonFiniteEvent, NonFiniteWatch
from .observer import OpObserver

__all__ = ["Fp32Modules", "ModelInputs", "replay_step", "max_finite_scale", "minimal_fp32_set", "ReplayResult",
           "FaultAnalysis", "locate", "rng_state", "step_device", "cuda_devices"]


@dataclasses.dataclass
class ModelInputs:
    """The arguments of one forward call, for replays of models that take more than one tensor: passed as ``x``,
    the replay calls ``model(*args, **kwargs)`` instead of ``model(x)`` (``mixprec.watch`` records these)."""

    args: tuple
    kwargs: dict


def _tensors(model: nn.Module, x: Any) -> list[torch.Tensor]:
    """The model's parameters and buffers, then every tensor in ``x`` (nested containers included)."""
    inputs = tree_leaves((x.args, x.kwargs)) if isinstance(x, ModelInputs) else tree_leaves(x)
    return [*model.parameters(), *model.buffers(), *(t for t in inputs if isinstance(t, torch.Tensor))]


def step_device(model: nn.Module, x: Any = ()) -> torch.device:
    """The device a step of ``model`` on ``x`` computes on: the first non-CPU device among the model's parameters
    and buffers and the tensors of ``x`` (a tensor, a :class:`ModelInputs`, or containers of them, at any depth),
    else the CPU. One rule for the watch, which records the step's autocast and CUDA RNG state on it, and for the
    replay, which restores them there."""
    return next((t.device for t in _tensors(model, x) if t.device.type != "cpu"), torch.device("cpu"))


def cuda_devices(model: nn.Module, x: Any = ()) -> list[torch.device]:
    """Every CUDA device the model's tensors and ``x``'s are on: the generators a replay forks."""
    return list(dict.fromkeys(t.device for t in _tensors(model, x) if t.device.type == "cuda"))


def rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The RNG state :func:`replay_step` restores: the CPU generator's, and on a CUDA device that device's."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _forward(model: nn.Module, x: Any) -> Any:
    return model(*x.args, **x.kwargs) if isinstance(x, ModelInputs) else model(x)


class Fp32Modules:
    """Context: the named modules of ``model`` run in fp32 with autocast off (converts them in place)."""

    def __init__(self, model: nn.Module, names: Iterable[str], device_type: str) -> None:
        self.model = model
        self.names = list(dict.fromkeys(names))
        self._forward = Fp32Forward(device_type)

    def __enter__(self) -> Fp32Modules:
        modules = [self.model.get_submodule(name) for name in self.names]
        for m in modules:
            m.float()
        self._forward.install(modules)
        return self

    def __exit__(self, *exc) -> None:
        self._forward.remove()


def replay_step(
    model: nn.Module,
    autocast: Callable[[], contextlib.AbstractContextManager],
    loss_fn: Callable,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    scale: float = 1.0,
    fp32: Iterable[str] = (),
    rng: tuple | None = None,
) -> NonFiniteEvent | None:
    """Forward + ``(loss * scale).backward()`` on a copy of ``model``; the first non-finite op, or None.

    Args:
        x: the model's input, or a :class:`ModelInputs` (then the forward is ``model(*x.args, **x.kwargs)``).
        rng: ``(cpu_state, cuda_state_or_None)`` to replay with (the failed step's dropout masks; the CUDA
            state is :func:`step_device`'s); the caller's RNG state is restored afterwards either way.
    """
    replica = copy.deepcopy(model)
    replica.train(model.training)
    device = step_device(model, x)
    tracker = ModuleTracker(replica)
    watch = NonFiniteWatch()
    with torch.random.fork_rng(devices=cuda_devices(model, x)), tracker, Fp32Modules(replica, fp32, device.type), \
            OpObserver(tracker, [watch]):
        if rng is not None:
            torch.set_rng_state(rng[0])
            if rng[1] is not None and device.type == "cuda":  # (a CUDA step replayed on the CPU: no GPU draws)
                torch.cuda.set_rng_state(rng[1], device)
        with autocast():
            loss = loss_fn(_forward(replica, x), y)
        if watch.first is None:
            (loss * scale).backward()
    if watch.first is not None:
        watch.first.loss_scale = scale
    return watch.first


def max_finite_scale(model, autocast, loss_fn, x, y, *, scale: float, fp32: Iterable[str] = (),
                     rng: tuple | None = None) -> float | None:
    """Largest power of two ``<= scale`` at which the step is finite; None if not even at 1."""
    fp32 = list(fp32)

    def finite(s: float) -> bool:
        return replay_step(model, autocast, loss_fn, x, y, scale=s, fp32=fp32, rng=rng) is None

    if not finite(1.0):
        return None
    lo, hi = 0, max(0, math.floor(math.log2(scale)))  # finite at 2**lo; test up to 2**hi
    if hi > 0 and finite(2.0**hi):
        return 2.0**hi
    hi -= 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if finite(2.0**mid):
            lo = mid
        else:
            hi = mid - 1
    return 2.0**lo


@dataclasses.dataclass
class ReplayResult:
    """Outcome of :func:`minimal_fp32_set`."""

    modules: list[str] | None
    """The 1-minimal set of modules to keep in fp32 (qualified names), or None when none was found."""
    trials: list[dict[str, Any]]
    """Each replay: the fp32 set and the first non-finite op it still produced (None: finite)."""
    note: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def minimal_fp32_set(
    model: nn.Module,
    autocast: Callable[[], contextlib.AbstractContextManager],
    loss_fn: Callable,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    scale: float = 1.0,
    base: Iterable[str] = (),
    max_trials: int = 32,
    rng: tuple | None = None,
) -> ReplayResult:
    """Find a small set of modules whose fp32 execution makes the step finite (see the module docstring).

    Args:
        base: modules already kept in fp32 (the recipe's ``keep_fp32``); always part of every replay.
    """
    base = list(base)
    trials: list[dict[str, Any]] = []

    def trial(mods: list[str]) -> NonFiniteEvent | None:
        ev = replay_step(model, autocast, loss_fn, x, y, scale=scale, fp32=base + mods, rng=rng)
        trials.append({"fp32": [display_path(m) for m in mods],
                       "first_nonfinite": None if ev is None else ev.describe()})
        return ev

    chosen: list[str] = []
    ev = trial(chosen)
    if ev is None:
        return ReplayResult([], trials, "the step is finite in this replay; nothing needs fp32")
    while ev is not None:
        if len(trials) >= max_trials:
            return ReplayResult(None, trials, f"no finite replay within {max_trials} trials")
        m = ev.module
        if m is None:
            return ReplayResult(None, trials, f"the first non-finite op ran outside the model "
                                              f"({ev.phase}: aten.{ev.op}); keeping modules in fp32 cannot fix it")
        if (m in chosen or m in base) and ev.phase == "backward" and ev.op == "_to_copy" \
                and ev.upstream is not None and ev.upstream not in chosen:
            # the gradient left the fp32 module finite and overflowed when cast to the dtype of the module
            # that produced the input: that module has to join the fp32 set
            m = ev.upstream
        if m in chosen or m in base:
            return ReplayResult(None, trials, f"{display_path(m)} still produces non-finite values in fp32 "
                                              f"({ev.describe()}): this is not a precision problem")
        chosen.append(m)
        ev = trial(chosen)
    for m in reversed(list(chosen)):  # prune to a 1-minimal set
        if len(chosen) > 1 and len(trials) < max_trials:
            rest = [c for c in chosen if c != m]
            if trial(rest) is None:
                chosen = rest
    names = ", ".join(display_path(m) for m in chosen)
    return ReplayResult(chosen, trials, f"the step is finite with {names} in fp32")


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


def locate(ev: NonFiniteEvent, model: nn.Module, autocast: Callable[[], contextlib.AbstractContextManager],
           loss_fn: Callable, x: Any, y: Any, *, step: int, scale: float, fp32: Iterable[str] = (),
           rng: tuple | None = None, bisect: bool = True, search: bool = True) -> FaultAnalysis:
    """Classify ``ev``, the first non-finite op :func:`replay_step` found for these arguments.

    ``bisect``: a backward overflow at a scale above 1 that a smaller power of two avoids is a ``scale overflow``
    (:func:`max_finite_scale`); ``search``: for any other fault, the minimal fp32 module set at scale 1 (``fp32``:
    modules already kept in fp32, part of every replay).
    """
    ev.step = step
    if not ev.inputs_finite:
        return FaultAnalysis(step, ev, "non-finite inputs", loss_scale=scale)
    fp32 = list(fp32)
    if ev.phase == "backward" and scale > 1 and bisect:
        mfs = max_finite_scale(model, autocast, loss_fn, x, y, scale=scale, fp32=fp32, rng=rng)
        if mfs is not None:
            return FaultAnalysis(step, ev, "scale overflow", loss_scale=scale, max_finite_scale=mfs)
    analysis = FaultAnalysis(step, ev, f"{ev.phase} {ev.kind}", loss_scale=scale)
    if search:
        analysis.replay = minimal_fp32_set(model, autocast, loss_fn, x, y, scale=1.0, base=fp32, rng=rng)
    return analysis
