"""One optimizer step and one evaluation: the only code that runs a model forward and backward.

The step never asks which precision it runs: it calls the recipe's hooks (:mod:`mixprec.precision`) on a
:class:`StepContext`, and takes the loss through :class:`~mixprec.train.contract.Objective`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any

import torch
from torch import nn

from ..errors import one_line
from ..guard import StepGuard
from ..memory import SavedTensorTracker
from ..precision import Recipe, StepResult
from . import distributed
from .contract import Objective, as_batch
from .data.protocol import DataSource
from .oom import StepOutOfMemoryError, is_out_of_memory
from .tasks import Task

__all__ = ["StepContext", "train_step", "accumulate_step", "evaluate", "compile_warmup"]


@dataclasses.dataclass
class StepContext:
    """What one training step needs."""

    model: nn.Module
    recipe: Recipe
    optimizer: torch.optim.Optimizer
    objective: Objective
    """How the model is called and its loss taken (the model contract)."""
    device: torch.device
    clip_grad_norm: float | None = None
    guard: StepGuard | None = None
    """Set by the training loop: the recipe's hooks then keep their skip decisions on the device
    (:mod:`mixprec.guard`); None: they read on the host and raise on a non-finite loss (doctor, bench's probes)."""

    @property
    def task(self) -> Task:
        return self.objective.task


def train_step(
    ctx: StepContext,
    *batch: Any,
    step: int | None = None,
    tracker: SavedTensorTracker | None = None,
) -> tuple[torch.Tensor, StepResult]:
    """One optimizer step on one batch (``xb, yb``, ``x1, x2, yb``, or one batch). Returns the unscaled, detached
    loss tensor (not read on the host) and the StepResult."""
    raw = batch[0] if len(batch) == 1 else batch
    return accumulate_step(ctx, [raw], step=step, tracker=tracker)


def accumulate_step(
    ctx: StepContext,
    micro_batches: list[Any],
    *,
    step: int | None = None,
    tracker: SavedTensorTracker | None = None,
) -> tuple[torch.Tensor, StepResult]:
    """One optimizer step over K micro-batches (K = 1 is a plain step); the gradient is that of the mean loss
    over all their samples. ``tracker`` watches the first forward.

    Returns the step's mean loss (detached, not read on the host) and the StepResult. Raises
    :class:`~mixprec.train.oom.StepOutOfMemoryError` naming the phase. With ``ctx.guard`` nothing is read on
    the host and a non-finite loss halts the run on the device instead of raising (:mod:`mixprec.guard`).
    """
    model, recipe = ctx.model, ctx.recipe
    guarded = {} if ctx.guard is None else {"guard": ctx.guard}  # (callers that patch the hooks pass no guard)
    batches = [as_batch(b) for b in micro_batches]
    n_samples = sum(len(b) for b in batches)
    ctx.optimizer.zero_grad(set_to_none=True)
    step_loss = None
    phase = "forward"
    try:
        for i, batch in enumerate(batches):
            phase = "forward"
            batch = batch.to(ctx.device, non_blocking=True)
            last = i == len(batches) - 1
            with distributed.no_sync(model, enabled=not last):
                with tracker if (tracker is not None and i == 0) else contextlib.nullcontext(), recipe.autocast():
                    loss = ctx.objective(model, batch)
                if len(batches) > 1:
                    loss = loss * (len(batch) / n_samples)
                phase = "backward"
                recipe.backward(loss, step=step, **guarded)  # under torchrun a bad loss on one rank stops all ranks
            step_loss = loss.detach() if step_loss is None else step_loss + loss.detach()
        phase = "optimizer step"
        result = recipe.step(ctx.optimizer, ctx.clip_grad_norm, **(guarded and {**guarded, "step": step}))
    except (RuntimeError, MemoryError) as e:
        if not is_out_of_memory(e) or isinstance(e, StepOutOfMemoryError):
            raise
        raise StepOutOfMemoryError(f"out of memory in the {phase}: {one_line(e)}", phase=phase) from e
    return step_loss, result


@torch.no_grad()
def evaluate(ctx: StepContext, data: DataSource, *, batch_size: int = 1000) -> tuple[dict[str, float | None], float]:
    """The task's metrics (:meth:`~mixprec.train.tasks.Task.finish`, without the ``test_`` prefix) and the mean
    loss over ``data``'s test split, under the recipe's autocast. Under torchrun every rank returns the whole
    set's numbers (padding of the strided shards is not counted)."""
    model, task = ctx.model, ctx.task
    was_training = model.training
    model.eval()
    idx, n_real = distributed.eval_shard(data.n_test)
    sums = torch.zeros(1 + task.n_sums, dtype=torch.float64, device=ctx.device)  # loss sum, the task's sums
    seen = 0
    for raw in data.eval_batches(idx, batch_size):
        batch = as_batch(raw).to(ctx.device)
        n = len(batch)
        k = min(max(n_real - seen, 0), n)  # real samples in this batch; the rest is padding
        seen += n
        if 0 < k < n:
            batch = batch.head(k)
        with ctx.recipe.autocast():
            out = ctx.objective.forward(model, batch)
            if k:
                loss = ctx.objective.loss(out, batch)
        if k:
            sums[0] += loss.detach().double() * k
            if task.n_sums and out.logits is not None and batch.targets is not None:
                sums[1:] += task.sums(out.logits.detach(), batch.targets)
    distributed.all_reduce_sum(sums)
    model.train(was_training)
    n_test = max(data.n_test, 1)
    values = sums.tolist()
    loss = values[0] / n_test
    return task.finish(values[1:], data.n_test, loss), loss


def compile_warmup(ctx: StepContext, batches: list[Any]) -> float:
    """Compile forward and backward for each batch shape and leave no trace (gradients, buffers and RNG are
    restored). Returns the wall time spent."""
    from .. import hardware

    model = ctx.model
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(ctx.device) if ctx.device.type == "cuda" else None
    hardware.synchronize(ctx.device)
    t0 = time.perf_counter()
    for raw in batches:
        with ctx.recipe.autocast():
            loss = ctx.objective(model, as_batch(raw).to(ctx.device))
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
