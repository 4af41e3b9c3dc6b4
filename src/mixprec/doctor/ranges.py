"""Range profile: per-layer log2 histograms of activations and gradients, set against each format's range.

What is measured
----------------
Each profiled step runs one extra forward + backward of the model *in fp32* (a functional call with fp32
copies of the weights, the recipe's autocast off, the RNG state forked so dropout masks equal the real
step's): the true magnitudes, before any format could clip them. For every layer (leaf modules and modules
owning parameters) it records the magnitudes of

* the layer's output (activations),
* the gradient of the loss with respect to that output (what backward carries between layers),
* the gradients of the layer's own parameters,

as counts per binade: ``|x|`` in ``[2**e, 2**(e+1))`` goes to bin ``e`` (``e = frexp(x).exponent - 1``,
exact, no logarithms), plus separate counts of exact zeros and non-finite values.

Projection onto a format
------------------------
A format with smallest subnormal ``2**s``, smallest normal ``2**n`` and max ``M`` maps a value in binade
``e`` (after multiplying by a loss scale ``2**k``, i.e. in binade ``e + k``) to

* **overflow** if ``e + k > floor(log2 M)`` (fp16: ``e + k >= 16``, i.e. ``>= 65536``),
* **underflow to zero** if ``e + k <= s - 2`` (below half the smallest subnormal, round-to-nearest gives 0),
* **subnormal** (precision loss: fewer than the format's mantissa bits survive) if ``s - 1 <= e + k < n``.

Resolution is one binade: the top binade of a format (fp16: 32768..65504) counts as representable. Fractions
are of the non-zero finite values (a zero is a zero in every format). Activations are projected at scale 1;
gradients at the loss scale (``2**k``), because what backward stores in fp16 is the *scaled* gradient.

Choosing a loss scale
---------------------
:meth:`Log2Histogram.best_scale` tries every power of two ``2**k``. Among the scales without overflow (an
overflow makes the scaler skip the whole step; if every scale overflows, among all) it keeps those that lose
the fewest values to underflow + overflow, give or take ``TOLERANCE`` (one value in a million): an interval
``[k_lo, k_hi]``. Within it, larger is better (fewer subnormals, more precision for small gradients) up to a
headroom of ``HEADROOM`` binades (8x) below the overflow edge, for gradients that grow between steps:
``k = max(k_lo, k_hi - HEADROOM)``.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.func import functional_call
from torch.utils._pytree import tree_leaves

from ..formats import Format, get_format
from ..train.contract import Batch, Objective, parse_output

__all__ = ["Log2Histogram", "LayerRanges", "RangeProfile", "RangeProfiler", "DEFAULT_FORMATS", "BIN_MIN", "BIN_MAX"]

DEFAULT_FORMATS = ("fp16", "bf16", "fp8_e4m3", "fp8_e5m2")
HEADROOM = 3
"""Binades kept free below the overflow edge by the recommended loss scale."""
TOLERANCE = 1e-6
"""Losses (underflow + overflow fractions) closer than this count as equal when choosing a loss scale."""
BIN_MIN, BIN_MAX = -160, 140
"""Binade range kept (fp32 spans -149..127; float64 extremes are clamped into the end bins)."""
_NBINS = BIN_MAX - BIN_MIN + 1


def _fmt_edges(fmt: Format) -> tuple[int, int, int]:
    """(top binade that fits, smallest-subnormal exponent s, smallest-normal exponent n)."""
    return (math.floor(math.log2(fmt.max)), round(math.log2(fmt.smallest_subnormal)),
            round(math.log2(fmt.smallest_normal)))


@functools.lru_cache(maxsize=64)
def _named_edges(name: str) -> tuple[int, int, int]:
    return _fmt_edges(get_format(name))


@dataclasses.dataclass
class Log2Histogram:
    """Counts of magnitudes per binade, plus zeros and non-finite values."""

    counts: torch.Tensor = dataclasses.field(default_factory=lambda: torch.zeros(_NBINS, dtype=torch.int64))
    zeros: int = 0
    nonfinite: int = 0

    def add(self, t: torch.Tensor) -> None:
        """Count the magnitudes of ``t`` (converted to float32) into binades.

        Reads the binade straight from the float32 bits (biased exponent ``(bits >> 23) & 0xFF``): one
        integer pass and one bincount, cheaper than ``frexp`` + masking on large tensors.
        Only the rare fp32 subnormals take a second, ``frexp`` pass.
        """
        a = t.detach().reshape(-1)
        if not a.is_floating_point() or not a.numel():
            return
        if a.dtype != torch.float32:
            a = a.float()
        m = a.contiguous().view(torch.int32) & 0x7FFFFFFF  # bits without the sign
        biased = m >> 23
        c = torch.bincount(biased.to(torch.int64), minlength=256).cpu()
        zeros = a.numel() - int(torch.count_nonzero(m))
        self.zeros += zeros
        self.nonfinite += int(c[255])
        self.counts[-126 - BIN_MIN:128 - BIN_MIN] += c[1:255]  # normal numbers: binade = biased - 127
        if int(c[0]) > zeros:  # fp32 subnormals
            sub = a[(biased == 0) & (m != 0)]
            e = torch.frexp(sub).exponent.to(torch.int64) - 1 - BIN_MIN
            self.counts += torch.bincount(e.clamp(0, _NBINS - 1), minlength=_NBINS).cpu()

    def merge(self, other: Log2Histogram) -> None:
        self.counts += other.counts
        self.zeros += other.zeros
        self.nonfinite += other.nonfinite

    @property
    def nonzero(self) -> int:
        return int(self.counts.sum())

    @property
    def total(self) -> int:
        return self.nonzero + self.zeros + self.nonfinite

    def binade_range(self) -> tuple[int, int] | None:
        """(lowest, highest) occupied binade, or None if there are no non-zero finite values."""
        idx = torch.nonzero(self.counts).flatten()
        if not idx.numel():
            return None
        return int(idx[0]) + BIN_MIN, int(idx[-1]) + BIN_MIN

    def prefix(self) -> list[int]:
        """Prefix sums of the binade counts (``[0, c0, c0 + c1, ...]``), for :meth:`fractions`."""
        return [0, *itertools.accumulate(self.counts.tolist())]

    def fractions(self, fmt: str | Format, log2_scale: int = 0, prefix: list[int] | None = None) -> dict[str, float]:
        """Fractions of the non-zero finite values that overflow / underflow / are subnormal at ``2**k``.

        ``prefix``: :meth:`prefix`, when the caller projects the same counts many times.
        """
        top, s, n = _named_edges(fmt) if isinstance(fmt, str) else _fmt_edges(get_format(fmt))
        cum = prefix if prefix is not None else self.prefix()
        nz = cum[-1]
        if nz == 0:
            return {"overflow": 0.0, "underflow": 0.0, "subnormal": 0.0}
        k = int(log2_scale)

        def upto(e: int) -> int:  # counts of binades <= e (after the shift by k)
            return cum[min(max(e - k - BIN_MIN + 1, 0), _NBINS)]

        return {"overflow": (nz - upto(top)) / nz, "underflow": upto(s - 2) / nz,
                "subnormal": (upto(n - 1) - upto(s - 2)) / nz}

    def best_scale(self, fmt: str | Format = "fp16", k_min: int = -24, k_max: int = 40,
                   headroom: int = HEADROOM) -> int | None:
        """The exponent ``k`` of the recommended loss scale ``2**k`` (see the module docstring)."""
        cum = self.prefix()
        if cum[-1] == 0:
            return None
        fr = {k: self.fractions(fmt, k, cum) for k in range(k_min, k_max + 1)}
        clean = [k for k, f in fr.items() if f["overflow"] == 0]
        pool = clean or list(fr)
        least = min(fr[k]["overflow"] + fr[k]["underflow"] for k in pool)
        good = [k for k in pool if fr[k]["overflow"] + fr[k]["underflow"] <= least + TOLERANCE]
        return max(min(good), max(good) - headroom)

    def to_dict(self) -> dict[str, Any]:
        r = self.binade_range()
        counts = {}
        if r is not None:
            for e in range(r[0], r[1] + 1):
                v = int(self.counts[e - BIN_MIN])
                if v:
                    counts[str(e)] = v
        return {"binade_counts": counts, "zeros": self.zeros, "nonfinite": self.nonfinite,
                "binade_range": list(r) if r else None}


@dataclasses.dataclass
class LayerRanges:
    name: str
    kind: str
    """Module type name."""
    activations: Log2Histogram = dataclasses.field(default_factory=Log2Histogram)
    grad_outputs: Log2Histogram = dataclasses.field(default_factory=Log2Histogram)
    grad_params: Log2Histogram = dataclasses.field(default_factory=Log2Histogram)

    def gradients(self) -> Log2Histogram:
        h = Log2Histogram()
        h.merge(self.grad_outputs)
        h.merge(self.grad_params)
        return h


@dataclasses.dataclass
class RangeProfile:
    """Per-layer histograms over the profiled steps, and their projection onto formats."""

    layers: list[LayerRanges]
    steps: int
    formats: tuple[str, ...] = DEFAULT_FORMATS

    def all_gradients(self) -> Log2Histogram:
        h = Log2Histogram()
        for lr in self.layers:
            h.merge(lr.gradients())
        return h

    def layer_rows(self, log2_scale: int) -> list[dict[str, Any]]:
        """Per layer: binade ranges and fractions per format (activations at 1, gradients at 2**k)."""
        rows = []
        for lr in self.layers:
            g = lr.gradients()
            ca, cg = lr.activations.prefix(), g.prefix()
            rows.append({
                "layer": lr.name,
                "type": lr.kind,
                "activation_binades": lr.activations.binade_range(),
                "gradient_binades": g.binade_range(),
                "activation_nonfinite": lr.activations.nonfinite,
                "gradient_nonfinite": g.nonfinite,
                "activations": {f: lr.activations.fractions(f, 0, ca) for f in self.formats},
                "gradients": {f: g.fractions(f, log2_scale, cg) for f in self.formats},
            })
        return rows

    def to_dict(self, log2_scale: int = 0) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "formats": list(self.formats),
            "layers": self.layer_rows(log2_scale),
            "histograms": {lr.name: {"activations": lr.activations.to_dict(),
                                     "grad_outputs": lr.grad_outputs.to_dict(),
                                     "grad_params": lr.grad_params.to_dict()} for lr in self.layers},
        }


def profiled_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Leaf modules and modules owning parameters, minus pass-through ``nn.Identity``; not the root."""
    out = []
    for name, m in model.named_modules():
        if not name or isinstance(m, nn.Identity):
            continue
        if not any(True for _ in m.children()) or any(True for _ in m.parameters(recurse=False)):
            out.append((name, m))
    return out


