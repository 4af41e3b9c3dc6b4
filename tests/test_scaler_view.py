"""mixprec.scaler_view.ScalerView reads the same state from torch.amp.GradScaler, ShardedGradScaler and
mixprec's DynamicLossScaler. The view reads private attributes of PyTorch's scalers (listed in the module's
docstring); every test here checks what it reads against the scalers' public behaviour, so a torch release
that renames or reshapes one of them fails here first."""


import pytest
import torch
import torch.distributed as dist
from torch import nn

from mixprec.scaler import DynamicLossScaler
from mixprec.scaler_view import ScalerView

pytestmark = pytest.mark.usefixtures("one_thread")

INIT = 1024.0


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory):
    """A one-process gloo group: ShardedGradScaler all-reduces its inf check over it."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _make(kind, **kw):
    if kind == "GradScaler":
        return torch.amp.GradScaler("cpu", init_scale=INIT, growth_interval=2, **kw)
    if kind == "ShardedGradScaler":
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler("cpu", init_scale=INIT, growth_interval=2, **kw)
    return DynamicLossScaler(init_scale=INIT, growth_interval=2, **kw)


KINDS = ["GradScaler", "ShardedGradScaler", "DynamicLossScaler"]


@pytest.fixture(params=KINDS)
def kind(request):
    if request.param == "ShardedGradScaler":
        request.getfixturevalue("one_rank_group")
    return request.param


def _model_and_opt():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _backward(scaler, model, poison=False):
    loss = model(torch.randn(8, 4)).square().mean()
    scaler.scale(loss).backward()
    if poison:
        model.weight.grad[0, 0] = float("inf")


def test_before_the_first_scaled_loss_there_is_no_device_state(kind):
    view = ScalerView(_make(kind))
    _, opt = _model_and_opt()
    assert view.kind == kind and view.enabled
    assert view.scale() is None and view.growth_tracker() is None and view.found_inf(opt) is None
    assert view.scale_value() == INIT


def test_scale_growth_and_found_inf_follow_the_scalers_public_state(kind):
    scaler = _make(kind)
    view = ScalerView(scaler)
    model, opt = _model_and_opt()

    _backward(scaler, model)
    scale = view.scale()
    assert scale.shape == () and scale.dtype == torch.float32 and scale.item() == scaler.get_scale() == INIT
    assert view.found_inf(opt) is None  # not checked yet
    scaler.unscale_(opt)
    found = view.found_inf(opt)
    assert found.shape == () and found.dtype == torch.float32 and found.item() == 0 and not view.skipped(opt)
    scaler.step(opt)
    scaler.update()
    assert view.found_inf(opt) is None  # update() forgets the checks
    assert view.growth_tracker().item() == scaler.state_dict()["_growth_tracker"] == 1

    _backward(scaler, model, poison=True)
    scaler.unscale_(opt)
    assert view.found_inf(opt).item() > 0 and view.skipped(opt)
    other = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    assert view.found_inf(other) is None and not view.skipped(other)
    scaler.step(opt)
    scaler.update()
    assert view.scale() is scale, "the view returns the scaler's own tensor, updated in place"
    assert scale.item() == scaler.get_scale() == INIT / 2 == view.scale_value()
    assert view.growth_tracker().item() == scaler.state_dict()["_growth_tracker"] == 0


def test_the_iteration_token_changes_at_a_skipped_update_only(kind):
    """A skipped step calls no optimizer hook: the token is how a watcher tells it from gradient accumulation."""
    from mixprec.probes.loss_scale import iteration_changed

    scaler = _make(kind)
    view = ScalerView(scaler)
    model, opt = _model_and_opt()
    _backward(scaler, model)
    before = view.iteration()
    _backward(scaler, model)  # a second micro-batch: the iteration goes on
    assert not iteration_changed(before, view.iteration())
    _backward(scaler, model, poison=True)
    scaler.step(opt)  # skipped
    scaler.update()
    assert iteration_changed(before, view.iteration())


def test_the_growth_tracker_counts_to_growth(kind):
    scaler = _make(kind)
    view = ScalerView(scaler)
    model, opt = _model_and_opt()
    seen = []
    for _ in range(3):
        _backward(scaler, model)
        scaler.step(opt)  # step unscales itself: the check is recorded there too
        assert view.found_inf(opt).item() == 0
        scaler.update()
        seen.append((view.growth_tracker().item(), view.scale().item()))
    assert seen == [(1, INIT), (0, 2 * INIT), (1, 2 * INIT)]


def test_a_disabled_scaler_has_no_state(kind):
    scaler = _make(kind, enabled=False)
    view = ScalerView(scaler)
    model, opt = _model_and_opt()
    _backward(scaler, model)
    scaler.unscale_(opt)
    assert not view.enabled
    assert view.scale() is None and view.growth_tracker() is None and view.hysteresis_left() is None
    assert view.found_inf(opt) is None and not view.skipped(opt) and view.scale_value() == 1.0


def test_hysteresis_left_is_mixprecs_alone():
    scaler = DynamicLossScaler(hysteresis=3)
    model, _ = _model_and_opt()
    _backward(scaler, model)
    assert ScalerView(scaler).hysteresis_left().item() == 2
    grad_scaler = torch.amp.GradScaler("cpu")
    _backward(grad_scaler, model)
    assert ScalerView(grad_scaler).hysteresis_left() is None


def test_the_private_state_pytorch_keeps_is_where_the_view_reads_it():
    """The names and shapes mixprec.scaler_view depends on, stated once: a clear failure when torch changes."""
    scaler = torch.amp.GradScaler("cpu")
    model, opt = _model_and_opt()
    _backward(scaler, model)
    scaler.unscale_(opt)
    assert isinstance(scaler._scale, torch.Tensor) and isinstance(scaler._growth_tracker, torch.Tensor)
    per_device = scaler._per_optimizer_states[id(opt)]["found_inf_per_device"]
    assert list(per_device) == [torch.device("cpu")] and per_device[torch.device("cpu")].numel() == 1
    scaler.step(opt)
    scaler.update()
    assert id(opt) not in scaler._per_optimizer_states


def test_anything_else_is_refused():
    with pytest.raises(TypeError, match="ScalerView\\(dict\\)"):
        ScalerView({})


@pytest.mark.cuda  # host syncs are only detectable on CUDA
@pytest.mark.parametrize("kind", ["GradScaler", "DynamicLossScaler"])
def test_reading_the_state_does_not_sync_the_host(kind):
    scaler = (torch.amp.GradScaler("cuda", init_scale=INIT) if kind == "GradScaler"
              else DynamicLossScaler(init_scale=INIT))
    view = ScalerView(scaler)
    model = nn.Linear(4, 2).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(torch.randn(8, 4, device="cuda")).sum()).backward()
    scaler.unscale_(opt)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        view.scale(), view.growth_tracker(), view.found_inf(opt)
    finally:
        torch.cuda.set_sync_debug_mode("default")
