"""What a sampled step observes: per-layer ranges, per-layer gradient norms and lost updates, on the real step.

Ranges
------
The doctor's range profiler (:mod:`mixprec.doctor.ranges`) counts magnitudes per binade (:class:`Log2Histogram`)
and projects them onto fp16/bf16/fp8 at a loss scale. On a sampled step the watch fills the same
per-layer histograms (:class:`LayerRanges`, the same layers: :func:`profiled_layers`) from the *real* step
instead of an extra fp32 pass: forward hooks count each layer's output, tensor hooks the gradient flowing
into it, and the parameter gradients are counted before the optimizer step. No second forward runs, so no
loss function is needed and nothing of the step is repeated. What this sees is the step as it ran: a value
that overflowed is counted as non-finite, one that underflowed as a zero, where the doctor's fp32 pass sees
their true magnitudes. Gradients of a scaled loss carry the loss scale ``2**k``; they are counted ``k``
binades lower (exact for the power-of-two scales GradScaler and DynamicLossScaler use), so the histograms
hold true magnitudes and the report projects them at the current scale, as doctor.json does. A tensor of
more than ``sample_elements`` elements is counted from a fixed strided subsample (:mod:`.subsample`: fractions
are estimates, the largest magnitude and non-finite presence exact); the step's tensors are binned together
at the end of the step, with one host read.

Lost updates
------------
The doctor's :class:`~mixprec.doctor.lost_updates.LostUpdateMonitor` (a shadow fp32 step over copies of the
stepped tensors, then ``low(w + Δ) == w``), driven by the watch's own step hooks on sampled steps only, on the
same subsample of each large tensor (``max_elements``; elementwise optimizers only).

Gradient norms
--------------
Per layer, ``||g||_2`` of its parameters' gradients (unscaled): the finite check's per-gradient norms where it
took them (no loss scaler), else one ``_foreach_norm`` per layer; one host read at the end of the step.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from ..doctor.lost_updates import LostUpdateMonitor, optimizer_param_names
from ..doctor.ranges import BIN_MAX, BIN_MIN, LayerRanges, Log2Histogram, RangeProfile, profiled_layers
from ..memory import local_tensor
from .subsample import DEFAULT_SAMPLE_ELEMENTS, HistogramBatch

__all__ = ["Sampler", "InertHook", "shifted"]


class InertHook:
    """A hook that a deep copy of the module turns into a no-op (a copy must not call back into the watch)."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs) if self.fn is not None else None

    def __deepcopy__(self, memo: dict) -> InertHook:
        return InertHook(None)


def shifted(h: Log2Histogram, k: int) -> Log2Histogram:
    """``h`` with every binade lowered by ``k`` (values divided by ``2**k``); the end bins absorb the rest."""
    out = Log2Histogram(zeros=h.zeros, nonfinite=h.nonfinite)
    c, n = h.counts, BIN_MAX - BIN_MIN + 1
    if k == 0:
        out.counts = c.clone()
    elif k > 0:
        out.counts[: n - k] = c[k:]
        out.counts[0] += c[:k].sum()
    else:
        out.counts[-k:] = c[: n + k]
        out.counts[-1] += c[n + k:].sum()
    return out


