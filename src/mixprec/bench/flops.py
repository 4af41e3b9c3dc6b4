"""Model FLOPs of one training step (:mod:`mixprec.flops`), the numerator of MFU.

The count is the model's, not the recipe's: matmul-like ops counted by their shapes whatever their dtype, so
every recipe of one model shares one count. Elementwise ops, norms, the loss and the optimizer update are not
counted; a layer no formula knows is listed in ``StepFlops.uncounted``, never counted as zero. For an
``nn.Linear(in, out)`` on a batch of ``B`` the forward is ``2*B*in*out``; the backward twice that, except the
first layer's (no input gradient). Counted once per bench invocation, on the fp32 reference run's model.
"""

from __future__ import annotations

from torch import nn

from ..flops import StepFlops, count_flops
from ..train.contract import Batch, Objective

__all__ = ["StepFlops", "count_step_flops"]


def count_step_flops(model: nn.Module, batch: Batch, objective: Objective) -> StepFlops:
    """FLOPs of one forward and backward of ``objective(model, batch)``; leaves ``.grad`` None (use a copy when
    BatchNorm running statistics matter)."""
    return count_flops(model, lambda: objective(model, batch))
