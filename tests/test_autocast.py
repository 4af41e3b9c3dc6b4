"""mixprec's from-scratch autocast against torch.autocast on CPU (and, with a GPU, on CUDA), plus its own features.

Tiers: where both autocasts run the same casts into the same kernels (every op and model below)
outputs and gradients must be *identical* (rtol=0, atol=0) -- a looser tolerance would hide a
missing or extra cast. ``emulate=True`` is checked exactly against fp32 arithmetic on rounded
operands, and against native fp16 with an fp16 tolerance.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from mixprec import hardware
from mixprec.autocast import autocast, autocast_dtype, is_autocast_active
from mixprec.autocast.cpp_composites import cross_entropy_loss
from mixprec.autocast.frame import STATE
from mixprec.autocast.policy import CastKind, CastPolicy, default_policy

LOWS = [torch.bfloat16, torch.float16]
LOW_IDS = ["bf16", "fp16"]


def native(dtype=torch.bfloat16, **kwargs):
    return torch.autocast("cpu", dtype=dtype, **kwargs)


def scratch(dtype=torch.bfloat16, **kwargs):
    return autocast(dtype, device_type="cpu", **kwargs)


def r16(t, low=torch.float16):
    """Round to the nearest value of ``low`` (RNE), kept in fp32."""
    return t.to(low).to(torch.float32)


def _global_hooks() -> int:
    return (len(nn.modules.module._global_forward_pre_hooks)
            + len(nn.modules.module._global_forward_hooks))


def assert_clean_state(global_hooks: int = 0):
    """Nothing of any autocast is left behind in this thread."""
    assert torch._C._len_torch_function_stack() == 0
    assert STATE.frames == [] and STATE.mode is None
    assert not any(STATE.cache.values())  # no cached casts
    assert not is_autocast_active() and autocast_dtype() is None
    assert _global_hooks() == global_hooks  # keep_fp32's global hooks are gone


@pytest.fixture(autouse=True)
def _clean_state_after_each_test():
    hooks_before = _global_hooks()
    yield
    assert_clean_state(hooks_before)


class Record(TorchDispatchMode):
    """Every ATen op that runs (forward and backward) with the dtypes of its tensor outputs."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, tuple[str, ...]]] = []

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat = out if isinstance(out, (tuple, list)) else (out,)
        dtypes = tuple(str(o.dtype)[6:] for o in flat if isinstance(o, torch.Tensor))
        self.ops.append((func.overloadpacket.__name__, dtypes))
        return out

    def count(self, name: str) -> int:
        return sum(op == name for op, _ in self.ops)


# ---------------------------------------------------------------------------------------------
# Op by op: same output dtype, same values, same gradients as torch.autocast("cpu")
# ---------------------------------------------------------------------------------------------

def make_inputs(low: torch.dtype) -> types.SimpleNamespace:
    """Fresh leaves and modules (same values every call)."""
    torch.manual_seed(0)
    t = types.SimpleNamespace()
    t.x = torch.randn(4, 8, requires_grad=True)
    t.xl = t.x.to(low)  # a low-precision activation, as a low op would leave it
    t.img = torch.randn(2, 3, 8, 8, requires_grad=True)
    t.imgl = t.img.to(low)
    t.q = torch.randn(2, 5, 8, requires_grad=True)
    t.kv = torch.randn(2, 7, 8, requires_grad=True)
    t.w = torch.randn(8, 3, requires_grad=True)
    t.a, t.b, t.c = (torch.randn(2, 3, 4, requires_grad=True), torch.randn(2, 4, 5, requires_grad=True),
                     torch.randn(2, 3, 5, requires_grad=True))
    t.qkv = [torch.randn(2, 2, 5, 4, requires_grad=True) for _ in range(3)]
    t.mask = torch.randn(5, 5)
    t.labels = torch.tensor([0, 1, 2, 3])
    t.lin = nn.Linear(8, 6)
    t.conv = nn.Conv2d(3, 4, 3)
    t.convt = nn.ConvTranspose2d(3, 2, 3)
    t.mha = nn.MultiheadAttention(8, 2, batch_first=True)
    t.enc = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    t.bn = nn.BatchNorm2d(3)
    t.ln = nn.LayerNorm(8)
    t.emb = nn.Embedding(10, 8)
    t.prelu = nn.PReLU()
    t.lstm = nn.LSTM(8, 6, batch_first=True)
    t.h = torch.randn(4, 6, requires_grad=True)  # a hidden state for the RNN cells
    t.lstm_cell = nn.LSTMCell(8, 6)
    t.gru_cell = nn.GRUCell(8, 6)
    t.rnn_tanh_cell = nn.RNNCell(8, 6)
    t.rnn_relu_cell = nn.RNNCell(8, 6, bias=False, nonlinearity="relu")
    return t


# torch._convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding,
#                    groups, benchmark, deterministic, cudnn_enabled[, allow_tf32])
_CONV_ARGS = ([1, 1], [0, 0], [1, 1], False, [0, 0], 1, False, False, True)


