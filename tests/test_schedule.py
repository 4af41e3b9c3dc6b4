"""The trainer's learning-rate schedule, user optimizers, --betas and --eval-every (mixprec/train/schedule.py,
optimizers.py): exact schedule values, one-line errors, and resume bit-identical to a run never stopped."""

import json
import math

import pytest
import torch

from conftest import ROOT
from mixprec.errors import CheckpointError, ConfigError
from mixprec.train.build import build_run, optimizer_factory
from mixprec.train.checkpoint import load_checkpoint
from mixprec.train.config import OptimConfig, TrainConfig
from mixprec.train.loop import train
from mixprec.train.resume import resume_config
from mixprec.train.schedule import LRSchedule, planned_steps
from mixprec.train.usercode import UserCodeError

OPT = str(ROOT / "tests" / "userpkg" / "optimizers.py")
BASE = dict(dataset="digits", model="mlp", width=32, depth=1, batch_size=32, log_every=0, progress="off", lr=0.05)
"""45 steps per epoch on digits' 1,438 training samples."""


# ------------------------------------------------------------------------------------------- schedule values

def test_warmup_is_linear_from_zero_then_constant():
    s = LRSchedule(kind="constant", lr=1.0, warmup_steps=4)
    assert [s.rate(k) for k in range(7)] == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_cosine_values():
    s = LRSchedule(kind="cosine", lr=1.0, min_lr=0.0, total_steps=8)
    assert s.rate(0) == 1.0
    assert s.rate(4) == 0.5  # halfway: cos(pi/2) = 0
    assert s.rate(2) == 0.5 * (1 + math.cos(math.pi / 4))
    assert s.rate(8) == 0.0 and s.rate(100) == 0.0  # the floor from the total on


def test_cosine_with_warmup_and_floor():
    s = LRSchedule(kind="cosine", lr=1.0, min_lr=0.5, warmup_steps=2, total_steps=10)
    assert [s.rate(k) for k in (0, 1, 2)] == [0.0, 0.5, 1.0]  # warmup, then the peak
    assert s.rate(6) == 0.75  # halfway through the 8 decay steps: midway between peak and floor
    assert s.rate(10) == 0.5 and s.rate(11) == 0.5


def test_linear_values_and_group_ratios():
    s = LRSchedule(kind="linear", lr=1.0, min_lr=0.25, total_steps=4)
    assert [s.rate(k) for k in range(6)] == [1.0, 0.8125, 0.625, 0.4375, 0.25, 0.25]
    # a group at a tenth of the rate keeps a tenth of it, floor included
    assert s.rate(4, base=0.1) == pytest.approx(0.025, rel=1e-15)
    assert s.rate(2, base=0.1) == pytest.approx(0.0625, rel=1e-15)


def test_apply_sets_every_group_and_tensor_rates_in_place():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([{"params": [a]}, {"params": [b], "lr": torch.tensor(0.5)}], lr=1.0)
    s = LRSchedule.for_optimizer(opt, kind="linear", lr=1.0, total_steps=4)
    lr_tensor = opt.param_groups[1]["lr"]
    s.apply(opt, 2)
    assert opt.param_groups[0]["lr"] == 0.5
    assert opt.param_groups[1]["lr"] is lr_tensor and lr_tensor.item() == 0.25


def test_planned_steps():
    assert planned_steps(2, 45, 1, None) == 90
    assert planned_steps(2, 45, 2, None) == 46  # ceil(45 / 2) optimizer steps per epoch
    assert planned_steps(2, 45, 1, 50) == 50


@pytest.mark.parametrize("flags, words", [
    (dict(lr_schedule="step"), "--lr-schedule"),
    (dict(min_lr=1e-4), "--min-lr 0.0001 applies to --lr-schedule cosine or linear"),
    (dict(lr_schedule="cosine", min_lr=0.1, lr=0.05), "--min-lr 0.1 is above --lr 0.05"),
    (dict(lr_schedule="cosine", lr_warmup_steps=10, lr_total_steps=10), "--lr-warmup-steps 10 leaves no steps"),
    (dict(lr_warmup_steps=-1), "--lr-warmup-steps"),
    (dict(betas=(0.9, 0.95)), "--betas 0.9,0.95 applies to adamw"),
    (dict(optimizer="adamw", betas=(0.9,)), "--betas must be two numbers"),
    (dict(optimizer="adamw", betas=(0.9, 1.0)), "--betas must be two numbers"),
    (dict(optimizer="lion"), "MODULE:CALLABLE"),
    (dict(eval_every=0), "--eval-every"),
])
def test_bad_schedule_optimizer_and_eval_settings_are_refused(flags, words):
    with pytest.raises(ConfigError) as e:
        TrainConfig.from_flags(**flags).validate()
    assert words in str(e.value)


