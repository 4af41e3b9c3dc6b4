"""The flight recorder: what a step needs to be replayed, the replay that localises its fault, and capture.pt.

For each forward of a training step (each micro-batch) :class:`MicroBatch` keeps references to the call's
arguments, the CPU (and CUDA) RNG state before it ran, the autocast state, and the *seed*: the gradient backward
sent into the model's output. The seed makes the replay independent of the user's loss, which the watch never
sees: a replay's loss is the model's own loss times the seed, or ``sum(output * seed)``, whose gradient with
respect to the output is exactly the seed; a forward that no backward reached (the loop skipped it) replays
its forward alone. Whether a backward reached it (:attr:`MicroBatch.backward`) is how the watch tells an
iteration the loop ended without a step from a micro-batch of gradient accumulation. :func:`localize` names a
batch that holds inf/nan as the fault (the data, not the model), else replays the micro-batches on copies of the
model (:mod:`mixprec.probes.replay`; the weights are still the failing step's: the check runs before the update,
and a skipped step changed nothing) and classifies the first non-finite op. :func:`save_capture` writes the step
as plain tensors, numbers and strings (``torch.load(path, weights_only=True)``); :func:`analyze_capture` reruns
the replay from it.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ..autocast import autocast as scratch_autocast
from ..autocast import autocast_dtype, is_autocast_active
from ..jsonio import to_jsonable
from ..memory import local_tensor
from ..probes.nonfinite import all_finite
from ..probes.observer import dtype_name
from ..probes.replay import FaultAnalysis, ModelInputs, locate, replay_step
from ..train.contract import Batch
from .config import WatchError

__all__ = ["AutocastState", "MicroBatch", "batch_nonfinite", "localize", "save_capture", "load_capture",
           "analyze_capture", "CAPTURE_FORMAT"]

CAPTURE_FORMAT = "mixprec.watch.capture/1"
LOSS_OUTSIDE = "non-finite loss (computed outside the model: its gradient reached the model non-finite)"
_DTYPES = {dtype_name(d): d for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64)}


@dataclasses.dataclass(frozen=True)
class AutocastState:
    """The autocast a forward ran under: ``torch.autocast`` (dtype, None if off) and mixprec's scratch autocast."""

    device_type: str
    dtype: torch.dtype | None
    scratch: torch.dtype | None = None

    @classmethod
    def now(cls, device_type: str) -> AutocastState:
        native = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
        return cls(device_type, native, autocast_dtype() if is_autocast_active() else None)

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        """The same autocast, with the weight cache off (a replay must not fill the user's cache)."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.autocast(self.device_type, dtype=self.dtype or torch.bfloat16,
                                               enabled=self.dtype is not None, cache_enabled=False))
            if self.scratch is not None:
                stack.enter_context(scratch_autocast(self.scratch))
            yield

    @property
    def low(self) -> torch.dtype | None:
        return self.dtype or self.scratch

    def to_dict(self) -> dict[str, Any]:
        return {"device_type": self.device_type, "dtype": dtype_name(self.dtype) if self.dtype else None,
                "scratch": dtype_name(self.scratch) if self.scratch else None}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> AutocastState:
        return cls(d["device_type"], _DTYPES.get(d["dtype"]), _DTYPES.get(d["scratch"]))


@dataclasses.dataclass(eq=False)
class MicroBatch:
    """One forward of a training step, as the replay needs it (see the module docstring)."""

    inputs: ModelInputs
    rng: tuple[torch.Tensor, torch.Tensor | None]
    autocast: AutocastState
    seed_kind: str | None = None
    """``loss`` (the model returned its loss), ``outputs`` (gradients of its outputs) or None (no output needs a
    gradient: whether a backward ran cannot be seen)."""
    seed: list[torch.Tensor | None] = dataclasses.field(default_factory=list)
    loss: torch.Tensor | None = None
    """The model's own loss (detached, on the watch's device), if it returned one."""
    logged: list[torch.Tensor] = dataclasses.field(default_factory=list)
    """Losses the loop handed ``watch.log`` after this forward."""

    @property
    def backward(self) -> bool:
        """A backward reached the model's output (its seed arrived)."""
        return any(g is not None for g in self.seed)

    @property
    def skipped(self) -> bool:
        """No backward reached an output that needed one: the loop dropped this forward."""
        return self.seed_kind is not None and not self.backward

    def attach_seed(self, output: Any, on_backward: Callable[[], None] | None = None) -> torch.Tensor | None:
        """Hook the output tensors whose gradient is the seed; returns the model's own loss, if it has one.

        ``on_backward`` is called inside the backward, when the first seed arrives.
        """
        loss = find_loss(output)
        targets = [loss] if loss is not None else [t for t in output_tensors(output) if t.requires_grad]
        if not targets:
            return loss
        self.seed_kind = "loss" if loss is not None else "outputs"
        self.seed = [None] * len(targets)
        for i, t in enumerate(targets):
            t.register_hook(_Keep(self.seed, i, on_backward))
        return loss


