"""``mixprec bench``: the same training under several recipes, side by side.

What one invocation does, in order:

1. Checks everything it can before any run starts (recipe names, flag contradictions per recipe, the
   dataset, that warm-up leaves timed steps), so mistakes exit 2 at once, not after an hour of runs.
2. Counts the model's FLOPs per step once (:mod:`mixprec.bench.flops`) and measures the peak matmul
   rate of every dtype the recipes use (:func:`mixprec.bench.measure.measure_matmul_peak`).
3. Prints the hardware preflight, one line per recipe (:mod:`mixprec.bench.preflight`).
4. Runs the (recipe, repeat) matrix, each run in a fresh subprocess (:mod:`mixprec.bench.runner`),
   printing one line per finished run.
5. Prints the comparison table and writes ``results.json``, ``results.md`` and the PNG plots to ``--out``.

Exit status: 0 when every run succeeded, 1 when any failed (their rows say why), 2 for usage errors.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import math
import os
import platform
import shlex
import sys
from typing import Any

from ..errors import ConfigError

__all__ = ["add_parser", "run", "DEFAULT_PRECISIONS"]

DEFAULT_PRECISIONS = "fp32,amp,bf16-mixed"


def add_parser(sub) -> argparse.ArgumentParser:
    """Add ``bench`` to the CLI's subparsers (called by :func:`mixprec.cli.build_parser`)."""
    from .. import cli  # lazy: cli imports this module

    p = sub.add_parser(
        "bench", help="run several precision recipes side by side and compare them",
        description="Train the same model under several precision recipes, each (recipe, repeat) in a fresh "
                    "process, and compare memory, epoch time, throughput, MFU, accuracy and convergence "
                    "parity against fp32. Every `mixprec train` flag applies to every run.",
    )
    cli.add_train_arguments(p, with_precision=False)
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
    p.set_defaults(func=run, log_every=0, progress="off")
    return p


# ------------------------------------------------------------------------------------------ planning


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
    if args.strategy != "none":
        raise ConfigError(f"--strategy {args.strategy}: bench runs single-process; drop --strategy "
                          "(run `torchrun ... mixprec train --strategy ...` per recipe instead)")


def _run_config(args: argparse.Namespace, recipe: str):
    """The TrainConfig of ``recipe``: the user's flags, logging off, no checkpoints."""
    from .. import cli
    from ..precision import resolve_recipe

    spec = resolve_recipe(recipe)
    # --stochastic-rounding only means something for recipes with low-precision params; fp32-param recipes
    # in the same matrix run without it (the preflight says so) instead of failing the whole bench.
    sr = bool(args.stochastic_rounding) and spec.param_dtype.itemsize < 4
    return cli.config_from_args(args, precision=recipe, out=None, metrics_json=None, resume=None,
                                checkpoint_every=None, log_every=0, progress="off", stochastic_rounding=sr)


def _environment(device) -> dict[str, Any]:
    import numpy
    import torch

    from .. import __version__, hardware
    from .preflight import RELEVANT_CPU_FLAGS

    env = {
        "mixprec": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "platform": platform.platform(),
        "device": str(device),
        "device_name": hardware.device_name(device),
        "cpu": hardware.cpu_name(),
        "cpu_flags": [f for f in RELEVANT_CPU_FLAGS if f in hardware.cpu_flags()],
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "gpu": None,
    }
    if device.type == "cuda":
        env["gpu"] = {"name": torch.cuda.get_device_name(device),
                      "capability": list(torch.cuda.get_device_capability(device)),
                      "cuda": torch.version.cuda}
    try:
        import matplotlib

        env["matplotlib"] = matplotlib.__version__
    except ImportError:
        env["matplotlib"] = None
    return env


def _flops(config, data, device):
    import torch
    import torch.nn.functional as F

    from ..train.models import build_model
    from .flops import count_step_flops

    torch.manual_seed(config.seed)
    model = build_model(config.model, input_shape=data.input_shape, num_classes=data.num_classes,
                        width=config.width, depth=config.depth, channels=config.channels, d_model=config.d_model,
                        n_heads=config.n_heads, n_layers=config.n_layers, patch_size=config.patch_size).to(device)
    n = min(config.batch_size, len(data.x_train))
    return count_step_flops(model, data.x_train[:n].to(device), data.y_train[:n].to(device), F.cross_entropy)


# --------------------------------------------------------------------------------------------- run


def _say(msg: str = "") -> None:
    print(msg, flush=True)


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