class Sampler:
    """The observers of sampled steps; accumulates over samples and keeps one record per sample."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, formats: tuple[str, ...],
                 lost_updates: bool, sample_elements: int = DEFAULT_SAMPLE_ELEMENTS, *,
                 device: torch.device | None = None) -> None:
        self.model = model
        self.device = device
        """Where a sample's tensors are gathered for its reads (the watch's device); None: the first one's."""
        self.formats = formats
        self.sample_elements = sample_elements
        self.modules = dict(profiled_layers(model))
        self.kinds = {name: type(m).__name__ for name, m in self.modules.items()}
        if any(True for _ in model.parameters(recurse=False)):
            self.kinds[""] = type(model).__name__
        self.owner = {}
        for name, m in model.named_modules():
            for pn, _ in m.named_parameters(recurse=False, prefix=name):
                self.owner[pn] = name
        self._named = [(self.owner.get(n, ""), p) for n, p in model.named_parameters()]
        self.cumulative = {name: LayerRanges(name, kind) for name, kind in self.kinds.items()}
        self.monitor = LostUpdateMonitor(optimizer, optimizer_param_names(optimizer, model),
                                         max_elements=sample_elements) if lost_updates else None
        self.samples: list[dict[str, Any]] = []
        self._handles: list[Any] = []
        self._current: dict[str, LayerRanges] = {}
        self._batch = HistogramBatch(sample_elements, device=device)
        self._k = 0
        self._norms: dict[str, float] = {}
        self._pending_norms: tuple | None = None
        self._lost_before: dict[str, tuple[int, int]] = {}
        self.pre_done = False
        self.low_dtype: torch.dtype | None = None
        """A 16-bit dtype seen in a layer's output (autocast applied inside the model's forward)."""
        self.elements = self.seen = 0
        """Elements the histograms stood for, and elements they binned (the subsamples), over all samples."""

    # -- one sampled step ---------------------------------------------------------------------------
    def arm(self, log2_scale: int) -> None:
        """Before the step's first forward: hook the layers (``log2_scale``: the scale its backward uses)."""
        self._k = log2_scale
        self._current = {name: LayerRanges(name, kind) for name, kind in self.kinds.items()}
        self._batch = HistogramBatch(self.sample_elements, device=self.device)
        self._norms = {}
        self.pre_done = False
        if self.monitor is not None:
            self._lost_before = {lu.name: (lu.updated, lu.lost) for lu in self.monitor.result().layers}
        for name, m in self.modules.items():
            self._handles.append(m.register_forward_hook(InertHook(self._forward_hook(name))))

    def _forward_hook(self, name: str):
        batch = self._batch
        act, grad = (name, "activations", 0), (name, "grad_outputs", self._k)

        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            for t in tree_leaves(output):
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    if self.low_dtype is None and t.dtype in (torch.float16, torch.bfloat16):
                        self.low_dtype = t.dtype
                    batch.add(act, t)
                    if t.requires_grad:
                        t.register_hook(lambda g: batch.add(grad, g))
        return hook

    def before_step(self, grads_log2_scale: int, squares: dict[int, torch.Tensor] | None = None) -> None:
        """The gradients are final (``grads_log2_scale``: the scale they still carry, 0 once unscaled).

        ``squares``: the gradients' squared L2 norms by ``id(param)`` where the caller took them already (the
        finite check); the other gradients' norms are taken here, one ``_foreach_norm`` per layer.
        """
        known: dict[str, list[torch.Tensor]] = {}
        unmeasured: dict[str, list[torch.Tensor]] = {}
        for layer, p in self._named:
            if p.grad is None:
                continue
            g = p.grad.detach()
            g = local_tensor(g)
            if layer in self._current:
                self._batch.add((layer, "grad_params", grads_log2_scale), g)
            known.setdefault(layer, [])
            if squares is not None and id(p) in squares:
                known[layer].append(squares[id(p)])
            else:
                unmeasured.setdefault(layer, []).append(g)
        for layer, gs in unmeasured.items():
            known[layer] += [n.float().square() for n in torch._foreach_norm(gs)]
        if known:
            device = self.device or next(iter(known.values()))[0].device
            sq = [torch.stack([n.float().to(device) for n in ns]).sum() for ns in known.values()]
            self._pending_norms = (list(known), torch.stack(sq).sqrt(), grads_log2_scale)

    @property
    def step_norms(self) -> dict[str, float]:
        """The last sampled step's per-layer gradient norms (unscaled)."""
        return self._norms

    def pre_update(self, optimizer: torch.optim.Optimizer) -> None:
        if self.monitor is not None:
            self.monitor.before_step(optimizer)
        self.pre_done = True

    def post_update(self, optimizer: torch.optim.Optimizer) -> None:
        if self.monitor is not None and self.pre_done:
            self.monitor.after_step(optimizer)

    def finish(self, step: int, scale: float) -> dict[str, Any]:
        """After the step: unhook, read the step's histograms (one read), fold them into the totals, and return
        its record."""
        self.remove()
        self.elements += self._batch.elements
        self.seen += self._batch.seen
        pending, self._pending_norms = self._pending_norms, None
        if pending is not None:
            layers, values, k = pending
            self._norms = {layer: v / 2.0**k for layer, v in zip(layers, values.tolist())}  # the norms' one read
        for (layer, field, shift), h in self._batch.read():
            getattr(self._current[layer], field).merge(shifted(h, shift) if shift else h)
        for name, lr in self._current.items():
            self.cumulative[name].activations.merge(lr.activations)
            self.cumulative[name].grad_outputs.merge(lr.grad_outputs)
            self.cumulative[name].grad_params.merge(lr.grad_params)
        k = round(math.log2(scale)) if scale > 0 else 0
        step_profile = RangeProfile(layers=[lr for lr in self._current.values()
                                            if lr.activations.total or lr.gradients().total], steps=1,
                                    formats=self.formats)
        rows = step_profile.layer_rows(k)
        record = {"step": step, "loss_scale": scale,
                  "layers": [{"layer": r["layer"], "grad_norm": self._norms.get(r["layer"]),
                              "activations": r["activations"], "gradients": r["gradients"]} for r in rows],
                  "lost_updates": self._lost_since()}
        self.samples.append(record)
        return record

    def _lost_since(self) -> dict[str, Any] | None:
        if self.monitor is None or not self.pre_done:
            return None
        layers, upd, lost = {}, 0, 0
        for lu in self.monitor.result().layers:
            u0, l0 = self._lost_before.get(lu.name, (0, 0))
            du, dl = lu.updated - u0, lu.lost - l0
            layers[lu.name] = dl / du if du else 0.0
            upd, lost = upd + du, lost + dl
        return {"fraction": lost / upd if upd else 0.0, "layers": layers}

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # -- totals -------------------------------------------------------------------------------------
    def profile(self) -> RangeProfile:
        layers = [lr for lr in self.cumulative.values() if lr.activations.total or lr.gradients().total]
        return RangeProfile(layers=layers, steps=len(self.samples), formats=self.formats)
