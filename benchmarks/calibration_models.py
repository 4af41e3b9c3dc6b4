"""Models that calibrate the planner's CPU step-time factors (``plan_vs_measured.py --calibrate``), as
``--model benchmarks.calibration_models:NAME`` imports them. They are other families than the checked ones
(mixprec's built-in MLP, CNN and transformer, tests/userpkg's CNN and transformer), so the check is not a fit.
"""

from __future__ import annotations

import torch
from torch import nn


class _Block(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(x + self.bn2(self.conv2(y)))


def resnet(input_shape, num_classes, width: int = 24, blocks: int = 2):
    """A small residual network with batch norm: a stem, ``blocks`` residual blocks, a strided stage, pooling."""
    c = input_shape[0]
    return nn.Sequential(
        nn.Conv2d(c, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
        *[_Block(width) for _ in range(blocks)],
        nn.Conv2d(width, 2 * width, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(2 * width), nn.ReLU(),
        _Block(2 * width), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * width, num_classes))


def wide_resnet(input_shape, num_classes):
    return resnet(input_shape, num_classes, width=48, blocks=1)


class _GRUClassifier(nn.Module):
    """Rows of the image as a sequence through a GRU, the last hidden state classified."""

    def __init__(self, input_shape, num_classes, hidden: int):
        super().__init__()
        self.rnn = nn.GRU(input_shape[-1], hidden, num_layers=2, batch_first=True)
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x):
        h, _ = self.rnn(x.flatten(1, -2))
        return self.head(h[:, -1])


def gru(input_shape, num_classes):
    return _GRUClassifier(input_shape, num_classes, hidden=128)


class _Mixer(nn.Module):
    """An MLP-Mixer: token-mixing and channel-mixing MLPs over the image's rows (no attention, no convolution)."""

    def __init__(self, input_shape, num_classes, dim: int = 128, depth: int = 3):
        super().__init__()
        tokens, feats = input_shape[-2], input_shape[-1]
        self.embed = nn.Linear(feats, dim)
        self.layers = nn.ModuleList(nn.ModuleList([nn.LayerNorm(dim), nn.Linear(tokens, 2 * tokens),
                                                   nn.Linear(2 * tokens, tokens), nn.LayerNorm(dim),
                                                   nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)])
                                    for _ in range(depth))
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x):
        h = self.embed(x.flatten(1, -2))  # (B, rows, dim)
        for n1, t1, t2, n2, c1, c2 in self.layers:
            h = h + t2(torch.nn.functional.gelu(t1(n1(h).transpose(1, 2)))).transpose(1, 2)
            h = h + c2(torch.nn.functional.gelu(c1(n2(h))))
        return self.head(h.mean(1))


def mixer(input_shape, num_classes):
    return _Mixer(input_shape, num_classes)
