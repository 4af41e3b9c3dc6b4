"""Tiny models with faults planted by the data, for the watch's tests (tests/test_watch*.py).

Column 0 of each input row is a *mode*: 0 normal, 1 makes ``boost`` overflow in its forward, 2 makes it
overflow in its backward. The fault depends only on the batch, so a replay of the step reproduces it, as a
real fault (a batch, weights and RNG state that overflow) would.
"""

from __future__ import annotations

import torch
from torch import nn

FORWARD, BACKWARD = 1.0, 2.0
D_IN, HIDDEN, CLASSES = 8, 16, 3


class _Steep(torch.autograd.Function):
    """Identity forward; backward multiplies the rows marked BACKWARD by 1e30 twice (inf in any float dtype)."""

    @staticmethod
    def forward(ctx, h, mode):
        ctx.save_for_backward(mode)
        return h.view_as(h)

    @staticmethod
    def backward(ctx, grad):
        (mode,) = ctx.saved_tensors
        marked = (mode == BACKWARD).to(grad.dtype).unsqueeze(1)
        boost = marked * 1e30 * 1e30 + (1 - marked)
        return grad * boost, None


class Boost(nn.Module):
    """Where a fault is planted: rows marked FORWARD overflow here, rows marked BACKWARD in its backward."""

    def forward(self, h: torch.Tensor, mode: torch.Tensor) -> torch.Tensor:
        marked = (mode == FORWARD).to(h.dtype).unsqueeze(1)
        h = h * (marked * 1e30 * 1e30 + (1 - marked))
        return _Steep.apply(h, mode)


class Net(nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Linear(D_IN, HIDDEN)
        self.act = nn.Tanh()
        self.drop = nn.Dropout(dropout)
        self.boost = Boost()
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.boost(self.drop(self.act(self.embed(x))), x[:, 0]))


class SplitNet(Net):
    """``Net`` with its first layer on the CPU and the rest on ``device`` (a CPU embedding before a device body)."""

    def __init__(self, device: str | torch.device, dropout: float = 0.0) -> None:
        super().__init__(dropout)
        self.to(device)
        self.embed.cpu()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = self.head.weight.device
        h = self.embed(x.cpu()).to(device)
        return self.head(self.boost(self.drop(self.act(h)), x[:, 0].to(device)))


class LossNet(Net):
    """``Net`` that returns its loss, as Hugging Face models do when given labels."""

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        logits = super().forward(x)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(logits.float(), labels)
        return out


def batches(n: int, *, batch: int = 4, fault_at: int | None = None, mode: float = FORWARD,
            seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` batches; batch ``fault_at`` has its first row marked ``mode``."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        x = torch.randn(batch, D_IN, generator=g)
        x[:, 0] = 0.0
        if i == fault_at:
            x[0, 0] = mode
        out.append((x, torch.randint(0, CLASSES, (batch,), generator=g)))
    return out
