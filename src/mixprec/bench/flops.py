"""Model FLOPs of one training step, counted once with ``torch.utils.flop_counter.FlopCounterMode``.

MFU (model FLOPs utilisation) divides the FLOPs the *model* needs per step by the step time and by the
machine's peak rate. The count is the model's, not the recipe's: FlopCounterMode counts the matmul-like
ops (mm, addmm, bmm, convolution, scaled-dot-product attention) by their shapes, whatever their dtype,
so every recipe of one model shares one count. Elementwise ops, norms, the loss and the optimizer update
are not counted (by convention: they are a few percent of a model's work and not what a matmul peak
measures).

The forward and the backward are counted separately. For an ``nn.Linear(in, out)`` on a batch of ``B``,
the forward is one ``addmm``: ``2*B*in*out`` FLOPs. The backward computes the weight gradient
(``2*B*in*out``) and, only when the input needs a gradient (any layer after the first), the input gradient
(another ``2*B*in*out``); the bias gradient is a sum and is not counted. So the usual "backward = 2 x
forward" holds for hidden layers, and the first layer's backward is 1 x its forward.

The count runs on a fresh fp32 copy of the model, outside any timed region, once per bench invocation.
"""

from __future__ import annotations

import dataclasses

from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from ..train.contract import Batch, Objective

__all__ = ["StepFlops", "count_step_flops"]


@dataclasses.dataclass(frozen=True)
class StepFlops:
    forward: int
    backward: int
    by_op: dict[str, int]
    """Forward + backward FLOPs per aten op (``mm``, ``addmm``, ``convolution``...)."""

    @property
    def total(self) -> int:
        return self.forward + self.backward

    def to_dict(self) -> dict:
        return {"forward": self.forward, "backward": self.backward, "total": self.total, "by_op": self.by_op}


def _by_op(counter: FlopCounterMode) -> dict[str, int]:
    out: dict[str, int] = {}
    for op, n in counter.get_flop_counts().get("Global", {}).items():
        name = str(op).split(".")[-1]
        out[name] = out.get(name, 0) + int(n)
    return out


def count_step_flops(model: nn.Module, batch: Batch, objective: Objective) -> StepFlops:
    """FLOPs of one forward and one backward of ``objective(model, batch)`` (the model contract's loss).

    The model's ``.grad`` fields are restored to None afterwards; nothing else is changed (call it on a
    copy when BatchNorm running statistics matter).
    """
    with FlopCounterMode(display=False) as fwd:
        loss = objective(model, batch)
    with FlopCounterMode(display=False) as bwd:
        loss.backward()
    for p in model.parameters():
        p.grad = None
    ops = _by_op(fwd)
    for k, v in _by_op(bwd).items():
        ops[k] = ops.get(k, 0) + v
    return StepFlops(forward=int(fwd.get_total_flops()), backward=int(bwd.get_total_flops()), by_op=ops)
