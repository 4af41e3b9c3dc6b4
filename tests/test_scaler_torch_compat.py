"""PyTorch's own grad-scaling tests, ported to mixprec's DynamicLossScaler ("drop-in means drop-in").

Sources: the device-generic ``test_grad_scaling_*`` tests of PyTorch's test/test_torch.py (formerly
test/test_cuda.py: ``_run_scaling_case``, autocast, clipping, clipping with a separate unscale_,
gradient penalty, accumulation, multiple losses/optimizers, ``test_grad_scaler_pass_itself``,
state_dict, ``test_grad_scaling_unscale_sparse``), ``test_grad_scaling_autocast_fused_optimizers`` of test/test_optim.py, and the helpers
``_create_scaling_case`` / ``_create_scaling_models_optimizers`` of
torch/testing/_internal/common_cuda.py, rewritten for pytest on CPU.

Each scenario asserts what PyTorch asserts for its own scaler, with PyTorch's tolerances: the
scaled run (scaler, optionally autocast) matches a control run without scaling that skips the same
optimizer steps by hand, and the final scale is ``128 * growth**unskipped * backoff**skipped``.
On top of that, the same scenario runs with ``torch.amp.GradScaler("cpu")`` side by side and its
parameters, gradients, optimizer state and scale must be bit-identical to DynamicLossScaler's.

Deliberate divergences, each tested: an optimizer whose ``step`` takes GradScaler's deprecated
``grad_scaler=`` argument is refused with a message (GradScaler passes itself with a
FutureWarning); a skipped step never calls a fused optimizer's ``step`` (see mixprec.scaler).
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable
from contextlib import AbstractContextManager
from itertools import chain

import pytest
import torch
from torch import nn

from mixprec.autocast import autocast as mixprec_autocast
from mixprec.scaler import DynamicLossScaler

pytestmark = pytest.mark.usefixtures("one_thread")

EXACT = {"rtol": 0, "atol": 0, "equal_nan": True}

# ---------------------------------------------------------------- PyTorch's helpers


def _create_scaling_models_optimizers(optimizer_ctor=torch.optim.SGD, optimizer_kwargs=None):
    """A module+optimizer that will use scaling and an identical control pair that will not."""
    mod_control = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    mod_scaling = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    with torch.no_grad():
        for c, s in zip(mod_control.parameters(), mod_scaling.parameters(), strict=True):
            s.copy_(c)
    kwargs = {"lr": 1.0, **(optimizer_kwargs or {})}
    return mod_control, mod_scaling, optimizer_ctor(mod_control.parameters(), **kwargs), \
        optimizer_ctor(mod_scaling.parameters(), **kwargs)


def _create_scaling_case(optimizer_ctor=torch.optim.SGD, optimizer_kwargs=None, seed=0):
    torch.manual_seed(seed)
    data = [(torch.randn(8, 8), torch.randn(8, 8)) for _ in range(4)]
    skip_iter = 2
    return (*_create_scaling_models_optimizers(optimizer_ctor, optimizer_kwargs), data, nn.MSELoss(), skip_iter)


def _twin(model: nn.Module, optimizer_ctor=torch.optim.SGD, optimizer_kwargs=None):
    """A bit-identical copy of a fresh model, with its own optimizer (for the GradScaler run)."""
    m = copy.deepcopy(model)
    return m, optimizer_ctor(m.parameters(), **{"lr": 1.0, **(optimizer_kwargs or {})})


def _assert_bit_equal(ma: nn.Module, oa: torch.optim.Optimizer, mb: nn.Module, ob: torch.optim.Optimizer) -> None:
    for p, q in zip(ma.parameters(), mb.parameters(), strict=True):
        torch.testing.assert_close(p, q, **EXACT)
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, **EXACT)
        sa, sb = oa.state[p], ob.state[q]
        assert sa.keys() == sb.keys()
        for k in sa:
            torch.testing.assert_close(sa[k], sb[k], **EXACT, msg=k)


def _run_scaling_case(run: Callable, unskipped: int, skipped: int, atol: float = 1e-7,
                      optimizer_ctor=torch.optim.SGD, optimizer_kwargs=None,
                      control_mismatch: bool = False) -> None:
    """PyTorch's _run_scaling_case, plus the GradScaler twin run.

    ``control_mismatch``: PyTorch expects the comparison with the fp32 control to *fail* (it wraps
    it in assertRaises(AssertionError)), as for Adam/AdamW under autocast; the scale and the
    GradScaler twin are still checked exactly."""
    for enabled in (True, False):  # scaling can be disabled without changing the user's control flow
        mod_control, mod_scaling, opt_control, opt_scaling, data, loss_fn, skip_iter = _create_scaling_case(
            optimizer_ctor, optimizer_kwargs)
        mod_ref, opt_ref = _twin(mod_scaling, optimizer_ctor, optimizer_kwargs)
        # A modest initial scale and an unrealistically large growth factor magnify growth errors.
        kw = {"init_scale": 128.0, "growth_factor": 2.0, "enabled": enabled, "growth_interval": 1}
        scaler, ref = DynamicLossScaler(**kw), torch.amp.GradScaler("cpu", **kw)

        run(data, mod_control, opt_control, scaler, loss_fn, skip_iter, False)
        scaler = run(data, mod_scaling, opt_scaling, scaler, loss_fn, skip_iter, True) or scaler
        ref = run(data, mod_ref, opt_ref, ref, loss_fn, skip_iter, True) or ref

        if enabled:
            net_growth = scaler.get_growth_factor() ** unskipped if unskipped > 0 else 1.0
            net_backoff = scaler.get_backoff_factor() ** skipped if skipped > 0 else 1.0
            assert scaler.get_scale() == 128.0 * net_growth * net_backoff
            assert scaler.skipped_steps == skipped
        else:
            assert scaler.get_scale() == 1.0
        if control_mismatch:
            with pytest.raises(AssertionError):
                _assert_close_to_control(mod_control, opt_control, mod_scaling, opt_scaling, atol)
        else:
            _assert_close_to_control(mod_control, opt_control, mod_scaling, opt_scaling, atol)
        assert scaler.get_scale() == ref.get_scale()
        _assert_bit_equal(mod_scaling, opt_scaling, mod_ref, opt_ref)


def _assert_close_to_control(mod_control, opt_control, mod_scaling, opt_scaling, atol: float) -> None:
    for c, s in zip(mod_control.parameters(), mod_scaling.parameters(), strict=True):
        torch.testing.assert_close(s.grad, c.grad, atol=atol, rtol=1e-5)
        c_state, s_state = opt_control.state[c], opt_scaling.state[s]
        for k in c_state:
            torch.testing.assert_close(s_state[k], c_state[k], atol=atol, rtol=1e-5, msg=k)
        torch.testing.assert_close(s, c, atol=atol, rtol=1e-5)


def _inject_inf(model: nn.Module) -> None:
    with torch.no_grad():
        model[1].weight.grad.fill_(float("inf"))


# ---------------------------------------------------------------- state_dict


@pytest.mark.parametrize("lazy_init_scale", [True, False])
def test_grad_scaling_state_dict(lazy_init_scale: bool) -> None:
    s0 = DynamicLossScaler(init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
    s1 = DynamicLossScaler(init_scale=6.0, growth_factor=7.0, backoff_factor=0.8, growth_interval=1)
    s1._init_growth_tracker = 7  # a value for load_state_dict to overwrite
    if lazy_init_scale:
        s1.scale(torch.full((1,), 4.0))  # a dummy scale() so the scale tensor exists
        assert isinstance(s1._scale, torch.Tensor) and s1._scale.dtype == torch.float32
    s1.load_state_dict(s0.state_dict())
    assert s1.get_scale() == 3.0
    assert s1.get_growth_factor() == 4.0
    assert s1.get_backoff_factor() == 0.5
    assert s1.get_growth_interval() == 2
    assert s1._init_growth_tracker == 0


def test_grad_scaling_state_dict_crosses_with_grad_scaler() -> None:
    """Either scaler loads the other's state (GradScaler reads its five keys of ours)."""
    ref = torch.amp.GradScaler("cpu", init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
    ours = DynamicLossScaler()
    ours.load_state_dict(ref.state_dict())
    assert {k: ours.state_dict()[k] for k in ref.state_dict()} == ref.state_dict()
    back = torch.amp.GradScaler("cpu", init_scale=6.0, growth_factor=7.0, backoff_factor=0.8, growth_interval=1)
    back.load_state_dict(DynamicLossScaler(init_scale=3.0, growth_factor=4.0, growth_interval=2).state_dict())
    assert (back.get_scale(), back.get_growth_factor(), back.get_backoff_factor(), back.get_growth_interval()) \
        == (3.0, 4.0, 0.5, 2)


# ---------------------------------------------------------------- single optimizer scenarios


AUTOCASTS: dict[str, Callable[[bool], AbstractContextManager]] = {
    "torch.autocast": lambda on: torch.autocast("cpu", dtype=torch.float16, enabled=on),
    "mixprec.autocast": lambda on: mixprec_autocast(torch.float16, device_type="cpu", emulate=True, enabled=on),
}


def _autocast_run(autocast: Callable[[bool], AbstractContextManager], try_pickle: bool) -> Callable:
    """PyTorch's _grad_scaling_autocast_test run(): no scaling + no autocast vs scaling + autocast."""

    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        for i, (x, target) in enumerate(data):
            optimizer.zero_grad()
            with autocast(try_scaling_api):
                loss = loss_fn(model(x), target)
            if try_scaling_api:
                scaler.scale(loss).backward()
                if i == skip_iter and scaler.is_enabled():
                    _inject_inf(model)
                scaler.step(optimizer)
                scaler.update()
                if try_pickle:
                    scaler = pickle.loads(pickle.dumps(scaler))
            else:
                loss.backward()
                if (not scaler.is_enabled()) or (i != skip_iter):
                    optimizer.step()
        return scaler

    return run


OPTIMIZER_VARIANTS = [
    (torch.optim.SGD, None), (torch.optim.Adam, None), (torch.optim.AdamW, None),  # test_grad_scaling_autocast
    (torch.optim.SGD, {"foreach": True}), (torch.optim.Adam, {"foreach": True}),  # ..._foreach
    (torch.optim.AdamW, {"foreach": True}),
    (torch.optim.Adam, {"fused": True}), (torch.optim.AdamW, {"fused": True}),  # ..._fused
]


@pytest.mark.parametrize("try_pickle", [False, True], ids=["", "pickled"])
@pytest.mark.parametrize("autocast", list(AUTOCASTS))
@pytest.mark.parametrize("optimizer_ctor,optimizer_kwargs", OPTIMIZER_VARIANTS,
                         ids=[f"{c.__name__}-{next(iter(k or {'plain': 1}))}" for c, k in OPTIMIZER_VARIANTS])
def test_grad_scaling_autocast(optimizer_ctor, optimizer_kwargs, autocast: str, try_pickle: bool) -> None:
    """atol=1e-3: pure fp32 arithmetic against a mixture of fp16 and fp32 (PyTorch's tolerance).
    PyTorch notes that Adam/AdamW (plain, foreach or fused) fail that comparison "with the current
    way of testing" (lr=1 and Adam's normalized steps amplify fp16 rounding) and asserts the failure."""
    _run_scaling_case(_autocast_run(AUTOCASTS[autocast], try_pickle), unskipped=3, skipped=1, atol=1e-3,
                      optimizer_ctor=optimizer_ctor, optimizer_kwargs=optimizer_kwargs,
                      control_mismatch=optimizer_ctor in (torch.optim.Adam, torch.optim.AdamW))


def test_grad_scaling_clipping() -> None:
    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        max_norm = 0.2  # a value that actually clips, per PyTorch's printouts of the grads
        for i, (x, target) in enumerate(data):
            optimizer.zero_grad()
            loss = loss_fn(model(x), target)
            if try_scaling_api:
                scaler.scale(loss).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm * scaler.get_scale())
                if i == skip_iter and scaler.is_enabled():
                    _inject_inf(model)
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                if (not scaler.is_enabled()) or (i != skip_iter):
                    optimizer.step()

    _run_scaling_case(run, unskipped=3, skipped=1, atol=1e-5)


