"""Tests for mixprec.scaler.DynamicLossScaler.

Tiers: exact (``torch.equal``, float ``==``) against ``torch.amp.GradScaler("cpu")`` on scripted runs
with injected inf/NaN gradients; hand-written expected scale sequences for hysteresis and bounds
plus a long random script against a plain-Python model of DeepSpeed's rule; the state machine's
misuse errors; a 2-process gloo run.
"""

from __future__ import annotations

import copy
import io
import random
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from mixprec.scaler import DynamicLossScaler

# ---------------------------------------------------------------- helpers


pytestmark = pytest.mark.usefixtures("one_thread")


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(32, 8, generator=g), torch.randn(32, 4, generator=g)) for _ in range(n)]


def _inject(model: nn.Module, kind: str | None) -> None:
    if kind is not None:
        model[0].weight.grad[1, 2] = {"inf": float("inf"), "-inf": -float("inf"), "nan": float("nan")}[kind]


def _iteration(model, opt, scaler, batch, inject=None, clip=None) -> bool:
    """One training iteration; returns whether the optimizer step was applied."""
    x, y = batch
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    _inject(model, inject)
    if clip is not None:
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    before = scaler.get_scale()
    out = scaler.step(opt)
    scaler.update()
    if isinstance(scaler, DynamicLossScaler):
        return out
    return not scaler.get_scale() < before  # GradScaler (hysteresis 1): a skip always backs off


def _params_equal(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


SCRIPT = {2: "inf", 3: "nan", 9: "inf", 10: None, 15: "-inf", 16: "nan", 17: "inf"}
N_STEPS = 22

OPTIMIZERS: dict[str, Callable] = {
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-4),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
}


# ---------------------------------------------------------------- parity with torch.amp.GradScaler


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("clip", [None, 0.5], ids=["noclip", "clip"])
@pytest.mark.parametrize(
    "kwargs",
    [{}, {"min_scale": 2.0**-24, "max_scale": 2.0**60}, {"growth_factor": 1.7, "backoff_factor": 0.3}],
    ids=["plain", "general-path", "odd-factors"],
)
def test_matches_grad_scaler_step_by_step(opt_name: str, clip: float | None, kwargs: dict) -> None:
    """Same model, data and injected inf/NaN: same scale, same skips, bit-identical parameters.

    "general-path" has bounds that never bind, so it runs the hysteresis/bounds update logic
    instead of torch's kernel and must still agree exactly."""
    gf, bf = kwargs.get("growth_factor", 2.0), kwargs.get("backoff_factor", 0.5)
    ours_m, ref_m = _model(), _model()
    ours_o, ref_o = OPTIMIZERS[opt_name](ours_m.parameters()), OPTIMIZERS[opt_name](ref_m.parameters())
    ours = DynamicLossScaler(init_scale=2.0**10, growth_interval=3, **kwargs)
    ref = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_factor=gf, backoff_factor=bf, growth_interval=3)
    scales = []
    for i, batch in enumerate(_batches(N_STEPS)):
        a = _iteration(ours_m, ours_o, ours, batch, SCRIPT.get(i), clip)
        b = _iteration(ref_m, ref_o, ref, batch, SCRIPT.get(i), clip)
        assert a == b == (SCRIPT.get(i) is None), f"step {i}"
        assert ours.get_scale() == ref.get_scale(), f"step {i}"
        assert _params_equal(ours_m, ref_m), f"step {i}"
        scales.append(ours.get_scale())
    n_skips = sum(v is not None for v in SCRIPT.values())
    assert ours.skipped_steps == n_skips
    assert sum(b > a for a, b in zip(scales, scales[1:])) >= 3  # growth happened several times


def test_found_inf_is_a_0dim_float32_tensor() -> None:
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    s = DynamicLossScaler()
    assert s.found_inf is None
    x, y = _batches(1)[0]
    s.scale(nn.functional.mse_loss(m(x), y)).backward()
    _inject(m, "inf")
    s.unscale_(opt)
    assert s.found_inf.dim() == 0 and s.found_inf.dtype == torch.float32 and s.found_inf.item() == 1.0


