"""What a sampled step reads of a large tensor: a fixed strided subsample, plus the exact extremes.

A sampled step of the watch looks at every layer's output, the gradient flowing into it and its parameters'
gradients, and at every stepped tensor for lost updates. Reading each of them whole costs several plain
steps (the histograms, the shadow optimizer step, the counts and medians are all O(elements)). So a tensor
of more than ``limit`` elements (:attr:`~.config.WatchConfig.sample_elements`) is read through a subsample;
one of at most ``limit`` elements is taken whole, so small tensors' statistics stay exact.

The subsample
-------------
Every ``s``-th element in memory order, ``s = ceil(numel / limit)`` raised to the next integer coprime with
the tensor's row length (``numel / shape[0]``): a stride that divides the row would see the same columns of
every row, a coprime one walks through all of them. It is deterministic (no RNG is drawn, so a watched run
stays bit-identical to an unwatched one) and the same positions every sample (a layer's numbers are
comparable over time). Each sampled element stands for ``s`` elements: histogram counts are the subsample's
counts times ``s`` -- estimates of the whole tensor's, with fractions good to about ``1/sqrt(count)``.

Exact despite the subsample
---------------------------
One ``aminmax`` pass over the whole tensor (no bool tensors: on a CPU they are far slower than a reduction)
gives the largest magnitude exactly when all values are finite, and tells whether any value is not (the max and min
propagate NaN and inf). The histogram is then corrected so that its top binade is the exact one (the binade
of the largest value counts at least 1), so "does anything overflow format F at scale 2**k" is answered
exactly; and a tensor holding a non-finite value counts at least one even if the subsample missed it.
What stays an estimate: the fractions (overflow, underflow, subnormal) and the non-finite *count*. Faults
themselves are never sampled: the triggers check every step's gradients whole (:mod:`.core`) and the
flight recorder replays the step exactly.

Binning
-------
Each subsample is copied as float64 (fp32 subnormals are normal float64 numbers, so the biased float64
exponent is the exact binade of every fp32 value) onto the batch's device (a model over several devices:
everything meets there) and turned in place into its exponent plus an offset per tensor; at the end of the
step one ``bincount`` over all of them and one host read give every histogram.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..doctor.ranges import BIN_MAX, BIN_MIN, Log2Histogram

__all__ = ["stride_for", "flat_sample", "HistogramBatch", "DEFAULT_SAMPLE_ELEMENTS"]

DEFAULT_SAMPLE_ELEMENTS = 1 << 14
"""Default :attr:`~.config.WatchConfig.sample_elements`."""

_F64_BIAS, _F64_EXP = 1023, 2048
_NB = BIN_MAX - BIN_MIN + 1
_LO, _HI = _F64_BIAS + BIN_MIN, _F64_BIAS + BIN_MAX  # float64 biased exponents of the kept binades


def stride_for(t: torch.Tensor, limit: int) -> int:
    """1 (whole) if ``t`` has at most ``limit`` elements (or ``limit`` is 0), else the subsample's stride."""
    n = t.numel()
    if limit <= 0 or n <= limit:
        return 1
    s = -(-n // limit)
    row = n // t.shape[0] if t.dim() > 1 and t.shape[0] else 1
    while math.gcd(s, row) != 1:
        s += 1
    return s


def _memory_order(t: torch.Tensor) -> torch.Tensor:
    """``t`` as one dimension in memory order: a view for every dense layout (contiguous, channels-last...)."""
    if t.is_contiguous():
        return t.view(-1)
    perm = sorted(range(t.dim()), key=lambda d: (-t.stride(d), d))
    return t.permute(perm).reshape(-1)  # a view when the permuted tensor is contiguous, a copy otherwise


def flat_sample(t: torch.Tensor, stride: int, *, like: torch.Tensor | None = None) -> torch.Tensor:
    """The (flat, strided) subsample of ``t``: a view, with ``stride`` 1 the whole tensor flattened.

    ``like``: take the positions of ``like``'s memory order (a gradient or optimizer state read at the
    parameter's positions, whatever its own layout).
    """
    ref = t if like is None else like
    if t.is_contiguous() and ref.is_contiguous():
        flat = t.view(-1)
    elif like is None or t.stride() == ref.stride():
        flat = _memory_order(t)
    else:
        perm = sorted(range(ref.dim()), key=lambda d: (-ref.stride(d), d))
        flat = t.permute(perm).reshape(-1)
    return flat if stride == 1 else flat[::stride]


class HistogramBatch:
    """The histograms of one sampled step: tensors added as they appear, binned and read in one go."""

    def __init__(self, limit: int, *, device: torch.device | str | None = None) -> None:
        self.limit = limit
        self.device = None if device is None else torch.device(device)
        """Where the step's subsamples and extremes are kept and binned; None: the first added tensor's."""
        self._subs: list[torch.Tensor] = []
        self._strides: list[int] = []
        self._extremes: list[torch.Tensor | None] = []
        self.keys: list[Any] = []
        self.elements = 0
        """Elements of the added tensors."""
        self.seen = 0
        """Of those, elements binned (the subsamples)."""

    def add(self, key: Any, t: torch.Tensor) -> None:
        """Count ``t`` (any float dtype) under ``key``; copies what it needs (``t`` may change afterwards)."""
        t = t.detach()
        if not t.is_floating_point() or not t.numel():
            return
        s = stride_for(t, self.limit)
        sub = flat_sample(t, s)
        if sub.dtype == torch.float64:
            sub = sub.float()  # binned as float32 values, as Log2Histogram.add does
        if self.device is None:
            self.device = t.device
        # fp32 subnormals are normal here: exact binades
        e = sub.to(self.device, torch.float64, copy=True).view(torch.int64)
        e >>= 52
        e &= _F64_EXP - 1
        e += len(self.keys) * _F64_EXP  # this tensor's row of the step's one bincount
        self.keys.append(key)
        self._subs.append(e)
        self._strides.append(s)
        self._extremes.append(torch.stack(torch.aminmax(t)).float().to(self.device) if s > 1 else None)
        self.elements += t.numel()
        self.seen += sub.numel()

    def __len__(self) -> int:
        return len(self.keys)

    def read(self) -> list[tuple[Any, Log2Histogram]]:
        """(key, histogram) per added tensor, in order: one device pass and one host read for all of them."""
        if not self.keys:
            return []
        dev = self.device
        n = len(self.keys)
        c = torch.bincount(torch.cat(self._subs), minlength=n * _F64_EXP).view(n, _F64_EXP)
        if any(s > 1 for s in self._strides):
            c = c * torch.tensor(self._strides, device=dev, dtype=torch.int64).unsqueeze(1)
        cols = torch.cat([c[:, _LO:_HI + 1], c[:, :1], c[:, -1:]], dim=1)  # binades, zeros, non-finite
        parts = [cols.double().flatten()]
        wide = [(i, e) for i, e in enumerate(self._extremes) if e is not None]
        if wide:
            parts.append(torch.cat([e for _, e in wide]).double())
        both = torch.cat(parts).cpu()  # the step's one read
        rows = both[: n * (_NB + 2)].view(n, _NB + 2).to(torch.int64)
        extremes = dict(zip((i for i, _ in wide), both[n * (_NB + 2):].view(-1, 2).tolist()))
        tail = rows[:, _NB:].tolist()
        out = []
        for i, key in enumerate(self.keys):
            h = Log2Histogram(counts=rows[i, :_NB].clone(), zeros=tail[i][0], nonfinite=tail[i][1])
            if i in extremes:
                _exact_extremes(h, *extremes[i])
            out.append((key, h))
        self._subs, self._extremes = [], []
        return out


def _exact_extremes(h: Log2Histogram, lo: float, hi: float) -> None:
    """Correct a subsample's histogram with the whole tensor's min and max (see the module docstring)."""
    top = max(abs(lo), abs(hi))
    if not math.isfinite(top):  # a NaN or an inf somewhere in the tensor
        h.nonfinite = max(h.nonfinite, 1)
        return
    if top > 0:
        e = min(max(math.frexp(top)[1] - 1, BIN_MIN), BIN_MAX) - BIN_MIN
        if int(h.counts[e]) == 0:
            h.counts[e] = 1
