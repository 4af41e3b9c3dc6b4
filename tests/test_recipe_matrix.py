"""Every recipe x every built-in model x every --amp-impl: two real training steps, then the recipe's facts.

Exit 0 is not enough (a recipe that silently trained in fp32 would pass), so each case builds the run
in-process with the trainer's own build path (``build_run``), takes two steps with the trainer's step,
and checks what actually happened against the table below, written from the documented recipe table
(docs/architecture.md), not read from the recipe object:

- the dtype of every parameter, and of the gradients backward produced for them;
- the dtype a Linear's output has under the recipe's autocast (a forward hook), which mechanism was
  active there (torch.autocast, mixprec's autocast, none), and for emulated fp16 that the fp32 output
  holds fp16 values;
- fp32 master weights: the optimizer steps fp32 copies, not the model's parameters;
- loss scaling: the gradient backward produced is ``init_scale`` times the one the optimizer stepped;
- FP8/FP4 layers exactly where the recipe converts them, of the class that runs its GEMMs
  (:class:`mixprec.lowp.fp8.Fp8Linear` per tensor, :class:`mixprec.lowp.block.BlockLinear` for the block-scaled
  recipes; torchao's layers under ``--fp8-impl torchao``), and the formats each GEMM quantises to.

What ``--amp-impl auto`` picks depends on the CPU (fast fp16 kernels or not): the expectation is derived
from :mod:`mixprec.hardware`, and both answers are checked on any machine by patching it. One CLI smoke
test per model (slow) keeps the command line itself covered.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from mixprec import hardware
from mixprec.autocast import autocast_dtype, is_autocast_active
from mixprec.lowp.block import BlockLinear
from mixprec.lowp.fp8 import Fp8Linear
from mixprec.precision import AMP_IMPLS, RECIPES
from mixprec.train.build import build_run
from mixprec.train.config import TrainConfig
from mixprec.train.models import MODELS
from mixprec.train.step import train_step

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
CPU = torch.device("cpu")
INIT_SCALE = 256.0
"""Passed to loss-scaled recipes: small enough that fp16 gradients of these tiny models never overflow
(no skipped step), distinct from the default so a recipe ignoring it is caught."""


@dataclasses.dataclass(frozen=True)
class Expected:
    params: torch.dtype
    """Dtype of every floating parameter (and of the gradients backward produces for them)."""
    compute: torch.dtype | None
    """Dtype of low-precision ops under the recipe's autocast; None: no autocast at all."""
    scaled: bool
    """Dynamic loss scaling."""
    masters: bool
    """The optimizer steps fp32 master copies of the (low-precision) parameters."""
    fp8: tuple[type, int, tuple[str, str, str]] | None = None
    """FP8/FP4 recipes: the layer class, the multiple in/out features need, and the formats of ``(x, W, dy)`` in
    the forward GEMM, of ``dy`` in ``dx``, and of ``dy`` in ``dW`` (docs: the recipe table of lowp/recipes.py)."""


EXPECTED = {
    "fp32": Expected(params=F32, compute=None, scaled=False, masters=False),
    "tf32": Expected(params=F32, compute=None, scaled=False, masters=False),
    "fp16-mixed": Expected(params=F32, compute=F16, scaled=True, masters=False),
    "bf16-mixed": Expected(params=F32, compute=BF16, scaled=False, masters=False),
    "fp16-master": Expected(params=F16, compute=F16, scaled=True, masters=True),
    "bf16-master": Expected(params=BF16, compute=BF16, scaled=False, masters=True),
    "bf16-true": Expected(params=BF16, compute=BF16, scaled=False, masters=False),
    "fp8-mixed": Expected(params=F32, compute=BF16, scaled=False, masters=False,
                          fp8=(Fp8Linear, 16, ("e4m3-tensor", "e4m3-tensor", "e5m2-tensor"))),
    "fp8-rowwise": Expected(params=F32, compute=BF16, scaled=False, masters=False,
                            fp8=(BlockLinear, 16, ("e4m3-row", "e4m3-row", "e4m3-row"))),
    "mxfp8": Expected(params=F32, compute=BF16, scaled=False, masters=False,
                      fp8=(BlockLinear, 32, ("mxfp8", "mxfp8", "mxfp8"))),
    "mxfp4": Expected(params=F32, compute=BF16, scaled=False, masters=False,
                      fp8=(BlockLinear, 32, ("mxfp4", "mxfp4", "mxfp4"))),
    "nvfp4": Expected(params=F32, compute=BF16, scaled=False, masters=False,
                      fp8=(BlockLinear, 16, ("nvfp4", "nvfp4", "nvfp4"))),
}

