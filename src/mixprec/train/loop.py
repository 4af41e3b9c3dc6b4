"""The training loop: one code path for every recipe.

The loop never asks which precision it runs; it calls the recipe's hooks (see :mod:`mixprec.precision`).
One step reads top to bottom in :func:`train_step`; :func:`train` adds epochs, evaluation, memory
sampling, logging, checkpoints and the summary. ``bench`` and ``doctor`` reuse these functions.
"""

from __future__ import annotations

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
from .config import TrainConfig
from .data import BatchLoader, Dataset, load_dataset
from .models import build_model
from .report import Reporter, summary_table

__all__ = ["Run", "build_run", "train_step", "evaluate", "train", "TrainResult", "make_optimizer_factory"]


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
    """Resolve device and recipe, load data, build and convert the model, create the optimizer."""
    config.validate()
    device = hardware.resolve_device(config.device)
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
    optimizer = recipe.build_optimizer(model, make_optimizer_factory(config))
    loader = BatchLoader(data.x_train, data.y_train, config.batch_size, shuffle=True, seed=config.seed)
    return Run(config=config, device=device, data=data, model=model, recipe=recipe, optimizer=optimizer,
               loss_fn=F.cross_entropy, train_loader=loader)


def train_step(
    run: Run,
    xb: torch.Tensor,
    yb: torch.Tensor,
    *,
    step: int | None = None,
    tracker: SavedTensorTracker | None = None,
) -> tuple[torch.Tensor, StepResult]:
    """One optimizer step: forward under the recipe's autocast, scaled backward, unscale/clip/step.

    Returns the (unscaled, detached) loss tensor — not read on the host here — and the StepResult.
    """
    model, recipe, optimizer = run.model, run.recipe, run.optimizer
    xb = xb.to(run.device, non_blocking=True)
    yb = yb.to(run.device, non_blocking=True)
    optimizer.zero_grad(set_to_none=True)
    if tracker is None:
        with recipe.autocast():
            loss = run.loss_fn(model(xb), yb)
    else:
        with tracker, recipe.autocast():
            loss = run.loss_fn(model(xb), yb)
    recipe.backward(loss, step=step)
    result = recipe.step(optimizer, run.config.clip_grad_norm)
    return loss.detach(), result


@torch.no_grad()
def evaluate(run: Run, *, batch_size: int = 1000) -> tuple[float, float]:
    """Test accuracy (fraction) and mean loss, under the recipe's autocast."""
    model = run.model
    was_training = model.training
    model.eval()
    x, y = run.data.x_test, run.data.y_test
    correct = torch.zeros((), dtype=torch.int64, device=run.device)
    loss_sum = torch.zeros((), dtype=torch.float64, device=run.device)
    for i in range(0, len(x), batch_size):
        xb = x[i:i + batch_size].to(run.device)
        yb = y[i:i + batch_size].to(run.device)
        with run.recipe.autocast():
            logits = model(xb)
            loss = run.loss_fn(logits, yb)
        correct += (logits.argmax(dim=1) == yb).sum()
        loss_sum += loss.double() * len(yb)
    model.train(was_training)
    n = max(len(x), 1)
    return correct.item() / n, loss_sum.item() / n


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


def _memory_sample(run: Run, tracker: SavedTensorTracker, t0_cuda: bool) -> MemoryReport:
    rep = static_memory(run.model, run.optimizer, run.recipe.master)
    rep.activations = tracker.nbytes
    if t0_cuda:
        rep.cuda_peak_allocated = torch.cuda.max_memory_allocated(run.device)
        rep.cuda_peak_reserved = torch.cuda.max_memory_reserved(run.device)
    return rep


def _checkpoint_payload(run: Run, *, epoch: int, batch: int, global_step: int, history, counters) -> dict:
    return {
        "model": run.model.state_dict(),
        "optimizer": run.optimizer.state_dict(),
        "recipe": run.recipe.state_dict(),
        "rng": ckpt_mod.rng_state(),
        "epoch": epoch,
        "batch": batch,
        "global_step": global_step,
        "config": run.config.to_dict(),
        "history": history,
        "counters": counters,
    }


