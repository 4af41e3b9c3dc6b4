"""mixprec bench: the CLI end to end (one small matrix, shared by most tests), and its pure parts.

The end-to-end matrix runs fp32, bf16-mixed and amp (fp16-mixed) twice each on synthetic data with the
built-in MLP wrapped by ``tests/userpkg/faults.py:aborts_in_fp16``, each run in its own worker process:
the model aborts its process (SIGABRT, no result file) at its first fp16 forward, so the same matrix
proves that a crashing recipe leaves the other rows complete. A copy of its folder is then resumed
(``--resume``) to prove that the finished runs are kept and the failed and missing ones run again.
"""

import contextlib
import dataclasses
import io
import json
import math
import os
import shlex
import shutil
import sys

import numpy as np
import pytest
import torch

from conftest import ROOT
from mixprec import hardware
from mixprec.bench import BenchConfig, compare, measure, parity, runner, worker
from mixprec.bench.command import config_from_args
from mixprec.bench.config import RESUME_MAY_CHANGE
from mixprec.bench.flops import count_step_flops
from mixprec.bench.measure import ALLOCATOR_METHOD
from mixprec.bench.report import COLUMNS, INVOCATION_COLUMN, PLAN_COLUMNS
from mixprec.bench.results import RunResult, SummaryRow
from mixprec.bench.resume import SCHEMA
from mixprec.cli import build_parser, main
from mixprec.errors import ConfigError
from mixprec.memory import CATEGORIES, SAVED_CATEGORIES
from mixprec.train.config import TrainConfig
from mixprec.train.models import build_model

FAULTS = str(ROOT / "tests" / "userpkg" / "faults.py")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MIB = 2**20
STEPS_PER_EPOCH, EPOCHS, WARMUP = 8, 2, 2  # 512 samples / batch 64
SMALL = ["--dataset", "synthetic", "--synthetic-train", "512", "--synthetic-test", "128", "--batch-size", "64",
         "--epochs", str(EPOCHS), "--warmup-steps", str(WARMUP), "--peak-seconds", "0.1", "--device", "cpu"]
MATRIX = ["--precisions", "fp32,bf16-mixed,amp", "--repeats", "2", "--model", f"{FAULTS}:aborts_in_fp16", *SMALL]
CPU = torch.device("cpu")


def _quiet_main(argv):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main([str(a) for a in argv])
    return code, buf.getvalue()


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    """Run the matrix once through the CLI; returns (exit code, stdout, out dir, results.json)."""
    out = tmp_path_factory.mktemp("bench")
    code, stdout = _quiet_main(["bench", *MATRIX, "--out", out])
    doc = json.loads((out / "results.json").read_text())
    return code, stdout, out, doc


def _runs(doc, recipe):
    return [r for r in doc["runs"] if r["recipe"] == recipe]


def _row(doc, recipe):
    return next(r for r in doc["summary"] if r["recipe"] == recipe)


# ------------------------------------------------------------------------------------ end to end


@pytest.mark.slow
def test_crashing_recipe_leaves_the_other_rows(bench):
    code, out, _, doc = bench
    assert code == 1  # some runs failed
    for r in _runs(doc, "fp16-mixed"):
        assert r["status"] == "failed" and "SIGABRT" in r["reason"] and "aborting on purpose" in r["reason"]
    for name in ("fp32", "bf16-mixed"):
        runs = _runs(doc, name)
        assert [r["status"] for r in runs] == ["ok", "ok"], [r.get("reason") for r in runs]
    assert [r["recipe"] for r in doc["summary"]] == ["fp32", "bf16-mixed", "fp16-mixed"]
    assert "fp16-mixed seed 0: FAILED — crashed: killed by SIGABRT" in out
    progress = [ln for ln in out.splitlines() if ln.startswith("[") and "/6]" in ln]
    assert len(progress) == 6  # one line per finished run, in run order
    assert progress[0].startswith("[1/6] fp32 seed 0:") and progress[3].startswith("[4/6] fp32 seed 1:")


@pytest.mark.slow
def test_results_json_schema(bench):
    _, _, path, doc = bench
    assert doc["schema"] == SCHEMA == "mixprec.bench/3"
    assert {"created", "command", "invocation", "invocations", "progress", "bench", "configs", "seeds",
            "environment", "preflight", "peaks", "flops_per_step", "prediction", "columns", "summary", "runs",
            "plots"} <= set(doc)
    assert "flags" not in doc  # the configs are stored, not argparse's namespace
    env = doc["environment"]
    assert env["torch"] == torch.__version__ and env["cpu"] and env["device_name"] and env["threads"] >= 1
    assert {"python", "numpy", "mixprec", "platform", "cpu_flags", "gpu"} <= set(env)
    bench = BenchConfig.from_dict(doc["bench"])
    assert bench.precisions == ("fp32", "bf16-mixed", "fp16-mixed")  # amp stored by its canonical name
    assert (bench.repeats, bench.warmup_steps, bench.out, bench.resume) == (2, WARMUP, str(path), None)
    assert bench.train.model.name == f"{FAULTS}:aborts_in_fp16" and bench.train.run.log_every == 0
    assert bench.to_dict() == doc["bench"] and doc["seeds"] == [0, 1]
    assert list(doc["configs"]) == list(bench.precisions)
    for name, d in doc["configs"].items():
        config = TrainConfig.from_dict(d)
        assert config.recipe.precision == name and config.optim == bench.train.optim
    argv = shlex.split(doc["command"])  # the stored command asks for the same bench
    assert argv[:2] == ["mixprec", "bench"] and config_from_args(build_parser().parse_args(argv[1:])) == bench
    assert doc["invocation"] == 1 and [i["number"] for i in doc["invocations"]] == [1]
    assert doc["invocations"][0]["peaks"] == doc["peaks"] and len(doc["invocations"][0]["runs"]) == 6
    assert [p["recipe"] for p in doc["preflight"]] == list(bench.precisions)
    for dt, peak in doc["peaks"].items():
        assert dt in ("fp32", "tf32", "bf16", "fp16") and peak["flops_per_s"] > 0
    assert len(doc["runs"]) == 6
    for r in doc["runs"]:
        assert set(r) == {f for f in RunResult.__dataclass_fields__}
        assert r["invocation"] == 1 and r["log"] == f"logs/{r['recipe']}-r{r['repeat']}.log"
        on_disk = json.loads((path / "runs" / f"{r['recipe']}-r{r['repeat']}.json").read_text())
        assert on_disk == r  # the runner completed the worker's file with what it knows
    for row in doc["summary"]:
        assert set(row) == {f for f in SummaryRow.__dataclass_fields__} and row["invocations"] == [1]


@pytest.mark.slow
def test_every_column_present(bench):
    _, out, path, doc = bench
    header = "| " + " | ".join(COLUMNS) + " |"
    assert doc["columns"] == COLUMNS  # one invocation: no invocation column
    assert COLUMNS[:3] == ["recipe", "memory", "avg epoch time"]  # the tutorial's columns come first
    lines = out.splitlines()
    i = lines.index(header)
    rows = lines[i + 2:i + 5]
    # --amp-impl auto: native, except fp16 on a CPU (then the scratch autocast, emulating fp16)
    assert [r.split("|")[1].strip() for r in rows] == ["fp32", "bf16-mixed", "fp16-mixed (scratch)"]
    for r in rows:
        assert len(r.strip("|").split("|")) == len(COLUMNS)
    fp32_cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert "—" not in fp32_cells, fp32_cells  # every column is filled for a successful recipe
    assert fp32_cells[3] == "1.00x" and fp32_cells[COLUMNS.index("parity vs fp32")] == "yes"
    assert header in (path / "results.md").read_text()


