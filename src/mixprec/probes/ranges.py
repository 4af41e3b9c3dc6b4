"""Range probe: per-layer log2 histograms of activations and gradients, set against each format's range.

A histogram counts magnitudes per binade (``|x|`` in ``[2**e, 2**(e+1))`` goes to bin ``e``, exact: read from
the float64 exponent of each value as float32), plus zeros and non-finite values. :class:`HistogramBatch` is the
one filler: every tensor of a step is binned on its device as it appears, and the step's histograms are read
with one host read. :class:`LayerRecorder` hooks the layers (:func:`profiled_layers`) and fills it; the doctor's
:class:`RangeProfiler` runs it over an extra fp32 pass (true magnitudes), the watch over the real step.

Projection onto a format with smallest subnormal ``2**s``, smallest normal ``2**n`` and max ``M``, at a loss
scale ``2**k`` (a value of binade ``e`` lands in ``e + k``): **overflow** if ``e + k > floor(log2 M)``,
**underflow** to zero if ``e + k <= s - 2`` (below half the smallest subnormal), **subnormal** if
``s - 1 <= e + k < n``. Resolution is one binade; fractions are of the non-zero finite values.

:meth:`Log2Histogram.best_scale`: among the scales without overflow (else all), those losing the fewest values
to underflow + overflow (within ``TOLERANCE``), the largest that keeps ``HEADROOM`` binades below the overflow edge.

A tensor of more than ``limit`` elements is binned from its strided subsample (:mod:`.subsample`; the counts
scaled by the stride), corrected with the whole tensor's extremes: the top binade and whether any value is
non-finite stay exact, the fractions are estimates.
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
from .attribution import display_path
from .replay import ModelInputs, cuda_devices, step_device
from .subsample import flat_sample, stride_for

__all__ = ["Log2Histogram", "HistogramBatch", "LayerRanges", "RangeProfile", "LayerRecorder", "RangeProfiler",
           "GradientLoss", "InertHook", "profiled_layers", "DEFAULT_FORMATS", "BIN_MIN", "BIN_MAX"]

DEFAULT_FORMATS = ("fp16", "bf16", "fp8_e4m3", "fp8_e5m2")
HEADROOM = 3
"""Binades kept free below the overflow edge by the recommended loss scale."""
TOLERANCE = 1e-6
"""Losses (underflow + overflow fractions) closer than this count as equal when choosing a loss scale."""
BIN_MIN, BIN_MAX = -160, 140
"""Binade range kept (fp32 spans -149..127)."""
_NBINS = BIN_MAX - BIN_MIN + 1
_F64_BIAS, _F64_EXP = 1023, 2048
_LO, _HI = _F64_BIAS + BIN_MIN, _F64_BIAS + BIN_MAX  # float64 biased exponents of the kept binades
_FOLD_AT = 1 << 24
"""Pending binades (int64) a :class:`HistogramBatch` holds before folding them into its counts."""


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
        """Count the magnitudes of ``t`` (as float32 values), whole; one host read."""
        batch = HistogramBatch()
        batch.add(None, t)
        for _, h in batch.read():
            self.merge(h)

    def merge(self, other: Log2Histogram) -> None:
        self.counts += other.counts
        self.zeros += other.zeros
        self.nonfinite += other.nonfinite

    def shifted(self, k: int) -> Log2Histogram:
        """Every binade lowered by ``k`` (values divided by ``2**k``); the end bins absorb the rest."""
        out = Log2Histogram(zeros=self.zeros, nonfinite=self.nonfinite)
        c, n = self.counts, _NBINS
        if k == 0:
            out.counts = c.clone()
        elif k > 0:
            out.counts[: n - k] = c[k:]
            out.counts[0] += c[:k].sum()
        else:
            out.counts[-k:] = c[: n + k]
            out.counts[-1] += c[n + k:].sum()
        return out

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


class HistogramBatch:
    """The histograms of one step: tensors added as they appear, binned with one ``bincount`` and read in one go.

    ``limit``: a tensor of more elements is binned from its strided subsample (0: every tensor whole).
    ``device``: where the step's binades are kept and binned (None: the first added tensor's; others are copied
    there). Pending binades are folded into the counts once they exceed ``_FOLD_AT`` elements (bounded memory).
    """

    def __init__(self, limit: int = 0, *, device: torch.device | str | None = None) -> None:
        self.limit = limit
        self.device = None if device is None else torch.device(device)
        self._subs: list[torch.Tensor] = []
        self._pending = 0
        self._counts: torch.Tensor | None = None
        self._strides: list[int] = []
        self._extremes: list[torch.Tensor | None] = []
        self.keys: list[Any] = []
        self.elements = 0
        """Elements of the added tensors."""
        self.seen = 0
        """Of those, elements binned (the subsamples)."""

    def add(self, key: Any, t: torch.Tensor) -> None:
        """Count ``t`` (any float dtype, as float32 values) under ``key``; ``t`` may change afterwards."""
        t = t.detach()
        if not t.is_floating_point() or not t.numel():
            return
        s = stride_for(t, self.limit)
        sub = flat_sample(t, s)
        if sub.dtype == torch.float64:
            sub = sub.float()  # binned as float32 values
        if self.device is None:
            self.device = t.device
        e = sub.to(self.device, torch.float64, copy=True).view(torch.int64)  # fp32 subnormals are normal here
        e >>= 52
        e &= _F64_EXP - 1
        e += len(self.keys) * _F64_EXP  # this tensor's row of the bincount
        self.keys.append(key)
        self._subs.append(e)
        self._pending += e.numel()
        self._strides.append(s)
        self._extremes.append(torch.stack(torch.aminmax(t)).float().to(self.device) if s > 1 else None)
        self.elements += t.numel()
        self.seen += sub.numel()
        if self._pending > _FOLD_AT:
            self._fold()

    def _fold(self) -> None:
        if not self._subs:
            return
        c = torch.bincount(torch.cat(self._subs), minlength=len(self.keys) * _F64_EXP)
        if self._counts is not None:
            c[: self._counts.numel()] += self._counts
        self._counts, self._subs, self._pending = c, [], 0

    def __len__(self) -> int:
        return len(self.keys)

    def read(self) -> list[tuple[Any, Log2Histogram]]:
        """(key, histogram) per added tensor, in order; one host read for all of them."""
        if not self.keys:
            return []
        self._fold()
        n = len(self.keys)
        c = self._counts.view(n, _F64_EXP)
        if any(s > 1 for s in self._strides):
            c = c * torch.tensor(self._strides, device=c.device, dtype=torch.int64).unsqueeze(1)
        cols = torch.cat([c[:, _LO:_HI + 1], c[:, :1], c[:, -1:]], dim=1)  # binades, zeros, non-finite
        parts = [cols.double().flatten()]
        wide = [(i, e) for i, e in enumerate(self._extremes) if e is not None]
        if wide:
            parts.append(torch.cat([e for _, e in wide]).double())
        both = torch.cat(parts).cpu()  # the one read
        rows = both[: n * (_NBINS + 2)].view(n, _NBINS + 2).to(torch.int64)
        extremes = dict(zip((i for i, _ in wide), both[n * (_NBINS + 2):].view(-1, 2).tolist()))
        tail = rows[:, _NBINS:].tolist()
        out = []
        for i, key in enumerate(self.keys):
            h = Log2Histogram(counts=rows[i, :_NBINS].clone(), zeros=tail[i][0], nonfinite=tail[i][1])
            if i in extremes:
                _exact_extremes(h, *extremes[i])
            out.append((key, h))
        self._counts, self._extremes = None, []
        return out


def _exact_extremes(h: Log2Histogram, lo: float, hi: float) -> None:
    """Correct a subsample's histogram with the whole tensor's min and max: its top binade counts at least 1, and
    a non-finite extreme at least one non-finite value."""
    top = max(abs(lo), abs(hi))
    if not math.isfinite(top):
        h.nonfinite = max(h.nonfinite, 1)
        return
    if top > 0:
        e = min(max(math.frexp(top)[1] - 1, BIN_MIN), BIN_MAX) - BIN_MIN
        if int(h.counts[e]) == 0:
            h.counts[e] = 1


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

    def merge(self, other: LayerRanges) -> None:
        self.activations.merge(other.activations)
        self.grad_outputs.merge(other.grad_outputs)
        self.grad_params.merge(other.grad_params)

    @property
    def total(self) -> int:
        return self.activations.total + self.grad_outputs.total + self.grad_params.total


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


class InertHook:
    """A hook that a deep copy of the module turns into a no-op (a copy must not call back into a probe)."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs) if self.fn is not None else None

    def __deepcopy__(self, memo: dict) -> InertHook:
        return InertHook(None)