def test_grad_scaling_clipping_separate_unscale() -> None:
    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        max_norm = 0.2
        for i, (x, target) in enumerate(data):
            optimizer.zero_grad()
            loss = loss_fn(model(x), target)
            if try_scaling_api:
                scaler.scale(loss).backward()
                if i == skip_iter and scaler.is_enabled():
                    _inject_inf(model)
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, error_if_nonfinite=False)
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                if (not scaler.is_enabled()) or (i != skip_iter):
                    optimizer.step()

    _run_scaling_case(run, unskipped=3, skipped=1)


def test_grad_scaling_penalty() -> None:
    """A gradient penalty: autograd.grad of the *scaled* loss, unscaled by hand, then backward again."""

    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        for i, (x, target) in enumerate(data):
            optimizer.zero_grad()
            loss = loss_fn(model(x), target)
            if try_scaling_api:
                grad_params = torch.autograd.grad(scaler.scale(loss), model.parameters(), create_graph=True)
                inv_scale = 1.0 / scaler.get_scale()
                grad_params = [p * inv_scale for p in grad_params]
            else:
                grad_params = torch.autograd.grad(loss, model.parameters(), create_graph=True)
            grad_norm = sum(g.pow(2).sum() for g in grad_params).sqrt()
            loss = loss + grad_norm
            if try_scaling_api:
                scaler.scale(loss).backward()
                if i == skip_iter and scaler.is_enabled():
                    _inject_inf(model)
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                if (not scaler.is_enabled()) or (i != skip_iter):
                    optimizer.step()

    _run_scaling_case(run, unskipped=3, skipped=1)