OPS = {
    "linear": lambda t: t.lin(t.x),
    "linear_low_input": lambda t: t.lin(t.xl),
    "conv1d": lambda t: F.conv1d(t.img[:, :, 0], t.conv.weight[:, :, 0]),
    "conv2d": lambda t: t.conv(t.img),
    "conv_transpose2d": lambda t: t.convt(t.img),
    "matmul_operator": lambda t: t.x @ t.w,
    "matmul_mixed": lambda t: torch.matmul(t.xl, t.w),
    "bmm": lambda t: torch.bmm(t.a, t.b),
    "baddbmm": lambda t: torch.baddbmm(t.c, t.a, t.b),
    "addmm": lambda t: torch.addmm(t.w[0], t.x, t.w),
    "einsum": lambda t: torch.einsum("bij,bjk->bik", t.a, t.b),
    "tensordot": lambda t: torch.tensordot(t.x, t.w, dims=1),
    "tensordot_dim_lists": lambda t: torch.tensordot(t.a, t.b, dims=([2], [1])),
    "tensordot_broadcast_dim": lambda t: torch.tensordot(t.a[:, :1], t.c, dims=([0, 1], [0, 1])),
    "tensordot_low": lambda t: torch.tensordot(t.xl, t.w.detach().to(t.xl.dtype), dims=1),
    # only the 12-argument (deprecated) overload is on CPU autocast's lower-precision list
    "_convolution_12_args": lambda t: torch._convolution(t.img, t.conv.weight, t.conv.bias, *_CONV_ARGS),
    "_convolution_13_args": lambda t: torch._convolution(t.img, t.conv.weight, t.conv.bias, *_CONV_ARGS,
                                                         True),
    # C++ composites whose inner linears CPU autocast lowers
    "lstm_cell_h": lambda t: t.lstm_cell(t.x)[0],
    "lstm_cell_c": lambda t: t.lstm_cell(t.x, (t.h, t.h * 2))[1],
    "gru_cell": lambda t: t.gru_cell(t.x, t.h),
    "rnn_tanh_cell": lambda t: t.rnn_tanh_cell(t.x, t.h),
    "rnn_relu_cell": lambda t: t.rnn_relu_cell(t.xl),
    "relu_low": lambda t: F.relu(t.xl),
    "gelu_low": lambda t: F.gelu(t.xl),
    "layer_norm_low": lambda t: t.ln(t.xl),
    "layer_norm": lambda t: t.ln(t.x),
    "softmax_low": lambda t: F.softmax(t.xl, -1),
    "log_softmax_low": lambda t: t.xl.log_softmax(-1),
    "cross_entropy_low": lambda t: F.cross_entropy(t.xl, t.labels),
    "nll_loss_low": lambda t: F.nll_loss(t.xl, t.labels),
    "mse_loss_mixed": lambda t: F.mse_loss(t.xl, t.x.detach()),
    "bce_with_logits_low": lambda t: F.binary_cross_entropy_with_logits(t.xl, t.x.detach().sigmoid()),
    "mha_output": lambda t: t.mha(t.q, t.q, t.q)[0],
    "mha_weights": lambda t: t.mha(t.q, t.q, t.q)[1],
    "mha_no_weights": lambda t: t.mha(t.q, t.q, t.q, need_weights=False)[0],
    "mha_cross": lambda t: t.mha(t.q, t.kv, t.kv)[0],
    "transformer_encoder_layer": lambda t: t.enc(t.q),
    "sdpa": lambda t: F.scaled_dot_product_attention(*t.qkv),
    "sdpa_float_mask": lambda t: F.scaled_dot_product_attention(*t.qkv, attn_mask=t.mask),
    "add_mixed": lambda t: t.xl + t.x,
    "cat_mixed": lambda t: torch.cat([t.xl, t.x]),
    "stack_mixed": lambda t: torch.stack([t.xl, t.x]),
    "cat_low": lambda t: torch.cat([t.xl, t.xl]),
    "index_copy_mixed": lambda t: t.x.index_copy(0, t.labels[:1], t.xl[:1]),
    "max_pool2d_low": lambda t: F.max_pool2d(t.imgl, 2),
    "max_pool3d_low": lambda t: F.max_pool3d(t.imgl[None], 2),
    "avg_pool2d_low": lambda t: F.avg_pool2d(t.imgl, 2),
    "adaptive_avg_pool2d_low": lambda t: F.adaptive_avg_pool2d(t.imgl, 1),
    "flatten_low": lambda t: t.imgl.flatten(1),
    "dropout_low": lambda t: F.dropout(t.xl, 0.5),
    "mean_low": lambda t: t.xl.mean(),
    "sum_low": lambda t: t.xl.sum(),
    "batch_norm_low": lambda t: t.bn(t.imgl),
    "batch_norm": lambda t: t.bn(t.img),
    "embedding": lambda t: t.emb(t.labels),
    "pad_reflect_low": lambda t: F.pad(t.imgl, (1, 1, 1, 1), mode="reflect"),
    "pad_constant_low": lambda t: F.pad(t.imgl, (1, 1)),
    "interpolate_low": lambda t: F.interpolate(t.imgl, scale_factor=2),
    "prelu": lambda t: t.prelu(t.x),
    "group_norm_low": lambda t: F.group_norm(t.imgl, 3),
    "exp_low": lambda t: t.xl.exp(),
    "pow_low": lambda t: t.xl ** 2,
    "prod_low": lambda t: t.xl.prod(),
    "cdist_low": lambda t: torch.cdist(t.xl, t.xl),
    "norm_low": lambda t: t.xl.norm(),
}
OPS["lstm"] = lambda t: t.lstm(t.q)[0]


def run_op(ctx, name: str, low: torch.dtype, *, backward: bool = True):
    t = make_inputs(low)
    torch.manual_seed(1)  # dropout
    with ctx:
        out = OPS[name](t)
    leaves = [v for v in vars(t).values() if isinstance(v, torch.Tensor) and v.is_leaf and v.requires_grad]
    leaves += [p for v in vars(t).values() if isinstance(v, nn.Module) for p in v.parameters()]
    leaves += t.qkv
    if backward and out.requires_grad:
        out.float().sum().backward()
    return out, [p.grad for p in leaves]