def test_at_most_one_host_sync_per_iteration(monkeypatch: pytest.MonkeyPatch) -> None:
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    s = DynamicLossScaler(hysteresis=2, min_scale=1.0)  # the general update path
    syncs = []
    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        orig = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _o=orig, _n=name: (syncs.append(_n), _o(self, *a))[1])
    for batch in _batches(3):
        x, y = batch
        opt.zero_grad()
        loss = s.scale(nn.functional.mse_loss(m(x), y))
        loss.backward()
        s.unscale_(opt)
        assert syncs == []
        s.step(opt)
        assert syncs == ["item"]
        s.update()
        assert syncs == ["item"]
        syncs.clear()


# ---------------------------------------------------------------- hysteresis and bounds


class _Rig:
    """One parameter whose gradient we set directly: drives the scaler with chosen overflows."""

    def __init__(self, scaler: DynamicLossScaler) -> None:
        self.p = nn.Parameter(torch.zeros(3))
        self.opt = torch.optim.SGD([self.p], lr=1.0)
        self.s = scaler

    def step(self, overflow: bool) -> bool:
        self.s.scale(torch.ones(()))  # marks the start of an iteration (and lazily creates the scale)
        scale = self.s.get_scale()
        self.p.grad = torch.full((3,), float("inf") if overflow else scale)
        applied = self.s.step(self.opt)
        self.s.update()
        return applied


def test_hysteresis_two_scripted() -> None:
    """hysteresis=2: the first overflow is skipped without backing off; the budget refills only
    when the scale grows, so later overflows (consecutive or not) back off until then."""
    rig = _Rig(DynamicLossScaler(init_scale=1024.0, growth_interval=3, hysteresis=2))
    script = "OOO...O.O"
    expected = [1024, 512, 256, 256, 256, 512, 512, 512, 256]
    got, applied = [], []
    for c in script:
        applied.append(rig.step(c == "O"))
        got.append(rig.s.get_scale())
    assert got == expected
    assert applied == [c == "." for c in script]  # every overflow is skipped, absorbed or not
    assert rig.s.skipped_steps == script.count("O")
    assert rig.p.detach().tolist() == [-4.0] * 3  # the four clean unit steps were applied


def test_consecutive_hysteresis_refills_after_every_clean_step() -> None:
    rig = _Rig(DynamicLossScaler(init_scale=1024.0, growth_interval=3, hysteresis=2, consecutive_hysteresis=True))
    script = "OO.O.OO"
    expected = [1024, 512, 512, 512, 512, 512, 256]
    assert [(rig.step(c == "O"), rig.s.get_scale())[1] for c in script] == expected


def _deepspeed_reference(flags, init, gi, h, consecutive, lo, hi, gf=2.0, bf=0.5):
    """DeepSpeed's update_scale hysteresis (cur_hysteresis counts down to 1, refilled on growth or,
    with consecutive_hysteresis, on every clean step) with GradScaler's growth counter and clamps."""
    scale, tracker, cur = init, 0, h
    out = []
    for overflow in flags:
        if overflow:
            if cur == 1:
                scale = max(scale * bf, lo)
            else:
                cur -= 1
            tracker = 0
        else:
            if consecutive:
                cur = h
            tracker += 1
            if tracker == gi:
                scale, tracker, cur = min(scale * gf, hi), 0, h
        out.append(scale)
    return out


@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize("h", [1, 2, 3])
def test_hysteresis_and_bounds_match_python_reference(h: int, consecutive: bool) -> None:
    rnd = random.Random(h * 10 + consecutive)
    flags = [rnd.random() < p for p, n in ((0.6, 40), (0.08, 80), (0.35, 80)) for _ in range(n)]
    lo, hi = 2.0**4, 2.0**12
    rig = _Rig(DynamicLossScaler(init_scale=2.0**8, growth_interval=3, hysteresis=h, min_scale=lo,
                                 max_scale=hi, consecutive_hysteresis=consecutive))
    got = []
    for f in flags:
        assert rig.step(f) == (not f)
        got.append(rig.s.get_scale())
    want = _deepspeed_reference(flags, 2.0**8, 3, h, consecutive, lo, hi)
    assert got == want
    assert min(got) == lo and max(got) == hi  # the script reaches both bounds