def test_grad_scaling_accumulation() -> None:
    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        iters_to_accumulate = 2
        for i, (x, target) in enumerate(data):
            loss = loss_fn(model(x), target) / iters_to_accumulate
            if try_scaling_api:
                scaler.scale(loss).backward()
            else:
                loss.backward()
            if (i + 1) % iters_to_accumulate == 0:
                if try_scaling_api:
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    optimizer.step()
                optimizer.zero_grad()

    _run_scaling_case(run, unskipped=2, skipped=0)


# ---------------------------------------------------------------- multiple losses and optimizers


@pytest.mark.parametrize("enabled", [True, False])
def test_grad_scaling_multiple(enabled: bool) -> None:
    """Two models and two optimizers, both receiving gradients from two losses; only optimizer1's
    gradients overflow at skip_iter, so only it skips, while the one scale backs off."""
    mod_control0, mod_scaling0, opt_control0, opt_scaling0, data, loss_fn, skip_iter = _create_scaling_case()
    mod_control1, mod_scaling1, opt_control1, opt_scaling1 = _create_scaling_models_optimizers()
    twins = [_twin(mod_scaling0), _twin(mod_scaling1)]
    kw = {"init_scale": 128.0, "growth_factor": 2.0, "enabled": enabled, "growth_interval": 1}
    scaler, ref = DynamicLossScaler(**kw), torch.amp.GradScaler("cpu", **kw)

    def run(model0, model1, optimizer0, optimizer1, scaler, try_scaling_api):
        for i, (x, target) in enumerate(data):
            optimizer0.zero_grad()
            optimizer1.zero_grad()
            output0, output1 = model0(x), model1(x)
            loss0 = loss_fn(0.3 * output0 + 0.7 * output1, target)
            loss1 = loss_fn(0.6 * output0 - 0.4 * output1, target)
            if try_scaling_api:
                scaler.scale(loss0).backward(retain_graph=True)
                scaler.scale(loss1).backward()
                if i == skip_iter and scaler.is_enabled():
                    _inject_inf(model1)
                scaler.unscale_(optimizer0)  # an extra stress test: unscale one optimizer separately
                scaler.step(optimizer0)
                scaler.step(optimizer1)
                scaler.update()
            else:
                loss0.backward(retain_graph=True)
                loss1.backward()
                optimizer0.step()
                if (not scaler.is_enabled()) or (i != skip_iter):
                    optimizer1.step()

    run(mod_control0, mod_control1, opt_control0, opt_control1, scaler, False)
    run(mod_scaling0, mod_scaling1, opt_scaling0, opt_scaling1, scaler, True)
    run(twins[0][0], twins[1][0], twins[0][1], twins[1][1], ref, True)

    # The scale was multiplied by the growth factor 3 times and by the backoff factor once.
    assert scaler.get_scale() == (128.0 * scaler.get_growth_factor() ** 3 * scaler.get_backoff_factor()
                                  if enabled else 1.0)
    assert scaler.skipped_steps == (1 if enabled else 0)
    for c, s in zip(chain(mod_control0.parameters(), mod_control1.parameters()),
                    chain(mod_scaling0.parameters(), mod_scaling1.parameters()), strict=True):
        torch.testing.assert_close(s, c, rtol=1e-5, atol=1e-7)
    assert scaler.get_scale() == ref.get_scale()
    _assert_bit_equal(mod_scaling0, opt_scaling0, *twins[0])
    _assert_bit_equal(mod_scaling1, opt_scaling1, *twins[1])