@pytest.mark.parametrize("low", LOWS, ids=LOW_IDS)
@pytest.mark.parametrize("name", sorted(OPS))
def test_op_matches_torch_autocast(name, low):
    if name == "lstm" and not hardware.autocast_runs_lstm(low):
        low_id = LOW_IDS[LOWS.index(low)]
        pytest.skip(f"torch.autocast's CPU LSTM (oneDNN) has no {low_id} kernel on this CPU: it raises")
    want, want_grads = run_op(native(low), name, low)
    got, got_grads = run_op(scratch(low), name, low)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for g, w in zip(got_grads, want_grads):
        if w is None:
            assert g is None
        else:
            assert g.dtype == w.dtype
            torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["lstm_cell_c", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
                                  "tensordot_broadcast_dim", "_convolution_13_args"])
def test_transcribed_composites_run_the_same_aten_ops_as_torch_autocast(name):
    # the Python transcriptions of C++ composites repeat torch's inner ops, in-place ones included
    traces = []
    for ctx in (native(), scratch()):
        t = make_inputs(torch.bfloat16)
        with Record() as rec:
            with ctx:
                out = OPS[name](t)
            out.float().sum().backward()
        traces.append(rec.ops)
    assert traces[0] == traces[1]


# ---------------------------------------------------------------------------------------------
# Intentional differences from torch.autocast
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("module", ["enc", "mha"])
def test_inference_fast_paths_are_replaced_by_the_slow_path(module):
    # Eval + no_grad: torch.autocast("cpu") lets nn.TransformerEncoderLayer / MultiheadAttention
    # take their fused fast paths (their "autocast is enabled" check looks at CUDA only), whose
    # fused kernels it casts differently from the op-by-op path: the post-norm encoder layer
    # returns bf16 in eval but fp32 (a bf16 sublayer added to the fp32 residual) in training.
    # Any TorchFunctionMode blocks those fast paths, so here the slow path runs, op by op under
    # the policy -- the same ops, dtypes and values as in training mode.
    t = make_inputs(torch.bfloat16)
    mod = getattr(t, module)
    call = (lambda: mod(t.q)) if module == "enc" else (lambda: mod(t.q, t.q, t.q, need_weights=False)[0])
    with torch.no_grad():
        with scratch():
            slow_path = call()
        mod.eval()
        with native():
            fast_path = call()
        with scratch():
            got = call()
    assert got.dtype == slow_path.dtype
    torch.testing.assert_close(got, slow_path, rtol=0, atol=0)
    torch.testing.assert_close(got.float(), fast_path.float(), rtol=0.05, atol=0.05)


@pytest.mark.parametrize("low", LOWS, ids=LOW_IDS)
def test_tensordot_of_mixed_dtypes_raises_as_in_torch(low):
    # at::tensordot checks that its inputs share a dtype before its inner mm, the op CPU autocast
    # lowers; casting both inputs up front would hide the error
    a, b = torch.randn(4, 8), torch.randn(8, 3).to(low)
    for ctx in (native(low), scratch(low)):
        with pytest.raises(RuntimeError, match="both inputs should have same dtype"), ctx:
            torch.tensordot(a, b, dims=1)


def test_gru_runs_in_fp32():
    # torch.autocast("cpu") lowers the gate matmuls *inside* aten::gru (a C++ composite) and
    # returns fp32; a function-level autocast sees one gru call, which is on no list.
    gru = nn.GRU(8, 6)
    x = torch.randn(5, 2, 8)
    with scratch():
        out = gru(x)[0]
    torch.testing.assert_close(out, gru(x)[0], rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# Whole models: the same ATen ops with the same dtypes, forward and backward
# ---------------------------------------------------------------------------------------------

MODELS = ["simplenet", "mlp", "cnn", "transformer"]


def trace_step(model_name: str, ctx, low: torch.dtype):
    from mixprec.train.models import build_model

    torch.manual_seed(0)
    model = build_model(model_name, input_shape=(1, 8, 8), num_classes=5, width=32, channels=4,
                        d_model=16, n_heads=2, n_layers=1)
    x, y = torch.randn(3, 1, 8, 8), torch.tensor([0, 3, 4])
    rec = Record()
    with rec:
        with ctx:
            loss = F.cross_entropy(model(x), y)
        loss.backward()
    return rec.ops, loss, [p.grad for p in model.parameters()]


@pytest.mark.parametrize("low", LOWS, ids=LOW_IDS)
@pytest.mark.parametrize("model_name", MODELS)
def test_model_runs_the_same_aten_ops_as_torch_autocast(model_name, low):
    want_ops, want_loss, want_grads = trace_step(model_name, native(low), low)
    got_ops, got_loss, got_grads = trace_step(model_name, scratch(low), low)
    assert any(low_name in dtypes for _, dtypes in got_ops for low_name in ("bfloat16", "float16"))
    assert got_ops == want_ops
    assert got_loss.dtype == torch.float32
    torch.testing.assert_close(got_loss, want_loss, rtol=0, atol=0)
    for g, w in zip(got_grads, want_grads):
        assert g.dtype == torch.float32  # gradients reach the fp32 parameters in fp32
        torch.testing.assert_close(g, w, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# emulate=True
# ---------------------------------------------------------------------------------------------

EMULATED = {
    "linear": (lambda x, w, b: F.linear(x, w, b), ((4, 8), (6, 8), (6,))),
    "conv2d": (lambda x, w, b: F.conv2d(x, w, b), ((2, 3, 6, 6), (4, 3, 3, 3), (4,))),
    "matmul": (lambda x, w: x @ w, ((4, 8), (8, 3))),
    "bmm": (lambda a, b: torch.bmm(a, b), ((2, 3, 4), (2, 4, 5))),
    "sdpa": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v), ((1, 2, 5, 4),) * 3),
}