def test_general_update_arithmetic_matches_torch_kernel() -> None:
    """Backoff and growth products with arbitrary factors round exactly like torch._amp_update_scale_
    (double product, then float32), on the bounds path that does not use that kernel."""
    rnd = random.Random(0)
    for _ in range(60):
        init = float(torch.tensor(rnd.uniform(1.0, 1e6), dtype=torch.float32))
        gf, bf = rnd.uniform(1.01, 3.0), rnd.uniform(0.01, 0.99)
        for overflow in (True, False):
            ours = _Rig(DynamicLossScaler(init_scale=init, growth_factor=gf, backoff_factor=bf, growth_interval=1,
                                          min_scale=1e-30))
            ours.step(overflow)
            ref = torch.full((), init)
            torch._amp_update_scale_(ref, torch.zeros((), dtype=torch.int32), torch.full((), float(overflow)),
                                     gf, bf, 1)
            assert ours.s.get_scale() == ref.item()


def test_min_and_max_scale_clamp() -> None:
    rig = _Rig(DynamicLossScaler(init_scale=1024.0, min_scale=256.0))
    assert [(rig.step(True), rig.s.get_scale())[1] for _ in range(4)] == [512, 256, 256, 256]
    rig = _Rig(DynamicLossScaler(init_scale=1024.0, growth_interval=1, max_scale=3000.0))
    assert [(rig.step(False), rig.s.get_scale())[1] for _ in range(3)] == [2048, 3000, 3000]


def test_growth_stops_below_float32_overflow() -> None:
    rig = _Rig(DynamicLossScaler(init_scale=2.0**127, growth_interval=1, hysteresis=2))
    rig.step(False)
    assert rig.s.get_scale() == 2.0**127


@pytest.mark.parametrize(
    "kwargs",
    [{"growth_factor": 1.0}, {"backoff_factor": 1.0}, {"growth_interval": 0}, {"hysteresis": 0},
     {"init_scale": 8.0, "min_scale": 16.0}, {"init_scale": 8.0, "max_scale": 4.0}, {"init_scale": 0.0}],
)
def test_constructor_rejects_bad_configuration(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="DynamicLossScaler"):
        DynamicLossScaler(**kwargs)


# ---------------------------------------------------------------- checkpoints


def _roundtrip(obj: object) -> object:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_state_dict_round_trip_continues_identically() -> None:
    kw = {"init_scale": 2.0**10, "growth_interval": 3, "hysteresis": 2, "min_scale": 1.0}
    batches = _batches(N_STEPS)
    m = _model()
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    s = DynamicLossScaler(**kw)
    for i in range(8):
        _iteration(m, opt, s, batches[i], SCRIPT.get(i))
    sd = s.state_dict()
    assert set(sd) == {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker",
                       "hysteresis", "consecutive_hysteresis", "_hysteresis_left", "min_scale", "max_scale",
                       "skipped_steps"}
    m2 = copy.deepcopy(m)
    opt2 = torch.optim.Adam(m2.parameters(), lr=1e-2)
    opt2.load_state_dict(_roundtrip(opt.state_dict()))
    s2 = DynamicLossScaler(init_scale=1.0)  # its config comes from the state dict
    s2.load_state_dict(_roundtrip(sd))
    assert s2.state_dict() == sd
    for i in range(8, N_STEPS):
        a = _iteration(m, opt, s, batches[i], SCRIPT.get(i))
        b = _iteration(m2, opt2, s2, batches[i], SCRIPT.get(i))
        assert a == b and s.get_scale() == s2.get_scale() and _params_equal(m, m2), f"step {i}"
    assert s.state_dict() == s2.state_dict()


