"""First non-finite: the first op of a step whose output holds an inf or a NaN.

:class:`NonFiniteWatch` is a sink of :class:`~.observer.OpObserver`: it checks the outputs of every arithmetic op
and every cast, in forward, backward and optimizer step, and records the first one that is not finite, with its
module path, the op, the autograd node, and the dtype, shape and range of each input (all finite inputs: this op
created the problem). It costs a reduction and a host read per op, so it runs only in replays of failed steps.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

import torch

from .attribution import display_path
from .observer import OpCall, OpObserver, dtype_name, is_data_movement

__all__ = ["TensorInfo", "NonFiniteEvent", "NonFiniteWatch", "tensor_info", "all_finite"]

_CHECK_MOVEMENT = frozenset({"_to_copy", "copy_"})  # the data-movement ops that can overflow (casts)


@dataclasses.dataclass
class TensorInfo:
    """Dtype, shape and range of one tensor (ranges over its finite values)."""

    dtype: str
    shape: list[int]
    absmax: float
    """Largest finite magnitude (0 if none)."""
    absmin_nonzero: float
    """Smallest non-zero finite magnitude (0 if none)."""
    n_inf: int
    n_nan: int
    producer: str | None = None
    """The op that produced this tensor during the observed step, when known."""

    @property
    def finite(self) -> bool:
        return self.n_inf == 0 and self.n_nan == 0

    def short(self) -> str:
        s = f"{self.dtype}{self.shape} |x| in [{self.absmin_nonzero:.3g}, {self.absmax:.3g}]"
        if self.n_inf or self.n_nan:
            s += f" with {self.n_inf} inf, {self.n_nan} nan"
        if self.producer:
            s += f" (from {self.producer})"
        return s


def tensor_info(t: torch.Tensor, producer: str | None = None) -> TensorInfo:
    x = t.detach()
    if not x.is_floating_point():
        return TensorInfo(dtype_name(x.dtype), list(x.shape), 0.0, 0.0, 0, 0, producer)
    x = x.float()
    fin = torch.isfinite(x)
    a = x[fin].abs()
    nz = a[a > 0]
    return TensorInfo(
        dtype=dtype_name(t.dtype),
        shape=list(t.shape),
        absmax=float(a.max()) if a.numel() else 0.0,
        absmin_nonzero=float(nz.min()) if nz.numel() else 0.0,
        n_inf=int(torch.isinf(x).sum()),
        n_nan=int(torch.isnan(x).sum()),
        producer=producer,
    )


@dataclasses.dataclass
class NonFiniteEvent:
    """The first op of a step that produced an inf or NaN."""

    phase: str
    module: str | None
    op: str
    node: str | None
    inputs: list[TensorInfo]
    output: TensorInfo
    emulated: str | None = None
    upstream: str | None = None
    """Backward: the module the gradient flows into next (where a cast at a module border sends it)."""
    step: int | None = None
    loss_scale: float | None = None

    @property
    def inputs_finite(self) -> bool:
        return all(i.finite for i in self.inputs)

    @property
    def kind(self) -> str:
        if not self.inputs_finite:
            return "propagated"  # the inputs of the first checked op were already non-finite
        return "overflow" if self.output.n_nan == 0 else "nan"

    def describe(self) -> str:
        op = f"aten.{self.op}"
        if self.op in ("_to_copy", "copy_") and self.inputs:
            src = self.inputs[0]
            op += f" (cast {src.dtype} -> {self.output.dtype}" + (f" of the output of aten.{src.producer})"
                                                               if src.producer else ")")
        where = f"{self.phase}: {op} in {display_path(self.module)}"
        if self.node:
            where += f" (autograd node {self.node})"
        if self.emulated:
            where += f", emulating {self.emulated}"
        what = f"{self.output.n_inf} inf, {self.output.n_nan} nan out of {math.prod(self.output.shape) or 1}"
        origin = "from finite inputs" if self.inputs_finite else "from inputs that were already non-finite"
        return f"{where} produced {what} ({self.output.dtype}) {origin}"

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["module"] = display_path(self.module)
        d["kind"] = self.kind
        d["description"] = self.describe()
        return d


def all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether every element of every tensor is finite: one sum per tensor (finite exactly when every element
    is, unless finite values overflow the float32 sum, which the element-wise check then settles)."""
    for t in tensors:
        t = t.detach()
        if not bool(torch.isfinite(t.sum(dtype=torch.float32))) and not bool(torch.isfinite(t).all()):
            return False
    return True


class NonFiniteWatch:
    """Sink recording the first op whose floating output is not all finite (see the module docstring)."""

    def __init__(self) -> None:
        self.first: NonFiniteEvent | None = None

    def reset(self) -> None:
        self.first = None

    def on_op(self, call: OpCall, observer: OpObserver) -> None:
        if self.first is not None:
            return
        if is_data_movement(call.func) and call.name not in _CHECK_MOVEMENT:
            return
        for o in call.out_tensors:
            if o.is_floating_point() and o.numel() and not all_finite([o]):
                self.first = NonFiniteEvent(
                    phase=call.phase,
                    module=call.module,
                    op=call.name,
                    node=call.node,
                    inputs=[tensor_info(t, observer.producer_of(t)) for t in call.in_tensors
                            if t.is_floating_point()],
                    output=tensor_info(o),
                    emulated=dtype_name(call.emulated) if call.emulated is not None else None,
                    upstream=observer.tracker.upstream() if call.phase == "backward" else None,
                )
                return
