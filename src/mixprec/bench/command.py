"""``mixprec bench``: the same training under several recipes, side by side.

What one invocation does, one function each:

- :func:`plan`: checks everything it can before any run starts (recipe names, flag contradictions per
  recipe, the dataset, that warm-up leaves timed steps), so mistakes exit 2 at once, not after an hour of
  runs; builds the fp32 run once (the one build path) to count the model's FLOPs per step.
- :func:`measure_machine`: counts those FLOPs (:mod:`mixprec.bench.flops`) and measures the peak matmul
  rate of every dtype the recipes use (:func:`mixprec.bench.measure.measure_matmul_peak`); prints the
  hardware preflight, one line per recipe (:mod:`mixprec.bench.preflight`).
- :func:`mixprec.bench.runner.execute_matrix`: the (recipe, repeat) matrix, each run in a fresh
  subprocess, one line per finished run.
- :func:`report`: the comparison table, ``results.json``, ``results.md`` and the PNG plots in ``--out``.

Exit status: 0 when every run succeeded, 1 when any failed (their rows say why), 2 for usage errors.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import math
import os
import shlex
import sys
from typing import Any

from ..errors import ConfigError
from ..train.args import add_train_arguments, config_from_args

__all__ = ["add_parser", "bench_main", "plan", "measure_machine", "report", "Plan", "DEFAULT_PRECISIONS"]

DEFAULT_PRECISIONS = "fp32,amp,bf16-mixed"


def add_parser(sub) -> argparse.ArgumentParser:
    """Add ``bench`` to the CLI's subparsers (called by :func:`mixprec.cli.build_parser`)."""
    p = sub.add_parser(
        "bench", help="run several precision recipes side by side and compare them",
        description="Train the same model under several precision recipes, each (recipe, repeat) in a fresh "
                    "process, and compare memory, epoch time, throughput, MFU, accuracy and convergence "
                    "parity against fp32. Every `mixprec train` flag applies to every run.",
    )
    add_train_arguments(p, with_precision=False)
    g = p.add_argument_group("bench")
    g.add_argument("--precisions", default=DEFAULT_PRECISIONS, metavar="R1,R2,...",
                   help=f"comma-separated recipes to compare (default {DEFAULT_PRECISIONS}); include fp32 for "
                        "the speedup, memory-saving, accuracy-delta and parity columns")
    g.add_argument("--repeats", type=int, default=2,
                   help="runs per recipe, with seeds seed, seed+1, ... (default 2; parity needs >= 2)")
    g.add_argument("--out", default=None, metavar="DIR",
                   help="write results.json, results.md, plots and per-run logs here "
                        "(default runs/bench-YYYYmmdd-HHMMSS)")
    g.add_argument("--warmup-steps", type=int, default=3,
                   help="steps at the start of every epoch left out of the timings (default 3)")
    g.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="give up on a run after S seconds (its row says so; default: no limit)")
    g.add_argument("--peak-seconds", type=float, default=1.0, metavar="S",
                   help="time budget of the peak-matmul micro-benchmark, per dtype (default 1.0)")
    g.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    # Bench keeps .item() and logging out of the timed steps, and each run's output goes to its log file.
    p.set_defaults(func=bench_main, log_every=0, progress="off")
    return p


def bench_main(args: argparse.Namespace) -> int:
    """``mixprec bench``: plan, measure the machine, execute the matrix, report. Exit 0, 1 (a run failed) or 2."""
    p = plan(args)
    machine = measure_machine(p)
    return report(p, machine, execute_matrix_for(p))[0]


def execute_matrix_for(p: Plan) -> list[dict[str, Any]]:
    """Run the planned matrix, one line per finished run."""
    from .runner import execute_matrix

    return execute_matrix(p.specs, p.out_dir, timeout=p.args.timeout, on_done=_progress_line)


# ------------------------------------------------------------------------------------------ planning


@dataclasses.dataclass
class Plan:
    """Everything decided before the first run."""

    args: argparse.Namespace
    recipes: list[str]
    configs: dict[str, Any]
    """Recipe name -> its TrainConfig."""
    checks: dict[str, Any]
    """Recipe name -> its :class:`~mixprec.bench.preflight.Preflight`."""
    impl: dict[str, str]
    reference: Any
    """The fp32 :class:`~mixprec.train.build.Run` the FLOPs are counted on."""
    specs: list[Any]
    seeds: list[int]
    out_dir: str

    @property
    def base(self):
        return self.configs[self.recipes[0]]

    @property
    def accum(self) -> int:
        return self.base.optim.grad_accum


def _recipes(text: str) -> list[str]:
    from ..precision import resolve_recipe

    names: list[str] = []
    for part in text.split(","):
        if part.strip():
            name = resolve_recipe(part).name
            if name not in names:
                names.append(name)
    if not names:
        raise ConfigError(f"--precisions {text!r} names no recipe; e.g. --precisions {DEFAULT_PRECISIONS}")
    return names