# ---------------------------------------------------------------- optimizers that unscale inside


class _PlaceHolderOptimizer(torch.optim.Optimizer):
    def __init__(self, params) -> None:
        super().__init__(params, {})
        self._step_supports_amp_scaling = True


def test_grad_scaler_pass_itself() -> None:
    """PyTorch's test: an optimizer declaring _step_supports_amp_scaling gets the scale and the inf
    flag as tensor attributes. Divergence: the deprecated ``grad_scaler=`` keyword (GradScaler passes
    itself, with a FutureWarning) is refused, since such a step() would drive GradScaler's privates."""
    seen = []

    class Optimizer1(_PlaceHolderOptimizer):
        def step(self, closure=None, *, grad_scaler=None):
            raise AssertionError("not called")

    class Optimizer2(_PlaceHolderOptimizer):
        def step(self, closure=None):
            seen.append((self.grad_scale, self.found_inf))

    x = torch.randn(4, 4)
    m = nn.Linear(4, 1)
    o1, o2 = Optimizer1(m.parameters()), Optimizer2(m.parameters())
    scaler = DynamicLossScaler(init_scale=2.0)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = m(x).mean()
    scaler.scale(loss).backward()
    with pytest.raises(RuntimeError, match="grad_scaler argument.*deprecated contract"):
        scaler.step(o1)
    assert scaler.step(o2)
    scaler.update()
    ((grad_scale, found_inf),) = seen
    assert isinstance(grad_scale, torch.Tensor) and grad_scale.item() == 2.0
    assert isinstance(found_inf, torch.Tensor) and found_inf.item() == 0.0
    assert not hasattr(o2, "grad_scale") and not hasattr(o2, "found_inf")


