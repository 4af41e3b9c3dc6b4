import pytest
import torch

from mixprec.autocast import autocast as scratch_autocast
from mixprec.train.attention import SelfAttention, attention
from torch import nn

from mixprec.train.config import ModelConfig
from mixprec.train.models import MODELS, ModelError, build_model, count_parameters

SMALL = dict(width=32, channels=4, d_model=16, n_heads=2, n_layers=1)  # keep the tests fast


def check_forward_backward(model: nn.Module, input_shape, num_classes, batch=3):
    x = torch.randn(batch, *input_shape)
    out = model(x)
    assert out.shape == (batch, num_classes) and out.dtype == torch.float32
    out.square().mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


@pytest.mark.parametrize("input_shape", [(1, 28, 28), (1, 8, 8)])
@pytest.mark.parametrize("name", MODELS)
def test_every_model_builds_and_trains(name, input_shape):
    torch.manual_seed(0)
    model = build_model(name, input_shape=input_shape, num_classes=10, **SMALL)
    assert isinstance(model.head if name != "simplenet" else model.fc, nn.Linear)
    check_forward_backward(model, input_shape, 10)


@pytest.mark.parametrize("name", MODELS)
def test_default_sizes_forward(name):
    model = build_model(name, input_shape=(1, 28, 28), num_classes=10)
    with torch.no_grad():
        assert model(torch.randn(2, 1, 28, 28)).shape == (2, 10)


@pytest.mark.parametrize("input_shape", [(16,), (12, 5), (3, 10, 6)])
def test_transformer_sequences_and_odd_images(input_shape):
    torch.manual_seed(0)
    model = build_model("transformer", input_shape=input_shape, num_classes=3, **SMALL)
    check_forward_backward(model, input_shape, 3)


def test_transformer_patch_choice():
    assert build_model("transformer", input_shape=(1, 28, 28), num_classes=10).patch_size == 7
    assert build_model("transformer", input_shape=(1, 8, 8), num_classes=10).patch_size == 4
    assert build_model("transformer", input_shape=(1, 8, 8), num_classes=10, patch_size=2).patch_size == 2
    assert build_model("transformer", input_shape=(3, 10, 6), num_classes=10).patch_size == 2  # gcd-limited
    model = build_model("transformer", input_shape=(1, 28, 28), num_classes=10, d_model=16, n_heads=2)
    assert model.pos.shape == (1, 16 + 1, 16)  # 4x4 patches + CLS
    assert model.embed.in_features == 49


def test_transformer_is_written_out():
    model = build_model("transformer", input_shape=(1, 8, 8), num_classes=10, **SMALL)
    assert not any(isinstance(m, nn.TransformerEncoderLayer) for m in model.modules())
    attn = [m for m in model.modules() if isinstance(m, SelfAttention)]
    assert len(attn) == SMALL["n_layers"] and not any(isinstance(m, nn.MultiheadAttention) for m in model.modules())


def test_cpu_attention_runs_low_precision_inputs_in_fp32_and_matches_sdpa():
    q, k, v = (torch.randn(2, 2, 5, 8) for _ in range(3))
    low = [t.bfloat16() for t in (q, k, v)]
    ref = torch.nn.functional.scaled_dot_product_attention(*[t.float() for t in low], is_causal=True)
    for ctx in (torch.autocast("cpu", dtype=torch.bfloat16), scratch_autocast(torch.bfloat16, device_type="cpu")):
        with ctx:
            out = attention(*low, causal=True)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out, ref.bfloat16(), rtol=0, atol=0)


def test_transformer_eval_matches_train_mode_without_dropout():
    torch.manual_seed(0)
    model = build_model("transformer", input_shape=(1, 8, 8), num_classes=10, **SMALL)
    x = torch.randn(4, 1, 8, 8)
    train_out = model(x)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x), train_out, rtol=1e-5, atol=1e-6)


def test_simplenet_is_the_tutorial_model():
    model = build_model("simplenet", input_shape=(1, 28, 28), num_classes=10)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears == [model.fc]
    assert (model.fc.in_features, model.fc.out_features) == (784, 10)
    assert count_parameters(model) == 784 * 10 + 10
    assert sum(1 for _ in model.parameters()) == 2
    x = torch.randn(5, 1, 28, 28)
    torch.testing.assert_close(model(x), model.fc(x.view(-1, 784)), rtol=0, atol=0)