def _check_flags(args: argparse.Namespace) -> None:
    if args.repeats < 1:
        raise ConfigError(f"--repeats {args.repeats} must be >= 1")
    if args.warmup_steps < 0:
        raise ConfigError(f"--warmup-steps {args.warmup_steps} must be >= 0")
    if args.timeout is not None and not args.timeout > 0:
        raise ConfigError(f"--timeout {args.timeout} must be a positive number of seconds")
    if not args.peak_seconds > 0:
        raise ConfigError(f"--peak-seconds {args.peak_seconds} must be positive")
    if args.log_every:
        raise ConfigError("--log-every: bench keeps logging and .item() out of the timed steps; drop the flag "
                          "(each run's output is in OUT/logs/)")
    if args.strategy not in ("auto", "none"):
        raise ConfigError(f"--strategy {args.strategy}: bench runs single-process; drop --strategy "
                          "(run `torchrun ... mixprec train --strategy ...` per recipe instead)")


def plan(args: argparse.Namespace) -> Plan:
    """Check every flag and recipe, build the reference run, lay out the matrix; raises UsageError (exit 2)."""
    from .. import hardware
    from ..precision import RecipeConfig, build_recipe
    from ..train.build import build_run
    from .preflight import preflight
    from .runner import RunSpec

    _check_flags(args)
    recipes = _recipes(args.precisions)
    base = config_from_args(args, out=None, metrics_json=None, resume=None, checkpoint_every=None,
                            log_every=0, progress="off")
    device = hardware.resolve_device(base.run.device)
    configs, checks, impl = {}, {}, {}
    for name in recipes:
        recipe_config, notes = base.recipe.for_recipe(name)
        configs[name] = dataclasses.replace(base, recipe=recipe_config)
        configs[name].validate()
        recipe = build_recipe(recipe_config, device=device, seed=base.run.seed)
        checks[name], impl[name] = preflight(recipe, notes), recipe.impl
    reference = build_run(dataclasses.replace(base, recipe=RecipeConfig()))
    _check_warmup(args, base, len(reference.train_loader))
    seeds = [base.run.seed + r for r in range(args.repeats)]
    specs = [RunSpec(recipe=name, repeat=r, seed=seeds[r],
                     config=configs[name].with_flags(seed=seeds[r]).to_dict(), warmup_steps=args.warmup_steps)
             for r in range(args.repeats) for name in recipes]
    out_dir = args.out or os.path.join("runs", "bench-" + _dt.datetime.now().strftime("%Y%m%d-%H%M%S"))
    os.makedirs(out_dir, exist_ok=True)
    return Plan(args=args, recipes=recipes, configs=configs, checks=checks, impl=impl, reference=reference,
                specs=specs, seeds=seeds, out_dir=out_dir)


def _check_warmup(args: argparse.Namespace, base, n_batches: int) -> None:
    accum, max_steps = base.optim.grad_accum, base.optim.max_steps
    steps_per_epoch = math.ceil(n_batches / accum)
    first_epoch = min(steps_per_epoch, max_steps or steps_per_epoch)
    if args.warmup_steps >= first_epoch:
        raise ConfigError(
            f"--warmup-steps {args.warmup_steps} leaves no timed step: the first epoch has {first_epoch} steps "
            f"({n_batches} batches of {base.optim.batch_size}"
            + (f" / --grad-accum {accum}" if accum > 1 else "")
            + (f", --max-steps {max_steps}" if max_steps else "")
            + "); lower --warmup-steps or train longer")


# ------------------------------------------------------------------------------------------ measuring


@dataclasses.dataclass
class Machine:
    """What was measured before the matrix: model FLOPs, peak matmul rates, the environment."""

    flops: Any
    peaks: dict[str, dict[str, Any]]
    env: dict[str, Any]


def measure_machine(p: Plan) -> Machine:
    """Count the model's FLOPs per step and measure the peak matmul rate of every dtype in play; print the
    preflight."""
    import torch

    from .. import hardware
    from .flops import count_step_flops
    from .measure import measure_matmul_peak

    ref = p.reference
    ref.train_loader.set_epoch(0)
    xb, yb = next(iter(ref.train_loader))  # one micro-batch; an optimizer step runs `accum` of them
    flops = count_step_flops(ref.model, xb.to(ref.device), yb.to(ref.device), ref.loss_fn)
    peaks = {}
    for dt in dict.fromkeys(c.matmul_dtype for c in p.checks.values()):
        dtype = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dt]
        peaks[dt] = measure_matmul_peak(dtype, ref.device, budget_s=p.args.peak_seconds, tf32=(dt == "tf32"))
    env = _environment(ref.device)
    _announce(p, flops, peaks, env)
    p.reference = None  # the reference run's model and data are not needed any more
    return Machine(flops=flops, peaks=peaks, env=env)