@pytest.mark.parametrize("low", LOWS, ids=LOW_IDS)
@pytest.mark.parametrize("name", sorted(EMULATED))
def test_emulate_is_fp32_compute_on_rounded_operands_and_result(name, low):
    fn, shapes = EMULATED[name]
    torch.manual_seed(0)
    leaves = [torch.randn(*s, requires_grad=True) for s in shapes]
    with scratch(low, emulate=True):
        got = fn(*leaves)
    got.sum().backward()
    got_grads = [p.grad.clone() for p in leaves]

    for p in leaves:
        p.grad = None
    want = r16(fn(*(r16(p, low) for p in leaves)), low)
    want.sum().backward()
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for g, p in zip(got_grads, leaves):
        torch.testing.assert_close(g, p.grad, rtol=0, atol=0)
        torch.testing.assert_close(g, r16(g, low), rtol=0, atol=0)  # gradients are rounded too


def test_emulate_leaves_other_ops_in_exact_fp32():
    x = torch.randn(4, 8)
    with scratch(torch.float16, emulate=True):
        y = F.gelu(x).softmax(-1)
    torch.testing.assert_close(y, F.gelu(x).softmax(-1), rtol=0, atol=0)


def test_emulate_overflows_like_fp16():
    x = torch.full((1, 4), 200.0)
    w = torch.full((1, 4), 100.0)  # 4 * 200 * 100 = 80000 > 65504
    with scratch(torch.float16, emulate=True):
        assert torch.isinf(F.linear(x, w)).all()
    with scratch(torch.bfloat16, emulate=True):
        assert torch.isfinite(F.linear(x, w)).all()


def test_emulate_is_close_to_native_fp16():
    from mixprec.train.models import build_model

    torch.manual_seed(0)
    model = build_model("cnn", input_shape=(1, 8, 8), num_classes=5, channels=4)
    x, y = torch.randn(3, 1, 8, 8), torch.tensor([0, 3, 4])
    with native(torch.float16):
        want = F.cross_entropy(model(x), y)
    with scratch(torch.float16, emulate=True):
        got = F.cross_entropy(model(x), y)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=5e-3, atol=5e-3)


def test_emulate_caches_the_rounded_weight():
    lin = nn.Linear(4, 4)
    with Record() as rec, scratch(torch.float16, emulate=True):
        lin(torch.randn(2, 4))
        n = rec.count("_to_copy")
        lin(torch.randn(2, 4))
    # second call: only the input (2 casts) and the result (2 casts) are rounded
    assert rec.count("_to_copy") - n == 4


def test_emulate_rounds_a_low_format_value_again_after_an_in_place_change():
    # the result of a low op is marked as a low-format value and not rounded again as an operand
    # of the next low op -- unless an in-place op has changed it since
    torch.manual_seed(0)
    lin, x = nn.Linear(8, 8), torch.randn(2, 8)
    with scratch(torch.float16, emulate=True):
        h = lin(x).view(2, 8)
        h.add_(torch.randn(2, 8) * 0.01)
        out = lin(h)
    assert not torch.equal(h, r16(h))  # h is no longer an fp16 value...
    want = r16(F.linear(r16(h), r16(lin.weight), r16(lin.bias)))
    torch.testing.assert_close(out, want, rtol=0, atol=0)  # ...so it was rounded again


@pytest.mark.parametrize("params", ["fp32", "fp16"])
@pytest.mark.parametrize("model_name", MODELS)
def test_emulate_skips_rounding_low_format_operands_without_changing_a_bit(model_name, params,
                                                                         monkeypatch):
    from mixprec.autocast import rounded
    from mixprec.train.models import build_model

    def step():
        torch.manual_seed(0)
        model = build_model(model_name, input_shape=(1, 8, 8), num_classes=5, width=32, channels=4,
                            d_model=16, n_heads=2, n_layers=1)
        if params == "fp16":  # fp16-master
            model.half()
        x, y = torch.randn(3, 1, 8, 8), torch.tensor([0, 3, 4])
        with Record() as rec:
            with scratch(torch.float16, emulate=True):
                loss = F.cross_entropy(model(x), y)
            loss.backward()
        return rec.count("_to_copy"), loss, [p.grad for p in model.parameters()]

    casts, loss, grads = step()
    monkeypatch.setattr(rounded, "SKIP_ROUNDED_OPERANDS", False)
    STATE.frame_cache.clear()  # frames read the switch when they are built
    try:
        casts_every_operand, want_loss, want_grads = step()
    finally:
        STATE.frame_cache.clear()
    # q, k, v and the out-projection's input: 4 operands x (2 casts forward + 2 backward)
    saved = {"simplenet": 0, "mlp": 0, "cnn": 0, "transformer": 16}[model_name]
    assert casts_every_operand - casts == saved
    torch.testing.assert_close(loss, want_loss, rtol=0, atol=0)
    for g, w in zip(grads, want_grads):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w, rtol=0, atol=0)


