"""Tests for mixprec.master.MasterWeights.

Tiers: exact (``torch.equal``) where the arithmetic is identical (masters vs an fp32 reference fed
the same gradients; write-back vs the plain cast; checkpoint resume; scaler parity with
``torch.amp.GradScaler``); a 5-sigma bound for the stochastic-rounding mean.
"""

from __future__ import annotations

import io
import math

import pytest
import torch
from torch import nn

from mixprec.formats import get_format
from mixprec.master import MasterWeights
from mixprec.scaler import DynamicLossScaler


pytestmark = pytest.mark.usefixtures("one_thread")


def _roundtrip(obj: object) -> object:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _model(dtype: torch.dtype, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(dtype)


# ---------------------------------------------------------------- construction


def test_masters_are_fp32_leaves_in_order_and_fp32_params_are_shared() -> None:
    model = _model(torch.bfloat16)
    model[2].bias.data = model[2].bias.data.float()  # one param kept in fp32
    mw = MasterWeights(model)
    params = list(model.parameters())
    assert len(mw.master_params) == len(params) == len(mw.model_params)
    for p, m in zip(params, mw.master_params):
        assert m.dtype == torch.float32 and m.is_leaf and m.shape == p.shape
        assert torch.equal(m, p.float())
        if p.dtype == torch.float32:
            assert m is p
        else:
            assert m.data_ptr() != p.data_ptr()
    low = [p for p in params if p.dtype == torch.bfloat16]
    assert mw.nbytes() == 4 * sum(p.numel() for p in low)
    assert MasterWeights(_model(torch.float32)).nbytes() == 0


def test_constructor_rejects_misuse() -> None:
    w = nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="rounding='truncate'"):
        MasterWeights([w], rounding="truncate")
    with pytest.raises(ValueError, match="appears twice"):
        MasterWeights([w, w])
    with pytest.raises(TypeError, match="pass a module or a list"):
        MasterWeights(w)
    with pytest.raises(TypeError, match="not a floating-point tensor"):
        MasterWeights([torch.zeros(3, dtype=torch.int64)])


# ---------------------------------------------------------------- exact tier


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sgd_through_masters_equals_fp32_run_then_rounding(dtype: torch.dtype) -> None:
    """Fed the same low-precision gradients, the masters follow the fp32 reference bit for bit and
    the model holds exactly the rounded reference after every step."""
    g = torch.Generator().manual_seed(0)
    w0 = (torch.randn(256, generator=g) * 3).to(dtype)
    low = nn.Parameter(w0.clone())
    ref = nn.Parameter(w0.float())
    mw = MasterWeights([low])
    opt = torch.optim.SGD(mw.master_params, lr=0.01, momentum=0.9, weight_decay=1e-3)
    ref_opt = torch.optim.SGD([ref], lr=0.01, momentum=0.9, weight_decay=1e-3)
    for _ in range(30):
        grad = (torch.randn(256, generator=g) * 0.1).to(dtype)
        low.grad, ref.grad = grad.clone(), grad.float()
        mw.copy_grads_to_master()
        assert low.grad is None and mw.master_params[0].grad.dtype == torch.float32
        assert torch.equal(mw.master_params[0].grad, grad.float())
        opt.step()
        ref_opt.step()
        mw.write_back()
        assert torch.equal(mw.master_params[0], ref)
        assert torch.equal(low.detach(), ref.detach().to(dtype))
    assert not torch.equal(low.detach(), w0)


def test_real_backward_bf16_model_trains_through_masters() -> None:
    model = _model(torch.bfloat16)
    mw = MasterWeights(model)
    opt = torch.optim.Adam(mw.master_params, lr=1e-2)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=g)
    y = x @ torch.randn(8, 4, generator=g) * 0.5  # a learnable target
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x.bfloat16()).float(), y)
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        mw.copy_grads_to_master()
        assert all(torch.equal(m.grad, gr.float()) for m, gr in zip(mw.master_params, grads))
        opt.step()
        mw.write_back()
        assert all(torch.equal(p, m.to(p.dtype)) for p, m in zip(model.parameters(), mw.master_params))
        losses.append(loss.item())
    assert losses[-1] < 0.3 * losses[0]