def _environment(device) -> dict[str, Any]:
    import numpy

    from .. import __version__, hardware

    env = {"mixprec": __version__, **hardware.environment(device), "numpy": numpy.__version__}
    try:
        import matplotlib

        env["matplotlib"] = matplotlib.__version__
    except ImportError:
        env["matplotlib"] = None
    return env


def _say(msg: str = "") -> None:
    print(msg, flush=True)


def _announce(p: Plan, flops, peaks: dict, env: dict) -> None:
    base, accum = p.base, p.accum
    _say(f"mixprec bench: {', '.join(p.recipes)} x {p.args.repeats} repeat(s) — {base.model.name} on "
         f"{base.data.name}, batch {base.optim.batch_size}, {base.optim.epochs} epoch(s)"
         + (f", max {base.optim.max_steps} steps" if base.optim.max_steps else "")
         + f"; {env['device_name']}, {env['threads']} threads")
    _say(f"model FLOPs per step: {flops.total * accum:,} (per batch of {base.optim.batch_size}: forward "
         f"{flops.forward:,}, backward {flops.backward:,}" + (f"; x{accum} micro-batches" if accum > 1 else "") + ")")
    _say("peak matmul rate measured now: " + ", ".join(
        f"{k} {v['flops_per_s'] / 1e9:,.1f} GFLOP/s" for k, v in peaks.items()))
    for name in p.recipes:
        _say(f"preflight: {p.checks[name].line}")


def _progress_line(i: int, n: int, r: dict[str, Any]) -> None:
    head = f"[{i}/{n}] {r['recipe']} seed {r['seed']}:"
    if r["status"] != "ok":
        _say(f"{head} FAILED — {r.get('reason')}")
        return
    t, s = r.get("timing") or {}, r.get("summary") or {}
    et = t.get("epoch_time_s")
    sps = t.get("samples_per_s")
    _say(f"{head} {et:.3f} s/epoch, {sps:,.0f} samples/s, train loss {s.get('final_train_loss', math.nan):.4f}, "
         f"test accuracy {100 * s.get('test_accuracy', math.nan):.2f}%, {r.get('process_wall_s', 0):.1f} s wall"
         if et and sps else f"{head} done (no timed steps), {r.get('process_wall_s', 0):.1f} s wall")


# ------------------------------------------------------------------------------------------ reporting


def report(p: Plan, machine: Machine, results: list[dict[str, Any]]) -> tuple[int, dict[str, Any]]:
    """Print the table, write results.json / results.md / plots; returns the exit status and the document."""
    from ..train.report import write_json
    from .report import COLUMNS, aggregate, markdown_report, table

    accum, flops = p.accum, machine.flops
    rows = aggregate(p.recipes, results, flops_per_step=flops.total * accum, peaks=machine.peaks,
                     matmul_dtype={n: p.checks[n].matmul_dtype for n in p.recipes}, impl=p.impl)
    created = _dt.datetime.now().astimezone().isoformat(timespec="seconds")
    doc: dict[str, Any] = {
        "schema": "mixprec.bench/2",
        "created": created,
        "command": "mixprec bench " + " ".join(shlex.quote(a) for a in sys.argv[2:])
        if sys.argv[1:2] == ["bench"] else "mixprec bench (called in-process)",
        "flags": {k: v for k, v in vars(p.args).items() if k != "func"},
        "config": p.base.to_dict(),
        "recipes": p.recipes,
        "repeats": p.args.repeats,
        "seeds": p.seeds,
        "warmup_steps": p.args.warmup_steps,
        "environment": machine.env,
        "preflight": [p.checks[n].to_dict() for n in p.recipes],
        "peaks": machine.peaks,
        "flops_per_step": {**flops.to_dict(), "micro_batches_per_step": accum, "per_step": flops.total * accum},
        "columns": list(COLUMNS),
        "summary": rows,
        "runs": results,
        "plots": [],
    }
    if not p.args.no_plots:
        from .plots import write_plots

        title = (f"{p.base.model.name} on {p.base.data.name}, batch {p.base.optim.batch_size} — "
                 f"{machine.env['device_name']}, {created[:10]}")
        doc["plots"] = write_plots(rows, results, p.out_dir, title=title)
    _say("")
    _say(table(rows))
    write_json(os.path.join(p.out_dir, "results.json"), doc)
    with open(os.path.join(p.out_dir, "results.md"), "w", encoding="utf-8") as f:
        f.write(markdown_report(doc))
    _say(f"\nwrote {p.out_dir}/results.json, results.md" + (", " + ", ".join(doc["plots"]) if doc["plots"] else "")
         + " and logs/")
    failed = sum(r["status"] != "ok" for r in results)
    if failed:
        _say(f"mixprec bench: {failed} of {len(results)} runs failed; their rows and {p.out_dir}/logs/ say why")
    return (1 if failed else 0), doc