FUSED = [
    (torch.optim.Adam, {"amsgrad": False}), (torch.optim.Adam, {"amsgrad": True}),
    (torch.optim.AdamW, {"amsgrad": False}), (torch.optim.AdamW, {"amsgrad": True, "weight_decay": 0.1}),
    (torch.optim.SGD, {"momentum": 0.9, "lr": 0.1}), (torch.optim.Adagrad, {"lr": 0.1}),
]


@pytest.mark.parametrize("separate_unscale", [False, True], ids=["", "unscale_"])
@pytest.mark.parametrize("optimizer_ctor,optimizer_kwargs", FUSED,
                         ids=[f"{c.__name__}-{i}" for i, (c, _) in enumerate(FUSED)])
def test_grad_scaling_autocast_fused_optimizers(optimizer_ctor, optimizer_kwargs, separate_unscale) -> None:
    """test_optim's comparison of a fused optimizer (which unscales inside its kernel) against the
    same optimizer unfused, each under its own scaler; plus GradScaler + the fused one, bit for bit."""
    torch.manual_seed(20)
    fused_kwargs = {**optimizer_kwargs, "fused": True}
    mod_control, mod_scaling, _, opt_scaling, data, loss_fn, _ = _create_scaling_case(
        optimizer_ctor, fused_kwargs, seed=20)
    opt_control = optimizer_ctor(mod_control.parameters(), **{"lr": 1.0, **optimizer_kwargs, "fused": False})
    mod_ref, opt_ref = _twin(mod_scaling, optimizer_ctor, fused_kwargs)
    scaler_control, scaler_scaling = DynamicLossScaler(init_scale=128.0), DynamicLossScaler(init_scale=128.0)
    ref = torch.amp.GradScaler("cpu", init_scale=128.0)
    # Non-tensor betas: fused computes in float, unfused partly in double (PyTorch's tolerances).
    loose = {"atol": 2e-5, "rtol": 2e-5} if "betas" in opt_control.defaults else {}
    for x, target in data:
        losses = []
        for model, opt, scaler, unscale in ((mod_control, opt_control, scaler_control, False),
                                            (mod_scaling, opt_scaling, scaler_scaling, separate_unscale),
                                            (mod_ref, opt_ref, ref, separate_unscale)):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_fn(model(x), target)
            losses.append(loss)
            scaler.scale(loss).backward()
            if unscale:
                scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
        torch.testing.assert_close(losses[1], losses[0])
        for c, s in zip(mod_control.parameters(), mod_scaling.parameters(), strict=True):
            torch.testing.assert_close(s.grad, c.grad)
            torch.testing.assert_close(s, c, **loose)
            for k in opt_control.state[c]:
                actual = opt_scaling.state[s][k]
                torch.testing.assert_close(actual.squeeze() if k == "step" else actual, opt_control.state[c][k],
                                           **(loose if k in ("exp_avg_sq", "max_exp_avg_sq") else {}))
        _assert_bit_equal(mod_scaling, opt_scaling, mod_ref, opt_ref)
    assert scaler_scaling.get_scale() == ref.get_scale()