# emulate=True with low-precision parameters (fp16-master): the activations are fp32 carriers of
# fp16 values, the parameters real fp16 tensors; where the two meet, the parameters are widened
# (exactly) so that the op computes in fp32 as it would on fp32 copies of the parameters.
NORMS = {
    "layer_norm": lambda: nn.LayerNorm(8),
    "batch_norm": lambda: nn.BatchNorm1d(8),
    "group_norm": lambda: nn.GroupNorm(2, 8),
    "linear_then_layer_norm": lambda: nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)),
}


@pytest.mark.parametrize("name", sorted(NORMS))
def test_emulate_widens_low_params_that_meet_fp32_activations(name):
    import copy

    torch.manual_seed(0)
    module = NORMS[name]()
    for p in module.parameters():  # not 1/0: give the affine parameters fp16 rounding work
        nn.init.normal_(p)
    reference = copy.deepcopy(module).half().float()  # fp32 copy of the fp16 values
    module.half()
    x = r16(torch.randn(4, 8))
    with scratch(torch.float16, emulate=True):
        got = module(x)
    want = reference(x) if name != "linear_then_layer_norm" else reference[1](r16(reference[0](x)))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    got.sum().backward()
    want.sum().backward()
    for p, q in zip(module.parameters(), reference.parameters()):
        assert p.grad.dtype == torch.float16  # the gradient reaches the fp16 parameter in fp16
        torch.testing.assert_close(p.grad, q.grad.half(), rtol=0, atol=0)
    for b, c in zip(module.buffers(), reference.buffers()):  # BatchNorm's running statistics
        assert b.dtype == (torch.float16 if b.is_floating_point() else torch.int64)
        torch.testing.assert_close(b, c.to(b.dtype), rtol=0, atol=0)


def test_emulate_writes_in_place_updates_of_widened_tensors_back():
    buf = torch.zeros(3, dtype=torch.float16)
    with scratch(torch.float16, emulate=True):
        out = buf.add_(torch.full((3,), 1.5))
        only_low = buf * buf  # no fp32 operand: nothing to widen, fp16 arithmetic as in torch
    assert out is buf and buf.dtype == torch.float16
    torch.testing.assert_close(buf, torch.full((3,), 1.5, dtype=torch.float16), rtol=0, atol=0)
    assert only_low.dtype == torch.float16


@pytest.mark.parametrize("model_name", ["cnn", "transformer"])
def test_emulated_fp16_params_are_close_to_native_fp16(model_name):
    from mixprec.train.models import build_model

    torch.manual_seed(0)
    model = build_model(model_name, input_shape=(1, 8, 8), num_classes=5, channels=4, d_model=16,
                        n_heads=2, n_layers=1).half()
    x, y = torch.randn(3, 1, 8, 8), torch.tensor([0, 3, 4])
    with native(torch.float16):
        want = F.cross_entropy(model(x), y)
    with scratch(torch.float16, emulate=True):
        got = F.cross_entropy(model(x), y)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=5e-3, atol=5e-3)


# ---------------------------------------------------------------------------------------------
# keep_fp32
# ---------------------------------------------------------------------------------------------

def _mlp():
    torch.manual_seed(0)
    return nn.ModuleDict({"body": nn.Sequential(nn.Linear(8, 16), nn.ReLU()), "head": nn.Linear(16, 4)})


def _run(model, x):
    return model["head"](model["body"](x))


def test_keep_fp32_by_name():
    model, x = _mlp(), torch.randn(3, 8)
    with Record() as rec, scratch(keep_fp32=["head"], model=model):
        out = _run(model, x)
        hidden = model["body"](x)
    assert hidden.dtype == torch.bfloat16 and out.dtype == torch.float32
    addmms = [dtypes for op, dtypes in rec.ops if op == "addmm"]
    assert addmms == [("bfloat16",), ("float32",), ("bfloat16",)]
    torch.testing.assert_close(out, model["head"](hidden.float()), rtol=0, atol=0)
    assert not model["head"]._forward_pre_hooks and not model["head"]._forward_hooks


@pytest.mark.parametrize("spec", [nn.LayerNorm, "LayerNorm"], ids=["type", "class_name"])
@pytest.mark.parametrize("with_model", [True, False], ids=["model", "global_hook"])
def test_keep_fp32_by_type(spec, with_model):
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8))
    x = torch.randn(2, 8)
    with scratch(keep_fp32=[spec], model=model if with_model else None):
        h = model[0](x)
        normed = model[1](h)
        out = model[2](normed)
    assert h.dtype == torch.bfloat16 and out.dtype == torch.bfloat16
    assert normed.dtype == torch.float32  # CPU autocast would have left layer_norm in bf16
    torch.testing.assert_close(normed, model[1](h.float()), rtol=0, atol=0)
    assert not model[1]._forward_pre_hooks


def test_keep_fp32_widens_the_low_precision_params_of_a_kept_module():
    # bf16-master keeps the parameters in bf16; a kept LayerNorm gets fp32 inputs from its pre hook
    # and must compute on fp32 copies of its bf16 weights (CPU layer_norm refuses to mix them)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)).bfloat16()
    x = torch.randn(2, 8).bfloat16()
    with scratch(keep_fp32=[nn.LayerNorm], model=model):
        hidden = model[0](x)
        out = model(x)
    ln = model[1]
    assert out.dtype == torch.float32 and ln.weight.dtype == torch.bfloat16
    want = F.layer_norm(hidden.float(), (8,), ln.weight.float(), ln.bias.float())
    torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_keep_fp32_inside_a_disabled_region_does_nothing():
    model = nn.Sequential(nn.Linear(8, 8))
    with scratch(keep_fp32=["0"], model=model), scratch(enabled=False):
        assert model(torch.randn(2, 8).bfloat16().float()).dtype == torch.float32