def test_sizes_come_from_the_model_config():
    """build_model has no defaults of its own: a name gets ModelConfig's sizes, a section its own."""
    d = ModelConfig()
    mlp = build_model("mlp", input_shape=(1, 8, 8), num_classes=10)
    assert [m.out_features for m in mlp.modules() if isinstance(m, nn.Linear)] == [d.width] * d.depth + [10]
    cfg = ModelConfig(name="mlp", width=12, depth=3)
    torch.manual_seed(0)
    a = build_model(cfg, input_shape=(1, 8, 8), num_classes=10)
    torch.manual_seed(0)
    b = build_model("mlp", input_shape=(1, 8, 8), num_classes=10, width=12, depth=3)
    assert [m.out_features for m in a.modules() if isinstance(m, nn.Linear)] == [12, 12, 12, 10]
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert build_model(cfg, input_shape=(1, 8, 8), num_classes=10, width=5).head.in_features == 5
    with pytest.raises(TypeError, match="widht"):
        build_model("mlp", input_shape=(1, 8, 8), num_classes=10, widht=5)


def test_mlp_and_cnn_structure():
    mlp = build_model("mlp", input_shape=(1, 8, 8), num_classes=10, width=20, depth=3)
    assert [m.out_features for m in mlp.modules() if isinstance(m, nn.Linear)] == [20, 20, 20, 10]
    assert count_parameters(mlp) == (64 * 20 + 20) + 2 * (20 * 20 + 20) + (20 * 10 + 10)
    cnn = build_model("cnn", input_shape=(1, 28, 28), num_classes=10, channels=8)
    assert sum(isinstance(m, nn.BatchNorm2d) for m in cnn.modules()) == 2
    assert cnn.head.in_features == 16 * 7 * 7


@pytest.mark.parametrize("name", MODELS)
def test_init_is_deterministic(name):
    def params(seed):
        torch.manual_seed(seed)
        model = build_model(name, input_shape=(1, 8, 8), num_classes=10, **SMALL)
        return [p.detach().clone() for p in model.parameters()]

    a, b, c = params(0), params(0), params(1)
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    assert not all(torch.equal(p, q) for p, q in zip(a, c))


def test_dropout_only_when_asked():
    off = build_model("transformer", input_shape=(16,), num_classes=2, **SMALL)
    assert not any(isinstance(m, nn.Dropout) for m in off.modules())
    on = build_model("mlp", input_shape=(16,), num_classes=2, dropout=0.1, **SMALL)
    assert any(isinstance(m, nn.Dropout) for m in on.modules())


@pytest.mark.parametrize(
    "name, kwargs, flag",
    [
        ("transformer", dict(d_model=130, n_heads=4), "--n-heads"),
        ("transformer", dict(d_model=0), "--d-model"),
        ("transformer", dict(n_layers=0), "--n-layers"),
        ("transformer", dict(patch_size=-1), "--patch-size"),
        ("transformer", dict(input_shape=(1, 2, 8, 8)), "--model mlp"),
        ("mlp", dict(width=0), "--width"),
        ("mlp", dict(depth=-2), "--depth"),
        ("cnn", dict(channels=0), "--channels"),
        ("cnn", dict(input_shape=(64,)), "--model"),
        ("cnn", dict(input_shape=(1, 2, 2)), "4x4"),
        ("mlp", dict(dropout=1.0), "--dropout"),
        ("resnet", {}, "choose one of: simplenet, mlp, cnn, transformer"),
    ],
)
def test_bad_args_name_the_flag(name, kwargs, flag):
    kwargs = {"input_shape": (1, 28, 28), "num_classes": 10, **kwargs}
    with pytest.raises(ModelError) as e:
        build_model(name, **kwargs)
    assert flag in str(e.value)
    assert isinstance(e.value, ValueError)


def test_unused_options_are_not_checked():
    # a bad transformer flag does not stop an mlp from building
    build_model("mlp", input_shape=(4,), num_classes=2, d_model=130, n_heads=4, width=8)