def _params_finite(model: nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def train(config: TrainConfig, *, run: Run | None = None, reporter: Reporter | None = None) -> TrainResult:
    """Train per ``config``; returns per-epoch history and the summary (also written per --metrics-json)."""
    run = run or build_run(config)
    reporter = reporter or Reporter(progress=config.progress)
    recipe, device, loader = run.recipe, run.device, run.train_loader
    reporter.info(recipe.describe())
    reporter.info(
        f"model {config.model} ({sum(p.numel() for p in run.model.parameters()):,} params) on {run.data.name} "
        f"[{len(run.data.x_train):,} train / {len(run.data.x_test):,} test from {run.data.source}], "
        f"device {device} ({hardware.device_name(device)}), {torch.get_num_threads()} threads"
    )

    history: list[dict[str, Any]] = []
    counters = {"skipped_total": 0, "consecutive_skips": 0}
    start_epoch, start_batch, global_step = 0, 0, 0
    if config.resume:
        ck = ckpt_mod.load_checkpoint(config.resume, config=config.to_dict())
        try:
            run.model.load_state_dict(ck["model"])
            run.optimizer.load_state_dict(ck["optimizer"])
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
        if config.out is None or run.rank != 0:
            return
        ckpt_mod.save_checkpoint(
            os.path.join(config.out, ckpt_mod.LAST),
            _checkpoint_payload(run, epoch=epoch, batch=batch, global_step=global_step, history=history,
                                counters=counters),
        )

    stopped: str | None = None
    steps_per_epoch = len(loader)
    total_steps = steps_per_epoch * config.epochs
    if config.max_steps is not None:
        total_steps = min(total_steps, config.max_steps)
    run.model.train()
    with recipe.run_context(), reporter.progress_bar(total=total_steps, completed=global_step) as bar:
        for epoch in range(start_epoch, config.epochs):
            if global_step >= total_steps:
                break
            loader.set_epoch(epoch)
            sample_at = min(1, steps_per_epoch - 1)  # first step after warm-up (optimizer state exists)
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
            for batch_idx, (xb, yb) in enumerate(loader):
                if batch_idx < first:
                    continue
                if global_step >= total_steps:
                    break
                sampled = batch_idx == sample_at
                tracker = None
                if sampled:
                    tracker = SavedTensorTracker(exclude=run.model.parameters())
                    if device.type == "cuda":
                        torch.cuda.reset_peak_memory_stats(device)
                try:
                    loss, res = train_step(run, xb, yb, step=global_step, tracker=tracker)
                except NonFiniteError as e:
                    e.step = global_step
                    stopped = _stop_nonfinite(run, e, epoch, batch_idx, save, reporter)
                    break
                if sampled:
                    mem = _memory_sample(run, tracker, device.type == "cuda")
                global_step += 1
                n_steps += 1
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
                    reporter.log(f"Epoch: {epoch}, Batch: {batch_idx}, Loss: {loss.item():.4f}")
                bar.advance()
                if counters["consecutive_skips"] >= config.max_consecutive_skips:
                    stopped = (
                        f"stopped at step {global_step}: {counters['consecutive_skips']} optimizer steps in a row were "
                        f"skipped for inf/nan gradients (loss scale now {res.scale:g}); the loss itself is likely "
                        "non-finite — lower --lr, add --clip-grad-norm, or run `mixprec doctor` to find the layer"
                    )
                    reporter.error(stopped)
                    break
                if config.checkpoint_every and global_step % config.checkpoint_every == 0:
                    save(epoch, batch_idx + 1)
            _sync(device)
            epoch_time = time.perf_counter() - t_epoch
            counters["skipped_total"] += skipped_epoch
            if n_steps == 0:
                break
            acc, test_loss = evaluate(run)
            curve = torch.stack(losses).float().cpu().tolist()
            rec = {
                "epoch": epoch,
                "steps": n_steps,
                "train_loss": loss_sum.item() / n_steps,
                "test_loss": test_loss,
                "test_accuracy": acc,
                "epoch_time_s": epoch_time,
                "samples_per_s": n_steps * config.batch_size / epoch_time,
                "step_times_s": step_times,
                "loss_curve": curve,
                "skipped_steps": skipped_epoch,
                "loss_scale": res.scale,
                "memory": mem.to_dict() if mem else None,
            }
            history.append(rec)
            reporter.epoch_done(rec, recipe.name)
            if stopped:
                break
            finished_epoch = n_steps + first >= steps_per_epoch
            save(epoch + 1, 0) if finished_epoch else save(epoch, first + n_steps)

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
    if run.config.out and run.rank == 0:
        if _params_finite(run.model):
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


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use `mixprec train` or `python -m mixprec train`")