@pytest.mark.slow
def test_the_plans_prediction_beside_the_measurement(bench):
    """Every bench checks the planner: results.json and the table carry mixprec plan's predicted step peak and
    step time with measured / predicted; the recipe whose trace kills the planner's process (the model aborts
    at its first fp16 forward, fake or not) has none, and one line says why."""
    _, out, path, doc = bench
    plan = doc["prediction"]
    assert plan["target"]["name"] == "cpu" and plan["target"]["peak_flops"]["fp32"] == doc["peaks"]["fp32"]["flops_per_s"]
    for name in ("fp32", "bf16-mixed"):
        recipe, pred = plan["recipes"][name], _row(doc, name)["prediction"]
        assert recipe["memory"]["parameters"] == _row(doc, name)["memory"]["parameters"]  # the same model
        assert pred["target"] == "cpu" and pred["reason"] is None and pred["step_time_s"] > 0
        assert 0 < pred["step_peak_bytes"] < pred["peak_bytes"] == recipe["peak_bytes"]
        assert pred["peak_compared_with"] == "measured_step_peak_bytes"
        assert pred["peak_ratio"] == pytest.approx(_row(doc, name)["measured_step_peak_bytes"] / pred["step_peak_bytes"])
        assert pred["step_time_ratio"] == pytest.approx(_row(doc, name)["step_time_s"]["median"] / pred["step_time_s"])
    fp16 = _row(doc, "fp16-mixed")["prediction"]
    assert fp16["step_time_s"] is None and "SIGABRT" in fp16["reason"] and "fp16-mixed" in fp16["reason"]
    plan_lines = [ln for ln in out.splitlines() if ln.startswith("plan")]
    assert plan_lines[0].startswith("plan (cpu, ") and "fp32 " in plan_lines[0] and "bf16-mixed " in plan_lines[0]
    assert plan_lines[1].startswith("plan: no prediction for fp16-mixed: the planner's process") and len(plan_lines) == 2
    assert out.index("plan (cpu") < out.index("[1/6]")  # planned before the first run
    fp32_row = next(ln for ln in out.splitlines() if ln.startswith("| fp32 |")).strip("|").split("|")
    cells = dict(zip(COLUMNS, (c.strip() for c in fp32_row)))
    assert cells["step peak (plan)"].endswith("iB") and cells["step time (plan)"].endswith("s")
    assert cells["measured / plan"].startswith("peak ") and ", time " in cells["measured / plan"]
    assert "- plan: no prediction for fp16-mixed: the planner's process" in (path / "results.md").read_text()


@pytest.mark.slow
def test_an_untraceable_model_is_benched_with_a_one_line_note_and_no_plan_leaves_the_columns_out(tmp_path):
    model = tmp_path / "reads.py"
    model.write_text("import torch\nfrom torch import nn\n\n\nclass Reads(nn.Module):\n"
                     "    def __init__(self, n, k):\n        super().__init__()\n        self.fc = nn.Linear(n, k)\n\n"
                     "    def forward(self, x):\n        if x.sum().item() > 1e9:  # a host read: no fake tensors\n"
                     "            x = x * 0\n        return self.fc(x.flatten(1))\n\n\n"
                     "def reads(input_shape, num_classes):\n    return Reads(int(torch.Size(input_shape).numel()), num_classes)\n")
    small = ["--dataset", "synthetic", "--synthetic-train", "256", "--synthetic-test", "64", "--batch-size", "64",
             "--epochs", "1", "--warmup-steps", "1", "--peak-seconds", "0.05", "--device", "cpu", "--no-plots",
             "--precisions", "fp32", "--repeats", "1", "--model", f"{model}:reads"]
    code, out = _quiet_main(["bench", *small, "--out", tmp_path / "a"])
    assert code == 0, out
    notes = [ln for ln in out.splitlines() if ln.startswith("plan")]
    assert len(notes) == 1 and notes[0].startswith("plan: no prediction for fp32: the model cannot be traced "
                                                   "under fake tensors with fp32"), notes
    assert "_local_scalar_dense" in notes[0] and "--fallback-real" not in notes[0]
    doc = json.loads((tmp_path / "a" / "results.json").read_text())
    assert doc["summary"][0]["runs_ok"] == 1 and "cannot be traced" in doc["summary"][0]["prediction"]["reason"]
    code, out = _quiet_main(["bench", *small, "--no-plan", "--out", tmp_path / "b"])
    doc = json.loads((tmp_path / "b" / "results.json").read_text())
    assert code == 0 and doc["prediction"] is None and doc["summary"][0]["prediction"] is None
    assert not any(c in doc["columns"] for c in PLAN_COLUMNS) and "plan" not in out.split("\n| recipe")[0].lower()
    assert BenchConfig.from_dict(doc["bench"]).predict is False and "--no-plan" in doc["command"]


@pytest.mark.slow
def test_same_seed_across_recipes_different_across_repeats(bench):
    _, _, _, doc = bench
    for name in ("fp32", "bf16-mixed"):
        assert [(r["repeat"], r["seed"]) for r in _runs(doc, name)] == [(0, 0), (1, 1)]
        for r in _runs(doc, name):
            assert r["history"][0]["steps"] == STEPS_PER_EPOCH and len(r["history"]) == EPOCHS
    f0, f1 = (r["history"][0]["loss_curve"][0] for r in _runs(doc, "fp32"))
    b0 = _runs(doc, "bf16-mixed")[0]["history"][0]["loss_curve"][0]
    # same initial weights and first batch: the first losses differ only by bf16 rounding
    assert abs(b0 - f0) < 0.01 * abs(f0) and abs(f1 - f0) > abs(b0 - f0)


@pytest.mark.slow
def test_timing_excludes_warmup_and_mfu_is_consistent(bench):
    _, _, _, doc = bench
    for r in _runs(doc, "fp32") + _runs(doc, "bf16-mixed"):
        t = r["timing"]
        assert t["timed_steps"] == EPOCHS * (STEPS_PER_EPOCH - WARMUP)
        kept = [s for h in r["history"] for s in h["step_times_s"][WARMUP:]]
        assert t["step_time_s"] == pytest.approx(float(np.median(kept)))
        assert t["samples_per_s"] == pytest.approx(64 / t["step_time_s"])
    flops = doc["flops_per_step"]["total"]
    assert flops == doc["flops_per_step"]["forward"] + doc["flops_per_step"]["backward"] > 0
    for name in ("fp32", "bf16-mixed"):
        row = _row(doc, name)
        peak = doc["peaks"][row["matmul_dtype"]]["flops_per_s"]
        assert row["mfu"] == pytest.approx(flops / row["step_time_s"]["median"] / peak)
    assert _row(doc, "bf16-mixed")["matmul_dtype"] == "bf16"


