"""Self-attention for the built-in transformer and GPT, with the attention kernel that is fast where it runs.

On the CPU a bf16 q/k/v is attended in fp32 and cast back (faster there, and no less accurate); elsewhere
attention runs in the input dtype. The choice is made below both autocasts, so a doctor precision map shows it;
:func:`planned_device` lets ``mixprec plan`` choose for a GPU target while tracing on CPU.
"""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.nn.functional as F
from torch import nn

from ..autocast import autocast as scratch_autocast
from ..autocast import is_autocast_active

__all__ = ["attention", "SelfAttention", "planned_device"]

_LOW = (torch.bfloat16,)  # fp16 on the CPU is emulated (fp32 carriers) or a slow native fallback anyway


_SCRATCH_OFF = {dt: scratch_autocast(dt, device_type="cpu", enabled=False) for dt in _LOW}
"""One re-entrant disabled frame per dtype: building an autocast context per call costs more than the op."""


_PLANNED = threading.local()


@contextlib.contextmanager
def planned_device(device_type: str | None):
    """Choose the attention kernel in this thread as on ``device_type`` (None: the tensors' device). Restored
    on exit."""
    prev = getattr(_PLANNED, "device_type", None)
    _PLANNED.device_type = device_type
    try:
        yield
    finally:
        _PLANNED.device_type = prev


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              dropout_p: float = 0.0) -> torch.Tensor:
    """``scaled_dot_product_attention``, in fp32 on the CPU for bf16 inputs (see the module doc)."""
    device_type = getattr(_PLANNED, "device_type", None) or q.device.type
    if device_type != "cpu" or q.dtype not in _LOW:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal)
    scratch = _SCRATCH_OFF[q.dtype] if is_autocast_active() else contextlib.nullcontext()
    with torch.autocast("cpu", enabled=False), scratch:
        y = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), dropout_p=dropout_p, is_causal=causal)
    return y.to(q.dtype)


class SelfAttention(nn.Module):
    """Multi-head self-attention: a fused qkv projection, :func:`attention`, an output projection."""

    def __init__(self, d_model: int, n_heads: int, *, dropout: float = 0.0, causal: bool = False):
        super().__init__()
        self.n_heads, self.dropout, self.causal = n_heads, dropout, causal
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        # (B, T, C) -> (B, heads, T, C / heads): heads become a batch dimension
        q, k, v = (z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = attention(q, k, v, causal=self.causal, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))  # heads side by side again