def test_warmup_longer_than_the_run_is_refused_when_the_run_is_built():
    with pytest.raises(ConfigError, match="leaves no steps to decay over"):
        build_run(TrainConfig.from_flags(**BASE, lr_schedule="cosine", lr_warmup_steps=10, max_steps=10))


@pytest.mark.slow
def test_betas_and_bad_flags_exit_2_in_one_line(cli):
    code, _, err = cli("train", "--dataset", "digits", "--optimizer", "sgd", "--betas", "0.9,0.95")
    assert code == 2 and "--betas" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    code, _, err = cli("train", "--dataset", "digits", "--optimizer", f"{OPT}:raises", "--max-steps", "1",
                       "--progress", "off")
    assert code == 2 and "lr must be below 1e-2" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


# ----------------------------------------------------------------------------------------- user optimizers

def _params():
    return [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.ones(2))]


def test_a_user_factory_gets_the_params_and_the_settings_it_declares():
    make = optimizer_factory(OptimConfig(optimizer=f"{OPT}:adamw", lr=0.003, weight_decay=0.1, betas=(0.8, 0.9)))
    params = _params()
    opt = make(params)
    assert isinstance(opt, torch.optim.AdamW) and opt.param_groups[0]["params"] == params
    g = opt.param_groups[0]
    assert (g["lr"], g["weight_decay"], g["betas"], g["foreach"]) == (0.003, 0.1, (0.8, 0.9), False)


def test_a_torch_optimizer_class_is_a_factory_too():
    opt = optimizer_factory(OptimConfig(optimizer="torch.optim:RMSprop", lr=0.02, momentum=0.5))(_params())
    assert isinstance(opt, torch.optim.RMSprop) and opt.param_groups[0]["momentum"] == 0.5


@pytest.mark.parametrize("name, flags, words", [
    ("raises", {}, "raised ValueError: lr must be below 1e-2"),
    ("returns_none", {}, "returned NoneType, not a torch.optim.Optimizer"),
    ("own_tensors", {}, "does not step the 2 tensors it was given"),
    ("no_params", {}, "takes no positional argument"),
    ("sgd_lr_only", {"betas": (0.9, 0.95)}, "takes no betas"),
    ("sgd_lr_only", {"momentum": 0.9}, "--momentum 0.9 would be ignored"),
    ("nope", {}, "has no attribute 'nope'"),
])
def test_optimizer_factory_errors_name_the_factory_in_one_line(name, flags, words):
    ref = f"{OPT}:{name}"
    with pytest.raises(UserCodeError) as e:
        optimizer_factory(OptimConfig(optimizer=ref, **flags))(_params())
    assert words in str(e.value) and ref in str(e.value) and "\n" not in str(e.value)


def test_a_master_weight_recipe_gives_the_user_factory_its_fp32_masters():
    run = build_run(TrainConfig.from_flags(**BASE, precision="bf16-master", optimizer=f"{OPT}:adamw", max_steps=2))
    stepped = [p for g in run.optimizer.param_groups for p in g["params"]]
    assert all(p.dtype == torch.float32 for p in stepped)
    assert all(p.dtype == torch.bfloat16 for p in run.model.parameters())
    assert {id(p) for p in stepped} == {id(p) for p in run.recipe.master.master_params}


@pytest.mark.slow
def test_a_user_factory_with_two_groups_keeps_their_ratio_under_the_schedule():
    run = build_run(TrainConfig.from_flags(**BASE, optimizer=f"{OPT}:two_groups", lr_schedule="cosine",
                                           lr_warmup_steps=3, max_steps=12))
    train(run)
    g0, g1 = run.optimizer.param_groups
    assert g0["lr"] == run.schedule.rate(11) and g0["lr"] < 0.05
    assert g1["lr"] == run.schedule.rate(11, base=0.005)