def test_loads_a_grad_scaler_state_dict_and_continues_like_it() -> None:
    batches = _batches(N_STEPS)
    ref_m = _model()
    ref_o = torch.optim.SGD(ref_m.parameters(), lr=0.05, momentum=0.9)
    ref = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    for i in range(5):
        _iteration(ref_m, ref_o, ref, batches[i], SCRIPT.get(i))
    m = copy.deepcopy(ref_m)
    o = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    o.load_state_dict(_roundtrip(ref_o.state_dict()))  # a copy: load_state_dict aliases tensors
    s = DynamicLossScaler()
    s.load_state_dict(ref.state_dict())
    for i in range(5, N_STEPS):
        assert _iteration(m, o, s, batches[i], SCRIPT.get(i)) == _iteration(ref_m, ref_o, ref, batches[i], SCRIPT.get(i))
        assert s.get_scale() == ref.get_scale() and _params_equal(m, ref_m)


def test_load_state_dict_rejects_what_is_not_one() -> None:
    s = DynamicLossScaler()
    with pytest.raises(TypeError, match="expected the dict returned by"):
        s.load_state_dict([1.0, 2.0])
    with pytest.raises(RuntimeError, match="empty.*disabled"):
        s.load_state_dict({})
    with pytest.raises(ValueError, match=r"missing keys \['scale'"):
        s.load_state_dict({"state": {}, "param_groups": []})  # e.g. an optimizer's state dict


# ---------------------------------------------------------------- the state machine


def _scaled_backward(m: nn.Module, s: DynamicLossScaler) -> None:
    x, y = _batches(1)[0]
    s.scale(nn.functional.mse_loss(m(x), y)).backward()


def test_misuse_fails_with_a_message_naming_the_fix() -> None:
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    s = DynamicLossScaler()
    nn.functional.mse_loss(m(_batches(1)[0][0]), torch.zeros(32, 4)).backward()
    with pytest.raises(RuntimeError, match=r"step\(optimizer\): scale\(\) has not been called.*scale\(loss\)"):
        s.step(opt)
    with pytest.raises(RuntimeError, match=r"unscale_\(optimizer\): scale\(\) has not been called"):
        s.unscale_(opt)
    with pytest.raises(RuntimeError, match=r"update\(\): scale\(\) has not been called"):
        s.update()

    opt.zero_grad()
    _scaled_backward(m, s)
    with pytest.raises(RuntimeError, match=r"no gradients were unscaled.*call scaler.step\(optimizer\)"):
        s.update()
    s.unscale_(opt)
    with pytest.raises(
        RuntimeError,
        match=r"unscale_\(\) has already been called on this optimizer since the last update\(\); "
        r"call update\(\) after step\(\)",
    ):
        s.unscale_(opt)
    assert s.step(opt)
    with pytest.raises(RuntimeError, match=r"step\(\) has already been called.*call update\(\)"):
        s.step(opt)
    with pytest.raises(RuntimeError, match=r"step\(\) was already called.*unscale_\(\) before step\(\)"):
        s.unscale_(opt)
    with pytest.raises(RuntimeError, match="closure"):
        s.step(opt, closure=lambda: 0.0)
    s.update()

    # After update() the cycle is open again.
    opt.zero_grad()
    _scaled_backward(m, s)
    s.unscale_(opt)
    assert s.step(opt)
    s.update()
    with pytest.raises(TypeError, match=r"scale\(str\)"):
        s.scale("loss")


def test_two_optimizers_share_one_update() -> None:
    m = _model()
    o1 = torch.optim.SGD(m[0].parameters(), lr=0.1)
    o2 = torch.optim.SGD(m[2].parameters(), lr=0.1)
    s = DynamicLossScaler(init_scale=64.0)
    _scaled_backward(m, s)
    _inject(m, "inf")  # only o1's gradients overflow
    assert s.step(o1) is False
    assert s.step(o2) is True
    s.update()
    assert s.get_scale() == 32.0


