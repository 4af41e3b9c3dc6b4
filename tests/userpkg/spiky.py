"""A model that uniform per-tensor FP8 cannot train (issue 33's second demonstration): the input of its layer
``spiky`` carries one row per batch 2**20 times the rest (a "massive activation", as LLMs' attention sinks have),
which a LayerNorm after it normalises away. Per-tensor e4m3 scales ``spiky``'s input by that row's amax, so every
other row flushes to zero; bf16 (fp32's exponent range) and per-row scales keep them."""

import torch
import torch.nn.functional as F
from torch import nn

BOOST = 2.0**20


class Spiky(nn.Module):
    def __init__(self, num_classes: int = 10, width: int = 64):
        super().__init__()
        self.fc1 = nn.Linear(64, width)
        self.spiky = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.fc2 = nn.Linear(width, width)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x):
        h = F.gelu(self.fc1(x.flatten(1)))
        h = torch.cat([h[:1] * BOOST, h[1:]])  # the first sample of every batch: the outlier row
        h = self.norm(self.spiky(h))
        return self.head(F.gelu(self.fc2(h)))


def model(num_classes):
    return Spiky(num_classes)