def run(args: argparse.Namespace) -> int:
    from .. import hardware
    from ..precision import ScalerConfig, build_recipe
    from ..train.data import load_dataset
    from ..train.report import write_json
    from .measure import measure_matmul_peak
    from .preflight import preflight
    from .report import aggregate, markdown_report, table
    from .runner import RunSpec, run_matrix

    import torch

    # 1. everything that can be wrong is checked before the first run
    _check_flags(args)
    recipes = _recipes(args.precisions)
    configs = {name: _run_config(args, name) for name in recipes}
    for c in configs.values():
        c.validate()
    base = configs[recipes[0]]
    device = hardware.resolve_device(base.device)
    built = {}
    for name, c in configs.items():
        built[name] = build_recipe(
            name, device=device, amp_impl=c.amp_impl, stochastic_rounding=c.stochastic_rounding, seed=c.seed,
            keep_fp32=tuple(c.keep_fp32),
            scaler=ScalerConfig(init_scale=c.init_scale, growth_factor=c.growth_factor,
                                backoff_factor=c.backoff_factor, growth_interval=c.growth_interval,
                                hysteresis=c.hysteresis),
        )
    data = load_dataset(base.dataset, data_dir=base.data_dir, seed=base.seed, synthetic_train=base.synthetic_train,
                        synthetic_test=base.synthetic_test, synthetic_shape=tuple(base.synthetic_shape),
                        limit_train=base.limit_train, limit_test=base.limit_test)
    accum = getattr(base, "grad_accum", 1)
    steps_per_epoch = math.ceil(math.ceil(len(data.x_train) / base.batch_size) / accum)
    first_epoch = min(steps_per_epoch, base.max_steps or steps_per_epoch)
    if args.warmup_steps >= first_epoch:
        raise ConfigError(
            f"--warmup-steps {args.warmup_steps} leaves no timed step: the first epoch has {first_epoch} steps "
            f"({len(data.x_train)} samples / batch {base.batch_size}"
            + (f" / --grad-accum {accum}" if accum > 1 else "")
            + (f", --max-steps {base.max_steps}" if base.max_steps else "")
            + "); lower --warmup-steps or train longer")
    out_dir = args.out or os.path.join("runs", "bench-" + _dt.datetime.now().strftime("%Y%m%d-%H%M%S"))
    os.makedirs(out_dir, exist_ok=True)

    # 2. model FLOPs once, peak matmul rates of the dtypes in play
    flops = _flops(base, data, device)  # one micro-batch; an optimizer step runs `accum` of them
    del data
    checks = {name: preflight(r) for name, r in built.items()}
    peaks = {}
    for dt in dict.fromkeys(p.matmul_dtype for p in checks.values()):
        dtype = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dt]
        peaks[dt] = measure_matmul_peak(dtype, device, budget_s=args.peak_seconds, tf32=(dt == "tf32"))

    # 3. preflight
    env = _environment(device)
    _say(f"mixprec bench: {', '.join(recipes)} x {args.repeats} repeat(s) — {base.model} on {base.dataset}, "
         f"batch {base.batch_size}, {base.epochs} epoch(s)" + (f", max {base.max_steps} steps" if base.max_steps
                                                                 else "")
         + f"; {env['device_name']}, {env['threads']} threads")
    _say(f"model FLOPs per step: {flops.total * accum:,} (per batch of {base.batch_size}: forward "
         f"{flops.forward:,}, backward {flops.backward:,}" + (f"; x{accum} micro-batches" if accum > 1 else "") + ")")
    _say("peak matmul rate measured now: " + ", ".join(
        f"{k} {v['flops_per_s'] / 1e9:,.1f} GFLOP/s" for k, v in peaks.items()))
    for name in recipes:
        line = checks[name].line
        if args.stochastic_rounding and not configs[name].stochastic_rounding:
            line += "; --stochastic-rounding does not apply (fp32 params) and is off for this recipe"
        _say(f"preflight: {line}")

    # 4. the matrix
    seeds = [base.seed + r for r in range(args.repeats)]
    specs = [RunSpec(recipe=name, repeat=r, seed=seeds[r],
                     config=dataclasses.replace(configs[name], seed=seeds[r]).to_dict(),
                     warmup_steps=args.warmup_steps)
             for r in range(args.repeats) for name in recipes]
    runs = run_matrix(specs, out_dir, timeout=args.timeout, on_done=_progress_line)

    # 5. report
    rows = aggregate(recipes, runs, flops_per_step=flops.total * accum, peaks=peaks,
                     matmul_dtype={n: checks[n].matmul_dtype for n in recipes},
                     impl={n: built[n].impl for n in recipes})
    doc: dict[str, Any] = {
        "schema": "mixprec.bench/1",
        "created": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": "mixprec bench " + " ".join(shlex.quote(a) for a in sys.argv[2:])
        if sys.argv[1:2] == ["bench"] else "mixprec bench (called in-process)",
        "flags": {k: v for k, v in vars(args).items() if k != "func"},
        "config": base.to_dict(),
        "recipes": recipes,
        "repeats": args.repeats,
        "seeds": seeds,
        "warmup_steps": args.warmup_steps,
        "environment": env,
        "preflight": [checks[n].to_dict() for n in recipes],
        "peaks": peaks,
        "flops_per_step": {**flops.to_dict(), "micro_batches_per_step": accum, "per_step": flops.total * accum},
        "columns": list(_columns()),
        "summary": rows,
        "runs": runs,
        "plots": [],
    }
    title = (f"{base.model} on {base.dataset}, batch {base.batch_size} — {env['device_name']}, "
             f"{doc['created'][:10]}")
    if not args.no_plots:
        doc["plots"] = _plots(rows, runs, out_dir, title)
    _say("")
    _say(table(rows))
    write_json(os.path.join(out_dir, "results.json"), doc)
    with open(os.path.join(out_dir, "results.md"), "w", encoding="utf-8") as f:
        f.write(markdown_report(doc))
    _say(f"\nwrote {out_dir}/results.json, results.md" + (", " + ", ".join(doc["plots"]) if doc["plots"] else "")
         + " and logs/")
    failed = sum(r["status"] != "ok" for r in runs)
    if failed:
        _say(f"mixprec bench: {failed} of {len(runs)} runs failed; their rows and {out_dir}/logs/ say why")
    return 1 if failed else 0


def _columns():
    from .report import COLUMNS

    return COLUMNS


def _plots(rows, runs, out_dir: str, title: str) -> list[str]:
    from .plots import write_plots

    return write_plots(rows, runs, out_dir, title=title)