@pytest.mark.slow
def test_quality_and_parity_columns(bench):
    _, _, _, doc = bench
    fp32 = _row(doc, "fp32")
    assert fp32["speedup_vs_fp32"] == pytest.approx(1.0) and fp32["memory_saving_vs_fp32"] == pytest.approx(0.0)
    assert fp32["parity"]["verdict"] == "yes"  # fp32's mean curve always lies inside its own seed band
    bf = _row(doc, "bf16-mixed")
    # same seeds as fp32, so bf16's rounding moves its mean curve far less than the seed-to-seed spread
    assert bf["parity"]["verdict"] == "yes" and bf["parity"]["inside_fraction"] >= 0.9, bf["parity"]
    assert bf["parity"]["steps"] == EPOCHS * STEPS_PER_EPOCH and "seed band" in bf["parity"]["reason"]
    assert 0 <= bf["test_accuracy"]["median"] <= 1 and math.isfinite(bf["final_train_loss"])
    assert bf["skipped_steps"] == 0 and bf["final_loss_scale"] == 1.0
    fp16 = _row(doc, "fp16-mixed")  # both runs crashed: nothing to compare
    assert fp16["parity"]["verdict"] == "n/a" and fp16["parity"]["reason"] == "no successful run to compare"


@pytest.mark.slow
def test_memory_accounting_and_honest_cpu_peak(bench):
    """The measured step peak (c10's allocator peak; beside it the VmHWM rise after clear_refs, glibc mmap
    threshold 64 KiB, malloc_trim) agrees with the exact accounting of the same step: never below the larger
    of the activations saved for backward (all alive when the forward ends) and the gradients (all alive when
    the backward ends) — activations are freed during the backward while gradients appear, so the peak may be
    below their sum — and at most 2 x (activations + gradients) + 1 MiB, the excess being temporaries the
    accounting does not count (activation gradients during backward; under bf16 autocast also the bf16 weight
    gradients before their cast to fp32)."""
    _, _, _, doc = bench
    mlp = build_model("mlp", input_shape=(1, 28, 28), num_classes=10, width=512, depth=2)  # aborts_in_fp16's
    small_grads = sum(p.nbytes for p in mlp.parameters() if p.nbytes < measure.MMAP_THRESHOLD_BYTES)
    assert 0 < small_grads < 64 * 2**10  # its biases and its 10x512 head
    for name in ("fp32", "bf16-mixed"):
        row = _row(doc, name)
        mem = row["memory"]
        fp32_bytes = sum(p.nbytes for p in mlp.parameters())  # ~2.6 MiB
        assert mem["parameters"] == mem["gradients"] == fp32_bytes > 2 * MIB  # fp32 params and grads
        assert mem["total"] == sum(mem[k] for k in CATEGORIES)  # one definition of each category (mixprec.memory)
        assert (mem["autocast_weight_copies"] > 0) == (name == "bf16-mixed") and mem["fp8_buffers"] == 0
        for r in _runs(doc, name):
            probe = r["memory_probe"]
            if probe.get("method") is None:
                pytest.skip(f"no honest CPU peak on this platform: {probe.get('reason')}")
            exact = probe["exact_activations_plus_gradients"]
            saved = sum(mem[k] for k in SAVED_CATEGORIES)  # the probe's "activations": all saved for backward
            assert exact["gradients"] == mem["gradients"] and exact["activations"] == saved
            lower = max(exact["activations"], exact["gradients"])
            assert probe["method"] == ALLOCATOR_METHOD and probe["rss_method"].startswith("VmHWM")
            upper = 2 * exact["total"] + MIB
            assert lower <= probe["step_peak_bytes"] <= upper, (name, probe)  # the allocator's: every byte counted
            # The RSS rise counts pages first touched: a tensor below glibc's mmap threshold may land in a heap
            # page already resident (the probe plugs only free chunks of at least the threshold), so it may read
            # up to those tensors' bytes below the exact count (seen: 40 B short, the 10-float bias's gradient).
            assert lower - small_grads <= probe["rss_step_peak_bytes"] <= upper, (name, probe)


def test_allocator_peak_is_the_most_bytes_alive_above_the_start():
    """The CPU allocator's peak from torch.profiler's memory events: a tensor freed before the next one is
    allocated does not add to it; one alive beside it does; what existed before does not count."""
    from mixprec.bench.measure import allocator_peak

    before = torch.empty(2**20, dtype=torch.uint8)

    def work():
        a = torch.empty(3 * 2**20, dtype=torch.uint8)
        del a
        b = torch.empty(2**20, dtype=torch.uint8)
        c = torch.empty(2**19, dtype=torch.uint8)
        del b, c

    assert allocator_peak(work) == 3 * 2**20
    keep = []
    assert allocator_peak(lambda: keep.extend([torch.empty(2**20, dtype=torch.uint8) for _ in range(4)])) == 4 * 2**20
    del before


