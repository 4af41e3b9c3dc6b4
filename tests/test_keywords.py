"""Every public entry point refuses a misspelt keyword in one line: the closest valid name and all of them."""

import pytest
import torch
import torch.nn.functional as F

import mixprec
from mixprec.errors import UsageError


def _model_and_opt():
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _calls():
    from mixprec.bench import compare
    from mixprec.doctor import diagnose
    from mixprec.train import fit

    model, opt = _model_and_opt()
    batch = (torch.randn(8, 4), torch.randint(0, 2, (8,)))
    return {
        "fit": (lambda: fit("mlp", "digits", epoch=2), "epochs"),
        "compare": (lambda: compare("mlp", "digits", precision="bf16-mixed"), "precisions"),
        "plan": (lambda: mixprec.plan(precision="bf16-mixed"), "precisions"),
        "mixprec.watch": (lambda: mixprec.watch(model, opt, evry=5), "every"),
        "diagnose": (lambda: diagnose(model, batch, F.cross_entropy, stesp=2), "steps"),
        "build_recipe": (lambda: mixprec.build_recipe("bf16-mixed", amp_imp="native"), "amp_impl"),
    }


@pytest.mark.parametrize("entry", ["fit", "compare", "plan", "mixprec.watch", "diagnose", "build_recipe"])
def test_a_misspelt_keyword_names_the_closest_valid_one(entry, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing may be written, but if it were, not into the checkout
    call, closest = _calls()[entry]
    with pytest.raises(UsageError) as e:
        call()
    msg = str(e.value)
    assert isinstance(e.value, TypeError) or entry == "mixprec.watch"
    assert "\n" not in msg and f"{entry}(" in msg and f"did you mean {closest}?" in msg and "it takes:" in msg
    assert not any(tmp_path.iterdir())


def test_plan_of_precision_does_not_plan_the_default_recipes_instead():
    """The worst of the wrong keywords: plan(precision=...) raised nothing and planned fp32 and bf16-mixed."""
    with pytest.raises(UsageError, match="did you mean precisions"):
        mixprec.plan(precision="bf16-mixed", model="mlp", dataset="digits")