# ---------------------------------------------------------------- lost updates


LR, STEPS, N = 1e-3, 50, 4096  # |lr * g| = 1e-3 < ulp(1.0 in bf16) / 2 = 2**-9


def _train_unit_grads(params: list[torch.Tensor], step) -> None:
    for _ in range(STEPS):
        for p in params:
            p.grad = torch.ones_like(p)
        step()


def test_lost_update_without_master_weights() -> None:
    w = nn.Parameter(torch.ones(N, dtype=torch.bfloat16))
    opt = torch.optim.SGD([w], lr=LR)
    _train_unit_grads([w], opt.step)
    assert torch.equal(w.detach(), torch.ones(N, dtype=torch.bfloat16))  # 50 updates, all lost


def _master_step(mw: MasterWeights, opt: torch.optim.Optimizer):
    """The optimizer-side step of a master-weight recipe: fp32 grads in, step the masters, round back."""

    def step() -> None:
        mw.copy_grads_to_master()
        opt.step()
        mw.write_back()

    return step


def test_master_weights_keep_the_updates() -> None:
    w = nn.Parameter(torch.ones(N, dtype=torch.bfloat16))
    mw = MasterWeights([w])
    opt = torch.optim.SGD(mw.master_params, lr=LR)

    _train_unit_grads([w], _master_step(mw, opt))
    master = mw.master_params[0]
    assert abs(master[0].item() - (1 - STEPS * LR)) < STEPS * 2.0**-24
    assert torch.equal(w.detach(), master.detach().to(torch.bfloat16))
    assert w[0].item() == pytest.approx(0.95, abs=2.0**-9)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_bf16_true_resync_only_stochastic_rounding_moves_the_mean(rounding: str) -> None:
    """resync=True: no fp32 state survives a step. Nearest rounding loses every update; stochastic
    rounding keeps them in expectation: mean within 5 sigma of 1 - steps * lr, with
    sigma <= ulp * sqrt(steps) / (2 sqrt(N)) (each rounding has variance <= ulp**2 / 4)."""
    w = nn.Parameter(torch.ones(N, dtype=torch.bfloat16))
    mw = MasterWeights([w], rounding=rounding, generator=torch.Generator().manual_seed(0), resync=True)
    opt = torch.optim.SGD(mw.master_params, lr=LR)

    _train_unit_grads([w], _master_step(mw, opt))
    mean = w.detach().double().mean().item()
    if rounding == "nearest":
        assert mean == 1.0
    else:
        ulp = get_format("bf16").eps / 2  # spacing in [0.5, 1)
        sigma = ulp * math.sqrt(STEPS) / (2 * math.sqrt(N))
        assert abs(mean - (1 - STEPS * LR)) < 5 * sigma
        assert w.detach().unique().numel() > 1  # individual weights took different paths


# ---------------------------------------------------------------- checkpoints


def _sr_run(model, mw, opt, batches) -> None:
    for x, y in batches:
        opt.zero_grad()
        nn.functional.mse_loss(model(x.bfloat16()).float(), y).backward()
        mw.copy_grads_to_master()
        opt.step()
        mw.write_back()


