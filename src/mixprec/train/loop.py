"""The training loop: one code path for every recipe.

The loop never asks which precision it runs; it calls the recipe's hooks (see :mod:`mixprec.precision`).
One step reads top to bottom in :func:`accumulate_step` (:func:`train_step` is its one-batch form);
:func:`train` adds epochs, evaluation, memory sampling, logging, checkpoints and the summary. ``bench`` and
``doctor`` reuse these functions. Under torchrun the same loop runs on every rank; :mod:`.distributed`
supplies the process group, the DDP/FSDP wrapper and the reductions, each a no-op in a one-process run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import hardware
from ..errors import NonFiniteError
from ..memory import MemoryReport, SavedTensorTracker, static_memory
from ..precision import Recipe, ScalerConfig, StepResult, build_recipe
from . import checkpoint as ckpt_mod
from . import distributed
from .config import TrainConfig
from .data import BatchLoader, Dataset, load_dataset
from .models import build_model
from .report import Reporter, summary_table

__all__ = ["Run", "build_run", "train_step", "accumulate_step", "evaluate", "train", "TrainResult",
           "make_optimizer_factory"]


@dataclasses.dataclass
class Run:
    """Everything a training run is made of; built once by :func:`build_run`."""

    config: TrainConfig
    device: torch.device
    data: Dataset
    model: nn.Module
    recipe: Recipe
    optimizer: torch.optim.Optimizer
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    train_loader: BatchLoader
    rank: int = 0
    world_size: int = 1


def make_optimizer_factory(config: TrainConfig) -> Callable:
    def make(params):
        params = list(params)
        if config.optimizer == "adamw":
            return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
        return torch.optim.SGD(params, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay)

    return make


def build_run(config: TrainConfig, *, data: Dataset | None = None) -> Run:
    """Resolve device and recipe, load data, build, convert and wrap the model, create the optimizer.

    Under torchrun this joins the process group (``--strategy ddp|fsdp``) and shards the data by rank.
    """
    config.validate()
    env, device = distributed.setup(config.strategy, hardware.resolve_device(config.device))
    recipe = build_recipe(
        config.precision,
        device=device,
        amp_impl=config.amp_impl,
        scaler=ScalerConfig(
            init_scale=config.init_scale,
            growth_factor=config.growth_factor,
            backoff_factor=config.backoff_factor,
            growth_interval=config.growth_interval,
            hysteresis=config.hysteresis,
        ),
        stochastic_rounding=config.stochastic_rounding,
        seed=config.seed,
        keep_fp32=tuple(config.keep_fp32),
    )
    distributed.prepare_recipe(recipe)  # multi-process: the loss scaler all-reduces found_inf
    if data is None:
        data = load_dataset(
            config.dataset,
            data_dir=config.data_dir,
            seed=config.seed,
            synthetic_train=config.synthetic_train,
            synthetic_test=config.synthetic_test,
            synthetic_shape=tuple(config.synthetic_shape),
            limit_train=config.limit_train,
            limit_test=config.limit_test,
        )
    torch.manual_seed(config.seed)
    model = build_model(
        config.model,
        input_shape=data.input_shape,
        num_classes=data.num_classes,
        width=config.width,
        depth=config.depth,
        channels=config.channels,
        d_model=config.d_model,
        n_heads=config.n_heads,
        n_layers=config.n_layers,
        patch_size=config.patch_size,
    )
    model = recipe.convert_module(model)
    model = distributed.wrap_model(model, recipe, config.strategy, device)  # DDP / FSDP2, or as it is
    optimizer = recipe.build_optimizer(model, make_optimizer_factory(config))
    loader = BatchLoader(data.x_train, data.y_train, config.batch_size, shuffle=True, seed=config.seed,
                         rank=env.rank, world_size=env.world_size)
    return Run(config=config, device=device, data=data, model=model, recipe=recipe, optimizer=optimizer,
               loss_fn=F.cross_entropy, train_loader=loader, rank=env.rank, world_size=env.world_size)


def train_step(
    run: Run,
    xb: torch.Tensor,
    yb: torch.Tensor,
    *,
    step: int | None = None,
    tracker: SavedTensorTracker | None = None,
) -> tuple[torch.Tensor, StepResult]:
    """One optimizer step on one batch: forward under the recipe's autocast, scaled backward, unscale/clip/step.

    Returns the (unscaled, detached) loss tensor — not read on the host here — and the StepResult.
    """
    return accumulate_step(run, [(xb, yb)], step=step, tracker=tracker)


def accumulate_step(
    run: Run,
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
    model, recipe, optimizer = run.model, run.recipe, run.optimizer
    n_samples = sum(len(yb) for _, yb in micro_batches)
    optimizer.zero_grad(set_to_none=True)
    step_loss = None
    for i, (xb, yb) in enumerate(micro_batches):
        xb = xb.to(run.device, non_blocking=True)
        yb = yb.to(run.device, non_blocking=True)
        last = i == len(micro_batches) - 1
        with distributed.no_sync(model, enabled=not last):
            with tracker if (tracker is not None and i == 0) else contextlib.nullcontext(), recipe.autocast():
                loss = run.loss_fn(model(xb), yb)
            if len(micro_batches) > 1:
                loss = loss * (len(yb) / n_samples)
            loss = distributed.agree_on_finite_loss(loss, recipe)  # a bad loss on one rank stops all ranks
            recipe.backward(loss, step=step)
        step_loss = loss.detach() if step_loss is None else step_loss + loss.detach()
    result = recipe.step(optimizer, run.config.clip_grad_norm)
    return step_loss, result


@torch.no_grad()
def evaluate(run: Run, *, batch_size: int = 1000) -> tuple[float, float]:
    """Test accuracy (fraction) and mean loss, under the recipe's autocast.

    Under torchrun each rank evaluates a strided shard (padded so all ranks run the same batches; the
    padding is not counted) and the sums are all-reduced, so every rank returns the whole test set's numbers.
    """
    model = run.model
    was_training = model.training
    model.eval()
    x, y = run.data.x_test, run.data.y_test
    idx, n_real = distributed.eval_shard(len(x))
    sums = torch.zeros(2, dtype=torch.float64, device=run.device)  # correct, loss sum
    for i in range(0, len(idx), batch_size):
        xb = x.index_select(0, idx[i:i + batch_size]).to(run.device)
        yb = y.index_select(0, idx[i:i + batch_size]).to(run.device)
        k = min(max(n_real - i, 0), len(yb))  # real samples in this batch; the rest is padding
        with run.recipe.autocast():
            logits = model(xb)[:k]
            loss = run.loss_fn(logits, yb[:k]) if k else None
        if k:
            sums[0] += (logits.argmax(dim=1) == yb[:k]).sum()
            sums[1] += loss.double() * k
    distributed.all_reduce_sum(sums)
    model.train(was_training)
    n = max(len(x), 1)
    return sums[0].item() / n, sums[1].item() / n


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclasses.dataclass
class TrainResult:
    history: list[dict[str, Any]]
    summary: dict[str, Any]
    stopped: str | None = None
    """Why the run stopped early (non-finite loss, too many skipped steps), or None."""


def _environment(device: torch.device) -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": str(device),
        "device_name": hardware.device_name(device),
        "cpu": hardware.cpu_name(),
        "threads": torch.get_num_threads(),
        "platform": platform.platform(),
    }


def _memory_sample(run: Run, tracker: SavedTensorTracker, on_cuda: bool) -> MemoryReport:
    rep = static_memory(run.model, run.optimizer, run.recipe.master)
    rep.activations = tracker.nbytes
    if on_cuda:
        rep.cuda_peak_allocated = torch.cuda.max_memory_allocated(run.device)
        rep.cuda_peak_reserved = torch.cuda.max_memory_reserved(run.device)
    return rep


def _checkpoint_payload(run: Run, *, epoch: int, batch: int, global_step: int, history, counters) -> dict:
    """The checkpoint's contents; under FSDP gathering them is a collective, so every rank calls this."""
    model_state, optimizer_state = distributed.state_dicts(run.model, run.optimizer)
    return {
        "model": model_state,
        "optimizer": optimizer_state,
        "recipe": run.recipe.state_dict(),
        "world_size": run.world_size,
        "rng": ckpt_mod.rng_state(),
        "epoch": epoch,
        "batch": batch,
        "global_step": global_step,
        "config": run.config.to_dict(),
        "history": history,
        "counters": counters,
    }