# ------------------------------------------------------------------------------------ the schedule in a run

@pytest.mark.slow
def test_skipped_steps_count_in_the_schedule():
    """A loss scale far too high makes the first steps overflow and skip; the rate still follows the counter."""
    run = build_run(TrainConfig.from_flags(**BASE, precision="fp16-mixed", init_scale=2.0**24,
                                           lr_schedule="cosine", lr_total_steps=40, max_steps=20))
    result = train(run)
    skipped = result.summary.skipped_steps
    assert 0 < skipped < 19
    assert run.optimizer.param_groups[0]["lr"] == run.schedule.rate(19)
    assert run.schedule.rate(19) != run.schedule.rate(19 - skipped)  # the test could tell the difference


@pytest.mark.slow
def test_the_total_is_the_planned_steps_and_a_resume_keeps_it(tmp_path):
    out = tmp_path / "run"
    run = build_run(TrainConfig.from_flags(**BASE, lr_schedule="linear", min_lr=0.01, epochs=2, max_steps=20,
                                           out=str(out)))
    assert run.config.optim.lr_total_steps == 20  # min(2 epochs x 45 steps, --max-steps 20)
    train(run)
    assert load_checkpoint(out)["config"]["optim"]["lr_total_steps"] == 20
    # the resume extends the run by 10 steps: they train at the floor, the schedule is not re-shaped
    resumed = build_run(resume_config({"resume": str(out), "max_steps": 30}))
    assert resumed.config.optim.lr_total_steps == 20
    train(resumed)
    assert resumed.optimizer.param_groups[0]["lr"] == 0.01
    # the Python API, which passes the whole config without the total, takes the checkpoint's too
    api = build_run(TrainConfig.from_flags(**BASE, lr_schedule="linear", min_lr=0.01, epochs=2, max_steps=30,
                                           out=str(out), resume=str(out)))
    assert api.config.optim.lr_total_steps == 20


@pytest.mark.slow
def test_resume_refuses_a_changed_schedule_or_optimizer_but_not_eval_every(tmp_path):
    out = tmp_path / "run"
    train(TrainConfig.from_flags(**{**BASE, "lr": 0.01}, optimizer="adamw", lr_schedule="cosine", lr_warmup_steps=2,
                                 max_steps=5, out=str(out)))
    for flags, words in [({"lr_schedule": "linear"}, "--lr-schedule 'cosine' in the checkpoint vs 'linear'"),
                         ({"lr_warmup_steps": 3}, "--lr-warmup-steps 2 in the checkpoint vs 3"),
                         ({"min_lr": 0.001}, "--min-lr"), ({"lr_total_steps": 9}, "--lr-total-steps 5"),
                         ({"betas": (0.9, 0.95)}, "--betas"),
                         ({"optimizer": f"{OPT}:adamw"}, "--optimizer 'adamw' in the checkpoint")]:
        with pytest.raises(CheckpointError) as e:
            resume_config({"resume": str(out), **flags})
        assert words in str(e.value)
    assert resume_config({"resume": str(out), "eval_every": 2}).run.eval_every == 2


def _state(path):
    ck = torch.load(path / "last.pt", weights_only=True)
    return ck["model"], ck["optimizer"], ck


def _assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


def _evals(records):
    return [{k: v for k, v in r.items() if k != "eval_time_s"} for r in records]


