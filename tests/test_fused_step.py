"""The trainer's optimizer is fused where PyTorch has it, and loss scaling still skips and counts exactly."""

import pytest
import torch

from mixprec.train.build import build_run
from mixprec.train.config import TrainConfig
from mixprec.train.step import train_step

FLAGS = dict(dataset="digits", model="mlp", width=32, depth=1, batch_size=32, momentum=0.9, log_every=0,
             progress="off")


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("impl", ["native", "scratch"])
def test_fused_optimizer_skips_overflowing_steps_without_touching_anything(impl, optimizer):
    flags = dict(FLAGS, momentum=0.9 if optimizer == "sgd" else 0.0)
    run = build_run(TrainConfig.from_flags(**flags, precision="fp16-mixed", amp_impl=impl, optimizer=optimizer,
                                           growth_interval=1000))
    assert run.optimizer.defaults.get("fused") is True
    run.train_loader.set_epoch(0)
    batches = list(run.train_loader)
    with run.recipe.run_context():
        train_step(run.ctx, *batches[0])  # optimizer state exists from here on
        params = [p.detach().clone() for p in run.model.parameters()]
        state = {k: v.clone() for st in run.optimizer.state.values() for k, v in st.items()
                 if isinstance(v, torch.Tensor)}
        backward = run.recipe.backward

        def overflow(loss, step=None):
            backward(loss, step=step)
            next(run.model.parameters()).grad.view(-1)[0] = float("inf")

        run.recipe.backward = overflow
        scale = run.recipe.loss_scale()
        _, res = train_step(run.ctx, *batches[1])
        run.recipe.backward = backward
        assert res.skipped and run.recipe.loss_scale() == scale / 2
        assert all(torch.equal(a, b) for a, b in zip(params, run.model.parameters()))
        after = {k: v for st in run.optimizer.state.values() for k, v in st.items() if isinstance(v, torch.Tensor)}
        assert all(torch.equal(state[k], after[k]) for k in state)
        _, res = train_step(run.ctx, *batches[2])
        assert not res.skipped and not all(torch.equal(a, b) for a, b in zip(params, run.model.parameters()))


def test_low_precision_params_get_foreach_not_fused():
    run = build_run(TrainConfig.from_flags(**FLAGS, precision="bf16-true"))
    assert run.optimizer.defaults.get("foreach") is True and not run.optimizer.defaults.get("fused")


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_skip_leaves_a_fused_optimizer_alone_when_found_inf_sums_over_ranks(optimizer):
    """ShardedGradScaler all-reduces found_inf with SUM: when both of 2 ranks overflow it records 2.0, and the
    fused kernels skip only on exactly 1.0 (GradScaler.step would apply the inf step). Here one process
    records what such a pair of ranks records."""
    flags = dict(FLAGS, momentum=0.9 if optimizer == "sgd" else 0.0)
    run = build_run(TrainConfig.from_flags(**flags, precision="fp16-mixed", amp_impl="native", optimizer=optimizer))
    assert run.optimizer.defaults.get("fused") is True
    run.train_loader.set_epoch(0)
    batches = list(run.train_loader)
    scaler = run.recipe.scaler
    with run.recipe.run_context():
        train_step(run.ctx, *batches[0])
        params = [p.detach().clone() for p in run.model.parameters()]
        state = {k: v.clone() for st in run.optimizer.state.values() for k, v in st.items()
                 if isinstance(v, torch.Tensor)}
        backward, unscale = run.recipe.backward, scaler.unscale_

        def overflow(loss, step=None):
            backward(loss, step=step)
            next(run.model.parameters()).grad.view(-1)[0] = float("inf")

        def two_ranks_overflowed(opt):
            unscale(opt)
            for t in scaler._per_optimizer_states[id(opt)]["found_inf_per_device"].values():
                t.mul_(2)

        run.recipe.backward, scaler.unscale_ = overflow, two_ranks_overflowed
        _, res = train_step(run.ctx, *batches[1])
    assert res.skipped
    assert all(torch.equal(a, b) for a, b in zip(params, run.model.parameters()))
    after = {k: v for st in run.optimizer.state.values() for k, v in st.items() if isinstance(v, torch.Tensor)}
    assert all(torch.equal(state[k], after[k]) for k in state)  # AdamW's step count too
