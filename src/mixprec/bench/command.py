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

Nothing is lost: every finished run's result is in ``OUT/runs/RECIPE-rN.json`` (the worker writes it),
and ``results.json`` / ``results.md`` are rewritten after every finished run (``progress.state``
"running"), so they hold the finished rows whatever happens next. They are written before the plots,
and a failing plot is a line in the output and ``plots_error`` in ``results.json``, not a lost report.
``--out`` is created and test-written during planning, so an unwritable place exits 2 before any run.

SIGINT or SIGTERM stops the running worker (:mod:`mixprec.bench.runner`), writes the report of the
finished runs (``progress.state`` "interrupted by SIGINT") and exits 130 or 143 with one line saying
what was kept.

Exit status: 0 when every run succeeded, 1 when any failed (their rows say why), 2 for usage errors,
128 + the signal number when interrupted.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import math
import os
import shlex
import sys
import tempfile
from typing import Any

from ..errors import ConfigError
from ..train.args import add_train_arguments, config_from_args

__all__ = ["add_parser", "bench_main", "plan", "measure_machine", "report", "Plan", "Session", "DEFAULT_PRECISIONS"]

DEFAULT_PRECISIONS = "fp32,amp,bf16-mixed"
MAX_REPEATS = 1000


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
    """``mixprec bench``: plan, measure the machine, execute the matrix, report.

    Exit 0, 1 (a run failed), 2 (usage error, raised) or 128 + signal (interrupted)."""
    from .runner import stop_on_signals

    session = Session()
    with stop_on_signals():
        try:
            return session.run(args)
        except KeyboardInterrupt as e:  # SIGINT, or SIGTERM as runner.Stopped
            return session.interrupted(e)


class Session:
    """One bench invocation's state, so an interrupt at any point knows what there is to keep."""

    def __init__(self) -> None:
        self.plan: Plan | None = None
        self.machine: Machine | None = None
        self.results: list[dict[str, Any]] = []
        self.doc: dict[str, Any] | None = None
        """The final results.json document, once the report is written."""

    def run(self, args: argparse.Namespace) -> int:
        from .runner import execute_matrix

        self.plan = plan(args)
        self.machine = measure_machine(self.plan)
        execute_matrix(self.plan.specs, self.plan.out_dir, timeout=args.timeout, on_done=self.finished)
        code, self.doc = report(self.plan, self.machine, self.results)
        return code

    def finished(self, i: int, n: int, result: dict[str, Any]) -> None:
        """A run finished: show it, and rewrite results.json / results.md with every finished run."""
        self.results.append(result)
        _progress_line(i, n, result)
        try:
            _write_documents(self.plan, _document(self.plan, self.machine, self.results, "running"))
        except OSError as e:
            print(f"mixprec bench: warning: cannot update {e.filename or self.plan.out_dir}: {e.strerror or e}; "
                  f"the run's own result is in {self.plan.out_dir}/runs/", file=sys.stderr, flush=True)

    def interrupted(self, e: BaseException) -> int:
        """Write what the finished runs give, say in one line what was kept; 128 + the signal number."""
        from .runner import signal_of

        sig = signal_of(e)
        p, done = self.plan, len(self.results)
        head = f"mixprec bench: interrupted by {sig.name}"
        if p is None or self.machine is None:
            print(f"{head} before the first run; nothing was run", file=sys.stderr, flush=True)
            return 128 + sig
        if done < len(p.specs):
            spec = p.specs[done]
            head += f" during {spec.recipe} seed {spec.seed} (run {done + 1} of {len(p.specs)}), its worker stopped"
        else:
            head += " while writing the report"
        try:
            _write_documents(p, _document(p, self.machine, self.results, f"interrupted by {sig.name}"))
            kept = (f"kept the {done} finished run{'s' if done != 1 else ''}: "
                    f"{os.path.join(p.out_dir, 'results.json')} (partial), results.md and runs/*.json"
                    if done else f"no run had finished; the started run's log is in {p.out_dir}/logs/")
        except OSError as err:
            kept = f"could not write the report ({err.strerror or err}); finished runs are in {p.out_dir}/runs/"
        print(f"{head}; {kept}", file=sys.stderr, flush=True)
        return 128 + sig


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


def _seconds(flag: str, value: float | None, *, none: str = "") -> None:
    if value is not None and not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{flag} {value:g} must be a finite positive number of seconds{none}")


def _check_flags(args: argparse.Namespace) -> None:
    if args.repeats < 1:
        raise ConfigError(f"--repeats {args.repeats} must be >= 1")
    if args.repeats > MAX_REPEATS:
        raise ConfigError(f"--repeats {args.repeats}: at most {MAX_REPEATS} (each repeat trains every recipe "
                          "once, in its own process)")
    if args.warmup_steps < 0:
        raise ConfigError(f"--warmup-steps {args.warmup_steps} must be >= 0")
    _seconds("--timeout", args.timeout, none=" (leave --timeout out for no limit)")
    _seconds("--peak-seconds", args.peak_seconds)
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
    _prepare_out_dir(out_dir)
    return Plan(args=args, recipes=recipes, configs=configs, checks=checks, impl=impl, reference=reference,
                specs=specs, seeds=seeds, out_dir=out_dir)


