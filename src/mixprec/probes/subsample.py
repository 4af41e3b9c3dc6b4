"""What a probe reads of a large tensor: a fixed, deterministic subsample (no RNG is drawn).

* :func:`stride_for` / :func:`flat_sample`: every ``s``-th element in memory order, ``s`` coprime with the row
  length so every column is visited; the same positions every time. The watch's histograms and lost updates read
  tensors of more than ``limit`` elements this way (each sampled element stands for ``s``).
* :func:`sample_rows`: whole rows of a 2-D operand, evenly spaced, plus the row holding its largest magnitude
  (so per-tensor scales are the full tensor's); the block-format probe quantizes these.
"""

from __future__ import annotations

import math

import torch

__all__ = ["stride_for", "flat_sample", "sample_rows", "DEFAULT_SAMPLE_ELEMENTS"]

DEFAULT_SAMPLE_ELEMENTS = 1 << 14
"""Default of the watch's ``sample_elements``."""


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
    """The flat strided subsample of ``t`` (a view; ``stride`` 1: the whole tensor flattened).

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


def sample_rows(m: torch.Tensor, limit: int) -> tuple[torch.Tensor, int]:
    """``(rows, n)``: ``m`` itself if it has at most ``max(1, limit // K)`` rows (``K`` its row length), else
    that many evenly spaced rows followed by the row of ``m``'s largest magnitude; the first ``n`` rows count."""
    rows, k = m.shape
    r = max(1, limit // max(k, 1))
    if rows <= r:
        return m, rows
    idx = torch.arange(r, device=m.device) * rows // r
    top = m.abs().amax(dim=1).argmax().view(1)
    return m.index_select(0, torch.cat([idx, top])), r
