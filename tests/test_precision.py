import pytest
import torch
from torch import nn

from mixprec.errors import NonFiniteError, RecipeError, ScalerConfigError
from mixprec.precision import ALIASES, RECIPES, ScalerConfig, build_recipe, resolve_recipe


@pytest.mark.parametrize("alias,name", [("amp", "fp16-mixed"), ("16-mixed", "fp16-mixed"), ("fp16", "fp16-mixed"),
                                        ("bf16", "bf16-mixed"), ("32", "fp32"), ("32-true", "fp32"),
                                        ("FP32", "fp32"), ("bf16-true", "bf16-true")])
def test_aliases_resolve(alias, name):
    assert resolve_recipe(alias).name == name


def test_every_alias_points_to_a_recipe():
    assert set(ALIASES.values()) <= set(RECIPES)


def test_unknown_recipe_lists_valid_names():
    with pytest.raises(RecipeError) as e:
        resolve_recipe("fp64")
    msg = str(e.value)
    assert "fp64" in msg and all(n in msg for n in RECIPES) and "amp=fp16-mixed" in msg


@pytest.mark.parametrize("kw,flag", [(dict(init_scale=0), "--init-scale"), (dict(growth_factor=1.0), "--growth-factor"),
                                     (dict(backoff_factor=1.0), "--backoff-factor"),
                                     (dict(growth_interval=0), "--growth-interval")])
def test_bad_scaler_config_names_the_flag(kw, flag):
    with pytest.raises(ScalerConfigError, match=flag):
        build_recipe("amp", scaler=ScalerConfig(**kw))


def test_contradictions():
    with pytest.raises(RecipeError, match="--stochastic-rounding"):
        build_recipe("bf16-mixed", stochastic_rounding=True)
    with pytest.raises(RecipeError, match="--amp-impl"):
        build_recipe("bf16-mixed", amp_impl="native", keep_fp32=("head",))
    with pytest.raises(RecipeError, match="--amp-impl"):
        build_recipe("bf16-mixed", amp_impl="cuda")


def test_auto_impl_picks_emulated_scratch_for_fp16_on_cpu_without_fast_fp16():
    from mixprec import hardware

    r = build_recipe("amp", device="cpu")
    if hardware.has_fast_fp16(torch.device("cpu")):
        assert r.impl == "native"
    else:
        assert r.impl == "scratch" and r.emulate
        assert "EMULATED" in r.describe()
    assert build_recipe("bf16-mixed", device="cpu").impl == "native"
    native = build_recipe("amp", device="cpu", amp_impl="native")
    assert not native.emulate and "EMULATED" not in native.describe()


@pytest.mark.parametrize("name", list(RECIPES))
def test_describe_says_what_and_why(name):
    d = build_recipe(name).describe()
    assert d.startswith(name) and RECIPES[name].summary in d


def _tiny():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


@pytest.mark.parametrize("impl", ["native", "scratch"])
def test_clip_happens_on_true_gradients_not_scaled_ones(impl):
    """SGD lr=1 with clip c: if clipping saw unscaled grads the update norm is exactly c; clipping scaled grads
    (then unscaling) would shrink it by the scale (2**8), and no clipping would leave it at the true norm."""
    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
    recipe = build_recipe("fp16-mixed", amp_impl=impl, scaler=ScalerConfig(init_scale=2.0**8))
    model = recipe.convert_module(_tiny())
    opt = recipe.build_optimizer(model, lambda p: torch.optim.SGD(p, lr=1.0))
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    with recipe.autocast():
        loss = nn.functional.cross_entropy(model(x), y) * 100.0  # true grad norm >> clip
    recipe.backward(loss)
    clip = 1e-2
    res = recipe.step(opt, clip)
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert not res.skipped and res.grad_norm.item() > 10 * clip
    assert res.grad_norm.item() < 1e4  # the *true* norm is reported, not the scaled one
    torch.testing.assert_close((after - before).norm().item(), clip, rtol=1e-3, atol=0)


def test_recipe_without_scaler_raises_before_touching_params_on_nonfinite_loss():
    recipe = build_recipe("bf16-mixed")
    model = recipe.convert_module(_tiny())
    opt = recipe.build_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with recipe.autocast():
        loss = nn.functional.cross_entropy(model(torch.randn(4, 8)), torch.zeros(4, dtype=torch.long)) * float("inf")
    with pytest.raises(NonFiniteError, match="step 7"):
        recipe.backward(loss, step=7)
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k])


@pytest.mark.parametrize("impl", ["native", "scratch"])
def test_scaled_recipe_skips_inf_step_and_backs_off(impl):
    recipe = build_recipe("fp16-mixed", amp_impl=impl, scaler=ScalerConfig(init_scale=1024.0))
    model = recipe.convert_module(_tiny())
    opt = recipe.build_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with recipe.autocast():
        loss = nn.functional.cross_entropy(model(torch.randn(4, 8)), torch.zeros(4, dtype=torch.long))
    recipe.backward(loss * float("inf"))
    res = recipe.step(opt)
    assert res.skipped and recipe.loss_scale() == 512.0
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k])


def test_run_context_restores_matmul_precision():
    before = torch.get_float32_matmul_precision()
    r = build_recipe("tf32")
    with pytest.raises(KeyError):
        with r.run_context():
            # TF32 only exists on CUDA tensor cores; on CPU the recipe runs as fp32
            assert torch.get_float32_matmul_precision() == ("high" if r.device.type == "cuda" else "highest")
            raise KeyError("boom")
    assert torch.get_float32_matmul_precision() == before