MODEL_FLAGS = {  # tiny, but wide enough (multiples of 32) that FP8 and MX convert some layers
    "simplenet": {},
    "mlp": {"width": 32, "depth": 1},
    "cnn": {"channels": 2},
    "transformer": {"d_model": 32, "n_heads": 2, "n_layers": 1, "patch_size": 4},
}
FP8_LAYERS = {  # in/out features multiples of 16 (FP8, NVFP4) or 32 (MX); the classifier (fc/head) stays out
    16: {"simplenet": set(), "mlp": {"body.0"}, "cnn": set(),
         "transformer": {"embed", "blocks.0.attn.qkv", "blocks.0.attn.proj", "blocks.0.fc1", "blocks.0.fc2"}},
    32: {"simplenet": set(), "mlp": {"body.0"}, "cnn": set(),  # the transformer's embed is 16 (4x4 patch) -> 32
         "transformer": {"blocks.0.attn.qkv", "blocks.0.attn.proj", "blocks.0.fc1", "blocks.0.fc2"}},
}
DATA_FLAGS = {"dataset": "synthetic", "synthetic_train": 8, "synthetic_test": 4, "synthetic_shape": [1, 8, 8],
              "batch_size": 4}
RUN_FLAGS = {"epochs": 1, "max_steps": 2, "log_every": 0, "progress": "off", "device": "cpu"}


def test_the_table_covers_every_recipe_and_model():
    assert set(EXPECTED) == set(RECIPES)
    assert set(MODEL_FLAGS) == set(FP8_LAYERS[16]) == set(FP8_LAYERS[32]) == set(MODELS)


def mechanism(recipe: str, impl: str) -> str:
    """``none``, ``native`` or ``scratch``: the autocast the recipe runs under (docs: --amp-impl auto is native
    except fp16 on a CPU, and bf16 on a CPU without bf16 kernels, which get mixprec's autocast emulating them)."""
    e = EXPECTED[recipe]
    if e.compute is None:
        return "none"
    if impl == "auto":
        return "scratch" if _slow(e.compute) else "native"
    return impl


def _slow(dtype) -> bool:
    """Whether this CPU runs real ``dtype`` steps slowly, written out here from the hardware answers."""
    if dtype == F16:
        return not hardware.has_fast_fp16_training(CPU)
    return dtype == torch.bfloat16 and not hardware.has_bf16_kernels(CPU)


def emulated(recipe: str, impl: str) -> bool:
    """Emulated: fp32 tensors holding low-precision values (mixprec's autocast where the dtype is slow)."""
    e = EXPECTED[recipe]
    return mechanism(recipe, impl) == "scratch" and e.compute is not None and _slow(e.compute)


@dataclasses.dataclass
class Observed:
    linear_out: list = dataclasses.field(default_factory=list)
    """(dtype, torch autocast on, mixprec autocast dtype, output) of the first Linear, per forward."""
    grads: dict = dataclasses.field(default_factory=dict)
    """parameter name -> the gradient backward produced for it in the last step."""
    skipped: list = dataclasses.field(default_factory=list)


def two_steps(recipe: str, model: str, impl: str, **extra) -> tuple:
    """Build the run like ``mixprec train`` does and take two steps; returns (run, initial params, Observed)."""
    flags = dict(precision=recipe, amp_impl=impl, model=model, **MODEL_FLAGS[model], **DATA_FLAGS, **RUN_FLAGS,
                 **extra)
    if EXPECTED[recipe].scaled:
        flags["init_scale"] = INIT_SCALE
    run = build_run(TrainConfig.from_flags(**flags))
    seen = Observed()
    first_linear = next(m for m in run.model.modules() if isinstance(m, nn.Linear))

    def on_forward(module, inputs, out):
        seen.linear_out.append((out.dtype, torch.is_autocast_enabled("cpu"),
                                autocast_dtype() if is_autocast_active() else None, out.detach().clone()))

    first_linear.register_forward_hook(on_forward)
    for name, p in run.model.named_parameters():
        p.register_hook(lambda g, name=name: seen.grads.__setitem__(name, g.detach().clone()))
    before = {n: p.detach().clone() for n, p in run.model.named_parameters()}
    batches = iter(run.train_loader)
    with run.recipe.run_context():
        for step in (1, 2):
            xb, yb = next(batches)
            _, result = train_step(run.ctx, xb, yb, step=step)
            seen.skipped.append(result.skipped)
    return run, before, seen