@pytest.mark.parametrize("optimizer_ctor", [torch.optim.Adam, torch.optim.AdamW])
@pytest.mark.parametrize("impl", [{"foreach": False, "fused": False}, {"foreach": True, "fused": False},
                                  {"foreach": False, "fused": True}], ids=["forloop", "foreach", "fused"])
def test_params_invalidated_with_grads_invalidated_between_unscale_and_step(optimizer_ctor, impl) -> None:
    """Finite scaled grads, broken by the user after unscale_(): the step is not skipped (the check
    already ran), so the parameters become nonsense -- as with GradScaler."""
    model, _, optimizer, _, data, loss_fn, _ = _create_scaling_case(optimizer_ctor, impl)
    scaler = DynamicLossScaler(init_scale=128.0)
    for i, (x, target) in enumerate(data):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(model(x), target)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        for j, param in enumerate(model.parameters()):  # deliberately break the grads
            param.grad.copy_(torch.inf if j % 2 else torch.nan)
        # applied on the first iteration; afterwards the broken params give non-finite grads
        assert scaler.step(optimizer) == (i == 0)
        scaler.update()
    assert all(p.isnan().any() or p.isinf().any() for p in model.parameters())


def test_grad_scale_will_not_overflow() -> None:
    model = nn.Linear(5, 1)
    optimizer = torch.optim.Adam(model.parameters())
    scaler = DynamicLossScaler(growth_interval=1, growth_factor=2**4, init_scale=1e38)
    optimizer.zero_grad()
    x = torch.randn(1, 5)
    y = 1e-30 * torch.randn(1, 1)
    scaler.scale(((model(x) - y) ** 2).mean()).backward()
    scaler.step(optimizer)
    scaler.update()
    assert scaler._scale != float("inf") and scaler._scale != float("nan")
    assert scaler.get_scale() == torch.tensor(1e38).item()  # the growth to inf was refused


# ---------------------------------------------------------------- sparse gradients


def _sparse(values, indices=((0, 1, 1), (2, 0, 2)), dtype=torch.float32) -> torch.Tensor:
    return torch.sparse_coo_tensor(torch.tensor(indices), torch.tensor(values), (2, 3), dtype=dtype,
                                   check_invariants=True)


