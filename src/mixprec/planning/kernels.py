"""Kernels the cpu target times on this CPU instead of pricing them by the roofline.

A small CPU kernel's time follows fixed costs of its op kind, shapes and dtype, not its FLOPs, so on the cpu
target each distinct GEMM, convolution and attention call of the traced step (:data:`TIMED_OPS`; same op,
shapes, strides, dtypes and flags) runs for real on random inputs, once per plan, and its measured time replaces
the roofline's (docs/architecture.md, "plan"). Calls over :data:`MAX_OPERAND_BYTES`, calls the roofline prices
above :attr:`KernelTimes.longest_s`, calls that fail on random inputs, GPU targets and ops without FLOPs keep the
roofline. Timing: a warm-up, then the median of a few calls, within a per-kernel and a per-plan budget.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Any

import torch

__all__ = ["TIMED_OPS", "MAX_OPERAND_BYTES", "TensorSpec", "KernelSpec", "kernel_spec", "KernelTimes"]

TIMED_OPS = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "convolution", "convolution_backward",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
})
"""The ops timed: only those whose every input may be any values (the fused RNN kernels' backward trusts its
workspace: replayed on random bytes it crashes the process)."""

MAX_OPERAND_BYTES = 256 * 2**20
"""A call whose tensors (inputs and outputs) hold more bytes keeps the roofline."""


@dataclasses.dataclass(frozen=True)
class TensorSpec:

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    def make(self, gen: torch.Generator) -> torch.Tensor:
        """A real tensor of this layout (stride 0 too), random normal when floating, zeros otherwise."""
        n = 1 + sum((d - 1) * st for d, st in zip(self.shape, self.stride)) if all(self.shape) else 0
        base = torch.empty(n, dtype=self.dtype)
        if base.is_floating_point():
            base.normal_(generator=gen)
        else:
            base.zero_()
        return base.as_strided(self.shape, self.stride)


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """One op call of the traced step, its tensors replaced by :class:`TensorSpec` (hashable: timed once)."""

    op: Any
    args: tuple
    kwargs: tuple[tuple[str, Any], ...]

    def inputs(self, gen: torch.Generator) -> tuple[list, dict]:
        return [_real(a, gen) for a in self.args], {k: _real(v, gen) for k, v in self.kwargs}


@dataclasses.dataclass(frozen=True)
class _List:
    """A list argument (``int[]``, ``Tensor[]``), kept hashable."""

    items: tuple


def _spec(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return TensorSpec(tuple(a.shape), tuple(a.stride()), a.dtype)
    if isinstance(a, list):
        return _List(tuple(_spec(x) for x in a))
    if isinstance(a, tuple):
        return tuple(_spec(x) for x in a)
    if isinstance(a, (dict, set)) or not isinstance(a, (int, float, bool, str, type(None), torch.dtype,
                                                        torch.device, torch.layout, torch.memory_format)):
        raise TypeError(f"argument of type {type(a).__name__}")
    return a


def _real(a: Any, gen: torch.Generator) -> Any:
    if isinstance(a, TensorSpec):
        return a.make(gen)
    if isinstance(a, _List):
        return [_real(x, gen) for x in a.items]
    if isinstance(a, tuple):
        return tuple(_real(x, gen) for x in a)
    return a


def _nbytes(a: Any) -> int:
    if isinstance(a, TensorSpec):
        return math.prod(a.shape) * a.dtype.itemsize
    if isinstance(a, _List):
        return sum(_nbytes(x) for x in a.items)
    if isinstance(a, tuple):
        return sum(_nbytes(x) for x in a)
    return 0


def kernel_spec(func, args: tuple, kwargs: dict, out_bytes: int = 0) -> KernelSpec | None:
    """The :class:`KernelSpec` of a call; None when it keeps the roofline (too large, or not replayable)."""
    try:
        spec = KernelSpec(func, tuple(_spec(a) for a in args), tuple((k, _spec(v)) for k, v in kwargs.items()))
    except TypeError:
        return None
    if _nbytes(spec.args) + sum(_nbytes(v) for _, v in spec.kwargs) + out_bytes > MAX_OPERAND_BYTES:
        return None
    return spec


class KernelTimes:
    """Measured seconds per :class:`KernelSpec` on this CPU, each measured once (a plan's recipes share them).

    ``budget_s``: no new timed call of a kernel starts after this long; ``repeats``: at most this many timed
    calls (the median is kept). ``total_budget_s``: after this long in all, calls not timed yet keep the
    roofline (:attr:`untimed` counts them)."""

    def __init__(self, *, budget_s: float = 0.5, repeats: int = 5, total_budget_s: float = 60.0,
                 longest_s: float = 1.0) -> None:
        self.budget_s = budget_s
        self.longest_s = longest_s
        """The planner does not time a call its roofline prices above this."""
        self.repeats = repeats
        self.total_budget_s = total_budget_s
        self.spent_s = 0.0
        self.untimed = 0
        self.seconds: dict[KernelSpec, float | None] = {}
        """None: the call failed on random inputs (it keeps the roofline)."""

    def measure(self, specs) -> dict[KernelSpec, float]:
        """Time every spec not measured yet; the times of those of ``specs`` that could be timed."""
        from torch.utils._python_dispatch import _disable_current_modes

        specs = [s for s in specs if s is not None]
        with _disable_current_modes():  # real tensors, whatever mode the caller is in
            for spec in dict.fromkeys(specs):
                if spec in self.seconds:
                    continue
                if self.spent_s >= self.total_budget_s:
                    self.untimed += 1
                    continue
                t0 = time.perf_counter()
                self.seconds[spec] = self._time(spec)
                self.spent_s += time.perf_counter() - t0
        return {s: t for s in specs if (t := self.seconds.get(s)) is not None}

    def _time(self, spec: KernelSpec) -> float | None:
        try:
            args, kwargs = spec.inputs(torch.Generator().manual_seed(0))
            with torch.no_grad():
                t0 = time.perf_counter()
                spec.op(*args, **kwargs)  # warm-up: kernel selection, the outputs' first pages
                warm = time.perf_counter() - t0
        except Exception:  # noqa: BLE001 -- an op that rejects random inputs keeps the roofline
            return None
        if warm > self.budget_s:
            return warm
        with torch.no_grad():
            times: list[float] = []
            start = time.perf_counter()
            while len(times) < self.repeats and (not times or time.perf_counter() - start < self.budget_s):
                t0 = time.perf_counter()
                spec.op(*args, **kwargs)
                times.append(time.perf_counter() - t0)
        return statistics.median(times)