def test_none_grads_are_skipped_and_sparse_grads_rejected() -> None:
    m = _model()
    frozen = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([*m.parameters(), frozen], lr=0.1)
    s = DynamicLossScaler()
    _scaled_backward(m, s)
    assert s.step(opt)
    assert frozen.grad is None and torch.equal(frozen, torch.ones(3))
    s.update()

    emb = nn.Embedding(10, 4, sparse=True)
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    s.scale(emb(torch.tensor([1, 2])).sum()).backward()
    with pytest.raises(NotImplementedError, match="sparse gradient.*sparse=False"):
        s.unscale_(opt)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_and_mixed_dtype_grads(dtype: torch.dtype) -> None:
    """Grads are unscaled in their own dtype (an exact power-of-two division) and checked."""
    g = torch.Generator().manual_seed(0)
    low = nn.Parameter(torch.zeros(64, dtype=dtype))
    full = nn.Parameter(torch.zeros(64))
    opt = torch.optim.SGD([low, full], lr=1.0)
    s = DynamicLossScaler(init_scale=2.0**8)
    s.scale(torch.ones(()))
    true_low = torch.randn(64, generator=g).to(dtype)
    true_full = torch.randn(64, generator=g)
    low.grad, full.grad = true_low * 256, true_full * 256
    assert s.step(opt)
    assert low.grad.dtype == dtype
    assert torch.equal(low.grad, true_low) and torch.equal(full.grad, true_full)
    assert torch.equal(low.detach(), -true_low)
    s.update()

    s.scale(torch.ones(()))
    low.grad = torch.full((64,), float("inf"), dtype=dtype)
    full.grad = torch.ones(64)
    before = low.detach().clone()
    assert not s.step(opt)
    s.update()
    assert torch.equal(low.detach(), before) and s.get_scale() == 2.0**7


def test_disabled_is_a_no_op() -> None:
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    s = DynamicLossScaler(enabled=False)
    x, y = _batches(1)[0]
    loss = nn.functional.mse_loss(m(x), y)
    assert s.scale(loss) is loss
    loss.backward()
    _inject(m, "inf")
    grad = m[0].weight.grad.clone()
    s.unscale_(opt)
    assert torch.equal(m[0].weight.grad, grad)
    assert s.step(opt) is True  # optimizer.step() was called, inf and all
    assert m[0].weight.isinf().any()
    s.update()
    assert s.get_scale() == 1.0 and s.state_dict() == {} and s.skipped_steps == 0 and s.found_inf is None
    assert not s.is_enabled()
    s.load_state_dict({"anything": 1})
    assert DynamicLossScaler().is_enabled()


# ---------------------------------------------------------------- distributed


def _dist_worker(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        m = _model()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        s = DynamicLossScaler(init_scale=2.0**10, growth_interval=2)
        record = []
        for i, batch in enumerate(_batches(4, seed=10 + rank)):  # different data per rank
            inject = "inf" if (rank == 0 and i == 1) else None
            applied = _iteration(m, opt, s, batch, inject)
            record.append((applied, s.get_scale()))
        torch.save({"record": record, "params": [p.detach() for p in m.parameters()]}, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available in this build")
def test_two_ranks_skip_and_back_off_together(tmp_path) -> None:
    """Only rank 0 sees an inf; the all-reduced found_inf makes both ranks skip and back off."""
    mp.spawn(_dist_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    expected = [(True, 1024.0), (False, 512.0), (True, 512.0), (True, 1024.0)]
    assert r0["record"] == r1["record"] == expected
    # Different data per rank, so params differ, but rank 1 did not step at i=1 either:
    ref = _model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    s = DynamicLossScaler(init_scale=2.0**10, growth_interval=2)
    for i, batch in enumerate(_batches(4, seed=11)):
        _iteration(ref, opt, s, batch, "inf" if i == 1 else None)  # as if rank 1 had seen the inf itself
    assert all(torch.equal(p, q) for p, q in zip(ref.parameters(), r1["params"], strict=True))
