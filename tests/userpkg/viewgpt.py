"""A language model whose ``forward`` is written as nanoGPT's ``model.py`` writes it: ``.view(-1)`` on the token ids
and on the targets, which raises on a non-contiguous batch ("view size is not compatible with input tensor's size
and stride"). Tests only: ``--model tests/userpkg/viewgpt.py:model --dataset text``."""

import torch
from torch import nn
from torch.nn import functional as F


class ViewGPT(nn.Module):
    def __init__(self, vocab_size: int, block_size: int, d: int = 16):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, d)
        self.wpe = nn.Embedding(block_size, d)
        self.head = nn.Linear(d, vocab_size)

    def forward(self, idx, targets=None):
        b, t = idx.size()
        x = self.wte(idx.view(-1)).view(b, t, -1) + self.wpe(torch.arange(t, device=idx.device))
        logits = self.head(x)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


def model(vocab_size, block_size):
    torch.manual_seed(0)
    return ViewGPT(vocab_size, block_size)