def _params_finite(model: nn.Module, device: torch.device) -> bool:
    """All parameters finite, on every rank (one all-reduce under torchrun)."""
    bad = sum((~torch.isfinite(distributed.local_tensor(p))).sum() for p in model.parameters())
    return distributed.all_reduce_sum(torch.as_tensor(bad, dtype=torch.float64, device=device)).item() == 0


def train(config: TrainConfig, *, run: Run | None = None, reporter: Reporter | None = None) -> TrainResult:
    """Train per ``config``; returns per-epoch history and the summary (also written per --metrics-json)."""
    run = run or build_run(config)
    reporter = reporter or Reporter(progress=config.progress, rank=run.rank)
    recipe, device, loader = run.recipe, run.device, run.train_loader
    reporter.info(recipe.describe())
    reporter.info(
        f"model {config.model} ({sum(p.numel() for p in run.model.parameters()):,} params) on {run.data.name} "
        f"[{len(run.data.x_train):,} train / {len(run.data.x_test):,} test from {run.data.source}], "
        f"device {device} ({hardware.device_name(device)}), {torch.get_num_threads()} threads"
    )
    if run.world_size > 1 or config.grad_accum > 1:
        per_step = config.batch_size * config.grad_accum * run.world_size
        reporter.info(
            f"{run.world_size} process(es), strategy {config.strategy}: batch {config.batch_size} x "
            f"{config.grad_accum} accumulated x {run.world_size} rank(s) = {per_step} samples per optimizer step; "
            "logs and checkpoints from rank 0, metrics averaged over ranks"
        )

    history: list[dict[str, Any]] = []
    counters = {"skipped_total": 0, "consecutive_skips": 0}
    start_epoch, start_batch, global_step = 0, 0, 0
    if config.resume:
        ck = ckpt_mod.load_checkpoint(config.resume, config=config.to_dict(), world_size=run.world_size)
        try:
            distributed.load_state_dicts(run.model, run.optimizer, ck["model"], ck["optimizer"])
            recipe.load_state_dict(ck["recipe"])
        except (RuntimeError, KeyError, ValueError) as e:
            from ..errors import CheckpointError

            raise CheckpointError(f"--resume {config.resume}: checkpoint does not fit this model: {e}") from None
        ckpt_mod.set_rng_state(ck["rng"])
        start_epoch, start_batch, global_step = ck["epoch"], ck["batch"], ck["global_step"]
        history = list(ck.get("history") or [])
        counters.update(ck.get("counters") or {})
        reporter.info(f"resumed from {config.resume} at epoch {start_epoch}, batch {start_batch} "
                      f"(step {global_step})")

    def save(epoch: int, batch: int) -> None:
        if config.out is None:
            return
        payload = _checkpoint_payload(run, epoch=epoch, batch=batch, global_step=global_step, history=history,
                                      counters=counters)
        if run.rank == 0:
            ckpt_mod.save_checkpoint(os.path.join(config.out, ckpt_mod.LAST), payload)

    stopped: str | None = None
    accum = config.grad_accum
    steps_per_epoch = math.ceil(len(loader) / accum)
    total_steps = steps_per_epoch * config.epochs
    if config.max_steps is not None:
        total_steps = min(total_steps, config.max_steps)
    run.model.train()
    with recipe.run_context(), reporter.progress_bar(total=total_steps, completed=global_step) as bar:
        for epoch in range(start_epoch, config.epochs):
            if global_step >= total_steps:
                break
            loader.set_epoch(epoch)
            sample_at = min(1, steps_per_epoch - 1) * accum  # first step after warm-up (optimizer state exists)
            loss_sum = torch.zeros((), dtype=torch.float64, device=device)
            losses: list[torch.Tensor] = []
            step_times: list[float] = []
            mem: MemoryReport | None = None
            skipped_epoch = 0
            n_steps = 0
            _sync(device)
            t_epoch = time.perf_counter()
            t_prev = t_epoch
            first = start_batch if epoch == start_epoch else 0
            pos = first  # next batch of the loader: where a checkpoint resumes
            for batch_idx, micro_batches in _step_batches(loader, accum, first):
                if global_step >= total_steps:
                    break
                sampled = batch_idx == sample_at
                tracker = None
                if sampled:
                    tracker = SavedTensorTracker(exclude=run.model.parameters())
                    if device.type == "cuda":
                        torch.cuda.reset_peak_memory_stats(device)
                try:
                    loss, res = accumulate_step(run, micro_batches, step=global_step, tracker=tracker)
                except NonFiniteError as e:
                    e.step = global_step
                    stopped = _stop_nonfinite(run, e, epoch, batch_idx, save, reporter)
                    break
                if sampled:
                    mem = _memory_sample(run, tracker, device.type == "cuda")
                global_step += 1
                n_steps += 1
                pos = batch_idx + len(micro_batches)
                loss_sum += loss
                losses.append(loss)
                if res.skipped:
                    skipped_epoch += 1
                    counters["consecutive_skips"] += 1
                else:
                    counters["consecutive_skips"] = 0
                now = time.perf_counter()
                step_times.append(now - t_prev)
                t_prev = now
                if config.log_every and batch_idx % config.log_every == 0:
                    reporter.log(f"Epoch: {epoch}, Batch: {batch_idx}, "
                                 f"Loss: {distributed.mean_over_ranks(loss).item():.4f}")
                bar.advance()
                if counters["consecutive_skips"] >= config.max_consecutive_skips:
                    stopped = (
                        f"stopped at step {global_step}: {counters['consecutive_skips']} optimizer steps in a row were "
                        f"skipped for inf/nan gradients (loss scale now {recipe.loss_scale():g}); the loss itself is "
                        "likely non-finite — lower --lr, add --clip-grad-norm, or run `mixprec doctor` to find the layer"
                    )
                    reporter.error(stopped)
                    break
                if config.check_consistency and global_step % config.check_consistency == 0:
                    try:
                        distributed.check_consistency(run.model, step=global_step, scale=recipe.loss_scale(),
                                                      skipped=counters["skipped_total"] + skipped_epoch,
                                                      device=device)
                    except distributed.RankDivergenceError as e:
                        stopped = str(e)
                        reporter.error(stopped)
                        break
                if config.checkpoint_every and global_step % config.checkpoint_every == 0:
                    save(epoch, pos)
            _sync(device)
            epoch_time = distributed.max_over_ranks(time.perf_counter() - t_epoch, device)
            counters["skipped_total"] += skipped_epoch
            if n_steps == 0:
                break
            acc, test_loss = evaluate(run)
            curve = distributed.mean_over_ranks(torch.stack(losses).float()).cpu().tolist()
            samples_per_step = config.batch_size * accum * run.world_size
            rec = {
                "epoch": epoch,
                "steps": n_steps,
                "train_loss": distributed.mean_over_ranks(loss_sum).item() / n_steps,
                "test_loss": test_loss,
                "test_accuracy": acc,
                "epoch_time_s": epoch_time,
                "samples_per_s": n_steps * samples_per_step / epoch_time,
                "step_times_s": step_times,
                "loss_curve": curve,
                "skipped_steps": skipped_epoch,
                "loss_scale": recipe.loss_scale(),
                "memory": mem.to_dict() if mem else None,
            }
            history.append(rec)
            reporter.epoch_done(rec, recipe.name)
            if stopped:
                break
            save(epoch + 1, 0) if pos >= len(loader) else save(epoch, pos)

    summary = _summarize(run, history, counters, stopped)
    reporter.summary(summary_table([summary]))
    if config.metrics_json and run.rank == 0:
        from .report import write_json

        write_json(config.metrics_json, {
            "config": config.to_dict(),
            "environment": _environment(device),
            "recipe": recipe.describe(),
            "epochs": history,
            "summary": summary,
        })
    return TrainResult(history=history, summary=summary, stopped=stopped)


