"""A model and an optimizer that run out of memory on purpose: ``--model tests/userpkg/oom.py:model
--optimizer tests/userpkg/oom.py:sgd`` with ``MIXPREC_TEST_OOM=PHASE:STEP`` (phase forward, backward or step;
the 0-based training step; ``RANKS=1`` in the value, as ``backward:3:1``, plants it on rank 1 only).

A CPU that runs out of memory is usually killed rather than raising, so the error PyTorch raises on a device
(:class:`torch.OutOfMemoryError`) is planted where it would come from: the model's forward, its backward (a
custom autograd function), the optimizer's step. Only training steps count (the build's no-grad probe and the
planner's fake-tensor trace do not). The fault fires in the training process; no product code has a hook.
"""

import os

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from mixprec.train.models import build_model


def _planted(phase: str, step: int) -> bool:
    spec = os.environ.get("MIXPREC_TEST_OOM", "")
    if not spec:
        return False
    where, at, *ranks = spec.split(":")
    here = not ranks or os.environ.get("RANK", "0") in ranks[0].split(",")
    return here and where == phase and int(at) == step


def _oom(phase: str, step: int):
    raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 2.00 GiB (planted in the {phase} of step "
                                 f"{step})")


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, step):
        ctx.step = step
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if _planted("backward", ctx.step):
            _oom("backward", ctx.step)
        return grad, None


class Planted(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.steps = 0

    def forward(self, x):
        if not (self.training and torch.is_grad_enabled()) or isinstance(x, FakeTensor):
            return self.inner(x)
        step, self.steps = self.steps, self.steps + 1
        if _planted("forward", step):
            _oom("forward", step)
        return _RaiseInBackward.apply(self.inner(x), step)


def model(input_shape, num_classes):
    """The built-in MLP (width 32, depth 1) with an out-of-memory error planted in its forward or backward."""
    return Planted(build_model("mlp", input_shape=input_shape, num_classes=num_classes, width=32, depth=1))


class _SGD(torch.optim.SGD):
    def step(self, closure=None):
        step, self.steps = getattr(self, "steps", 0), getattr(self, "steps", 0) + 1
        if _planted("step", step):
            _oom("step", step)
        return super().step(closure)


def sgd(params, lr):
    """SGD with an out-of-memory error planted in its step."""
    return _SGD(params, lr=lr)
