"""Replay a failing step to explain it: at lower loss scales, and with chosen modules in fp32.

A non-finite value has three usual causes, and each replay below tells one from the others. Replays run
on a *copy* of the model with the weights of the failing step, the same batch and the recipe's autocast,
so the run being diagnosed is never disturbed (BatchNorm statistics included).

1. **The loss scale is too large** (fp16 with dynamic scaling): the forward is finite and the backward
   overflows only because the loss was multiplied by ``S``. The dynamic scaler handles this by skipping
   the step and halving ``S``. :func:`max_finite_scale` finds the largest power of two ``<= S`` at which
   the step is finite (bisection over the exponent; finiteness is monotone in ``S`` up to rounding).
2. **A layer's values leave the low format's range** (an activation above 65504 in fp16, a gradient
   that explodes in a custom backward): :func:`minimal_fp32_set` runs modules in fp32 until the step is
   finite. Greedy: replay, take the module of the first non-finite op, add it to the fp32 set, replay
   again, until finite; then drop every module whose removal keeps the step finite. The result is a
   1-minimal set (no single module can be dropped), usually the one layer that overflows.
3. **The values are non-finite even in fp32** (a too-large learning rate, a log of zero): no module set
   helps, and the replay says so.

Running a module in fp32 (:class:`Fp32Modules`) means: its parameters and buffers converted to fp32 (on
the copy), its floating inputs cast up, and autocast disabled inside it -- both ``torch.autocast`` and
mixprec's scratch autocast, so the same replay works for either mechanism.

Devices: a replay computes on :func:`step_device` (the model's accelerator; its autocast is the one the fp32
modules turn off, its CUDA generator the one a recorded state is restored into) and forks the generator of
every CUDA device the model and its inputs touch (:func:`cuda_devices`), so the caller's RNG is left as it was.
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
           "step_device", "cuda_devices"]


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
