"""Model FLOPs of one training step, counted once with mixprec's one FLOP counter (:mod:`mixprec.flops`).

MFU (model FLOPs utilisation) divides the FLOPs the *model* needs per step by the step time and by the
machine's peak rate. The count is the model's, not the recipe's: ``FlopCounterMode`` counts the matmul-like
ops (mm, addmm, bmm, convolution, scaled-dot-product attention) by their shapes, whatever their dtype, and
:mod:`mixprec.flops` adds what PyTorch does not count (the CPU attention kernel, fused LSTM/GRU/RNN layers),
so every recipe of one model shares one count, and doctor's precision map counts the same ops with the same
formulas. Elementwise ops, norms, the loss and the optimizer update are not counted (by convention: they are
a few percent of a model's work and not what a matmul peak measures). A layer with parameters that did work
but that no formula knows is listed in ``StepFlops.uncounted`` (bench prints it and results.json keeps it),
never silently counted as zero.

The forward and the backward are counted separately. For an ``nn.Linear(in, out)`` on a batch of ``B``,
the forward is one ``addmm``: ``2*B*in*out`` FLOPs. The backward computes the weight gradient
(``2*B*in*out``) and, only when the input needs a gradient (any layer after the first), the input gradient
(another ``2*B*in*out``); the bias gradient is a sum and is not counted. So the usual "backward = 2 x
forward" holds for hidden layers, and the first layer's backward is 1 x its forward.

The count runs on the fp32 reference run's model, outside any timed region, once per bench invocation.
"""

from __future__ import annotations

from torch import nn

from ..flops import StepFlops, count_flops
from ..train.contract import Batch, Objective

__all__ = ["StepFlops", "count_step_flops"]


def count_step_flops(model: nn.Module, batch: Batch, objective: Objective) -> StepFlops:
    """FLOPs of one forward and one backward of ``objective(model, batch)`` (the loss by the model contract),
    and the layers no formula knows.

    The model's ``.grad`` fields are restored to None afterwards; nothing else is changed (call it on a
    copy when BatchNorm running statistics matter).
    """
    return count_flops(model, lambda: objective(model, batch))
