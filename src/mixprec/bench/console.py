"""What a bench prints while it works: what it will run and on what, one line per finished run (any field may be
missing: a dash)."""

from __future__ import annotations

from typing import Any

from .machine import Machine
from .plan import Plan
from .report import fmt
from .results import RunResult, number, ratio

__all__ = ["say", "announce", "progress_line"]


def say(msg: str = "") -> None:
    print(msg, flush=True)


def announce(p: Plan, machine: Machine) -> None:
    """The bench, the machine, the model's FLOPs, the peaks and one preflight line per recipe."""
    base, accum, env, flops = p.base, p.accum, machine.env, machine.flops
    say(f"mixprec bench: {', '.join(p.recipes)} x {p.config.repeats} repeat(s) — {base.model.name} on "
        f"{base.data.name}, batch {base.optim.batch_size}, {base.optim.epochs} epoch(s)"
        + (f", max {base.optim.max_steps} steps" if base.optim.max_steps else "")
        + f"; {env['device_name']}, {env['threads']} threads")
    if p.previous is not None:
        say(f"resuming {p.out_dir} (invocation {p.invocation}): kept {len(p.kept)} finished run(s) of "
            f"{len(p.specs)}, running {len(p.to_run)}"
            + (f" ({', '.join(s.name for s in p.to_run)})" if p.to_run else ""))
    say(f"model FLOPs per step: {flops.total * accum:,} (per batch of {base.optim.batch_size}: forward "
        f"{flops.forward:,}, backward {flops.backward:,}" + (f"; x{accum} micro-batches" if accum > 1 else "") + ")")
    if flops.uncounted:
        say(f"FLOPs unknown (not counted, so MFU is low by their share) for: {', '.join(flops.uncounted)}")
    say("peak matmul rate measured now: " + ", ".join(
        f"{k} {v['flops_per_s'] / 1e9:,.1f} GFLOP/s" for k, v in machine.peaks.items()))
    for name in p.recipes:
        say(f"preflight: {p.checks[name].line}")


def progress_line(i: int, n: int, r: RunResult | dict[str, Any]) -> None:
    """One line per finished run."""
    r = r if isinstance(r, RunResult) else RunResult.from_dict(r)
    head = f"[{i}/{n}] {r.recipe} seed {r.seed}:"
    wall = fmt(r.process_wall_s, ".1f", suffix=" s wall")
    if not r.ok:
        say(f"{head} FAILED — {r.reason}")
        return
    t, s = r.timing, r.summary
    if not (number(t.epoch_time_s) and number(t.samples_per_s)):
        say(f"{head} done (no timed steps), {wall}")
        return
    say(f"{head} {fmt(t.epoch_time_s, '.3f')} s/epoch, {fmt(t.samples_per_s, ',.0f')} samples/s, "
        f"train loss {fmt(s.get('final_train_loss'), '.4f')}, "
        + _quality(s) + _busy(r) + f", {wall}")


def _busy(r: RunResult) -> str:
    """CUDA: the device's busy share of the timed step; nothing where it was not measured."""
    share = ratio(r.device_busy.busy_s, r.timing.step_time_s)
    return "" if share is None else f", device busy {share:.0%} of the step"


def _quality(s: dict[str, Any]) -> str:
    metric = s.get("metric")
    if s.get("bits_per_char") is not None:
        return f"test loss {fmt(s.get('test_loss'), '.4f')}, {fmt(s.get('bits_per_char'), '.3f')} bits/char"
    if isinstance(metric, str) and metric != "test_accuracy":
        return f"{metric.replace('_', ' ')} {fmt(s.get(metric), '.4f')}"
    return f"test accuracy {fmt(s.get('test_accuracy'), '.2f', scale=100, suffix='%')}"