class LayerRecorder:
    """One step's per-layer histograms as the step runs: between :meth:`start` and :meth:`stop`, forward hooks
    count each profiled layer's outputs and (tensor hooks) the gradients flowing into them; :meth:`add_grads`
    counts parameter gradients; :meth:`read` returns them (one host read).

    Gradients carrying a loss scale ``2**k`` are counted ``k`` binades lower (exact for power-of-two scales).
    """

    def __init__(self, model: nn.Module, limit: int = 0, *, device: torch.device | None = None) -> None:
        self.modules = dict(profiled_layers(model))
        self.kinds = {name: type(m).__name__ for name, m in self.modules.items()}
        if any(True for _ in model.parameters(recurse=False)):  # e.g. a transformer's cls / pos embeddings
            self.kinds[""] = type(model).__name__
        self.owner = {pn: name for name, m in model.named_modules()
                      for pn, _ in m.named_parameters(recurse=False, prefix=name)}
        """Parameter name -> the name of the module owning it."""
        self.limit, self.device = limit, device
        self.batch = HistogramBatch(limit, device=device)
        self.low_dtype: torch.dtype | None = None
        """A 16-bit dtype seen in a layer's output (autocast inside the model's forward)."""
        self._handles: list[Any] = []

    def start(self, grads_log2_scale: int = 0) -> None:
        """Hook the layers for one step; ``grads_log2_scale``: the scale its backward's gradients carry."""
        self.batch = HistogramBatch(self.limit, device=self.device)
        self._handles = [m.register_forward_hook(InertHook(self._hook(name, grads_log2_scale)))
                         for name, m in self.modules.items()]

    def _hook(self, name: str, k: int):
        batch = self.batch
        act, grad = (name, "activations", 0), (name, "grad_outputs", k)

        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            for t in tree_leaves(output):
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    if self.low_dtype is None and t.dtype in (torch.float16, torch.bfloat16):
                        self.low_dtype = t.dtype
                    batch.add(act, t)
                    if t.requires_grad:
                        t.register_hook(lambda g: batch.add(grad, g))
        return hook

    def add_grads(self, grads: Iterable[tuple[str, torch.Tensor]], log2_scale: int = 0) -> None:
        """Count parameter gradients given as ``(parameter name, gradient)``."""
        for name, g in grads:
            layer = self.owner.get(name)
            if layer in self.kinds:
                self.batch.add((layer, "grad_params", log2_scale), g)

    def stop(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def read(self) -> dict[str, LayerRanges]:
        """The step's histograms per layer, in true magnitudes (one host read)."""
        out = {name: LayerRanges(name, kind) for name, kind in self.kinds.items()}
        for (layer, field, k), h in self.batch.read():
            getattr(out[layer], field).merge(h.shifted(k) if k else h)
        return out


class RangeProfiler:
    """Accumulates a :class:`RangeProfile` over calls of :meth:`observe` (one fp32 pass each)."""

    def __init__(self, model: nn.Module, formats: Iterable[str] = DEFAULT_FORMATS) -> None:
        self.model = model
        self.formats = tuple(formats)
        for f in self.formats:
            get_format(f)  # fail early on a bad name
        self.recorder = LayerRecorder(model)
        self.layers = {name: LayerRanges(name, kind) for name, kind in self.recorder.kinds.items()}
        self.steps = 0

    def observe(self, objective: Objective, batch: Batch) -> dict[str, torch.Tensor]:
        """One fp32 forward + backward on ``batch`` (fp32 copies of the weights through ``functional_call``, the
        step device's autocast off, every CUDA generator it touches forked so dropout masks equal the real
        step's), the model called and its loss taken by the model contract; returns the fp32 parameter
        gradients by name. Leaves the model, its gradients, its buffers and the RNG state as they were.
        """
        model = self.model
        params = {n: p.detach().float().requires_grad_(p.requires_grad) for n, p in model.named_parameters()}
        buffers = {n: (b.detach().float() if b.is_floating_point() else b.detach()).clone()
                   for n, b in model.named_buffers()}
        args, kwargs = objective.call.arguments(batch)
        x = ModelInputs(tuple(args), dict(kwargs))
        self.recorder.start()
        try:
            with torch.random.fork_rng(devices=cuda_devices(model, x)), \
                    torch.autocast(step_device(model, x).type, enabled=False):
                out = parse_output(functional_call(model, {**params, **buffers}, x.args, x.kwargs))
                loss = objective.loss(out, batch)
                wrt = [(n, p) for n, p in params.items() if p.requires_grad]
                grads = torch.autograd.grad(loss.float(), [p for _, p in wrt], allow_unused=True)
        finally:
            self.recorder.stop()
        ref = {n: g for (n, _), g in zip(wrt, grads) if g is not None}
        self.recorder.add_grads(ref.items())
        for name, lr in self.recorder.read().items():
            self.layers[name].merge(lr)
        self.steps += 1
        return ref

    def result(self) -> RangeProfile:
        return RangeProfile(layers=[lr for lr in self.layers.values() if lr.total], steps=self.steps,
                            formats=self.formats)


@dataclasses.dataclass
class GradientLoss:
    """Gradient elements lost to underflow: zero after the recipe's backward, non-zero in the fp32 pass (same
    weights, batch and dropout masks, so a difference in zero-ness is rounding)."""

    nonzero: int = 0
    lost: int = 0
    steps: int = 0
    per_layer: dict[str, list[int]] = dataclasses.field(default_factory=dict)

    def add(self, model: nn.Module, ref: dict[str, torch.Tensor]) -> None:
        """Compare the parameters' gradients after the recipe's backward with ``ref``'s (one host read); a
        non-finite gradient is left out."""
        names, rows = [], []
        for name, p in model.named_parameters():
            r, g = ref.get(name), p.grad
            if r is not None and g is not None:
                mask = r != 0
                rows.append(torch.stack([torch.isfinite(g).all(), mask.sum(), (mask & (g == 0)).sum()]).double())
                names.append(name)
        if not rows:
            return
        counted = False
        for name, (finite, n, lost) in zip(names, torch.stack([t.to(rows[0].device) for t in rows]).tolist()):
            if not finite:
                continue
            n, lost = int(n), int(lost)
            acc = self.per_layer.setdefault(name.rsplit(".", 1)[0] if "." in name else "", [0, 0])
            acc[0] += lost
            acc[1] += n
            self.nonzero += n
            self.lost += lost
            counted = True
        self.steps += counted

    @property
    def fraction(self) -> float:
        return self.lost / self.nonzero if self.nonzero else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "nonzero": self.nonzero, "lost": self.lost, "fraction": self.fraction,
                "per_layer": {display_path(k): {"lost": v[0], "nonzero": v[1]} for k, v in self.per_layer.items()}}
