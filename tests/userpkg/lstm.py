"""An LSTM sequence classifier and its data, as `--model userpkg.lstm:model --dataset userpkg.lstm:data` import
them (tests only). Sizes are module constants so tests can write the FLOP formula by hand."""

import torch
from torch import nn

VOCAB, EMB, HIDDEN, LAYERS, CLASSES, STEPS = 16, 8, 32, 2, 4, 12
"""Tokens, embedding width, LSTM hidden size and layers, classes, sequence length."""


class LSTMClassifier(nn.Module):
    def __init__(self, opaque: bool = False):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, EMB)
        self.lstm = nn.LSTM(EMB, HIDDEN, num_layers=LAYERS, batch_first=True)
        self.opaque = Opaque(HIDDEN) if opaque else nn.Identity()
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x):
        h, _ = self.lstm(self.emb(x))
        return self.head(self.opaque(h[:, -1]))


class Opaque(nn.Module):
    """A layer with a weight whose work no FLOP formula knows."""

    def __init__(self, n: int):
        super().__init__()
        self.w = nn.Parameter(torch.ones(n))

    def forward(self, x):
        return torch.tanh(x * self.w)


def model():
    return LSTMClassifier()


def model_with_opaque_layer():
    return LSTMClassifier(opaque=True)


def data(n_train: int = 256, n_test: int = 64):
    """The class is the most frequent token of the sequence, modulo CLASSES."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, VOCAB, (n_train + n_test, STEPS), generator=g)
    y = torch.mode(x, dim=1).values % CLASSES
    return (x[:n_train], y[:n_train]), (x[n_train:], y[n_train:])


def hand_flops(batch: int, *, onednn: bool = True) -> tuple[int, int, int]:
    """(LSTM forward, head forward, step total) FLOPs of one step on ``batch`` sequences: each LSTM layer's
    gate GEMMs are 2*T*B*(4H*in + 4H*H), its backward twice that; the head is 2*B*H*C forward, and its
    backward the weight and input gradients, 2 x that. ``onednn=False``: PyTorch's own LSTM, which runs where
    oneDNN has no kernel for the dtype (a bf16 LSTM on a CPU without AVX-512); its backward leaves out the
    gradient of each layer's initial state (zeros that need none), one 2*B*4H*H GEMM per layer."""
    lstm = sum(2 * STEPS * batch * (4 * HIDDEN * (EMB if layer == 0 else HIDDEN) + 4 * HIDDEN * HIDDEN)
               for layer in range(LAYERS))
    head = 2 * batch * HIDDEN * CLASSES
    initial_state_grads = 0 if onednn else LAYERS * 2 * batch * 4 * HIDDEN * HIDDEN
    return lstm, head, 3 * lstm + 3 * head - initial_state_grads