def _unscale_sparse(make: Callable, grad: torch.Tensor) -> tuple[float, torch.Tensor]:
    """A fresh scaler at scale 4 (PyTorch's inv_scale 0.25) unscales ``grad`` of a sparse parameter:
    (found_inf, the gradient afterwards)."""
    from mixprec.scaler_view import ScalerView

    p = grad.detach().clone().coalesce()
    opt = torch.optim.SGD([p], lr=1.0)
    p.grad = grad
    scaler = make(init_scale=4.0)
    scaler.scale(torch.ones(()))  # the scale is created on first use
    scaler.unscale_(opt)
    return ScalerView(scaler).found_inf(opt).item(), p.grad


@pytest.mark.parametrize("make", [DynamicLossScaler, lambda **kw: torch.amp.GradScaler("cpu", **kw)],
                         ids=["DynamicLossScaler", "GradScaler"])
def test_grad_scaling_unscale_sparse(make) -> None:
    """PyTorch's ``test_grad_scaling_unscale_sparse`` (test/test_cuda.py, now device-generic in
    test/test_torch.py), through the public ``unscale_``: a sparse COO gradient's values are unscaled and
    checked for inf and NaN; GradScaler side by side gives the same answers."""
    s = _sparse([16.0, 32.0, 64.0])
    found, g = _unscale_sparse(make, s.clone())
    assert found == 0.0 and g.is_sparse
    assert torch.equal(g.to_dense(), (s / 4).to_dense())
    assert _unscale_sparse(make, _sparse([16.0, 32.0, float("inf")]))[0] == 1.0
    assert _unscale_sparse(make, _sparse([16.0, 32.0, float("nan")]))[0] == 1.0


def test_grad_scaling_unscale_sparse_fp16_checks_the_coalesced_values() -> None:
    """The fp16 half of PyTorch's test (GradScaler takes fp16 gradients only with its private
    ``allow_fp16``; DynamicLossScaler unscales any dtype): duplicate indices whose sum overflows fp16
    (64000 + 64000 > 65504) are found although no stored value overflows, as
    ``GradScaler._unscale_grads_(..., allow_fp16=True)`` finds them."""
    s = _sparse([16.0, 32.0, 64.0], dtype=torch.float16)
    found, g = _unscale_sparse(DynamicLossScaler, s.clone())
    assert found == 0.0 and torch.equal(g.to_dense(), (s / 4).to_dense())
    dup = _sparse([64000.0, 32.0, 64000.0], indices=((0, 1, 0), (2, 0, 2)), dtype=torch.float16)
    assert not dup.is_coalesced() and torch.isfinite(dup._values()).all()
    assert _unscale_sparse(DynamicLossScaler, dup.clone())[0] == 1.0
    ref = torch.amp.GradScaler("cpu")
    p = dup.clone().coalesce()
    p.grad = dup.clone()
    found_ref = ref._unscale_grads_(torch.optim.SGD([p], lr=1.0), torch.full((1,), 0.25), torch.zeros(1), True)
    assert sum(v.item() for v in found_ref.values()) == 1.0


def test_sparse_embedding_trains_bit_identically_to_gradscaler() -> None:
    """nn.Embedding(sparse=True) under fp16 autocast with SGD, one step overflowing: DynamicLossScaler and
    GradScaler skip the same step, keep the same scale and end with the same weights, bit for bit."""
    torch.manual_seed(0)
    ours, theirs = nn.Embedding(20, 4, sparse=True), nn.Embedding(20, 4, sparse=True)
    theirs.load_state_dict(ours.state_dict())
    o1, o2 = torch.optim.SGD(ours.parameters(), lr=0.5), torch.optim.SGD(theirs.parameters(), lr=0.5)
    s1, s2 = DynamicLossScaler(init_scale=2.0**10), torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for step in range(4):
        ids = torch.randint(0, 20, (8,))
        for model, opt, scaler in ((ours, o1, s1), (theirs, o2, s2)):
            opt.zero_grad()
            loss = model(ids).sum() * (float("inf") if step == 2 else 1.0)
            scaler.scale(loss).backward()
            assert model.weight.grad.is_sparse
            scaler.step(opt)
            scaler.update()
        assert s1.get_scale() == s2.get_scale()
        assert torch.equal(ours.weight, theirs.weight), step
    assert s1.get_scale() == 2.0**9  # the overflowing step backed off once
