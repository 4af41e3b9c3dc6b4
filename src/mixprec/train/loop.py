"""The training loop: epochs, steps, evaluation, logging — one code path for every recipe, on every rank.

It calls :mod:`.step`, :func:`.build.build_run`, :class:`.meter.EpochMeter`, :class:`.checkpointer.Checkpointer`
and :class:`.stops.StopRules`. A step that neither logs, evaluates, checks nor checkpoints reads nothing on the
host: skips and faults stay in a :class:`~mixprec.guard.StepGuard`, and a run that halted stops at the halt,
rewound to the last good state (:func:`_halted`).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Iterator

import torch

from .. import hardware
from ..errors import NonFiniteError
from ..guard import StepGuard
from ..jsonio import write_json
from . import distributed, oom
from .baddata import data_fault
from .build import Run, build_run
from .checkpointer import Checkpointer, TrainState
from .config import TrainConfig
from .contract import as_batch
from .meter import EpochMeter, test_metrics
from .oom import StepOutOfMemoryError
from .report import Reporter, quality, summary_table
from .results import METRIC_KEYS, EvalRecord, RunSummary, TrainResult
from .schedule import planned_steps
from .step import accumulate_step, compile_warmup, evaluate
from .stops import StopRules

__all__ = ["train", "TrainResult", "summarize"]


def train(run: Run | TrainConfig, *, reporter: Reporter | None = None,
          largest_batch: Callable[[Run], int | str] | None = None) -> TrainResult:
    """Train a built run (or build one from a config first); returns the per-epoch records and the summary,
    also written to ``--metrics-json``. ``largest_batch``: what an out-of-memory stop asks for the batch that
    fits (:func:`mixprec.planning.fits.largest_batch`, passed by the entry points above the trainer)."""
    run = build_run(run) if isinstance(run, TrainConfig) else run
    config = run.config
    reporter = reporter or Reporter(progress=config.run.progress, rank=run.rank)
    _announce(run, reporter)
    checkpointer = Checkpointer(run)
    state, resumed = checkpointer.resume()
    total = _total_steps(run)
    if resumed:
        reporter.info(resumed + (_complete(run, state.global_step) if state.global_step >= total else ""))
    stopped: str | None = None
    run.model.train()
    compile_time = _compile(run, reporter) if config.run.compile == "on" else None
    run.ctx.guard = StepGuard(run.device, max_consecutive_skips=config.run.max_consecutive_skips,
                              consecutive_skips=state.consecutive_skips)
    try:
        with run.recipe.run_context(), reporter.progress_bar(total=total, completed=state.global_step) as bar:
            for epoch in range(state.epoch, config.optim.epochs):
                if state.global_step >= total:
                    break
                meter, stopped = _train_epoch(run, state, epoch, total, checkpointer, reporter, bar, largest_batch)
                epoch_time = meter.elapsed()
                state.skipped_total += meter.skipped
                if meter.n_steps == 0:  # the epoch's first step stopped the run, or an old checkpoint taken at
                    if stopped:         # the end of this epoch (then go on with the next)
                        break
                    continue
                rec = meter.record(epoch, epoch_time, *_epoch_evaluation(run, state))
                state.history.append(rec)
                reporter.epoch_done(rec, run.recipe.name)
                stopped = stopped or checkpointer.after_epoch(state, epoch, meter) or StopRules.after_epoch(
                    rec, data=lambda j: data_fault(run, epoch=epoch, position=j * config.optim.grad_accum),
                    first_step=state.global_step - meter.n_steps)
                if stopped:
                    break
    finally:
        run.ctx.guard = None
    if stopped:
        reporter.stopped(stopped, step=state.global_step, world_size=run.world_size)
    summary = summarize(run, state, stopped, compile_time_s=compile_time)
    reporter.summary(summary_table([summary]))
    _write_metrics(run, state, summary)
    if run.lock is not None:  # the folder is complete: another run may write it now
        run.lock.release()
    distributed.barrier()  # no rank returns (and exits) before rank 0 has written its checkpoint and metrics
    return TrainResult(history=state.history, summary=summary, stopped=stopped, evals=state.evals)


def _train_epoch(run: Run, state: TrainState, epoch: int, total: int, checkpointer: Checkpointer,
                 reporter: Reporter, bar, largest_batch=None) -> tuple[EpochMeter, str | None]:
    """The steps of one epoch; returns its meter and why the run must stop (or None)."""
    loader, accum, log_every = run.train_loader, run.config.optim.grad_accum, run.config.run.log_every
    eval_every = run.config.run.eval_every
    loader.set_epoch(epoch)
    first, state.batch = state.batch, 0  # a resumed epoch starts mid-way, the next ones at 0
    partial, state.partial = state.partial, None
    meter = EpochMeter(run, sample_at=min(1, math.ceil(len(loader) / accum) - 1) * accum, first_batch=first,
                       partial=partial, guard=run.ctx.guard)
    stops = StopRules(run)
    for batch_idx, micro_batches in _step_batches(loader, accum, first):
        if state.global_step >= total:
            break
        tracker = meter.tracker_for(batch_idx)
        if run.schedule is not None:
            run.schedule.apply(run.optimizer, state.global_step)
        try:
            loss, res = accumulate_step(run.ctx, micro_batches, step=state.global_step, tracker=tracker)
        except NonFiniteError as e:  # raised inside the step (the watch's stop): an earlier halt comes first
            halted = _halted(run, state, epoch, checkpointer, meter, stops)
            if halted:
                return meter, halted
            return meter, _stop_nonfinite(run, e.what, state.global_step, state, epoch, batch_idx, checkpointer, meter,
                                          micro_batches)
        except StepOutOfMemoryError as e:  # nothing is saved (a half-done step leaves the state suspect)
            text = oom.message(run, e, step=state.global_step, epoch=epoch, batch=batch_idx, kept=checkpointer.intact(),
                               largest_batch=largest_batch)
            distributed.stop_alone(text)
            raise StepOutOfMemoryError(text, phase=e.phase) from None
        meter.step_done(loss, res, batch_idx + len(micro_batches), tracker, start=batch_idx)
        state.global_step += 1
        logs = bool(log_every) and batch_idx % log_every == 0
        evals = bool(eval_every) and state.global_step % eval_every == 0
        if logs or evals or stops.due(state.global_step) or checkpointer.due(state.global_step):
            halted = _halted(run, state, epoch, checkpointer, meter, stops)  # the host reads here anyway
            if halted:
                return meter, halted
        if logs:
            reporter.log(f"Epoch: {epoch}, Batch: {batch_idx}, "
                         f"Loss: {distributed.mean_over_ranks(loss).item():.4f}")
        bar.advance()
        if evals:
            with meter.paused():
                _evaluate_mid_run(run, state, epoch, reporter)
        rule = stops.after_step(state, meter.skipped)
        if rule:  # nothing is saved: the ranks' states differ
            return meter, ((checkpointer.save(state, epoch, meter.pos, meter) if rule.save else None) or rule.reason)
        stop = checkpointer.after_step(state, epoch, meter)
        if stop:
            return meter, stop
    return meter, _halted(run, state, epoch, checkpointer, meter, stops)


def _halted(run: Run, state: TrainState, epoch: int, checkpointer: Checkpointer, meter: EpochMeter,
            stops: StopRules) -> str | None:
    """Read the step guard (one host read): why the run must stop if it halted since the last read, else None.
    Position, step and epoch sums are rewound to the last good state, which is saved."""
    reading = run.ctx.guard.read()
    state.consecutive_skips = reading.consecutive
    if not reading.halted:
        return None
    kept = reading.step + (1 if reading.what == "skips" else 0)  # the steps before the fault, or through the limit
    meter.rewind(meter.n_steps - (state.global_step - kept))
    state.global_step = kept
    if reading.what != "skips":
        return _stop_nonfinite(run, reading.what, kept, state, epoch, meter.pos, checkpointer, meter, None)
    rule = stops.too_many_skips(state, data=lambda: data_fault(run, epoch=epoch, position=meter.last_start))
    return (checkpointer.save(state, epoch, meter.pos, meter) if rule.save else None) or rule.reason


def _evaluate_mid_run(run: Run, state: TrainState, epoch: int, reporter: Reporter) -> None:
    """An ``--eval-every`` evaluation: its record goes to ``state.evals`` (and checkpoints, the JSON)."""
    t0 = time.perf_counter()
    metrics, loss = state.last_eval = evaluate(run.ctx, run.data)
    lr = run.optimizer.param_groups[0]["lr"]
    rec = EvalRecord(step=state.global_step, epoch=epoch, lr=float(lr), **test_metrics(run.task, metrics, loss),
                     eval_time_s=time.perf_counter() - t0)
    state.evals.append(rec)
    reporter.info(f"[{run.recipe.name}] step {rec.step} (epoch {epoch}): {quality(rec)}, lr {rec.lr:.3g}")


def _epoch_evaluation(run: Run, state: TrainState) -> tuple[dict[str, float | None], float]:
    """The end-of-epoch evaluation, unless ``--eval-every`` just evaluated this very step."""
    last = state.last_eval
    if state.evals and state.evals[-1].step == state.global_step and last is not None:
        return last
    return evaluate(run.ctx, run.data)


def _compile(run: Run, reporter: Reporter) -> float:
    """Compile before the clock starts: the first batch's shape, and the epoch's last (smaller) one."""
    loader, batch_size = run.train_loader, run.config.optim.batch_size
    loader.set_epoch(0)
    first = as_batch(next(iter(loader)))
    shapes = [first]
    rest = loader.num_samples % batch_size
    if rest and rest < len(first):
        shapes.append(first.head(rest))
    with run.recipe.run_context():
        seconds = compile_warmup(run.ctx, shapes)
    reporter.info(f"torch.compile: {seconds:.1f} s to compile {len(shapes)} batch shape(s), not counted in "
                  "epoch times")
    return seconds


def _step_batches(loader, accum: int, first: int) -> Iterator[tuple[int, list]]:
    """Yield ``(index of the first batch, [accum consecutive batches])`` per optimizer step, from batch
    ``first`` on (the last group of an epoch may be shorter)."""
    group: list = []
    for batch_idx, batch in enumerate(loader.iter_from(first), start=first):
        group.append(batch)
        if len(group) == accum:
            yield batch_idx - accum + 1, group
            group = []
    if group:
        yield len(loader) - len(group), group


def _total_steps(run: Run) -> int:
    cfg = run.config.optim
    return planned_steps(cfg.epochs, len(run.train_loader), cfg.grad_accum, cfg.max_steps)


def _complete(run: Run, step: int) -> str:
    """Why a resumed run has nothing left to train, and how to extend it."""
    o = run.config.optim
    limits = f"--epochs {o.epochs}" + (f", --max-steps {o.max_steps}" if o.max_steps is not None else "")
    return (f"; the run is already complete at step {step} ({limits}): pass a larger --epochs"
            + (" or --max-steps (none: no limit)" if o.max_steps is not None else "") + " to train further")


def _announce(run: Run, reporter: Reporter) -> None:
    cfg, device = run.config, run.device
    reporter.info(run.recipe.describe())
    reporter.info(
        f"model {cfg.model.name} ({sum(p.numel() for p in run.model.parameters()):,} params) on {run.data.name} "
        f"[{run.data.n_train:,} train / {run.data.n_test:,} test from {run.data.source}], "
        f"device {device} ({hardware.device_name(device)}), {torch.get_num_threads()} threads"
    )
    for note in run.notes:
        reporter.info(note)
    if run.schedule is not None:
        reporter.info(run.schedule.describe())
    if run.world_size > 1 or cfg.optim.grad_accum > 1:
        per_step = cfg.optim.batch_size * cfg.optim.grad_accum * run.world_size
        reporter.info(
            f"{run.world_size} process(es), strategy {cfg.run.strategy}: batch {cfg.optim.batch_size} x "
            f"{cfg.optim.grad_accum} accumulated x {run.world_size} rank(s) = {per_step} samples per optimizer "
            "step; logs and checkpoints from rank 0, metrics averaged over ranks"
        )


def _stop_nonfinite(run: Run, what: str, step: int, state: TrainState, epoch: int, batch_idx: int,
                    checkpointer: Checkpointer, meter: EpochMeter, batches: list | None) -> str:
    """Save the last good state (if it is still finite) and explain what to do: fix the data when the step's
    batch held inf/nan (``batches``; None: fetched again by position), else the recipe's remedies."""
    kept = checkpointer.keep_last_good(state, epoch, batch_idx, step, meter)
    data = data_fault(run, epoch=epoch, position=batch_idx, batches=batches)
    head = f"non-finite {what} at step {step} (epoch {epoch}, batch {batch_idx}) with {run.recipe.name}"
    if data:
        return f"{head}: the batch {data}{kept}"
    return f"{head}, which has no loss scaler to skip such steps{kept}. Remedies: {run.recipe.nonfinite_remedies()}"


def summarize(run: Run, state: TrainState, stopped: str | None, *, compile_time_s: float | None = None) -> RunSummary:
    """The run's summary row (the table, ``--metrics-json`` and bench read it)."""
    cfg = run.config
    return RunSummary.from_history(
        state.history, stopped=stopped, skipped_steps=state.skipped_total, recipe=run.recipe.name,
        impl=run.recipe.impl, model=cfg.model.name, dataset=run.data.name, device=str(run.device),
        world_size=run.world_size, strategy=cfg.run.strategy, grad_accum=cfg.optim.grad_accum,
        compile_time_s=compile_time_s, task=run.task.name, metric=METRIC_KEYS[run.task.main])


def _write_metrics(run: Run, state: TrainState, summary: RunSummary) -> None:
    path = run.config.run.metrics_json
    if not path or run.rank != 0:
        return
    write_json(path, {"config": run.config.to_dict(), "environment": hardware.environment(run.device),
                      "recipe": run.recipe.describe(), "epochs": state.history, "evals": state.evals,
                      "summary": summary})


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use `mixprec train` or `python -m mixprec train`")