class RangeProfiler:
    """Accumulates a :class:`RangeProfile` over calls of :meth:`observe` (one fp32 pass each)."""

    def __init__(self, model: nn.Module, formats: Iterable[str] = DEFAULT_FORMATS) -> None:
        self.model = model
        self.formats = tuple(formats)
        for f in self.formats:
            get_format(f)  # fail early on a bad name
        self._layers = {name: LayerRanges(name, type(m).__name__) for name, m in profiled_layers(model)}
        self._modules = dict(profiled_layers(model))
        if any(True for _ in model.parameters(recurse=False)):  # e.g. a transformer's cls / pos embeddings
            self._layers[""] = LayerRanges("", type(model).__name__)
        self._owner = {}
        for name, m in model.named_modules():
            for pn, _ in m.named_parameters(recurse=False, prefix=name):
                self._owner[pn] = name
        self.steps = 0

    def observe(self, objective: Objective, batch: Batch) -> dict[str, torch.Tensor]:
        """One fp32 forward + backward on ``batch``, the model called and its loss taken by the model
        contract (``objective``); returns the fp32 parameter gradients by name.

        Leaves the model, its gradients, its buffers and the global RNG state exactly as they were.
        """
        model = self.model
        params = {n: p.detach().float().requires_grad_(p.requires_grad) for n, p in model.named_parameters()}
        buffers = {n: (b.detach().float() if b.is_floating_point() else b.detach()).clone()
                   for n, b in model.named_buffers()}
        handles = []

        def hook(name: str):
            def fwd(module: nn.Module, args: tuple, output: Any) -> None:
                lr = self._layers[name]
                for t in tree_leaves(output):
                    if isinstance(t, torch.Tensor) and t.is_floating_point():
                        lr.activations.add(t)
                        if t.requires_grad:
                            t.register_hook(lambda g, lr=lr: lr.grad_outputs.add(g))
            return fwd

        for name, m in self._modules.items():
            handles.append(m.register_forward_hook(hook(name)))
        device = next((t.device for t in batch.inputs()), torch.device("cpu"))
        devices = [device] if device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices), torch.autocast(device.type, enabled=False):
                args, kwargs = objective.call.arguments(batch)
                out = parse_output(functional_call(model, {**params, **buffers}, args, kwargs))
                loss = objective.loss(out, batch)
                wrt = [(n, p) for n, p in params.items() if p.requires_grad]
                grads = torch.autograd.grad(loss.float(), [p for _, p in wrt], allow_unused=True)
        finally:
            for h in handles:
                h.remove()
        ref = {}
        for (n, _), g in zip(wrt, grads):
            if g is None:
                continue
            ref[n] = g
            owner = self._owner.get(n)
            if owner in self._layers:
                self._layers[owner].grad_params.add(g)
        self.steps += 1
        return ref

    def result(self) -> RangeProfile:
        layers = [lr for lr in self._layers.values()
                  if lr.activations.total or lr.grad_outputs.total or lr.grad_params.total]
        return RangeProfile(layers=layers, steps=self.steps, formats=self.formats)