def test_keep_fp32_errors_name_the_fix():
    with pytest.raises(ValueError, match=r"keep_fp32=\['head', \.\.\.\]\).*pass model="):
        scratch(keep_fp32=["head"])
    with pytest.raises(ValueError, match=r"no submodule or module class 'haed'.*'head'"):
        scratch(keep_fp32=["haed"], model=_mlp())
    with pytest.raises(TypeError, match="entries must be"):
        scratch(keep_fp32=[3], model=_mlp())


def test_exception_inside_a_kept_module_restores_state():
    class Boom(nn.Module):
        def forward(self, x):
            assert STATE.frames[-1].kinds["linear"].value == "fp32"
            raise KeyError("boom")

    model = nn.Sequential(nn.Linear(4, 4), Boom())
    with scratch(keep_fp32=[Boom], model=model):
        with pytest.raises(KeyError):
            model(torch.randn(1, 4))
        assert len(STATE.frames) == 1  # the always_call hook popped its frame
        assert model[0](torch.randn(1, 4)).dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------------
# Nesting, enabled=False, exceptions, decorator
# ---------------------------------------------------------------------------------------------

def test_nesting_inner_context_wins():
    lin, x = nn.Linear(4, 4), torch.randn(2, 4)
    with scratch(torch.bfloat16):
        assert lin(x).dtype == torch.bfloat16 and autocast_dtype() == torch.bfloat16
        with scratch(enabled=False):
            assert lin(x).dtype == torch.float32 and not is_autocast_active()
            with scratch(torch.float16):
                assert lin(x).dtype == torch.float16
            assert lin(x).dtype == torch.float32
        with scratch(torch.float16):
            assert lin(x).dtype == torch.float16
        assert lin(x).dtype == torch.bfloat16
        assert torch._C._len_torch_function_stack() == 1  # one mode, however deep the nesting
    assert lin(x).dtype == torch.float32


def test_enabled_false_is_a_no_op():
    lin, x = nn.Linear(4, 4), torch.randn(2, 4)
    with scratch(enabled=False) as ctx:
        assert torch._C._len_torch_function_stack() == 0
        assert lin(x).dtype == torch.float32 and not is_autocast_active()
    assert ctx.enabled is False


def test_tensors_on_other_devices_are_left_alone():
    lin, x = nn.Linear(4, 4), torch.randn(2, 4)
    with autocast(torch.float16, device_type="cuda"):
        assert lin(x).dtype == torch.float32


@pytest.mark.parametrize("depth", [1, 2])
def test_exception_restores_all_state(depth):
    lin = nn.Linear(4, 4)
    hooks_before = _global_hooks()
    with pytest.raises(RuntimeError, match="inside"):
        with scratch(keep_fp32=[nn.LayerNorm]):  # global hooks too
            assert _global_hooks() == hooks_before + 2
            lin(torch.randn(2, 4))
            assert any(STATE.cache.values())
            if depth == 2:
                with scratch(torch.float16):
                    raise RuntimeError("inside")
            raise RuntimeError("inside")
    assert_clean_state(hooks_before)
    assert lin(torch.randn(2, 4)).dtype == torch.float32


def test_decorator():
    lin = nn.Linear(4, 4)

    @scratch(torch.bfloat16)
    def forward(x, depth=0):
        """Docstring."""
        assert is_autocast_active()
        return forward(x, depth - 1) if depth else lin(x)

    assert forward.__doc__ == "Docstring." and forward.__name__ == "forward"
    assert forward(torch.randn(2, 4), depth=2).dtype == torch.bfloat16
    assert not is_autocast_active()

    @scratch()
    def fails():
        raise ValueError("x")

    with pytest.raises(ValueError):
        fails()


# ---------------------------------------------------------------------------------------------
# Weight-cast cache
# ---------------------------------------------------------------------------------------------

class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(torch.relu(self.lin(x)))  # the same weight twice


def _weight_casts(ctx) -> int:
    torch.manual_seed(0)
    model, x = Tied(), torch.randn(2, 8)
    with Record() as rec, ctx:
        model(x)
    return sum(op == "_to_copy" for op, _ in rec.ops)


def test_emulate_widens_a_low_precision_weight_once_per_context():
    # fp16-master: the fp16 parameters' fp32 carriers are cached like fp32 parameters' roundings
    model, x = Tied().half(), torch.randn(2, 8)
    counts = []
    for cache_enabled in (True, False):
        with Record() as rec, scratch(torch.float16, emulate=True, cache_enabled=cache_enabled):
            model(x)
        counts.append(rec.count("_to_copy"))
    assert counts[1] - counts[0] == 2  # the second use of the weight and of the bias


@pytest.mark.parametrize("cache_enabled", [True, False])
def test_cache_casts_a_shared_weight_once(cache_enabled):
    got = _weight_casts(scratch(cache_enabled=cache_enabled))
    want = _weight_casts(native(cache_enabled=cache_enabled))
    # input, weight, bias on the first call; on the second the (bf16) input needs no cast
    assert got == want == (3 if cache_enabled else 5)


def test_cache_lives_for_the_outermost_context():
    model, x = Tied(), torch.randn(2, 8)
    def cached():
        return sum(len(entries) for entries in STATE.cache.values())

    with scratch():
        model(x)
        assert cached() == 2  # weight and bias
        with scratch(torch.float16):
            model(x)
        assert cached() == 4  # keyed by dtype as well
    assert cached() == 0
    with torch.no_grad():
        model.lin.weight.zero_()
        model.lin.bias.fill_(1.0)
    with scratch():
        assert (model.lin(x) == 1).all()  # a new context casts the updated weights