@pytest.mark.parametrize("impl", AMP_IMPLS)
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_recipe_trains_with_its_own_numerics(one_thread, recipe, model, impl):
    check_facts(recipe, model, impl)


@pytest.mark.parametrize("impl", AMP_IMPLS)
@pytest.mark.parametrize("fast_fp16", [True, False], ids=["fast-fp16-cpu", "no-fast-fp16-cpu"])
@pytest.mark.parametrize("recipe", ["fp16-mixed", "fp16-master"])
def test_fp16_recipes_on_either_kind_of_cpu(one_thread, monkeypatch, recipe, fast_fp16, impl):
    """Whichever CPU runs the suite, both of its answers: fast fp16 kernels (auto -> torch.autocast in real
    fp16) and none (auto -> mixprec's autocast emulating fp16: fp32 tensors holding fp16 values)."""
    monkeypatch.setattr(hardware, "has_fast_fp16_training", lambda device: fast_fp16)
    assert mechanism(recipe, "auto") == ("native" if fast_fp16 else "scratch")
    assert emulated(recipe, "scratch") == (not fast_fp16)
    check_facts(recipe, "mlp", impl)


@pytest.mark.parametrize("impl", AMP_IMPLS)
@pytest.mark.parametrize("bf16_kernels", [True, False], ids=["avx512-cpu", "avx2-cpu"])
@pytest.mark.parametrize("recipe", ["bf16-mixed", "bf16-master", "bf16-true"])
def test_bf16_recipes_on_either_kind_of_cpu(one_thread, monkeypatch, recipe, bf16_kernels, impl):
    """Whichever CPU runs the suite, both of its answers: bf16 kernels (oneDNN from AVX-512 on: auto ->
    torch.autocast in real bf16) and none (an AVX2-only CPU, whose bf16 GEMM is a scalar fallback: auto ->
    mixprec's autocast emulating bf16, fp32 tensors holding bf16 values)."""
    monkeypatch.setattr(hardware, "has_bf16_kernels", lambda device: bf16_kernels)
    assert mechanism(recipe, "auto") == ("native" if bf16_kernels else "scratch")
    assert emulated(recipe, "scratch") == (not bf16_kernels)
    check_facts(recipe, "mlp", impl)


def check_facts(recipe: str, model: str, impl: str) -> None:
    e = EXPECTED[recipe]
    run, before, seen = two_steps(recipe, model, impl)
    params = dict(run.model.named_parameters())

    # it trained: two steps taken, none skipped, the weights moved
    assert seen.skipped == [False, False]
    assert any(not torch.equal(before[n], p.detach()) for n, p in params.items())

    # where parameters live, and the dtype of the gradients backward gives them
    assert {p.dtype for p in params.values()} == {e.params}
    assert set(seen.grads) == set(params)
    assert {g.dtype for g in seen.grads.values()} == {e.params}

    # the Linear's output under the recipe's autocast, and which autocast that was
    mech, emu = mechanism(recipe, impl), emulated(recipe, impl)
    assert len(seen.linear_out) == 2
    for dtype, torch_autocast, mixprec_autocast, out in seen.linear_out:
        assert torch_autocast == (mech == "native")
        assert mixprec_autocast == (e.compute if mech == "scratch" else None)
        if e.compute is None or emu:
            assert dtype == F32
            low_values = torch.equal(out, out.to(e.compute or F16).to(F32))
            assert low_values == emu, "emulated fp16/bf16 must hold its values; fp32 must not be rounded"
        else:
            assert dtype == e.compute

    # fp32 masters: the optimizer steps fp32 copies of the parameters, not the parameters
    stepped = [t for g in run.optimizer.param_groups for t in g["params"]]
    assert len(stepped) == len(params)
    ids = {id(p) for p in params.values()}
    if e.masters:
        assert not any(id(t) in ids for t in stepped)
        assert {t.dtype for t in stepped} == {F32} and {t.grad.dtype for t in stepped} == {F32}
        assert [t.shape for t in stepped] == [p.shape for p in params.values()]
    else:
        assert {id(t) for t in stepped} == ids

    # loss scaling: backward produced init_scale x the gradient the optimizer stepped (1x without a scaler)
    ratios = []
    for name, t in zip(params, stepped):
        produced, applied = seen.grads[name].float(), t.grad.float()
        if applied.abs().sum() > 0:
            ratios.append((produced.norm() / applied.norm()).item())
    assert ratios
    assert ratios == pytest.approx([INIT_SCALE if e.scaled else 1.0] * len(ratios), rel=1e-3)

    # FP8/FP4 layers exactly where the recipe converts them, each running the recipe's formats
    low = {n: m for n, m in run.model.named_modules() if isinstance(m, (Fp8Linear, BlockLinear))}
    if e.fp8 is None:
        assert low == {}
        return
    cls, multiple, (x_fmt, w_fmt, dy_fmt) = e.fp8
    assert set(low) == FP8_LAYERS[multiple][model]
    assert {type(m) for m in low.values()} <= {cls}
    for m in low.values():
        if cls is BlockLinear:
            r = m.recipe
            assert (r.output, r.grad_input[0], r.grad_weight[0]) == ((x_fmt, w_fmt), dy_fmt, dy_fmt)
    assert run.recipe.facts()["fp8_impl"] == "scratch"  # auto on a CPU


