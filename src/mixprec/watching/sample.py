"""What a sampled step observes of the real step: per-layer ranges, per-layer gradient norms and lost updates.

* Ranges: the probes' :class:`~mixprec.probes.ranges.LayerRecorder` on the real step (no second pass, no loss
  needed): what it sees is the step as it ran (an overflow counts as non-finite, an underflow as a zero, where
  the doctor's fp32 pass sees true magnitudes); gradients of a scaled loss are counted at their true magnitude,
  large tensors through their subsample, all binned with one host read at the end of the step.
* Lost updates: :class:`~mixprec.probes.lost_updates.LostUpdateMonitor`, driven by the watch's own step hooks, on
  the same subsample of each large tensor.
* Gradient norms: per layer, ``||g||_2`` of its parameters' gradients (unscaled): the finite check's squared
  norms where it took them, else one ``_foreach_norm`` per layer; one host read at the end of the step.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..memory import local_tensor
from ..probes.lost_updates import LostUpdateMonitor, optimizer_param_names
from ..probes.ranges import LayerRanges, LayerRecorder, RangeProfile
from ..probes.subsample import DEFAULT_SAMPLE_ELEMENTS

__all__ = ["Sampler"]


class Sampler:
    """The observers of sampled steps; accumulates over samples and keeps one record per sample."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, formats: tuple[str, ...],
                 lost_updates: bool, sample_elements: int = DEFAULT_SAMPLE_ELEMENTS, *,
                 device: torch.device | None = None) -> None:
        self.model = model
        self.formats = formats
        self.ranges = LayerRecorder(model, sample_elements, device=device)
        self.device = device
        """Where a sample's tensors are gathered for its reads (the watch's device); None: the first one's."""
        self._named = [(n, self.ranges.owner.get(n, ""), p) for n, p in model.named_parameters()]
        self.cumulative = {name: LayerRanges(name, kind) for name, kind in self.ranges.kinds.items()}
        self.monitor = LostUpdateMonitor(optimizer, optimizer_param_names(optimizer, model),
                                         max_elements=sample_elements) if lost_updates else None
        self.samples: list[dict[str, Any]] = []
        self._norms: dict[str, float] = {}
        self._pending_norms: tuple | None = None
        self._lost_before: dict[str, tuple[int, int]] = {}
        self.pre_done = False
        self.elements = self.seen = 0
        """Elements the histograms stood for, and elements they binned (the subsamples), over all samples."""

    @property
    def low_dtype(self) -> torch.dtype | None:
        """A 16-bit dtype seen in a layer's output (autocast applied inside the model's forward)."""
        return self.ranges.low_dtype

    # -- one sampled step ---------------------------------------------------------------------------
    def arm(self, log2_scale: int) -> None:
        """Before the step's first forward: hook the layers (``log2_scale``: the scale its backward uses)."""
        self._norms = {}
        self.pre_done = False
        if self.monitor is not None:
            self._lost_before = {lu.name: (lu.updated, lu.lost) for lu in self.monitor.result().layers}
        self.ranges.start(log2_scale)

    def before_step(self, grads_log2_scale: int, squares: dict[int, torch.Tensor] | None = None) -> None:
        """The gradients are final (``grads_log2_scale``: the scale they still carry, 0 once unscaled).

        ``squares``: the gradients' squared L2 norms by ``id(param)`` where the caller took them already (the
        finite check); the other gradients' norms are taken here, one ``_foreach_norm`` per layer.
        """
        known: dict[str, list[torch.Tensor]] = {}
        unmeasured: dict[str, list[torch.Tensor]] = {}
        grads = []
        for name, layer, p in self._named:
            if p.grad is None:
                continue
            g = local_tensor(p.grad.detach())
            grads.append((name, g))
            known.setdefault(layer, [])
            if squares is not None and id(p) in squares:
                known[layer].append(squares[id(p)])
            else:
                unmeasured.setdefault(layer, []).append(g)
        self.ranges.add_grads(grads, grads_log2_scale)
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
        """After the step: unhook, read the step's histograms and norms (one read each), fold them into the
        totals, and return its record."""
        self.ranges.stop()
        self.elements += self.ranges.batch.elements
        self.seen += self.ranges.batch.seen
        pending, self._pending_norms = self._pending_norms, None
        if pending is not None:
            layers, values, k = pending
            self._norms = {layer: v / 2.0**k for layer, v in zip(layers, values.tolist())}  # the norms' one read
        current = self.ranges.read()
        for name, lr in current.items():
            self.cumulative[name].merge(lr)
        k = round(math.log2(scale)) if scale > 0 else 0
        step_profile = RangeProfile(layers=[lr for lr in current.values() if lr.total], steps=1,
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
        self.ranges.stop()

    # -- totals -------------------------------------------------------------------------------------
    def profile(self) -> RangeProfile:
        layers = [lr for lr in self.cumulative.values() if lr.total]
        return RangeProfile(layers=layers, steps=len(self.samples), formats=self.formats)
