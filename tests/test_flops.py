"""One FLOP counter (mixprec/flops.py): every layer type the models use is counted or listed, never zero silently."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from mixprec import hardware
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


# ------------------------------------------------------------------------------ bench and doctor use it

LSTM_PY = str(Path(__file__).parent / "userpkg" / "lstm.py")


def _lstm_batch(b=32):
    from userpkg import lstm

    (x, y), _ = lstm.data()
    torch.manual_seed(0)
    return lstm, x[:b], y[:b]


def _bench_count(model, x, y, loss):
    """bench's count of one step of ``model`` on ``(x, y)``, the loss given as an explicit ``--loss``."""
    from mixprec.bench.flops import count_step_flops
    from mixprec.train.contract import ModelCall, Objective, as_batch
    from mixprec.train.tasks import LossOnly

    return count_step_flops(model, as_batch((x, y)), Objective(ModelCall(model), LossOnly(), loss))


def test_bench_counts_the_lstm_by_the_hand_formula():

    lstm, x, y = _lstm_batch()
    L, h, total = lstm.hand_flops(len(x))
    f = _bench_count(lstm.model(), x, y, F.cross_entropy)
    assert (f.forward, f.total, f.uncounted) == (L + h, total, ())
    assert f.by_op["mkldnn_rnn_layer"] == L and f.by_op["mkldnn_rnn_layer_backward"] == 2 * L
    g = _bench_count(lstm.model_with_opaque_layer(), x, y, F.cross_entropy)
    assert g.total == total and g.uncounted == ("opaque (Opaque)",)


@pytest.mark.slow
@pytest.mark.parametrize("keep", [(), ("head",), ("lstm",)])
def test_doctor_share_of_an_lstm_model_matches_the_hand_formula(keep):
    """bf16-mixed (scratch autocast, so --keep-fp32 applies): the map's total is the hand formula, and the
    low-precision share is what the kept-in-fp32 layer leaves in bf16. A bf16 LSTM runs oneDNN's kernel where
    the CPU has one, PyTorch's own LSTM elsewhere (its formula differs by the initial state's gradients)."""
    from mixprec.doctor.api import diagnose

    lstm, x, y = _lstm_batch()
    onednn = keep == ("lstm",) or hardware.autocast_runs_lstm(torch.bfloat16)
    _, h, total = lstm.hand_flops(len(x), onednn=onednn)
    rep = diagnose(lstm.model(), (x, y), F.cross_entropy, precision="bf16-mixed", amp_impl="scratch",
                   keep_fp32=keep, steps=1, replay=False)
    pm = rep.precision_map
    assert pm.total_flops == total and pm.uncounted == []
    low = {(): total, ("head",): total - 3 * h, ("lstm",): 3 * h}[keep]
    assert pm.low_flops == low and pm.low_flop_share == low / total


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_bench_and_doctor_count_the_same_total(precision):
    """A GPT (CPU SDPA) and the LSTM model: bench's count of the fp32 step equals doctor's map of the same
    step under any recipe (the map counts the ops that ran, in whatever dtype)."""
    from mixprec.doctor.api import precision_map
    from mixprec.train.gpt import GPT

    lstm, x, y = _lstm_batch(16)
    torch.manual_seed(0)
    tokens = torch.randint(0, 30, (4, 17))
    cases = [(lstm.model(), x, y), (GPT(30, 16, n_layers=2, n_heads=2, d_model=32), tokens[:, :-1], tokens[:, 1:])]

    def loss(out, t):
        return F.cross_entropy(out.reshape(-1, out.size(-1)), t.reshape(-1))

    for model, xb, yb in cases:
        bench = _bench_count(model, xb, yb, loss)
        doctor = precision_map(model, (xb, yb), loss, precision=precision)
        assert doctor.total_flops == bench.total > 0, type(model).__name__
    assert "_scaled_dot_product_flash_attention_for_cpu" in _bench_count(cases[1][0], *cases[1][1:], loss).by_op


@pytest.mark.slow
def test_doctor_report_names_the_layers_whose_flops_are_unknown(tmp_path):
    from mixprec.doctor.api import diagnose

    lstm, x, y = _lstm_batch()
    rep = diagnose(lstm.model_with_opaque_layer(), (x, y), F.cross_entropy, precision="bf16-mixed", steps=1,
                   replay=False)
    assert rep.precision_map.uncounted == ["opaque (Opaque)"]
    assert "FLOPs unknown (left out of the share) for: opaque (Opaque)" in rep.render()
    assert rep.to_dict()["precision_map"]["summary"]["uncounted"] == ["opaque (Opaque)"]


@pytest.mark.slow
def test_bench_mfu_counts_the_lstm_and_lists_unknown_layers(tmp_path, capsys):
    from mixprec.cli import main
    from userpkg import lstm

    out = tmp_path / "bench"
    code = main(["bench", "--model", f"{LSTM_PY}:model_with_opaque_layer", "--dataset", f"{LSTM_PY}:data",
                 "--precisions", "fp32", "--repeats", "1", "--batch-size", "32", "--max-steps", "4",
                 "--warmup-steps", "1", "--peak-seconds", "0.1", "--no-plots", "--no-plan", "--device", "cpu",
                 "--out", str(out)])
    stdout = capsys.readouterr().out
    assert code == 0, stdout
    doc = json.loads((out / "results.json").read_text())
    fl = doc["flops_per_step"]
    assert fl["total"] == lstm.hand_flops(32)[2] and fl["uncounted"] == ["opaque (Opaque)"]
    assert "FLOPs unknown (not counted, so MFU is low by their share) for: opaque (Opaque)" in stdout
    assert "FLOPs unknown (not counted, MFU is low by their share) for: opaque (Opaque)" in (out / "results.md").read_text()
