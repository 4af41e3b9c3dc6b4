"""Convergence parity: does a recipe's loss curve stay inside the band fp32 itself spans across seeds?

The fp32 runs with seeds ``s_1..s_R`` (R >= 2) span, at every step, a band ``[min_r f_r(t), max_r f_r(t)]`` of
their smoothed losses. A recipe runs with the same seeds (same initial weights and data order) and its curve is
the mean over its repeats: if it behaves like fp32 the mean tracks the fp32 mean and lies inside the band. (A
single curve against a two-seed band would not do: a third fp32 seed lies between two others a third of the
time.) Curves are smoothed by a trailing moving average (a twentieth of the curve); the band is widened by
``rtol`` of the fp32 mean on each side. Verdict ``"yes"`` when at least ``min_inside`` of the steps lie inside;
``"no"`` for a run stopped early or a non-finite curve; ``"n/a"`` without two finite fp32 runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

__all__ = ["ParityResult", "smooth", "fp32_band", "convergence_parity", "DEFAULT_RTOL", "DEFAULT_MIN_INSIDE"]

DEFAULT_RTOL = 0.01
DEFAULT_MIN_INSIDE = 0.9


@dataclasses.dataclass(frozen=True)
class ParityResult:
    verdict: str
    """"yes", "no" or "n/a"."""
    inside_fraction: float | None
    max_excursion: float | None
    """Largest distance outside the band, in units of the band's median width."""
    steps: int
    reason: str

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def smooth(curve: Sequence[float], window: int) -> np.ndarray:
    """Trailing moving average: point ``t`` is the mean of ``curve[max(0, t-window+1) : t+1]``."""
    x = np.asarray(curve, dtype=np.float64)
    if window <= 1 or x.size == 0:
        return x
    c = np.cumsum(np.insert(x, 0, 0.0))
    idx = np.arange(1, x.size + 1)
    lo = np.maximum(0, idx - window)
    return (c[idx] - c[lo]) / (idx - lo)


def default_window(n_steps: int) -> int:
    return max(1, n_steps // 20)


def fp32_band(fp32_curves: Sequence[Sequence[float]], *, window: int, rtol: float = DEFAULT_RTOL):
    """(lo, hi, mean) arrays of the smoothed fp32 curves, truncated to the shortest, widened by ``rtol``."""
    n = min(len(c) for c in fp32_curves)
    s = np.stack([smooth(c[:n], window) for c in fp32_curves])
    mean = s.mean(axis=0)
    pad = rtol * np.abs(mean)
    return s.min(axis=0) - pad, s.max(axis=0) + pad, mean


def convergence_parity(
    curves: Sequence[Sequence[float]],
    fp32_curves: Sequence[Sequence[float]],
    *,
    window: int | None = None,
    rtol: float = DEFAULT_RTOL,
    min_inside: float = DEFAULT_MIN_INSIDE,
    stopped: bool = False,
) -> ParityResult:
    """Compare a recipe's loss curves (one per repeat, same seeds as fp32's) with fp32's seed band."""
    if len(fp32_curves) < 2:
        return ParityResult("n/a", None, None, 0, "needs >= 2 successful fp32 runs (--repeats 2 or more)")
    if not curves:
        return ParityResult("n/a", None, None, 0, "no successful run to compare")
    if any(len(c) == 0 for c in list(curves) + list(fp32_curves)):
        return ParityResult("n/a", None, None, 0, "an empty loss curve")
    n = min(min(len(c) for c in curves), min(len(c) for c in fp32_curves))
    if stopped:
        return ParityResult("no", None, None, n, "stopped early (non-finite loss or too many skipped steps)")
    if not all(np.all(np.isfinite(np.asarray(c[:n], dtype=np.float64))) for c in fp32_curves):
        return ParityResult("n/a", None, None, n, "an fp32 loss curve is non-finite: fp32 itself diverged, so "
                                                  "there is no seed band to compare with")
    window = window or default_window(n)
    lo, hi, _ = fp32_band([c[:n] for c in fp32_curves], window=window, rtol=rtol)
    m = np.stack([smooth(c[:n], window) for c in curves]).mean(axis=0)
    if not np.all(np.isfinite(m)):
        return ParityResult("no", 0.0, None, n, "non-finite loss in the curve")
    inside = (m >= lo) & (m <= hi)
    frac = float(inside.mean())
    width = float(np.median(hi - lo)) or 1.0
    outside = np.maximum(lo - m, m - hi).clip(min=0.0)
    exc = float(outside.max() / width)
    verdict = "yes" if frac >= min_inside else "no"
    reason = (f"{100 * frac:.0f}% of {n} steps inside fp32's seed band "
              f"(moving average {window}, band widened by {100 * rtol:g}%; needs {100 * min_inside:.0f}%)")
    return ParityResult(verdict, frac, exc, n, reason)