@pytest.mark.slow
def test_plots_written_and_valid_png(bench):
    _, _, path, doc = bench
    assert doc["plots"] == ["time.png", "memory.png", "loss.png", "metric.png"]
    for name in doc["plots"]:
        data = (path / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 5000


@pytest.mark.slow
def test_per_run_logs_and_preflight(bench):
    _, out, path, doc = bench
    assert (path / "logs" / "fp32-r0.log").read_text().startswith("fp32")
    lines = [ln for ln in out.splitlines() if ln.startswith("preflight: ")]
    assert [ln.split()[1].rstrip(":") for ln in lines] == ["fp32", "bf16-mixed", "fp16-mixed"]
    fp16 = doc["preflight"][2]
    # the line says how fp16 runs on this CPU: auto picks scratch, emulated in fp32
    assert fp16["line"].startswith("fp16-mixed [scratch]: ") and "fp16 is EMULATED" in fp16["line"]
    assert fp16["matmul_dtype"] == "fp32" and not fp16["fast"]
    assert "peak matmul rate measured now:" in out and "model FLOPs per step:" in out


def _paths(o, path=()):
    """Every field of a result, nested (a list's first element stands for all of them)."""
    if path:
        yield path
    if isinstance(o, dict):
        for k, v in o.items():
            yield from _paths(v, path + (k,))
    elif isinstance(o, list) and o:
        yield from _paths(o[0], path + (0,))


def _set(o, path, value):
    for k in path[:-1]:
        o = o[k]
    o[path[-1]] = value


def _report_everything(doc, runs, out_dir=None):
    """Everything bench prints or writes from run results: progress lines, summary, table, markdown, plots."""
    from mixprec.bench.aggregate import aggregate
    from mixprec.bench.console import progress_line
    from mixprec.bench.plots import write_plots
    from mixprec.bench.report import markdown_report, table

    with contextlib.redirect_stdout(io.StringIO()):
        for i, r in enumerate(runs):
            progress_line(i + 1, len(runs), r)
    rows = aggregate(doc["bench"]["precisions"], runs, flops_per_step=doc["flops_per_step"]["per_step"],
                     peaks=doc["peaks"],
                     matmul_dtype={r["recipe"]: r["matmul_dtype"] for r in doc["summary"]})
    text = table(rows) + markdown_report({**doc, "summary": rows, "runs": runs})
    if out_dir is not None:
        assert write_plots(rows, runs, str(out_dir), title="t") == ["time.png", "memory.png", "loss.png", "metric.png"]
    return rows, text


@pytest.mark.slow
def test_report_survives_none_or_nan_in_any_field_of_any_run(bench, tmp_path):
    """Issue 11: one run's null loss (``--lr 1e30``) crashed the report and lost every row. Now every field
    of every real run result, set to None or NaN (one at a time), still gives the progress lines, the
    summary, the table and results.md, and the other rows keep their numbers."""
    import copy

    _, _, _, doc = bench
    fp32_loss = _row(doc, "fp32")["final_train_loss"]
    n = 0
    for i, run in enumerate(doc["runs"]):
        for path in _paths(run):
            for bad in (None, math.nan):
                runs = copy.deepcopy(doc["runs"])
                _set(runs[i], path, bad)
                rows, text = _report_everything(doc, runs)
                assert "| bf16-mixed" in text and "| fp32" in text, (i, path)
                if run["recipe"] != "fp32":  # the damage stays in its own row
                    assert rows[0].final_train_loss == fp32_loss, (i, path)
                n += 1
    assert n > 300
    for bad in (None, math.nan):  # every value of every run at once (the recipe and status aside), plots too
        runs = copy.deepcopy(doc["runs"])
        for r in runs:
            for path in _leaves(r):
                if path not in (("recipe",), ("status",)):
                    _set(r, path, bad)
        rows, text = _report_everything(doc, runs, out_dir=tmp_path)
        assert [r.runs_ok for r in rows] == [2, 2, 0] and all(r.final_train_loss is None for r in rows)


def _leaves(o, path=()):
    if isinstance(o, dict):
        for k, v in o.items():
            yield from _leaves(v, path + (k,))
    elif isinstance(o, list):
        for j, v in enumerate(o):
            yield from _leaves(v, path + (j,))
    else:
        yield path


# ---------------------------------------------------------------------------------------- resume


def _one_line(err):
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert "Traceback" not in err and len(lines) == 1, err
    return lines[0]


@pytest.mark.slow
def test_resume_reruns_failed_and_missing_runs_and_keeps_the_rest(bench, tmp_path):
    """A copy of the matrix's folder, one finished run deleted as an interrupted bench would lack it: the
    resume runs it and the two failed fp16-mixed runs again (they fail again: the model still aborts),
    keeps the other four byte for byte, re-measures the peaks and marks every row with its invocation."""
    _, _, path, first = bench
    d = tmp_path / "b"
    shutil.copytree(path, d)
    (d / "runs" / "bf16-mixed-r1.json").unlink()
    kept = ["fp32-r0", "bf16-mixed-r0", "fp32-r1"]
    before = {n: (d / "runs" / f"{n}.json").read_bytes() for n in kept}
    code, out = _quiet_main(["bench", "--resume", d, "--timeout", "600", "--no-plots"])
    assert code == 1, out  # fp16-mixed still fails
    doc = json.loads((d / "results.json").read_text())
    assert {n: (d / "runs" / f"{n}.json").read_bytes() for n in kept} == before
    assert [(r["recipe"], r["repeat"], r["invocation"], r["status"]) for r in doc["runs"]] == [
        ("fp32", 0, 1, "ok"), ("bf16-mixed", 0, 1, "ok"), ("fp16-mixed", 0, 2, "failed"),
        ("fp32", 1, 1, "ok"), ("bf16-mixed", 1, 2, "ok"), ("fp16-mixed", 1, 2, "failed")]
    assert doc["runs"][4]["seed"] == 1 and doc["runs"][4]["history"][0]["steps"] == STEPS_PER_EPOCH
    assert "[1/3] fp16-mixed seed 0:" in out and "[2/3] bf16-mixed seed 1:" in out and "[3/3]" in out
    assert "kept 3 finished run(s) of 6, running 3" in out
    assert doc["invocation"] == 2 and doc["progress"] == {"state": "complete", "finished": 6, "planned": 6}
    inv = doc["invocations"]
    assert [i["number"] for i in inv] == [1, 2] and inv[0] == first["invocations"][0]
    assert inv[1]["runs"] == ["fp16-mixed-r0", "bf16-mixed-r1", "fp16-mixed-r1"]
    assert inv[1]["peaks"] == doc["peaks"] and set(doc["peaks"]) == set(first["peaks"])  # measured again
    assert inv[1]["peaks"] != first["peaks"]  # a new measurement, not the stored one copied
    # the bench is the folder's, but for what --resume may change
    bench_now, bench_then = BenchConfig.from_dict(doc["bench"]), BenchConfig.from_dict(first["bench"])
    assert (bench_now.timeout, bench_now.plots, bench_now.resume, bench_now.out) == (600.0, False, str(d), str(d))
    assert bench_now.train == bench_then.train and bench_now.precisions == bench_then.precisions
    assert {r["recipe"]: r["invocations"] for r in doc["summary"]} == {
        "fp32": [1], "bf16-mixed": [1, 2], "fp16-mixed": [2]}
    assert doc["columns"] == COLUMNS + [INVOCATION_COLUMN]
    lines = out.splitlines()
    i = lines.index("| " + " | ".join(COLUMNS + [INVOCATION_COLUMN]) + " |")
    assert [r.strip("|").split("|")[-1].strip() for r in lines[i + 2:i + 5]] == ["1", "1+2", "2"]
    assert "the rows come from invocations 1 and 2 of this bench" in out and "not measured side by side" in out
    md = (d / "results.md").read_text()
    assert "## Invocations" in md and "ran fp16-mixed-r0, bf16-mixed-r1, fp16-mixed-r1" in md


def _bench_folder(tmp_path, **settings):
    """A bench folder as a first invocation leaves it, without running it (for the checks before a run)."""
    d = tmp_path / "b"
    d.mkdir()
    config = BenchConfig(train=TrainConfig.from_flags(dataset="synthetic", log_every=0, progress="off"),
                         out=str(d), **settings)
    doc = {"schema": SCHEMA, "invocation": 1, "bench": config.to_dict(), "invocations": [{"number": 1}]}
    (d / "results.json").write_text(json.dumps(doc))
    return d, config


@pytest.mark.parametrize("args,shown", [
    (["--repeats", "3"], "--repeats"), (["--precisions", "fp32"], "--precisions"), (["--lr", "0.1"], "--lr"),
    (["--warmup-steps", "3"], "--warmup-steps"), (["--out", "elsewhere"], "--out"), (["--seed", "0"], "--seed"),
    (["--peak-seconds", "2"], "--peak-seconds"), (["--amp-impl", "scratch"], "--amp-impl"),
])
def test_resume_refuses_a_flag_that_changes_the_bench(cli, tmp_path, args, shown):
    """Refused even when the value equals the stored one (--warmup-steps 3, --seed 0): a typed flag is a
    request to change it; nothing is built or written."""
    d, _ = _bench_folder(tmp_path)
    before = (d / "results.json").read_bytes()
    code, out, err = cli("bench", "--resume", d, *args)
    line = _one_line(err)
    assert code == 2 and f"--resume {d}: {shown} cannot change in a resumed bench" in line, line
    assert all(flag in line for flag in ("--timeout", "--no-plots", "--data-dir", "--data-path"))
    assert sorted(os.listdir(d)) == ["results.json"] and (d / "results.json").read_bytes() == before
    assert out == ""


def _damage(d, how):
    f = d / "results.json"
    if how == "missing folder":
        shutil.rmtree(d)
    elif how == "a file":
        shutil.rmtree(d)
        d.write_text("not a folder")
    elif how == "no results.json":
        f.unlink()
    elif how == "not JSON":
        f.write_text('{"schema": "mixprec.bench/3", ')
    elif how == "another schema":
        f.write_text(json.dumps({**json.loads(f.read_text()), "schema": "mixprec.bench/2"}))
    elif how == "bench section damaged":
        f.write_text(json.dumps({**json.loads(f.read_text()), "bench": {"train": {"optim": {"lr": "x", "bogus": 1}}}}))
    elif how == "no invocation":
        f.write_text(json.dumps({k: v for k, v in json.loads(f.read_text()).items() if k != "invocation"}))


@pytest.mark.parametrize("how,needle", [
    ("missing folder", "no such folder"), ("a file", "is a file, not a bench folder"),
    ("no results.json", "not a bench folder (no results.json)"), ("not JSON", "is damaged (JSONDecodeError"),
    ("another schema", "schema 'mixprec.bench/2', expected 'mixprec.bench/3'"),
    ("bench section damaged", "is damaged (damaged bench configuration"),
    ("no invocation", "damaged (invocation None)"),
])
def test_resume_of_a_bad_folder_is_one_line_exit_2(cli, tmp_path, how, needle):
    d, _ = _bench_folder(tmp_path)
    _damage(d, how)
    code, out, err = cli("bench", "--resume", d, "--timeout", "5")
    line = _one_line(err)
    assert code == 2 and line.startswith(f"mixprec bench: error: --resume {d}") and needle in line, line
    assert out == "" and not (d / "runs").exists()


def test_a_hand_built_resume_config_may_not_change_the_bench(tmp_path):
    """The Python path (a BenchConfig with ``resume=`` set) is held to the same rule as the flags."""
    from mixprec.bench.session import Session

    d, config = _bench_folder(tmp_path)
    with pytest.raises(ConfigError, match=r"--repeats cannot change in a resumed bench"):
        Session(dataclasses.replace(config, repeats=5, resume=str(d))).run()
    assert not (d / "runs").exists()
    assert set(RESUME_MAY_CHANGE) == {"timeout", "plots", "predict", "data_dir", "data_path"}


# ----------------------------------------------------------------------------------- usage errors


@pytest.mark.parametrize("args,needle", [
    (["--precisions", "fp32,fp12"], "unknown precision 'fp12'"),
    (["--precisions", ","], "--precisions ',' names no recipe"),
    (["--repeats", "0"], "--repeats must be a positive integer, got 0"),
    (["--warmup-steps", "8"], "--warmup-steps 8 leaves no timed step"),
    (["--log-every", "5"], "--log-every 5: bench keeps logging and .item() out of the timed steps"),
    (["--strategy", "ddp"], "--strategy ddp: bench runs single-process"),
])
def test_usage_errors_exit_2_before_any_run(cli, tmp_path, args, needle):
    code, out, err = cli("bench", *SMALL, "--out", tmp_path, *args)
    assert code == 2 and needle in _one_line(err), err
    assert not (tmp_path / "runs").exists() and "[1/" not in out


# ------------------------------------------------------------------------------- config and API


def test_bench_config_canonical_names_and_round_trip():
    c = BenchConfig(precisions="amp,fp32,fp16,bf16", repeats=3, timeout=30.0, plots=False)
    assert c.precisions == ("fp16-mixed", "fp32", "bf16-mixed")  # aliases resolved, repeats dropped, order kept
    assert BenchConfig(precisions=["16-mixed", "bf16-mixed"]).precisions == ("fp16-mixed", "bf16-mixed")
    d = json.loads(json.dumps(c.to_dict()))
    assert BenchConfig.from_dict(d) == c and d["precisions"] == ["fp16-mixed", "fp32", "bf16-mixed"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.repeats = 4
    with pytest.raises(TypeError):
        BenchConfig("fp32")  # keyword-only
    with pytest.raises(ConfigError, match="unknown bench setting"):
        BenchConfig.from_dict({**d, "flags": {}})
    for field in dataclasses.fields(BenchConfig):  # every field documented (a docstring under it)
        assert f"{field.name}:" in open(os.path.join(ROOT, "src/mixprec/bench/config.py")).read()


@pytest.mark.parametrize("settings,needle", [
    ({"repeats": 1001}, "--repeats 1001: at most 1000"), ({"timeout": 0.0}, "--timeout must be a positive number"),
    ({"warmup_steps": -1}, "--warmup-steps must be an integer >= 0, got -1"),
    ({"peak_seconds": math.inf}, "--peak-seconds must be a positive number, got inf"),
    ({"out": "x", "resume": "y"}, "--out x with --resume y"),
    ({"train": TrainConfig.from_flags(log_every=0, progress="off", out="ckpt")}, "--out: bench writes each run's"),
])
def test_bench_config_validate_names_the_setting(settings, needle):
    with pytest.raises(ConfigError) as e:
        BenchConfig(**settings).validate()
    assert needle in str(e.value)


def test_compare_rejects_unknown_keywords_with_a_type_error(tmp_path):
    with pytest.raises(TypeError, match=r"compare\(\.\.\., bogus_flag=\.\.\.\): unknown keyword"):
        compare("mlp", "synthetic", out=tmp_path / "c", bogus_flag=3, nope=1)
    with pytest.raises(TypeError, match="did you mean precisions"):
        compare("mlp", "synthetic", out=tmp_path / "c", precision="fp32")
    with pytest.raises(TypeError, match="metrics_json"):  # bench writes its own outputs
        compare("mlp", "synthetic", out=tmp_path / "c", metrics_json="m.json")
    assert not (tmp_path / "c").exists()  # refused before anything was built


def test_cli_and_api_build_the_same_config():
    args = build_parser().parse_args(["bench", "--model", "mlp", "--dataset", "synthetic", "--precisions", "amp",
                                      "--repeats", "1", "--epochs", "2", "--no-plots", "--timeout", "9"])
    assert config_from_args(args) == BenchConfig(
        train=TrainConfig.from_flags(model="mlp", dataset="synthetic", epochs=2, log_every=0, progress="off"),
        precisions=("fp16-mixed",), repeats=1, plots=False, timeout=9.0)
    # flags left out take the config's defaults, not argparse's
    assert config_from_args(build_parser().parse_args(["bench"])) == BenchConfig()


# ------------------------------------------------------------------------------------ pure parts


def _tiny_config(model, precision):
    return TrainConfig.from_flags(model=model, dataset="synthetic", synthetic_train=64, synthetic_test=16,
                                  batch_size=32, epochs=1, precision=precision, device="cpu", log_every=0,
                                  progress="off").to_dict()


def test_worker_turns_an_exception_into_a_failed_row():
    spec = runner.RunSpec(recipe="bf16-mixed", repeat=0, seed=0, warmup_steps=0,
                          config=_tiny_config(f"{FAULTS}:raises_in_bf16", "bf16-mixed"))
    r = worker.train_and_measure(spec)
    assert r.status == "failed" and r.reason == "RuntimeError: deliberate failure in the forward"
    assert r.impl == "native" and r.history == [] and (r.recipe, r.repeat, r.seed) == ("bf16-mixed", 0, 0)


def test_failed_reason_names_the_exit(tmp_path):
    log = tmp_path / "x.log"
    log.write_text("first\nTraceback...\nRuntimeError: boom\n")
    assert runner.failed_reason(-6, str(log)) == "crashed: killed by SIGABRT; last log line: RuntimeError: boom"
    assert "SIGKILL (out of memory?)" in runner.failed_reason(-9, str(tmp_path / "missing.log"))
    assert runner.failed_reason(None, str(log), timeout=5).startswith("timed out after 5 s")


def _step_flops(model, x, y):
    """bench's count of one step of ``model`` on ``(x, y)`` with the classify task's cross-entropy."""
    from mixprec.train.contract import ModelCall, Objective, as_batch
    from mixprec.train.tasks import Classify

    return count_step_flops(model, as_batch((x, y)), Objective(ModelCall(model), Classify()))


def test_flops_of_a_linear_are_exact():
    b, n_in, n_out = 8, 20, 30
    lin = torch.nn.Linear(n_in, n_out)
    x, y = torch.randn(b, n_in), torch.randint(0, n_out, (b,))
    f = _step_flops(lin, x, y)
    assert f.forward == 2 * b * n_in * n_out  # one addmm
    assert f.backward == 2 * b * n_in * n_out  # weight grad only: the input needs no grad
    assert f.by_op == {"addmm": 2 * b * n_in * n_out, "mm": 2 * b * n_in * n_out}
    assert lin.weight.grad is None  # grads are cleared
    f = _step_flops(lin, x.requires_grad_(), y)
    assert f.backward == 4 * b * n_in * n_out  # weight grad + input grad


def test_flops_of_a_two_layer_mlp():
    b = 4
    m = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    f = _step_flops(m, torch.randn(b, 10), torch.randint(0, 3, (b,)))
    assert f.forward == 2 * b * (10 * 16 + 16 * 3)
    assert f.backward == 2 * b * 10 * 16 + 4 * b * 16 * 3  # the hidden layer also needs its input grad
    assert f.total == f.forward + f.backward


def test_smooth_is_a_trailing_moving_average():
    np.testing.assert_allclose(parity.smooth([1, 2, 3, 4], 2), [1, 1.5, 2.5, 3.5], rtol=0, atol=0)
    np.testing.assert_allclose(parity.smooth([1, 2, 3], 1), [1, 2, 3], rtol=0, atol=0)


def _curves(seed: int, n: int = 200):
    """Two fp32 'seeds': a decaying loss plus independent noise of std 0.05."""
    rng = np.random.default_rng(seed)
    t = np.arange(n)
    base = 2.0 * np.exp(-t / 60) + 0.3
    return [base + rng.normal(0, 0.05, n) for _ in range(2)]


def test_parity_recipe_tracking_fp32_is_inside():
    fp32 = _curves(0)
    rng = np.random.default_rng(1)
    recipe = [c + rng.normal(0, 0.002, c.size) for c in fp32]  # same seeds, tiny rounding noise
    r = parity.convergence_parity(recipe, fp32)
    assert r.verdict == "yes" and r.inside_fraction >= 0.9 and r.steps == 200


def test_parity_shifted_recipe_is_outside():
    fp32 = _curves(0)
    lo, hi, _ = parity.fp32_band(fp32, window=parity.default_window(200))
    shift = 2 * float(np.max(hi - lo))  # more than the whole seed band
    r = parity.convergence_parity([c + shift for c in fp32], fp32)
    assert r.verdict == "no" and r.inside_fraction < 0.1 and r.max_excursion > 0


def test_parity_late_divergence_is_outside():
    fp32 = _curves(0)
    recipe = [c.copy() for c in fp32]
    for c in recipe:
        c[100:] += np.linspace(0, 1.0, 100)  # loss stops going down halfway
    r = parity.convergence_parity(recipe, fp32)
    assert r.verdict == "no" and 0.5 <= r.inside_fraction < 0.9


def test_parity_edge_cases():
    fp32 = _curves(0)
    assert parity.convergence_parity(fp32, fp32[:1]).verdict == "n/a"  # one fp32 seed spans no band
    assert parity.convergence_parity([], fp32).verdict == "n/a"
    assert parity.convergence_parity(fp32, fp32, stopped=True).verdict == "no"
    nan = [np.where(np.arange(200) > 150, np.nan, c) for c in fp32]
    assert parity.convergence_parity(nan, fp32).verdict == "no"
    short = [c[:50] for c in fp32]  # a shorter recipe run is compared over its steps
    assert parity.convergence_parity(short, fp32).steps == 50


def test_timing_from_history_drops_warmup_of_every_epoch():
    hist = [{"step_times_s": [9.0, 5.0, 1.0, 1.0, 2.0], "epoch_time_s": 18.0},
            {"step_times_s": [7.0, 1.0, 3.0, 3.0], "epoch_time_s": 14.0}]
    t = measure.timing_from_history(hist, warmup_steps=2, batch_size=10)
    assert t.timed_steps == 5
    assert t.step_time_s == 2.0  # median of 1, 1, 2, 3, 3
    assert t.samples_per_s == 5.0
    assert t.epoch_time_s == pytest.approx((4 / 3 * 5 + 3.0 * 4) / 2)
    assert t.raw_epoch_time_s == 16.0


def test_matmul_peak_micro_benchmark():
    p = hardware.measure_matmul_peak(torch.float32, "cpu", budget_s=0.2, sizes=(64, 128))
    assert p["flops_per_s"] > 0 and p["n"] in (64, 128) and p["dtype"] == "float32"
    assert torch.get_float32_matmul_precision() == "highest"  # restored


def test_runner_reports_a_hung_run(tmp_path, monkeypatch):
    """A worker that never exits (a stand-in interpreter that sleeps: argv is -m mixprec.bench.worker SPEC
    OUT) is killed at the timeout and becomes a failed row, the run's own file included."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho sleeping\nexec sleep 60\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))
    spec = runner.RunSpec(recipe="bf16-mixed", repeat=0, seed=3, config={}, warmup_steps=0)
    seen = []
    rows = runner.execute_matrix([spec], str(tmp_path), timeout=1, on_done=lambda i, n, r: seen.append((i, n, r)),
                                 invocation=4)
    assert [(i, n) for i, n, _ in seen] == [(1, 1)] and seen[0][2] is rows[0]
    r = rows[0]
    assert r.status == "failed" and r.reason == "timed out after 1 s (--timeout); last log line: sleeping"
    assert r.returncode is None and r.seed == 3 and r.invocation == 4 and 1 <= r.process_wall_s < 30
    assert (tmp_path / "runs" / "bf16-mixed-r0.spec.json").exists()
    assert RunResult.from_dict(json.loads((tmp_path / "runs" / "bf16-mixed-r0.json").read_text())) == r


def test_preflight_says_fp8_is_emulated_without_fp8_matmuls():
    import torch as _torch

    from mixprec import hardware as _hw
    from mixprec.bench.preflight import preflight as _preflight
    from mixprec.precision import build_recipe as _build

    p = _preflight(_build("fp8-mixed", device="cpu"))
    if _hw.has_fp8_matmul(_torch.device("cpu")):  # pragma: no cover - has_fp8_matmul is CUDA 8.9+ only
        pytest.skip("this device has FP8 matmuls")
    # emulated FP8 GEMMs run as bf16 GEMMs (FP8 values are exact in bf16): MFU against the bf16 peak
    assert "EMULATED" in p.line and "bf16" in p.line and p.matmul_dtype == "bf16"
    assert p.fast == _hw.has_fast_bf16(_torch.device("cpu"))


def test_a_plot_that_fails_mid_render_leaves_the_old_png_whole(tmp_path):
    """bench's plots go through jsonio.write_figure: rendered in memory first, so a failing savefig (or a full
    disk) never leaves half a PNG where the previous one was."""
    from mixprec.errors import OutputError
    from mixprec.jsonio import write_figure

    class Breaks:
        def savefig(self, f, **kw):
            f.write(b"\x89PNG half")
            raise RuntimeError("renderer died")

    old = tmp_path / "time.png"
    old.write_bytes(b"the previous plot")
    with pytest.raises(RuntimeError, match="renderer died"):
        write_figure(Breaks(), old)
    assert old.read_bytes() == b"the previous plot" and sorted(p.name for p in tmp_path.iterdir()) == ["time.png"]
    with pytest.raises(OutputError, match="could not write"):
        write_figure(type("Fig", (), {"savefig": lambda self, f, **kw: f.write(b"png")})(), old / "x.png")


H200_CNN = ROOT / "tests" / "fixtures" / "h200_2026-12-04_bench_cnn.json"


def test_a_cuda_bench_compares_the_step_peak_with_the_plans():
    """The H200 CNN bench (tests/fixtures/README.md) summarised again: the measured column and the ratio are the
    step's peak above the resident state (``max_memory_allocated`` less what the step started with), the figure
    the plan's ``step_peak_bytes`` predicts, not the process's ``max_memory_allocated``; so is the plot's point."""
    from mixprec.bench.aggregate import aggregate
    from mixprec.bench.plots import _measured_total
    from mixprec.bench.predict import predictions
    from mixprec.bench.report import table
    from mixprec.train.report import format_bytes

    doc = json.loads(H200_CNN.read_text())
    assert doc["environment"]["device"] == "cuda"
    rows = aggregate(doc["bench"]["precisions"], doc["runs"], flops_per_step=doc["flops_per_step"]["per_step"],
                     peaks=doc["peaks"], matmul_dtype={p["recipe"]: p["matmul_dtype"] for p in doc["preflight"]},
                     impl={p["recipe"]: p["impl"] for p in doc["preflight"]},
                     predictions=predictions(doc["prediction"]))
    fp32 = rows[0]
    probe, planned = doc["runs"][0]["memory_probe"], doc["prediction"]["recipes"]["fp32"]
    assert fp32.recipe == "fp32" and probe["method"] == "cuda max_memory_allocated"
    step, plan = probe["step_peak_bytes"], planned["step_peak_bytes"]
    assert fp32.measured_step_peak_bytes == step and fp32.cuda_peak_allocated_bytes > 1.5 * step  # the process's
    assert fp32.prediction.peak_ratio == pytest.approx(step / plan) == pytest.approx(1.0, abs=0.01)
    lines = table(rows).splitlines()
    cells = dict(zip(COLUMNS, (c.strip() for c in lines[2].strip("|").split("|"))))
    assert cells["step peak (measured)"] == format_bytes(step) == "117.27 MiB"
    assert cells["step peak (plan)"] == format_bytes(plan) and cells["measured / plan"].startswith("peak 1.01x, ")
    for r in rows:
        assert r.prediction.peak_ratio == pytest.approx(1.0, abs=0.05), r.recipe  # the plan agrees for all three
    assert "compares the step's peak above the resident state (CUDA max allocated less the step's start)" in lines[-1]
    mem = fp32.memory
    assert _measured_total(fp32) == mem["parameters"] + mem["optimizer_state"] + mem["master_weights"] + step


# ---------------------------------------------------------------------------------------- device busy


def test_host_bound_is_a_busy_share_under_the_bar():
    from mixprec.bench.results import HOST_BOUND_BELOW, Spread, host_bound

    assert HOST_BOUND_BELOW == 0.8
    assert host_bound(0.0041, 0.0241) is True and host_bound(0.79, 1.0) is True
    assert host_bound(0.8, 1.0) is False and host_bound(1.02, 1.0) is False  # a busy step (the probe ran long)
    for busy, step in ((None, 1.0), (0.5, None), (0.5, 0.0), (math.nan, 1.0), (0.5, math.inf)):
        assert host_bound(busy, step) is None, (busy, step)
    row = SummaryRow(recipe="bf16-mixed", device_busy_s=0.0041, step_time_s=Spread.of([0.0241]))
    assert row.host_bound is True and SummaryRow(recipe="fp32").host_bound is None


class _Event:
    """What busy_time_ns reads of a kineto event."""

    def __init__(self, start, end, kind="kernel", device="cuda", index=0):
        self.start, self.end, self.kind, self.index = start, end, kind, index
        self.device = torch.autograd.DeviceType.CUDA if device == "cuda" else torch.autograd.DeviceType.CPU

    def start_ns(self):
        return self.start

    def end_ns(self):
        return self.end

    def device_type(self):
        return self.device

    def device_index(self):
        return self.index

    def activity_type(self):
        return self.kind

    def is_user_annotation(self):
        return self.kind.endswith("user_annotation")


def test_device_busy_is_the_union_of_the_devices_work_intervals():
    """Kernels of concurrent streams count once (the union of their intervals), copies and memsets count, and
    what is not work on this device does not: annotations spanning the step, sync waits, host events, another
    GPU's kernels."""
    from mixprec.bench.measure import busy_time_ns

    events = [_Event(0, 100), _Event(50, 150), _Event(60, 70),  # overlapping streams: busy 0..150
              _Event(200, 210, "gpu_memcpy"), _Event(300, 305, "gpu_memset"), _Event(400, 500),
              _Event(0, 1000, "gpu_user_annotation"), _Event(150, 400, "cuda_sync"),
              _Event(0, 1000, "cpu_op", device="cpu"), _Event(0, 1000, index=1)]
    assert busy_time_ns(events, 0) == (150 + 10 + 5 + 100, 4)
    assert busy_time_ns(events, 1) == (1000, 1) and busy_time_ns([], 0) == (0, 0)

    class Older(_Event):  # a torch whose events have no activity_type: annotations are still left out
        activity_type = property()

    older = [Older(0, 100), Older(0, 1000, "gpu_user_annotation")]
    assert not hasattr(older[0], "activity_type") and busy_time_ns(older, 0) == (100, 1)


def test_device_busy_is_not_probed_on_the_cpu():
    """On the CPU the probe runs nothing (the run has no loader here to run) and says why."""
    from types import SimpleNamespace

    busy = measure.probe_device_busy(SimpleNamespace(device=CPU))
    assert busy.method is None and busy.busy_s is None and busy.reason.startswith("the run's device is cpu")


def test_the_busy_probe_profiles_its_steps_after_warm_up_and_reports_per_step(monkeypatch):
    """The probe's own arithmetic, with the CUDA parts stood in for (no GPU here): ``warmup`` + ``steps`` optimizer
    steps of ``accum`` micro-batches each, cycling through short epochs, only the last ``steps`` profiled, and the
    profiled busy time and kernels divided by ``steps``; the steps are guarded and numbered, as the trainer's."""
    import torch.profiler
    from types import SimpleNamespace

    from mixprec.train.data import FixedBatches

    steps, profiling, guarded = [], [], []

    class Profile:
        profiler = SimpleNamespace(kineto_results=SimpleNamespace(events=lambda: ["events"]))

        def __init__(self, activities):
            assert activities == [torch.profiler.ProfilerActivity.CUDA]

        def __enter__(self):
            profiling.append(len(steps))
            return self

        def __exit__(self, *exc):
            profiling.append(len(steps))

    monkeypatch.setattr(torch.profiler, "profile", Profile)
    monkeypatch.setattr(measure, "synchronize", lambda device: None)
    monkeypatch.setattr(measure, "accumulate_step", lambda ctx, micro, step: (
        steps.append([b[1].item() for b in micro]), guarded.append((ctx.guard, step))))
    monkeypatch.setattr(measure, "StepGuard", lambda device: "guard")
    monkeypatch.setattr(measure, "busy_time_ns", lambda events, index: (6_000_000, 90) if events == ["events"] else 0)
    loader = FixedBatches([(torch.zeros(1, 2), torch.tensor([i])) for i in range(3)])
    run = SimpleNamespace(device=torch.device("cuda", 0), train_loader=loader, ctx=SimpleNamespace(guard=None))
    busy = measure.probe_device_busy(run, accum=2, warmup=1, steps=3)
    assert steps == [[0, 1], [2, 0], [1, 2], [0, 1]] and profiling == [1, 4]
    assert guarded == [("guard", i) for i in range(4)] and run.ctx.guard is None
    assert busy.method == measure.BUSY_METHOD and busy.steps == 3 and busy.profiled_step_s >= 0
    assert busy.busy_s == pytest.approx(0.002) and busy.kernels_per_step == 30
    monkeypatch.setattr(measure, "busy_time_ns", lambda events, index: (0, 0))
    nothing = measure.probe_device_busy(run, accum=1, warmup=0, steps=2)
    assert nothing.busy_s is None and "no kernel" in nothing.reason


def _h200_rows(busy=None):
    """The H200 CNN bench's rows, its runs given ``busy`` (recipe -> share of the run's own step) if any."""
    from mixprec.bench.aggregate import aggregate
    from mixprec.bench.predict import predictions

    doc = json.loads(H200_CNN.read_text())
    runs = doc["runs"]
    for r in runs:
        assert "device_busy" not in r  # a file written before the probe existed
        if busy is not None:
            step = r["timing"]["step_time_s"]
            r["device_busy"] = {"method": "test", "busy_s": busy[r["recipe"]] * step, "kernels_per_step": 60,
                                "profiled_step_s": 1.5 * step, "steps": 5}
    return aggregate(doc["bench"]["precisions"], runs, flops_per_step=doc["flops_per_step"]["per_step"],
                     peaks=doc["peaks"], matmul_dtype={p["recipe"]: p["matmul_dtype"] for p in doc["preflight"]},
                     impl={p["recipe"]: p["impl"] for p in doc["preflight"]},
                     predictions=predictions(doc["prediction"])), doc


def test_an_old_results_json_reads_with_no_device_busy_and_its_table_is_unchanged():
    from mixprec.bench.report import BUSY_COLUMN, columns, table
    from mixprec.bench.results import DeviceBusy

    rows, doc = _h200_rows()
    assert all(RunResult.from_dict(r).device_busy == DeviceBusy() for r in doc["runs"])
    assert all(r.device_busy_s is None and r.host_bound is None for r in rows)
    assert columns(rows) == COLUMNS and BUSY_COLUMN not in table(rows) and "host-bound" not in table(rows)
    damaged = RunResult.from_dict({**doc["runs"][0], "device_busy": {"busy_s": "fast", "steps": 2.5}})
    assert damaged.device_busy == DeviceBusy()  # a damaged field is "not measured"


def test_the_device_busy_column_beside_the_step_time_and_the_host_bound_recipes_under_the_table():
    """The H200 CNN bench with a device busy time per run (a share of each run's step): the column follows the
    step time, its cell is the median busy time and its share of the median step, and the line under the table
    names the recipes under 80% with their share, and no other."""
    from mixprec.bench.report import BUSY_COLUMN, PLAN_COLUMNS, columns, markdown_report, table

    shares = {"fp32": 0.95, "fp16-mixed": 0.5, "bf16-mixed": 0.3}
    rows, doc = _h200_rows(shares)
    cols = columns(rows)
    assert cols.index(BUSY_COLUMN) == cols.index("step time") + 1 and len(cols) == len(COLUMNS) + 1
    text = table(rows)
    lines = text.splitlines()
    by_recipe = {r.recipe: dict(zip(cols, (c.strip() for c in line.strip("|").split("|"))))
                 for r, line in zip(rows, lines[2:])}
    for r in rows:
        assert r.device_busy_fraction == pytest.approx(shares[r.recipe], rel=1e-6), r.recipe
        step = r.median("step_time_s")
        assert r.device_busy_s == pytest.approx(shares[r.recipe] * step) and r.kernels_per_step == 60
        assert by_recipe[r.recipe][BUSY_COLUMN] == f"{r.device_busy_s * 1e3:.3g} ms ({100 * shares[r.recipe]:.0f}%)"
    assert by_recipe["bf16-mixed"][BUSY_COLUMN].endswith("(30%)")
    notes = [ln for ln in lines if "host-bound" in ln]
    assert len(notes) == 1 and notes[0].endswith("fp16-mixed 50%, bf16-mixed 30%") and "fp32" not in notes[0]
    doc["summary"] = [r.to_dict() for r in rows]
    assert "- device busy (CUDA)" in markdown_report(doc)
    assert [SummaryRow.from_dict(r.to_dict()) for r in rows] == rows  # results.json's summary reads back
    # without a plan the step time comes with it, where the plan's columns would be
    bare = [dataclasses.replace(r, prediction=None) for r in rows]
    at = [c for c in COLUMNS if c not in PLAN_COLUMNS].index("step peak (measured)") + 1
    assert columns(bare)[at:at + 2] == ["step time", BUSY_COLUMN]


@pytest.mark.cuda
def test_device_busy_of_a_real_cuda_run_and_its_data_on_the_gpu():
    """A small run on CUDA: the built-in dataset's training split lives on the GPU, and the probe records a
    device busy time per step that is positive and shorter than the profiled step's wall time."""
    from mixprec.train.build import build_run

    run = build_run(TrainConfig.from_flags(dataset="synthetic", synthetic_train=512, synthetic_test=64, model="mlp",
                                           batch_size=64, epochs=1, log_every=0, progress="off", device="cuda",
                                           precision="bf16-mixed"))
    assert run.train_loader.x.device.type == "cuda" and run.data.x_train.device.type == "cpu"
    with run.recipe.run_context():
        busy = measure.probe_device_busy(run, accum=2, warmup=1, steps=3)
    assert busy.method == measure.BUSY_METHOD and busy.reason is None and busy.steps == 3, busy
    assert 0 < busy.busy_s < busy.profiled_step_s and busy.kernels_per_step >= 1