def test_cast_made_under_no_grad_is_not_reused_with_grad():
    lin, x = nn.Linear(4, 4), torch.randn(2, 4)
    with scratch():
        with torch.no_grad():
            lin(x)
        y = lin(x)
    y.float().sum().backward()
    assert lin.weight.grad is not None and lin.weight.grad.dtype == torch.float32


# ---------------------------------------------------------------------------------------------
# Kinds beyond the CPU lists (exercised with the CUDA lists applied to CPU tensors)
# ---------------------------------------------------------------------------------------------

def cuda_lists_on_cpu() -> CastPolicy:
    import dataclasses

    return dataclasses.replace(default_policy("cuda"), device_type="cpu")


def test_fp32_out_promote_and_composite_kinds():
    xl = torch.randn(4, 8).bfloat16()
    with autocast(torch.bfloat16, policy=cuda_lists_on_cpu()):
        assert F.softmax(xl, -1).dtype == torch.float32  # FP32_OUT: dtype=float32 added
        assert F.softmax(xl, -1, dtype=torch.bfloat16).dtype == torch.bfloat16  # explicit dtype kept
        assert xl.sum().dtype == torch.float32 and xl.norm().dtype == torch.float32
        assert F.layer_norm(xl, (8,)).dtype == torch.float32  # FP32
        assert xl.exp().dtype == torch.float32
        idx = (torch.tensor([0]),)
        assert xl.float().index_put(idx, xl[0]).dtype == torch.float32  # PROMOTE
        assert F.normalize(xl).dtype == torch.float32  # COMPOSITE: its inner norm is FP32_OUT
        mha = nn.MultiheadAttention(8, 2)
        out, weights = mha(xl.float()[:, None], xl.float()[:, None], xl.float()[:, None])
        assert out.dtype == torch.bfloat16 and weights.dtype == torch.float32  # inner softmax


# F.cross_entropy's C++ composite (LossNLL.cpp), one case per branch: (logits shape, target, weight,
# ignore_index, label_smoothing); every case runs with reduction none, mean and sum.
CROSS_ENTROPY_CASES = {
    "index": ((4, 5), "index", False, -100, 0.0),
    "index_1d": ((5,), "index", False, -100, 0.0),
    "index_weight_ignore": ((4, 5), "index", True, 1, 0.0),
    "index_3d": ((2, 5, 3), "index", True, -100, 0.0),
    "index_4d": ((2, 5, 3, 2), "index", False, 2, 0.0),
    "smoothing": ((4, 5), "index", False, -100, 0.1),
    "smoothing_weight_ignore": ((4, 5), "index", True, 1, 0.2),
    "smoothing_5d": ((2, 5, 2, 2, 2), "index", True, 3, 0.1),
    "probs": ((4, 5), "probs", False, -100, 0.0),
    "probs_1d_weight": ((5,), "probs", True, -100, 0.0),
    "probs_weight_smoothing": ((2, 5, 3), "probs", True, -100, 0.3),
    "empty_batch": ((0, 5), "index", True, -100, 0.1),
}


def _cross_entropy_args(case: str, dtype: torch.dtype):
    shape, target_kind, weighted, ignore_index, label_smoothing = CROSS_ENTROPY_CASES[case]
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    class_dim = 0 if len(shape) == 1 else 1
    if target_kind == "probs":
        target = torch.randn(shape).softmax(class_dim)
    else:
        target = torch.randint(0, shape[class_dim], shape[:class_dim] + shape[class_dim + 1:])
        if ignore_index >= 0 and target.numel():
            target.view(-1)[0] = ignore_index
    weight = torch.rand(shape[class_dim], dtype=dtype) if weighted else None
    return x, target, weight, ignore_index, label_smoothing


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", sorted(CROSS_ENTROPY_CASES))
def test_cross_entropy_transcription_is_the_cpp_composite(case, dtype):
    # Without autocast the transcription runs the ATen ops torch's cross_entropy_loss runs, in the same order
    # (only Scalar/Tensor overloads of mul/add/div differ: Python wraps the scalar), with the same values.
    x, target, weight, ignore_index, label_smoothing = _cross_entropy_args(case, dtype)
    for reduction in (0, 1, 2):  # at::Reduction: none, mean, sum
        results = []
        for fn in (torch._C._nn.cross_entropy_loss, cross_entropy_loss):
            x.grad = None
            with Record() as rec:
                out = fn(x, target, weight, reduction, ignore_index, label_smoothing)
                out.float().sum().backward()
            results.append((rec.ops, out, x.grad))
        (want_ops, want, want_grad), (got_ops, got, got_grad) = results
        assert got_ops == want_ops
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(got_grad, want_grad, rtol=0, atol=0)


_IGNORE = 2


def _composite_by_hand(variant: str, x, w, target, probs, low):
    """What CUDA autocast computes for F.cross_entropy(F.linear(x, w), ...): the composite's log_softmax with
    dtype=low (autocast keeps an explicit dtype), its nll_loss in fp32 (on the fp32 list), its sums with
    dtype=float32 (fp32_set_opt_dtype) and the rest by type promotion."""
    lsm = torch.log_softmax(F.linear(x.to(low), w.to(low)), 1, dtype=low)
    if variant == "index":
        return F.nll_loss(lsm.float(), target)
    if variant == "smoothing":  # label_smoothing=0.1, ignore_index=_IGNORE, reduction mean
        nll = F.nll_loss(lsm.float(), target, ignore_index=_IGNORE)
        ignored = target == _IGNORE
        smooth = (-lsm.sum(1, dtype=torch.float32)).masked_fill(ignored, 0.0)
        count = (~ignored).sum()
        return (1 - 0.1) * nll + smooth.sum() / count * (0.1 / 5)
    return -(lsm * probs).sum() / 4  # class probabilities (fp32), mean over 4 rows


