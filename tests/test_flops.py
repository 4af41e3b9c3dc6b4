"""One FLOP counter (mixprec/flops.py): every layer type the models use is counted or listed, never zero silently."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from mixprec.flops import count_flops, flop_counter, op_flops


class LSTMNet(nn.Module):
    def __init__(self, vocab=20, emb=8, hidden=16, layers=2, classes=3):
        super().__init__()
        self.emb = nn.Embedding(vocab, emb)
        self.lstm = nn.LSTM(emb, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x):
        h, _ = self.lstm(self.emb(x))
        return self.head(h[:, -1])


def test_lstm_flops_match_the_hand_formula():
    B, T, E, H, L, C = 4, 5, 8, 16, 2, 3
    m = LSTMNet(emb=E, hidden=H, layers=L, classes=C)
    x = torch.randint(0, 20, (B, T))
    f = count_flops(m, lambda: m(x).sum())
    # forward: per layer 2*T*B*(4H*in + 4H*H), in = E for layer 0 and H after; head 2*B*H*C
    lstm_fwd = sum(2 * T * B * (4 * H * (E if layer == 0 else H) + 4 * H * H) for layer in range(L))
    head_fwd = 2 * B * H * C
    assert f.forward == lstm_fwd + head_fwd
    # backward: the fused LSTM layer's gradients are twice its forward; the head's weight and input grads
    assert f.backward == 2 * lstm_fwd + 2 * head_fwd
    assert f.uncounted == ()


def test_cpu_attention_is_counted_as_pytorch_counts_the_cuda_kernels():
    from torch.utils.flop_counter import sdpa_flop_count

    q = torch.randn(2, 4, 16, 8, requires_grad=True)
    with flop_counter() as fc:
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert fc.get_total_flops() == sdpa_flop_count(q.shape, q.shape, q.shape) > 0


def test_a_users_own_flop_counter_is_not_changed():
    m = LSTMNet()
    x = torch.randint(0, 20, (2, 3))
    with flop_counter():
        pass
    with FlopCounterMode(display=False) as plain:
        m(x)
    assert plain.get_total_flops() == 2 * 2 * 16 * 3  # only the head: PyTorch alone does not count the LSTM


class Opaque(nn.Module):
    """A layer whose work no formula knows (an elementwise 'kernel' with a weight)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(8))

    def forward(self, x):
        return torch.tanh(x * self.w)


def test_a_layer_whose_flops_are_unknown_is_listed():
    m = nn.Sequential(nn.Linear(8, 8), Opaque(), nn.LayerNorm(8), nn.Linear(8, 2))
    f = count_flops(m, lambda: m(torch.randn(3, 8)).sum())
    assert f.uncounted == ("1 (Opaque)",)  # the norm is elementwise by convention, not unknown
    assert f.to_dict()["uncounted"] == ["1 (Opaque)"]


def test_op_flops_uses_the_same_table():
    x, w = torch.randn(3, 8), torch.randn(5, 8)
    out = torch.ops.aten.mm.default(x, w.t())
    assert op_flops(torch.ops.aten.mm.default, (x, w.t()), {}, out) == 2 * 3 * 8 * 5
    q = torch.randn(1, 2, 4, 8)
    res = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(q, q, q)
    assert op_flops(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default, (q, q, q), {}, res) > 0
    assert op_flops(torch.ops.aten.add.Tensor, (x, x), {}, x + x) == 0
