"""Models that fail on purpose, for the bench's tests: ``--model tests/userpkg/faults.py:aborts_in_fp16``.

Each is the built-in MLP (width 512, depth 2) whose forward misbehaves as soon as its logits come out in
one low-precision dtype, so one matrix holds recipes that succeed (fp32, the other dtype) and one that
fails, under native and scratch autocast alike: native gives fp16 logits under fp16-mixed; mixprec's autocast
emulating fp16 (``--amp-impl auto`` on a CPU) gives fp32 logits holding fp16 values, so its dtype counts too.
The fault fires inside the bench's worker process; the parent builds only the fp32 reference run, which never
fires.
"""

import os
import time

import torch
from torch import nn

from mixprec.autocast import autocast_dtype, is_autocast_active
from mixprec.train.models import build_model


class Faulty(nn.Module):
    def __init__(self, inner: nn.Module, dtype: torch.dtype, fault):
        super().__init__()
        self.inner, self.dtype, self.fault = inner, dtype, fault

    def forward(self, x):
        y = self.inner(x)
        if y.dtype == self.dtype or (is_autocast_active() and autocast_dtype() == self.dtype):
            self.fault()
        return y


def _mlp(input_shape, num_classes):
    return build_model("mlp", input_shape=input_shape, num_classes=num_classes, width=512, depth=2)


def _abort():
    print("aborting on purpose", flush=True)
    os.abort()


def _raise():
    raise RuntimeError("deliberate failure in the forward")


def _hang():
    print(f"hanging on purpose (pid {os.getpid()})", flush=True)
    time.sleep(3600)


def aborts_in_fp16(input_shape, num_classes):
    """Dies of SIGABRT (no result file) at its first fp16 forward."""
    return Faulty(_mlp(input_shape, num_classes), torch.float16, _abort)


def raises_in_bf16(input_shape, num_classes):
    """Raises RuntimeError at its first bf16 forward."""
    return Faulty(_mlp(input_shape, num_classes), torch.bfloat16, _raise)


def hangs_in_bf16(input_shape, num_classes):
    """Sleeps for an hour at its first bf16 forward (after printing its pid)."""
    return Faulty(_mlp(input_shape, num_classes), torch.bfloat16, _hang)
