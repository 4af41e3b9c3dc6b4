"""One optimizer step and one evaluation: the only code that runs a model forward and backward.

The step never asks which precision it runs; it calls the recipe's hooks (see :mod:`mixprec.precision`)
on a small :class:`StepContext` — model, recipe, optimizer, loss, device, clip — so ``train``, ``bench``
(through the trainer) and ``doctor`` share it without knowing about each other's runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable

import torch
from torch import nn

from ..memory import SavedTensorTracker
from ..precision import Recipe, StepResult
from . import distributed
from .data.protocol import DataSource

__all__ = ["StepContext", "train_step", "accumulate_step", "evaluate", "compile_warmup"]


@dataclasses.dataclass
class StepContext:
    """What one training step needs."""

    model: nn.Module
    recipe: Recipe
    optimizer: torch.optim.Optimizer
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    device: torch.device
    clip_grad_norm: float | None = None


def train_step(
    ctx: StepContext,
    xb: torch.Tensor,
    yb: torch.Tensor,
    *,
    step: int | None = None,
    tracker: SavedTensorTracker | None = None,
) -> tuple[torch.Tensor, StepResult]:
    """One optimizer step on one batch: forward under the recipe's autocast, scaled backward, unscale/clip/step.

    Returns the (unscaled, detached) loss tensor — not read on the host here — and the StepResult.
    """
    return accumulate_step(ctx, [(xb, yb)], step=step, tracker=tracker)


def accumulate_step(
    ctx: StepContext,
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    step: int | None = None,
    tracker: SavedTensorTracker | None = None,
) -> tuple[torch.Tensor, StepResult]:
    """One optimizer step over K micro-batches (gradient accumulation; K = 1 is a plain step).

    Each micro-batch's loss is weighted by its share of the step's samples, so the accumulated gradient is
    that of the mean loss over all of them, as if they were one batch. The (scaled) backwards accumulate
    into ``.grad``; under DDP/FSDP only the last one reduces gradients across ranks. Then the recipe
    unscales, checks, clips, steps and updates the scale once. ``tracker`` watches the first forward.

    Returns the step's mean loss (detached, not read on the host) and the StepResult.
    """
    model, recipe = ctx.model, ctx.recipe
    n_samples = sum(len(yb) for _, yb in micro_batches)
    ctx.optimizer.zero_grad(set_to_none=True)
    step_loss = None
    for i, (xb, yb) in enumerate(micro_batches):
        xb = xb.to(ctx.device, non_blocking=True)
        yb = yb.to(ctx.device, non_blocking=True)
        last = i == len(micro_batches) - 1
        with distributed.no_sync(model, enabled=not last):
            with tracker if (tracker is not None and i == 0) else contextlib.nullcontext(), recipe.autocast():
                loss = ctx.loss_fn(model(xb), yb)
            if len(micro_batches) > 1:
                loss = loss * (len(yb) / n_samples)
            recipe.backward(loss, step=step)  # under torchrun a bad loss on one rank stops all ranks
        step_loss = loss.detach() if step_loss is None else step_loss + loss.detach()
    result = recipe.step(ctx.optimizer, ctx.clip_grad_norm)
    return step_loss, result


@torch.no_grad()
def evaluate(ctx: StepContext, data: DataSource, *, batch_size: int = 1000) -> tuple[float, float]:
    """Accuracy (fraction; per token for language models) and mean loss over ``data``'s test split, under
    the recipe's autocast.

    Under torchrun each rank evaluates a strided shard (padded so all ranks run the same batches; the
    padding is not counted) and the sums are all-reduced, so every rank returns the whole set's numbers.
    """
    model = ctx.model
    was_training = model.training
    model.eval()
    idx, n_real = distributed.eval_shard(data.n_test)
    sums = torch.zeros(2, dtype=torch.float64, device=ctx.device)  # correct, loss sum
    seen = 0
    for xb, yb in data.eval_batches(idx, batch_size):
        xb, yb = xb.to(ctx.device), yb.to(ctx.device)
        k = min(max(n_real - seen, 0), len(yb))  # real samples in this batch; the rest is padding
        seen += len(yb)
        with ctx.recipe.autocast():
            out = model(xb)[:k]
            loss = ctx.loss_fn(out, yb[:k]) if k else None
        if k:
            hit = (out.argmax(dim=-1) == yb[:k]).double()
            sums[0] += hit.reshape(k, -1).mean(dim=1).sum()
            sums[1] += loss.double() * k
    distributed.all_reduce_sum(sums)
    model.train(was_training)
    n = max(data.n_test, 1)
    return sums[0].item() / n, sums[1].item() / n


def compile_warmup(ctx: StepContext, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Trigger ``torch.compile``'s compilation of forward and backward for each batch shape, and leave no trace.

    Runs forward and backward under the recipe's autocast, then restores what they touched — gradients
    (dropped), buffers (BatchNorm statistics) and the RNG (dropout) — so the run that follows is the one it
    would have been without the warm-up. Returns the wall time: the compile time, reported apart.
    """
    from .. import hardware

    model = ctx.model
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(ctx.device) if ctx.device.type == "cuda" else None
    hardware.synchronize(ctx.device)
    t0 = time.perf_counter()
    for xb, yb in batches:
        with ctx.recipe.autocast():
            loss = ctx.loss_fn(model(xb.to(ctx.device)), yb.to(ctx.device))
        loss.backward()
    hardware.synchronize(ctx.device)
    elapsed = time.perf_counter() - t0
    for p in model.parameters():  # the optimizer's tensors (fp32 masters) get no grad from a backward
        p.grad = None
    with torch.no_grad():
        for b, saved in buffers:
            b.copy_(saved)
    torch.set_rng_state(rng)
    if cuda_rng is not None:
        torch.cuda.set_rng_state(cuda_rng, ctx.device)
    return elapsed