SMOKE_RECIPE = {"simplenet": "fp16-mixed", "mlp": "bf16-master", "cnn": "bf16-mixed", "transformer": "fp8-mixed"}


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_cli_trains_each_model(cli, one_thread, model):
    """The command line end to end, one recipe per model."""
    recipe = SMOKE_RECIPE[model]
    flags = []
    for k, v in {**MODEL_FLAGS[model], **DATA_FLAGS, **RUN_FLAGS}.items():
        flags += [f"--{k.replace('_', '-')}", "x".join(map(str, v)) if isinstance(v, list) else v]
    code, out, err = cli("train", "--precision", recipe, "--model", model, *flags)
    assert code == 0, err
    assert "Traceback" not in out + err and f"| {recipe} |" in out  # the summary table was printed


TORCHAO_LAYER = {"fp8-mixed": "Float8Linear", "fp8-rowwise": "Float8Linear", "mxfp8": "PaddedMXFP8Linear"}
"""The torchao layer each recipe torchao has becomes under --fp8-impl torchao (emulated on a CPU)."""


@pytest.mark.parametrize("model", ["mlp", "transformer"])
@pytest.mark.parametrize("recipe", list(TORCHAO_LAYER))
def test_torchao_runs_the_recipes_it_has(one_thread, recipe, model):
    """--fp8-impl torchao: torchao's layers exactly where mixprec's would be, trained two steps (not skipped)."""
    pytest.importorskip("torchao")
    run, before, seen = two_steps(recipe, model, "native", fp8_impl="torchao")
    assert seen.skipped == [False, False]
    assert any(not torch.equal(before[n], p.detach()) for n, p in run.model.named_parameters())
    tao = {n for n, m in run.model.named_modules() if type(m).__name__ == TORCHAO_LAYER[recipe]}
    assert tao == FP8_LAYERS[EXPECTED[recipe].fp8[1]][model]
    assert run.recipe.facts()["fp8_impl"] == "torchao"


@pytest.mark.cuda
@pytest.mark.parametrize("impl", ["native", "scratch"])
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_every_recipe_takes_two_steps_on_cuda(recipe, impl):
    """Each recipe and mechanism on a GPU: params of the recipe's dtype on the device, the first Linear's output
    in its compute dtype, finite losses, and the weights moved (the CPU matrix above pins the numerics)."""
    run = build_run(TrainConfig.from_flags(precision=recipe, amp_impl=impl, model="mlp", **MODEL_FLAGS["mlp"],
                                           **DATA_FLAGS, **{**RUN_FLAGS, "device": "cuda"}))
    e = EXPECTED[recipe]
    params = dict(run.model.named_parameters())
    assert all(p.device.type == "cuda" and p.dtype == e.params for p in params.values()), recipe
    outs = []
    first_linear = next(m for m in run.model.modules() if isinstance(m, nn.Linear))
    first_linear.register_forward_hook(lambda m, i, o: outs.append(o.dtype))
    before = {n: p.detach().clone() for n, p in params.items()}
    batches = iter(run.train_loader)
    with run.recipe.run_context():
        for step in (1, 2):
            xb, yb = next(batches)
            loss, _ = train_step(run.ctx, xb, yb, step=step)
            assert torch.isfinite(torch.as_tensor(loss)).all()
    assert outs and outs[0] == (e.compute or torch.float32)
    assert any(not torch.equal(before[n], p.detach()) for n, p in params.items())