def _prepare_out_dir(path: str) -> None:
    """Create ``--out`` and test-write a file in it, so an unusable place exits 2 before the first run.

    Nothing of the user's is touched: a file in the way is refused, and folders this call created are
    removed again if the folder turns out not to be writable."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"--out {path} is a file, not a folder; pass a folder (it is created if missing)")
    created, d = [], os.path.abspath(path)
    while d and not os.path.exists(d):
        created.append(d)
        d = os.path.dirname(d) if os.path.dirname(d) != d else ""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        _remove_dirs(created)
        raise ConfigError(f"--out {path}: cannot create the folder: {e.strerror or e}; pick a writable place") from None
    try:
        fd, probe = tempfile.mkstemp(prefix=".mixprec-write-test-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        _remove_dirs(created)
        raise ConfigError(f"--out {path}: cannot write into the folder: {e.strerror or e}; "
                          "pick a writable place") from None


def _remove_dirs(dirs: list[str]) -> None:
    for d in dirs:  # deepest first
        try:
            os.rmdir(d)
        except OSError:
            pass


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
    """One line per finished run; any field may be missing or non-finite (a dash then)."""
    from .report import clean_result, fmt, number

    r = clean_result(r)
    head = f"[{i}/{n}] {r.get('recipe')} seed {r.get('seed')}:"
    wall = fmt(r.get("process_wall_s"), ".1f", suffix=" s wall")
    if r["status"] != "ok":
        _say(f"{head} FAILED — {r.get('reason')}")
        return
    t, s = r["timing"], r["summary"]
    if not (number(t.get("epoch_time_s")) and number(t.get("samples_per_s"))):
        _say(f"{head} done (no timed steps), {wall}")
        return
    _say(f"{head} {fmt(t.get('epoch_time_s'), '.3f')} s/epoch, {fmt(t.get('samples_per_s'), ',.0f')} samples/s, "
         f"train loss {fmt(s.get('final_train_loss'), '.4f')}, "
         + (f"test loss {fmt(s.get('test_loss'), '.4f')}, {fmt(s.get('bits_per_char'), '.3f')} bits/char"
            if s.get("bits_per_char") is not None else
            f"test accuracy {fmt(s.get('test_accuracy'), '.2f', scale=100, suffix='%')}") + f", {wall}")


# ------------------------------------------------------------------------------------------ reporting


def _document(p: Plan, machine: Machine, results: list[dict[str, Any]], state: str) -> dict[str, Any]:
    """``results.json``'s content for the runs finished so far (``state``: running, complete, interrupted...)."""
    from .report import aggregate, columns

    accum, flops = p.accum, machine.flops
    rows = aggregate(p.recipes, results, flops_per_step=flops.total * accum, peaks=machine.peaks,
                     matmul_dtype={n: p.checks[n].matmul_dtype for n in p.recipes}, impl=p.impl)
    return {
        "schema": "mixprec.bench/2",
        "created": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": "mixprec bench " + " ".join(shlex.quote(a) for a in sys.argv[2:])
        if sys.argv[1:2] == ["bench"] else "mixprec bench (called in-process)",
        "progress": {"state": state, "finished": len(results), "planned": len(p.specs)},
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
        "columns": columns(rows),
        "summary": rows,
        "runs": list(results),
        "plots": [],
    }


def _write_documents(p: Plan, doc: dict[str, Any]) -> None:
    """Write results.json and results.md (atomically: a reader never sees half a file)."""
    from ..jsonio import write_json
    from .report import markdown_report

    write_json(os.path.join(p.out_dir, "results.json"), doc)
    md = os.path.join(p.out_dir, "results.md")
    with open(md + ".tmp", "w", encoding="utf-8") as f:
        f.write(markdown_report(doc))
    os.replace(md + ".tmp", md)


def _plots(p: Plan, machine: Machine, doc: dict[str, Any]) -> None:
    """Draw the plots into ``doc["plots"]``; a failure is one line and ``doc["plots_error"]``, not a crash."""
    from . import plots

    title = (f"{p.base.model.name} on {p.base.data.name}, batch {p.base.optim.batch_size} — "
             f"{machine.env['device_name']}, {doc['created'][:10]}")
    try:
        doc["plots"] = plots.write_plots(doc["summary"], doc["runs"], p.out_dir, title=title)
    except Exception as e:  # noqa: BLE001 -- the results are written already; the plots are extra
        doc["plots_error"] = f"{type(e).__name__}: {e}"
        _say(f"mixprec bench: plots failed: {doc['plots_error']} (results.json and results.md are complete)")


def report(p: Plan, machine: Machine, results: list[dict[str, Any]]) -> tuple[int, dict[str, Any]]:
    """Print the table, write results.json / results.md (first) and the plots; returns the exit status and
    the document."""
    from .report import table

    doc = _document(p, machine, results, "complete")
    _say("")
    _say(table(doc["summary"]))
    try:
        _write_documents(p, doc)  # before the plots: a plot that fails or hangs loses nothing
        if not p.args.no_plots:
            _plots(p, machine, doc)
            _write_documents(p, doc)
    except OSError as e:
        print(f"mixprec bench: cannot write {e.filename or p.out_dir}: {e.strerror or e}; each run's result is "
              f"in {p.out_dir}/runs/", file=sys.stderr)
        return 1, doc
    _say(f"\nwrote {p.out_dir}/results.json, results.md" + (", " + ", ".join(doc["plots"]) if doc["plots"] else "")
         + " and logs/")
    failed = sum(r.get("status") != "ok" for r in results)
    if failed:
        _say(f"mixprec bench: {failed} of {len(results)} runs failed; their rows and {p.out_dir}/logs/ say why")
    return (1 if failed else 0), doc