def test_state_dict_round_trip_continues_bit_identically() -> None:
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)) for _ in range(10)]
    model = _model(torch.bfloat16)
    mw = MasterWeights(model, rounding="stochastic", generator=torch.Generator().manual_seed(3))
    opt = torch.optim.Adam(mw.master_params, lr=1e-2)
    _sr_run(model, mw, opt, batches[:5])

    saved = _roundtrip({"model": model.state_dict(), "master": mw.state_dict(), "opt": opt.state_dict()})
    assert set(saved["master"]) == {"master_params", "rounding", "resync", "generator_state"}
    model2 = _model(torch.bfloat16, seed=123)
    model2.load_state_dict(saved["model"])
    mw2 = MasterWeights(model2, rounding="stochastic", generator=torch.Generator().manual_seed(999))
    mw2.load_state_dict(saved["master"])
    opt2 = torch.optim.Adam(mw2.master_params, lr=1e-2)
    opt2.load_state_dict(saved["opt"])

    _sr_run(model, mw, opt, batches[5:])
    _sr_run(model2, mw2, opt2, batches[5:])
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(mw.master_params, mw2.master_params))


def test_load_state_dict_rejects_mismatches() -> None:
    mw = MasterWeights(_model(torch.bfloat16))
    with pytest.raises(ValueError, match="expected the dict returned by MasterWeights.state_dict"):
        mw.load_state_dict({"scale": 1.0})
    other = MasterWeights(nn.Linear(3, 3).bfloat16())
    with pytest.raises(ValueError, match="the state has 2 master params, this model has 4"):
        mw.load_state_dict(other.state_dict())
    shared = MasterWeights(_model(torch.float32))
    with pytest.raises(ValueError, match="master param 0 does not match"):
        mw.load_state_dict(shared.state_dict())


# ---------------------------------------------------------------- with the loss scaler


def _scaled_master_step(model, mw, opt, scaler, batch, inject: bool) -> tuple[bool, list[torch.Tensor]]:
    x, y = batch
    opt.zero_grad()
    scaler.scale(nn.functional.mse_loss(model(x.half()).float(), y)).backward()
    if inject:
        model[0].weight.grad[0, 0] = float("inf")
    scaled = [p.grad.clone() for p in model.parameters()]
    mw.copy_grads_to_master()  # scaled fp16 grads -> fp32 masters; unscaling happens there
    before = scaler.get_scale()
    out = scaler.step(opt)
    applied = out if isinstance(scaler, DynamicLossScaler) else not torch.isinf(scaled[0]).any().item()
    if applied:  # the masters' grads were unscaled exactly (power-of-two scale) in fp32
        assert all(torch.equal(m.grad, s.float() / before) for m, s in zip(mw.master_params, scaled))
    scaler.update()
    mw.write_back()
    return applied, scaled


def test_fp16_masters_with_dynamic_loss_scaler_match_grad_scaler() -> None:
    """fp16 model + fp32 masters: our scaler and torch's give bit-identical runs, skips included."""
    g = torch.Generator().manual_seed(4)
    batches = [(torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)) for _ in range(12)]
    inject = {3, 4, 9}
    runs = []
    for scaler in (DynamicLossScaler(init_scale=2.0**12, growth_interval=2),
                   torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=2)):
        model = _model(torch.float16)
        mw = MasterWeights(model)
        opt = torch.optim.SGD(mw.master_params, lr=0.05, momentum=0.9)
        record = []
        for i, batch in enumerate(batches):
            masters_before = [m.detach().clone() for m in mw.master_params]
            applied, _ = _scaled_master_step(model, mw, opt, scaler, batch, i in inject)
            if not applied:
                assert all(torch.equal(a, b) for a, b in zip(masters_before, mw.master_params))
            record.append((applied, scaler.get_scale()))
        runs.append((record, [p.detach().clone() for p in model.parameters()], mw))
    (rec_a, params_a, mw_a), (rec_b, params_b, mw_b) = runs
    assert rec_a == rec_b
    assert [r[0] for r in rec_a] == [i not in inject for i in range(12)]
    assert all(torch.equal(a, b) for a, b in zip(params_a, params_b))
    assert all(torch.equal(a, b) for a, b in zip(mw_a.master_params, mw_b.master_params))
    assert all(p.dtype == torch.float16 for p in params_a)