@pytest.mark.parametrize("variant", ["index", "smoothing", "probs"])
@pytest.mark.parametrize("low", LOWS, ids=LOW_IDS)
def test_cuda_lists_run_cross_entropys_log_softmax_low_and_its_nll_loss_in_fp32(low, variant):
    # AutocastCUDA has no cross_entropy_loss kernel (AutocastCPU does: all fp32), so on CUDA the composite runs:
    # _log_softmax in the logits' low dtype, nll_loss in fp32 -- not the whole loss in fp32.
    torch.manual_seed(0)
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(5, 8, requires_grad=True)
    target, probs = torch.tensor([0, 2, 4, 1]), torch.randn(4, 5).softmax(1)
    loss_fn = {"index": nn.CrossEntropyLoss(),
               "smoothing": nn.CrossEntropyLoss(ignore_index=_IGNORE, label_smoothing=0.1),
               "probs": nn.CrossEntropyLoss()}[variant]
    with Record() as rec:
        with autocast(low, policy=cuda_lists_on_cpu()):
            got = loss_fn(F.linear(x, w), probs if variant == "probs" else target)
    low_name = str(low)[6:]
    assert [d for op, d in rec.ops if op == "_log_softmax"] == [(low_name,)]
    assert [d for op, d in rec.ops if op == "nll_loss_forward"] == ([] if variant == "probs" else
                                                                    [("float32", "float32")])
    got.backward()
    got_grads = x.grad, w.grad
    x.grad = w.grad = None
    want = _composite_by_hand(variant, x, w, target, probs, low)
    want.backward()
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for g, wg in zip(got_grads, (x.grad, w.grad)):
        torch.testing.assert_close(g, wg, rtol=0, atol=0)
    # the whole loss in fp32, on request
    with Record() as rec, autocast(low, policy=cuda_lists_on_cpu().with_ops(CastKind.FP32, ["cross_entropy_loss"])):
        loss_fn(F.linear(x, w), probs if variant == "probs" else target)
    assert [d for op, d in rec.ops if op == "_log_softmax"] == [("float32",)]


class TinyLM(nn.Module):
    """A pre-norm causal transformer block and a vocabulary head: linear, matmul, softmax, layer_norm, gelu."""

    def __init__(self, d: int = 32, heads: int = 2, vocab: int = 37):
        super().__init__()
        self.heads = heads
        self.inp, self.ln1, self.qkv, self.proj = nn.Linear(d, d), nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln2, self.fc, self.out = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.inp(x)
        q, k, v = self.qkv(self.ln1(h)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        att = (q @ k.transpose(-2, -1) * (d // self.heads) ** -0.5).masked_fill(causal, float("-inf")).softmax(-1)
        h = h + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        h = h + self.out(F.gelu(self.fc(self.ln2(h))))
        return self.head(self.ln_f(h))


@pytest.mark.cuda
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("low", LOWS, ids=LOW_IDS)
def test_transformer_loss_and_backward_match_torch_autocast_cuda(low, label_smoothing):
    torch.manual_seed(0)
    model = TinyLM().cuda()
    x, y = torch.randn(3, 16, 32, device="cuda"), torch.randint(0, 37, (3, 16), device="cuda")
    results = []
    for ctx in (torch.autocast("cuda", dtype=low), autocast(low, device_type="cuda")):
        model.zero_grad(set_to_none=True)
        with ctx:
            logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, 37), y.reshape(-1), label_smoothing=label_smoothing)
        loss.backward()
        results.append((logits, loss, [p.grad for p in model.parameters()]))
    (want_logits, want, want_grads), (got_logits, got, got_grads) = results
    assert got_logits.dtype == want_logits.dtype == low and got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for g, w in zip(got_grads, want_grads):
        assert g.dtype == w.dtype == torch.float32
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_banned_op_raises_with_the_fix():
    policy = CastPolicy("cpu", banned={"binary_cross_entropy"})
    p = torch.rand(4)
    with autocast(policy=policy):
        with pytest.raises(RuntimeError, match="binary_cross_entropy_with_logits"):
            F.binary_cross_entropy(p, p)
    with autocast(device_type="cuda"):  # banned on CUDA only for CUDA tensors
        F.binary_cross_entropy(p, p)


def test_out_argument_is_not_cast():
    a, out = torch.randn(3, 3), torch.empty(3, 3)
    with scratch():
        torch.mm(a, a, out=out)
    torch.testing.assert_close(out, a @ a)


# ---------------------------------------------------------------------------------------------
# Misuse
# ---------------------------------------------------------------------------------------------

def test_misuse_fails_at_once_and_names_the_fix():
    with pytest.raises(ValueError, match=r"autocast\(dtype=torch.float32\).*enabled=False"):
        autocast(torch.float32)
    with pytest.raises(TypeError, match="default_policy"):
        autocast(policy="cpu")
    with pytest.raises(ValueError, match="device types disagree"):
        autocast(device_type="cuda", policy=default_policy("cpu"))


def test_device_type_defaults_to_the_models_device():
    assert autocast(model=nn.Linear(2, 2)).device_type == "cpu"
    assert "autocast(torch.bfloat16, device_type='cpu'" in repr(scratch())
