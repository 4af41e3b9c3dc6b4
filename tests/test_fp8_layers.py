"""Which linear layers an FP8 recipe converts: where its GEMMs are real, only those where FP8 pays (torchao's
measured size rule, issue 29); emulated, every eligible layer; ``--fp8-layers all`` or a user's filter wins."""

import itertools

import pytest
import torch
from torch import nn

from mixprec.errors import RecipeError
from mixprec.hardware import Capabilities, capabilities
from mixprec.lowp.convert import convert_to_fp8, fp8_pays, plan_fp8_conversion
from mixprec.precision import build_recipe

DIMS = (16, 512, 1024, 1040, 2048, 2064, 4096, 4112, 8192)

H100 = Capabilities(torch.device("cuda"), "H100", tf32=True, fast_bf16=True, fast_fp16=True, fast_fp16_training=True,
                    fp8_matmul=True, rowwise_fp8=True)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_the_pay_rule_is_torchaos(recipe):
    """The copied rule answers as torchao 0.18's own private filter on every (N, K) around its thresholds."""
    utils = pytest.importorskip("torchao.float8.float8_linear_utils")
    theirs = {"tensorwise": utils._auto_filter_for_tensorwise, "rowwise": utils._auto_filter_for_rowwise}[recipe]
    for n, k in itertools.product(DIMS, DIMS):
        linear = nn.Linear(k, n, bias=False, device="meta")
        assert (fp8_pays(recipe, n, k) is None) == theirs(linear, "layer", []), (recipe, n, k)


class Widths(nn.Module):
    def __init__(self):
        super().__init__()
        self.small = nn.Linear(1024, 1024)     # pays in neither
        self.wide_out = nn.Linear(1024, 8192)  # tensorwise pays (N > 1024); rowwise does not (K <= 1024)
        self.big = nn.Linear(8192, 8192)       # pays in both
        self.head = nn.Linear(8192, 16)        # the classifier: never


def _converted(recipe, caps, **options):
    r = build_recipe(recipe, device=caps.device, for_target=caps.device.type == "cuda", capabilities=caps,
                     fp8_impl="scratch", **options)
    with torch.device("meta"):
        model = Widths()
    return set(r.fp8.plan(model).converted), r


@pytest.mark.parametrize("recipe, expected", [("fp8-mixed", {"wide_out", "big"}), ("fp8-rowwise", {"big"})])
def test_real_fp8_converts_only_the_layers_where_it_pays(recipe, expected):
    got, r = _converted(recipe, H100)
    assert got == expected
    assert _converted(recipe, H100, fp8_layers="all")[0] == {"small", "wide_out", "big"}
    with torch.device("meta"):
        skipped = dict(r.fp8.plan(Widths()).skipped)
    assert "too small" in skipped["small"] and "torchao's measured rule" in skipped["small"]


@pytest.mark.parametrize("recipe", ["fp8-mixed", "fp8-rowwise"])
def test_emulated_fp8_converts_every_eligible_layer(recipe):
    """On a CPU the GEMMs are emulated (the point is the numerics), so size does not decide."""
    assert _converted(recipe, capabilities("cpu"))[0] == {"small", "wide_out", "big"}


def test_a_users_filter_wins_over_the_pay_rule():
    with torch.device("meta"):
        model = Widths()
    mine = plan_fp8_conversion(model, module_filter_fn=lambda m, fqn: fqn != "big", pays_only="tensorwise")
    assert set(mine.converted) == {"small", "wide_out", "head"}
    with torch.device("meta"):
        converted = convert_to_fp8(Widths(), pays_only="tensorwise", emulate=True)
    assert [n for n, m in converted.named_children() if type(m) is not nn.Linear] == ["wide_out", "big"]


def test_fp8_layers_is_checked_and_belongs_to_the_fp8_recipes():
    with pytest.raises(RecipeError, match="--fp8-layers 'some'"):
        build_recipe("fp8-mixed", device="cpu", fp8_layers="some")
    with pytest.raises(RecipeError, match="--fp8-layers set"):
        build_recipe("bf16-mixed", device="cpu", fp8_layers="all")


def test_a_plan_for_a_gpu_names_the_layers_kept_out():
    import mixprec

    p = mixprec.plan(precisions=["fp8-mixed"], model="transformer", dataset="synthetic", d_model=1024, n_layers=1,
                     n_heads=8, target="h100-sxm", batch_size=8, synthetic_train=16, synthetic_test=8)
    note = next(n for n in p.recipes[0].notes if "would not pay" in n)
    assert "blocks.0.attn.proj" in note and "blocks.0.fc2" in note and "blocks.0.fc1" not in note
