"""Models that make ranks disagree on purpose, for the torchrun tests: ``--model tests/userpkg/ranks.py:drifts``.

The fault fires inside the training process of one rank; no product code has a hook for it.
"""

import os

import torch
from torch import nn

from mixprec.train.models import build_model

DRIFT_AT_FORWARD = 3
"""The training forward (1-based) at which rank 1 nudges its first parameter: ranks then hold different weights."""


class Drifting(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.calls = 0

    def forward(self, x):
        if self.training:
            self.calls += 1
            if self.calls == DRIFT_AT_FORWARD and os.environ.get("RANK") == "1":
                with torch.no_grad():
                    next(self.parameters()).add_(1e-3)
        return self.inner(x)


def drifts(input_shape, num_classes):
    """The built-in MLP (width 32, depth 1) whose rank-1 replica drifts at its third training step."""
    return Drifting(build_model("mlp", input_shape=input_shape, num_classes=num_classes, width=32, depth=1))