def _stop_nonfinite(run: Run, e: NonFiniteError, epoch: int, batch_idx: int, save, reporter: Reporter) -> str:
    """Save the last good state (if the params are still finite) and explain what to do."""
    where = ""
    if run.config.out:
        if _params_finite(run.model, run.device):
            save(epoch, batch_idx)
            where = f"; the last good state (before step {e.step}) is saved in {run.config.out}/last.pt"
        else:
            where = f"; parameters are already non-finite, so {run.config.out}/last.pt was left as it was"
    msg = (
        f"non-finite {e.what} at step {e.step} (epoch {epoch}, batch {batch_idx}) with {run.recipe.name}, which has "
        f"no loss scaler to skip such steps{where}. Remedies: lower --lr, add --clip-grad-norm 1.0, use a "
        "loss-scaled recipe (fp16-mixed) or bf16-mixed, or run `mixprec doctor` to locate the first non-finite op"
    )
    reporter.error(msg)
    return msg


def _summarize(run: Run, history: list[dict], counters: dict, stopped: str | None) -> dict[str, Any]:
    mems = [h["memory"] for h in history if h.get("memory")]
    peak = max((m["total"] for m in mems), default=None)
    peak_mem = max(mems, key=lambda m: m["total"]) if mems else None
    cuda_peak = max((m["cuda_peak_allocated"] or 0 for m in mems), default=None) if mems else None
    times = [h["epoch_time_s"] for h in history]
    return {
        "recipe": run.recipe.name,
        "impl": run.recipe.impl,
        "model": run.config.model,
        "dataset": run.data.name,
        "device": str(run.device),
        "world_size": run.world_size,
        "strategy": run.config.strategy,
        "grad_accum": run.config.grad_accum,
        "epochs": len(history),
        "peak_memory_bytes": peak,
        "memory": peak_mem,
        "cuda_peak_allocated_bytes": cuda_peak or None,
        "avg_epoch_time_s": sum(times) / len(times) if times else math.nan,
        "test_accuracy": history[-1]["test_accuracy"] if history else math.nan,
        "final_train_loss": history[-1]["train_loss"] if history else math.nan,
        "skipped_steps": counters["skipped_total"],
        "final_loss_scale": history[-1]["loss_scale"] if history else math.nan,
        "stopped": stopped,
    }


def _step_batches(loader: BatchLoader, accum: int, first: int):
    """Yield ``(index of the first batch, [accum consecutive batches])`` per optimizer step, from batch
    ``first`` on (the last group of an epoch may be shorter)."""
    group: list[tuple[torch.Tensor, torch.Tensor]] = []
    for batch_idx, (xb, yb) in enumerate(loader):
        if batch_idx < first:
            continue
        group.append((xb, yb))
        if len(group) == accum:
            yield batch_idx - accum + 1, group
            group = []
    if group:
        yield len(loader) - len(group), group


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use `mixprec train` or `python -m mixprec train`")