CASES = {
    "fp32-adamw-cosine": dict(precision="fp32", optimizer="adamw", lr=0.01, betas=(0.9, 0.95), lr_schedule="cosine",
                              lr_warmup_steps=10, min_lr=0.001),
    "fp16-mixed-sgd-linear": dict(precision="fp16-mixed", optimizer="sgd", momentum=0.9, lr_schedule="linear",
                                  lr_warmup_steps=5),
    "bf16-master-user-adamw": dict(precision="bf16-master", optimizer=f"{OPT}:adamw", lr=0.01, lr_schedule="cosine",
                                   lr_warmup_steps=10),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_stopped_and_resumed_between_evals_is_bit_identical(tmp_path, case):
    """Stopped at step 50 (mid-epoch 2, between the evals at 40 and 60) and resumed, vs never stopped: equal
    parameters, optimizer state (rates included), recipe state, epoch records and mid-epoch evaluations."""
    flags = {**BASE, **CASES[case], "epochs": 2, "eval_every": 20, "lr_total_steps": 90}
    full, part = tmp_path / "full", tmp_path / "part"
    r_full = train(TrainConfig.from_flags(**flags, out=str(full), metrics_json=str(tmp_path / "full.json")))
    train(TrainConfig.from_flags(**flags, out=str(part), max_steps=50))
    assert load_checkpoint(part)["global_step"] == 50
    r_part = train(TrainConfig.from_flags(**flags, out=str(part), resume=str(part)))
    (m_full, o_full, c_full), (m_part, o_part, c_part) = _state(full), _state(part)
    _assert_same(m_full, m_part)
    _assert_same(o_full, o_part)
    _assert_same(c_full["recipe"], c_part["recipe"])
    assert [e["step"] for e in r_full.evals] == [20, 40, 60, 80]
    assert _evals(r_full.evals) == _evals(r_part.evals) == _evals(c_part["evals"])
    assert [h.test_loss for h in r_full.history] == [h.test_loss for h in r_part.history]
    assert [h.loss_curve for h in r_full.history] == [h.loss_curve for h in r_part.history]
    doc = json.loads((tmp_path / "full.json").read_text())
    assert _evals(doc["evals"]) == _evals(r_full.evals) and doc["config"]["optim"]["lr_total_steps"] == 90
    assert r_full.evals[1]["lr"] == pytest.approx(LRSchedule(kind=CASES[case]["lr_schedule"], lr=flags["lr"],
                                                             warmup_steps=flags["lr_warmup_steps"],
                                                             min_lr=flags.get("min_lr", 0.0),
                                                             total_steps=90).rate(39), rel=1e-12)


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
def test_fsdp_with_a_user_optimizer_and_a_schedule_resumes_bit_identically(tmp_path):
    """2 ranks, FSDP2 (the factory gets DTensor shards), cosine with warmup: stopped mid-epoch 2 and resumed
    vs never stopped. Also the suite's FSDP resume of a stateful optimizer (tests/test_distributed.py has the
    stateless one): the full state dicts in last.pt end bit-identical, optimizer state included."""
    from test_distributed import _assert_identical, _model, _torchrun

    args = ["--dataset", "digits", "--model", "mlp", "--width", "32", "--depth", "1", "--batch-size", "32",
            "--epochs", "2", "--precision", "bf16-mixed", "--strategy", "fsdp", "--optimizer", f"{OPT}:adamw",
            "--lr", "0.01", "--lr-schedule", "cosine", "--lr-warmup-steps", "5", "--lr-total-steps", "46",
            "--eval-every", "10", "--log-every", "0", "--progress", "off"]
    full, part = tmp_path / "full", tmp_path / "part"
    _torchrun(*args, "--out", full)
    _torchrun(*args, "--out", part, "--max-steps", 30)  # 23 steps per epoch on 2 ranks
    ck = torch.load(part / "last.pt", weights_only=True)
    assert (ck["epoch"], ck["batch"], ck["global_step"], ck["world_size"]) == (1, 7, 30, 2)  # mid-epoch 2
    r = _torchrun(*args, "--out", part, "--resume", part, "--max-steps", "none")
    assert "resumed from" in r.stdout
    _assert_identical(_model(full), _model(part))
    a, b = (torch.load(p / "last.pt", weights_only=True) for p in (full, part))
    _assert_same(a["optimizer"], b["optimizer"])
    assert _evals(a["evals"]) == _evals(b["evals"]) and [e["step"] for e in a["evals"]] == [10, 20, 30, 40]


@pytest.mark.slow
def test_fit_takes_an_optimizer_factory_by_reference(tmp_path):
    from userpkg.optimizers import adamw

    from mixprec.train.api import fit

    m = tmp_path / "m.json"
    result = fit("mlp", "digits", precision="fp32", optimizer=adamw, lr=0.01, lr_schedule="linear", max_steps=4,
                 width=16, depth=1, log_every=0, progress="off", metrics_json=str(m))
    assert result.summary.final_train_loss > 0
    assert json.loads(m.read_text())["config"]["optim"]["optimizer"] == "userpkg.optimizers:adamw"