class _Keep:
    """A tensor hook that keeps the gradient (returns None: the gradient is unchanged)."""

    def __init__(self, slots: list, i: int, on_first: Callable[[], None] | None) -> None:
        self.slots, self.i, self.on_first = slots, i, on_first

    def __call__(self, grad: torch.Tensor) -> None:
        first = not any(g is not None for g in self.slots)
        self.slots[self.i] = grad.detach()
        if first and self.on_first is not None:
            self.on_first()


def output_tensors(o: Any) -> list[torch.Tensor]:
    """Floating tensors in a model's output (tensors, tuples, lists, dicts, ``ModelOutput``), in order."""
    if isinstance(o, torch.Tensor):
        return [o] if o.is_floating_point() else []
    if isinstance(o, Mapping):
        return [t for v in o.values() for t in output_tensors(v)]
    if isinstance(o, (list, tuple)):
        return [t for v in o for t in output_tensors(v)]
    return []


def find_loss(o: Any) -> torch.Tensor | None:
    """The loss a model returned: a 0-dim floating output, or a mapping's ``loss`` entry (Hugging Face)."""
    t = o.get("loss") if isinstance(o, Mapping) else o
    if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() == 0:
        return t
    return None


@dataclasses.dataclass
class _Seed:
    kind: str | None
    grads: list[torch.Tensor | None]
    scale: float


def _seed_loss(out: Any, seed: _Seed) -> torch.Tensor:
    """A replay's loss whose backward sends the recorded seed (divided by the step's loss scale) into ``out``."""
    if seed.kind == "loss":
        g = seed.grads[0]
        factor = 1.0 if g is None else float(g) / seed.scale
        return find_loss(out).float() * factor
    outs = output_tensors(out)
    device = outs[0].device if outs else torch.device("cpu")  # outputs on several devices meet on the first's
    terms = [(o.float() * (g.to(o.device).float() / seed.scale)).sum().to(device)
             for o, g in zip(outs, seed.grads) if g is not None]
    if not terms:  # no backward was recorded: the replay checks the forward only
        terms = [(o.float().sum() * 0.0).to(device) for o in outs] or [torch.zeros((), device=device)]
    return torch.stack(terms).sum()


@contextlib.contextmanager
def _ambient_autocast_off(device_type: str) -> Iterator[None]:
    """Disable the caller's autocast around a replay (a trigger can fire inside the user's autocast region)."""
    with torch.autocast(device_type, enabled=False, cache_enabled=False), \
            scratch_autocast(torch.bfloat16, enabled=False):
        yield


def _seed_fault(batches: list[MicroBatch], step: int, scale: float) -> FaultAnalysis:
    """The model's forward replays finite: the seed (the gradient that reached its output) was not.

    With a loss scale above 1 and only infs, the scaled gradient overflowed the output's dtype on its way back
    from the loss (a scale overflow: the scaler's backoff handles it); otherwise the loss itself was non-finite.
    """
    seeds = [g for mb in batches for g in mb.seed if g is not None]
    if all_finite(seeds):
        return FaultAnalysis(step, None, "not reproduced", loss_scale=scale)
    if scale > 1 and not any(bool(torch.isnan(g).any()) for g in seeds):
        return FaultAnalysis(step, None, "scale overflow", loss_scale=scale)
    return FaultAnalysis(step, None, LOSS_OUTSIDE, loss_scale=scale)


def batch_nonfinite(batches: list[MicroBatch]) -> list[str]:
    """The micro-batches' input tensors that hold inf/nan, named as the trainer names them
    (:meth:`~mixprec.train.contract.Batch.nonfinite`; the watch sees no targets: they go to the loop's loss)."""
    many = len(batches) > 1
    return [f"micro-batch {i} {what}" if many else what for i, mb in enumerate(batches)
            for what in Batch(tuple(mb.inputs.args), dict(mb.inputs.kwargs), None).nonfinite()]


