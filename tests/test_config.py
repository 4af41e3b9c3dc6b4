"""The sectioned config: flags in and out, the nested form checkpoints store, validation naming the flag."""

import dataclasses
import json
from pathlib import Path

import pytest

from mixprec.errors import ConfigError, RecipeError, ScalerConfigError
from mixprec.precision import ALIASES, RecipeConfig, ScalerConfig
from mixprec.train.config import DataConfig, ModelConfig, OptimConfig, RunConfig, TrainConfig

FIXTURES = Path(__file__).parent / "fixtures"  # written once by main at d16a38d; never regenerate


def test_flags_land_in_their_sections():
    c = TrainConfig.from_flags(precision="amp", model="mlp", width=64, dataset="digits", init_scale=1024.0,
                               lr=0.5, seed=3, keep_fp32=("head",), synthetic_shape=(1, 8, 8))
    assert c.recipe == RecipeConfig(precision="fp16-mixed", scaler=ScalerConfig(init_scale=1024.0),
                                    keep_fp32=("head",))
    assert c.model == ModelConfig(name="mlp", width=64)
    assert c.data == DataConfig(name="digits", synthetic_shape=(1, 8, 8))
    assert c.optim == OptimConfig(lr=0.5)
    assert c.run == RunConfig(seed=3)


def test_sections_are_frozen():
    c = TrainConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.optim.lr = 1.0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.model = ModelConfig()  # type: ignore[misc]


def test_dict_round_trip_is_exact_and_json_shaped():
    c = TrainConfig.from_flags(precision="bf16-true", stochastic_rounding=True, keep_fp32=("a", "b"),
                               synthetic_shape=(3, 4), clip_grad_norm=1.0, out="x")
    d = c.to_dict()
    assert d["recipe"]["scaler"]["init_scale"] == 2.0**16 and d["data"]["synthetic_shape"] == [3, 4]
    assert TrainConfig.from_dict(d) == c
    assert TrainConfig.from_dict(d).flags() == c.flags()


# what main wrote at d16a38d (see tests/fixtures/README.md); its loss was the default of then, cross-entropy,
# stored by name (today's default is auto: the model's own loss, else the task's); its compile was a bool, false:
# off (today's default is auto)
FIXTURE_CONFIG = TrainConfig(model=ModelConfig(name="cnn", channels=8, loss="cross-entropy"),
                             data=DataConfig(synthetic_shape=(1, 8, 8)),
                             recipe=RecipeConfig(precision="fp16-mixed", scaler=ScalerConfig(growth_interval=7),
                                                 keep_fp32=("head",)),
                             optim=OptimConfig(lr=0.5), run=RunConfig(compile="off"))


@pytest.mark.parametrize("name", ["main_d16a38d_config_flat.json", "main_d16a38d_config_nested.json"])
def test_configs_written_by_an_older_version_still_read(name):
    """Flat flags (version-1 checkpoints) and the nested form, as an older mixprec wrote them to disk."""
    stored = json.loads((FIXTURES / name).read_text())
    assert stored.get("precision", stored.get("recipe", {}).get("precision")) == "amp"  # the alias, as typed then
    assert TrainConfig.from_dict(stored) == FIXTURE_CONFIG


@pytest.mark.parametrize("alias", sorted(ALIASES))
def test_configs_hold_canonical_recipe_names(alias):
    c = TrainConfig.from_flags(precision=alias)
    assert c.recipe.precision == ALIASES[alias] and c == TrainConfig.from_flags(precision=ALIASES[alias])
    assert c.to_dict()["recipe"]["precision"] == ALIASES[alias]
    assert TrainConfig.from_flags(precision="fp7").recipe.precision == "fp7"  # left for validate() to name


def test_with_flags_changes_only_what_it_names():
    c = TrainConfig.from_flags(model="mlp", lr=0.1)
    d = c.with_flags(seed=5)
    assert d.run.seed == 5 and d.model == c.model and d.optim == c.optim and c.run.seed == 0


@pytest.mark.parametrize("bad", [{"precison": "fp32"}, {"optim": {"lr": 1}, "oops": {}}])
def test_unknown_settings_are_named(bad):
    with pytest.raises(ConfigError, match="unknown"):
        if "oops" in bad:
            TrainConfig.from_dict(bad)
        else:
            TrainConfig.from_flags(**bad)


@pytest.mark.parametrize("flags, match", [
    ({"lr": float("nan")}, "--lr"),
    ({"momentum": float("nan")}, "--momentum"),
    ({"weight_decay": -1.0}, "--weight-decay"),
    ({"epochs": 0}, "--epochs"),
    ({"strategy": "zero"}, "--strategy"),
    ({"checkpoint_every": 3}, "--checkpoint-every needs --out"),
    ({"grad_accum": 2.5}, "--grad-accum"),
    ({"width": -1}, "--width"),
    ({"synthetic_shape": (0, 3)}, "--synthetic-shape"),
    ({"epochs": 2.5}, "--epochs must be a positive integer"),
    ({"num_workers": -1}, "--num-workers must be an integer >= 0"),
    ({"progress": "maybe"}, "--progress"),
    ({"log_every": -1}, "--log-every"),
    ({"max_steps": 0}, "--max-steps"),
])
def test_validation_names_the_flag(flags, match):
    with pytest.raises(ConfigError, match=match):
        TrainConfig.from_flags(**flags).validate()


def test_recipe_section_validates_name_and_scaler():
    with pytest.raises(RecipeError, match="unknown precision"):
        TrainConfig.from_flags(precision="fp7").validate()
    with pytest.raises(ScalerConfigError, match="--growth-factor"):
        TrainConfig.from_flags(growth_factor=0.5).validate()


def test_for_recipe_drops_stochastic_rounding_where_params_are_fp32():
    rc = RecipeConfig(stochastic_rounding=True)
    keep, notes = rc.for_recipe("bf16-true")
    drop, notes2 = rc.for_recipe("amp")
    assert keep.stochastic_rounding and not notes and keep.precision == "bf16-true"
    assert not drop.stochastic_rounding and "does not apply" in notes2[0] and drop.precision == "fp16-mixed"


@pytest.mark.parametrize("flags, match", [
    ({"init_scale": float("inf")}, "--init-scale"),
    ({"growth_factor": float("nan")}, "--growth-factor"),
    ({"growth_interval": 2.5}, "--growth-interval"),
    ({"growth_interval": "10"}, "--growth-interval"),
])
def test_scaler_section_uses_the_scalers_own_validation(flags, match):
    with pytest.raises(ScalerConfigError, match=match):
        TrainConfig.from_flags(**flags).validate()