def localize(model: nn.Module, batches: list[MicroBatch], *, step: int, scale: float, search: bool = True,
             bisect: bool = True) -> FaultAnalysis:
    """The step's fault: a batch holding inf/nan (``non-finite batch``, nothing replayed), else the first
    non-finite op of the micro-batches replayed on copies of ``model``, classified."""
    if not batches:
        return FaultAnalysis(step, None, "not reproduced", loss_scale=scale)
    bad = batch_nonfinite(batches)
    if bad:
        return FaultAnalysis(step, None, "non-finite batch", loss_scale=scale, data=tuple(bad))
    device_type = batches[0].autocast.device_type
    with _ambient_autocast_off(device_type):
        for mb in batches:
            seed = _Seed(mb.seed_kind, mb.seed, scale)
            ev = replay_step(model, mb.autocast.context, _seed_loss, mb.inputs, seed, scale=scale, rng=mb.rng)
            if ev is not None:
                break
        else:
            return _seed_fault(batches, step, scale)
        if not ev.inputs_finite and ev.module is None:  # the seed: what the user's loss sent back into the model
            return _seed_fault(batches, step, scale)
        return locate(ev, model, mb.autocast.context, _seed_loss, mb.inputs, seed, step=step, scale=scale,
                      rng=mb.rng, bisect=bisect, search=search)


# ------------------------------------------------------------------------------------------------------
# capture.pt
# ------------------------------------------------------------------------------------------------------

def _plain(o: Any) -> Any:
    """``o`` as what ``torch.load(weights_only=True)`` accepts: CPU tensors, numbers, strings, containers."""
    if isinstance(o, torch.Tensor):
        return local_tensor(o).detach().cpu()  # a sharded (FSDP2) tensor: this rank's shard
    if o is None or isinstance(o, (bool, int, float, str)):
        return o
    if isinstance(o, Mapping):
        return {str(k): _plain(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_plain(v) for v in o]
    return {"__unsupported__": repr(o)[:200]}


def save_capture(path: str, *, model: nn.Module, batches: list[MicroBatch], step: int, reason: str, scale: float,
                 scaler: Any, analysis: FaultAnalysis | None) -> int:
    """Write capture.pt atomically; returns its size in bytes."""
    data = {
        "format": CAPTURE_FORMAT, "step": step, "reason": reason, "loss_scale": scale,
        "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
        "state_dict": _plain(model.state_dict()),
        "micro_batches": [{"args": _plain(list(mb.inputs.args)), "kwargs": _plain(mb.inputs.kwargs),
                           "rng_cpu": mb.rng[0], "rng_cuda": mb.rng[1], "autocast": mb.autocast.to_dict(),
                           "seed_kind": mb.seed_kind, "seed": _plain(mb.seed)} for mb in batches],
        "scaler": _plain(scaler.state_dict()) if scaler is not None and scaler.is_enabled() else None,
        "analysis": None if analysis is None else _plain(to_jsonable(analysis.to_dict())),
    }
    tmp = f"{path}.tmp-{os.getpid()}"
    torch.save(data, tmp)
    os.replace(tmp, path)
    return os.path.getsize(path)


def load_capture(path: str) -> dict[str, Any]:
    """A capture as saved (``weights_only=True``: no code runs while loading)."""
    data = torch.load(path, weights_only=True, map_location="cpu")
    if not isinstance(data, dict) or data.get("format") != CAPTURE_FORMAT:
        raise WatchError(f"{path} is not a mixprec.watch capture (expected format {CAPTURE_FORMAT})")
    return data


def analyze_capture(path: str, model: nn.Module, *, search: bool = True) -> FaultAnalysis:
    """Rerun the fault analysis of a capture on a copy of ``model`` (same class) with the captured weights."""
    data = load_capture(path)
    replica = copy.deepcopy(model)
    replica.load_state_dict(data["state_dict"])
    device = next(replica.parameters()).device
    batches = []
    for mb in data["micro_batches"]:
        move = (lambda t: t.to(device) if isinstance(t, torch.Tensor) else t)
        args = tuple(move(a) for a in mb["args"])
        kwargs = {k: move(v) for k, v in mb["kwargs"].items()}
        batches.append(MicroBatch(ModelInputs(args, kwargs), (mb["rng_cpu"], mb["rng_cuda"]),
                                  AutocastState.from_dict(mb["autocast"]), mb["seed_kind"],
                                  [None if g is None else g.to(device) for g in mb["seed"]]))
    scale = float(data["loss_scale"])
    return localize(replica, batches, step=int(data["step"]), scale=scale if math.isfinite(scale) else 1.0,
                    search=search)
