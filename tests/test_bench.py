"""mixprec bench: the CLI end to end (one small matrix, shared by most tests), and its pure parts.

The end-to-end matrix runs fp32, bf16-mixed and amp (fp16-mixed) twice each on synthetic data with a small
MLP, each run in its own worker process. The test hook ``MIXPREC_BENCH_TEST_CRASH=fp16-mixed`` (read only
by :mod:`mixprec.bench.worker`) makes both fp16-mixed workers abort (SIGABRT, no result file), so the same
matrix proves that a crashing recipe leaves the other rows complete.
"""

import contextlib
import io
import json
import math
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mixprec.bench import measure, parity, runner, worker
from mixprec.bench.flops import count_step_flops
from mixprec.bench.report import COLUMNS
from mixprec.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MIB = 2**20
STEPS_PER_EPOCH, EPOCHS, WARMUP = 8, 2, 2  # 512 samples / batch 64
SMALL = ["--dataset", "synthetic", "--synthetic-train", "512", "--synthetic-test", "128", "--model", "mlp",
         "--width", "512", "--depth", "2", "--batch-size", "64", "--epochs", str(EPOCHS),
         "--warmup-steps", str(WARMUP), "--peak-seconds", "0.1"]


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    """Run the matrix once through the CLI; returns (exit code, stdout, out dir, results.json)."""
    out = tmp_path_factory.mktemp("bench")
    old = os.environ.get(worker.TEST_CRASH_ENV)
    os.environ[worker.TEST_CRASH_ENV] = "fp16-mixed"
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            code = main(["bench", "--precisions", "fp32,bf16-mixed,amp", "--repeats", "2", *SMALL,
                         "--out", str(out)])
    finally:
        if old is None:
            del os.environ[worker.TEST_CRASH_ENV]
        else:
            os.environ[worker.TEST_CRASH_ENV] = old
    doc = json.loads((out / "results.json").read_text())
    return code, buf.getvalue(), out, doc


def _runs(doc, recipe):
    return [r for r in doc["runs"] if r["recipe"] == recipe]


def _row(doc, recipe):
    return next(r for r in doc["summary"] if r["recipe"] == recipe)


# ------------------------------------------------------------------------------------ end to end


def test_crashing_recipe_leaves_the_other_rows(bench):
    code, out, _, doc = bench
    assert code == 1  # some runs failed
    for r in _runs(doc, "fp16-mixed"):
        assert r["status"] == "failed" and "SIGABRT" in r["reason"]
    for name in ("fp32", "bf16-mixed"):
        runs = _runs(doc, name)
        assert [r["status"] for r in runs] == ["ok", "ok"], [r.get("reason") for r in runs]
    assert [r["recipe"] for r in doc["summary"]] == ["fp32", "bf16-mixed", "fp16-mixed"]
    assert "fp16-mixed seed 0: FAILED — crashed: killed by SIGABRT" in out
    progress = [ln for ln in out.splitlines() if ln.startswith("[") and "/6]" in ln]
    assert len(progress) == 6  # one line per finished run, in run order
    assert progress[0].startswith("[1/6] fp32 seed 0:") and progress[3].startswith("[4/6] fp32 seed 1:")


def test_results_json_schema(bench):
    _, _, _, doc = bench
    assert doc["schema"] == "mixprec.bench/2"
    assert {"created", "command", "flags", "config", "recipes", "repeats", "seeds", "warmup_steps",
            "environment", "preflight", "peaks", "flops_per_step", "columns", "summary", "runs",
            "plots"} <= set(doc)
    env = doc["environment"]
    assert env["torch"] == torch.__version__ and env["cpu"] and env["device_name"] and env["threads"] >= 1
    assert {"python", "numpy", "mixprec", "platform", "cpu_flags", "gpu"} <= set(env)
    assert doc["recipes"] == ["fp32", "bf16-mixed", "fp16-mixed"] and doc["seeds"] == [0, 1]
    assert doc["flags"]["precisions"] == "fp32,bf16-mixed,amp" and doc["flags"]["repeats"] == 2
    assert [p["recipe"] for p in doc["preflight"]] == doc["recipes"]
    for dt, peak in doc["peaks"].items():
        assert dt in ("fp32", "tf32", "bf16", "fp16") and peak["flops_per_s"] > 0
    assert len(doc["runs"]) == 6
    for r in doc["runs"]:
        assert {"status", "reason", "recipe", "repeat", "seed", "impl", "history", "summary", "timing",
                "memory_probe", "returncode", "log"} <= set(r)
    for row in doc["summary"]:
        assert {"recipe", "impl", "runs_ok", "runs_total", "failures", "epoch_time_s", "step_time_s",
                "samples_per_s", "memory", "memory_total_bytes", "measured_step_peak_bytes", "mfu",
                "peak_flops_per_s", "matmul_dtype", "final_train_loss", "test_accuracy", "skipped_steps",
                "final_loss_scale", "speedup_vs_fp32", "memory_saving_vs_fp32", "accuracy_delta_vs_fp32_pp",
                "parity"} <= set(row)


def test_every_column_present(bench):
    _, out, path, doc = bench
    header = "| " + " | ".join(COLUMNS) + " |"
    assert doc["columns"] == COLUMNS
    assert COLUMNS[:3] == ["recipe", "memory", "avg epoch time"]  # the tutorial's columns come first
    lines = out.splitlines()
    i = lines.index(header)
    rows = lines[i + 2:i + 5]
    assert [r.split("|")[1].strip() for r in rows] == ["fp32", "bf16-mixed", "fp16-mixed (scratch)"]
    for r in rows:
        assert len(r.strip("|").split("|")) == len(COLUMNS)
    fp32_cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert "—" not in fp32_cells, fp32_cells  # every column is filled for a successful recipe
    assert fp32_cells[3] == "1.00x" and fp32_cells[13] == "yes"
    assert header in (path / "results.md").read_text()


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


def test_quality_and_parity_columns(bench):
    _, _, _, doc = bench
    fp32 = _row(doc, "fp32")
    assert fp32["speedup_vs_fp32"] == pytest.approx(1.0) and fp32["memory_saving_vs_fp32"] == pytest.approx(0.0)
    assert fp32["parity"]["verdict"] == "yes"  # fp32's mean curve always lies inside its own seed band
    bf = _row(doc, "bf16-mixed")
    assert bf["parity"]["verdict"] in ("yes", "no") and "seed band" in bf["parity"]["reason"]
    assert 0 <= bf["test_accuracy"]["median"] <= 1 and math.isfinite(bf["final_train_loss"])
    assert bf["skipped_steps"] == 0 and bf["final_loss_scale"] == 1.0
    assert _row(doc, "fp16-mixed")["parity"]["verdict"] == "n/a"


def test_memory_accounting_and_honest_cpu_peak(bench):
    """The measured step peak (VmHWM after clear_refs, glibc mmap threshold 64 KiB, malloc_trim) agrees
    with the exact accounting of the same step: never below 0.9 x (activations + gradients), and at most
    2 x that + 1 MiB — the excess being temporaries the accounting does not count (activation gradients
    during backward; under bf16 autocast also the bf16 weight gradients before their cast to fp32)."""
    _, _, _, doc = bench
    for name in ("fp32", "bf16-mixed"):
        row = _row(doc, name)
        mem = row["memory"]
        assert mem["parameters"] == mem["gradients"] > 2 * MIB  # fp32 params and grads, ~2.6 MiB
        assert mem["total"] == sum(mem[k] for k in ("parameters", "gradients", "optimizer_state",
                                                     "master_weights", "activations"))
        for r in _runs(doc, name):
            probe = r["memory_probe"]
            if probe.get("method") is None:
                pytest.skip(f"no honest CPU peak on this platform: {probe.get('reason')}")
            exact = probe["exact_activations_plus_gradients"]
            assert exact["gradients"] == mem["gradients"] and exact["activations"] == mem["activations"]
            assert 0.9 * exact["total"] <= probe["step_peak_bytes"] <= 2 * exact["total"] + MIB, (name, probe)


def test_plots_written_and_valid_png(bench):
    _, _, path, doc = bench
    assert doc["plots"] == ["time.png", "memory.png", "loss.png"]
    for name in doc["plots"]:
        data = (path / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 5000


def test_per_run_logs_and_preflight(bench):
    _, out, path, doc = bench
    assert (path / "logs" / "fp32-r0.log").read_text().startswith("fp32")
    lines = [ln for ln in out.splitlines() if ln.startswith("preflight: ")]
    assert [ln.split()[1].rstrip(":") for ln in lines] == ["fp32", "bf16-mixed", "fp16-mixed"]
    fp16 = doc["preflight"][2]
    # whatever this machine is, the line says how fp16 will run here
    assert any(w in fp16["line"] for w in ("EMULATED", "WARNING", "fast fp16", "tensor cores"))
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
    from mixprec.bench.command import _progress_line
    from mixprec.bench.plots import write_plots
    from mixprec.bench.report import aggregate, markdown_report, table

    with contextlib.redirect_stdout(io.StringIO()):
        for i, r in enumerate(runs):
            _progress_line(i + 1, len(runs), r)
    rows = aggregate(doc["recipes"], runs, flops_per_step=doc["flops_per_step"]["per_step"], peaks=doc["peaks"],
                     matmul_dtype={r["recipe"]: r["matmul_dtype"] for r in doc["summary"]})
    text = table(rows) + markdown_report({**doc, "summary": rows, "runs": runs})
    if out_dir is not None:
        assert write_plots(rows, runs, str(out_dir), title="t") == ["time.png", "memory.png", "loss.png"]
    return rows, text


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
                    assert rows[0]["final_train_loss"] == fp32_loss, (i, path)
                n += 1
    assert n > 300
    for bad in (None, math.nan):  # every value of every run at once (the recipe and status aside), plots too
        runs = copy.deepcopy(doc["runs"])
        for r in runs:
            for path in _leaves(r):
                if path not in (("recipe",), ("status",)):
                    _set(r, path, bad)
        rows, text = _report_everything(doc, runs, out_dir=tmp_path)
        assert [r["runs_ok"] for r in rows] == [2, 2, 0] and all(r["final_train_loss"] is None for r in rows)


def _leaves(o, path=()):
    if isinstance(o, dict):
        for k, v in o.items():
            yield from _leaves(v, path + (k,))
    elif isinstance(o, list):
        for j, v in enumerate(o):
            yield from _leaves(v, path + (j,))
    else:
        yield path


# ----------------------------------------------------------------------------------- usage errors


@pytest.mark.parametrize("args,needle", [
    (["--precisions", "fp32,fp12"], "unknown precision 'fp12'"),
    (["--precisions", ","], "names no recipe"),
    (["--repeats", "0"], "--repeats 0 must be >= 1"),
    (["--warmup-steps", "8"], "leaves no timed step"),
    (["--log-every", "5"], "--log-every"),
    (["--strategy", "ddp"], "single-process"),
])
def test_usage_errors_exit_2_before_any_run(cli, tmp_path, args, needle):
    code, out, err = cli("bench", *SMALL, "--out", tmp_path, *args)
    assert code == 2 and needle in err, err
    assert not (tmp_path / "runs").exists()


# ------------------------------------------------------------------------------------ pure parts


def test_worker_turns_an_exception_into_a_failed_row(monkeypatch):
    monkeypatch.setenv(worker.TEST_CRASH_ENV, "bf16-mixed:raise")
    r = worker.train_and_measure({"recipe": "bf16-mixed", "repeat": 0, "seed": 0, "warmup_steps": 0, "config": {}})
    assert r["status"] == "failed" and "deliberate failure" in r["reason"] and r["history"] == []


def test_failed_reason_names_the_exit(tmp_path):
    log = tmp_path / "x.log"
    log.write_text("first\nTraceback...\nRuntimeError: boom\n")
    assert runner.failed_reason(-6, str(log)) == "crashed: killed by SIGABRT; last log line: RuntimeError: boom"
    assert "SIGKILL (out of memory?)" in runner.failed_reason(-9, str(tmp_path / "missing.log"))
    assert runner.failed_reason(None, str(log), timeout=5).startswith("timed out after 5 s")


def test_flops_of_a_linear_are_exact():
    b, n_in, n_out = 8, 20, 30
    lin = torch.nn.Linear(n_in, n_out)
    x, y = torch.randn(b, n_in), torch.randint(0, n_out, (b,))
    f = count_step_flops(lin, x, y, F.cross_entropy)
    assert f.forward == 2 * b * n_in * n_out  # one addmm
    assert f.backward == 2 * b * n_in * n_out  # weight grad only: the input needs no grad
    assert f.by_op == {"addmm": 2 * b * n_in * n_out, "mm": 2 * b * n_in * n_out}
    assert lin.weight.grad is None  # grads are cleared
    f = count_step_flops(lin, x.requires_grad_(), y, F.cross_entropy)
    assert f.backward == 4 * b * n_in * n_out  # weight grad + input grad


def test_flops_of_a_two_layer_mlp():
    b = 4
    m = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    f = count_step_flops(m, torch.randn(b, 10), torch.randint(0, 3, (b,)), F.cross_entropy)
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
    assert t["timed_steps"] == 5
    assert t["step_time_s"] == 2.0  # median of 1, 1, 2, 3, 3
    assert t["samples_per_s"] == 5.0
    assert t["epoch_time_s"] == pytest.approx((4 / 3 * 5 + 3.0 * 4) / 2)
    assert t["raw_epoch_time_s"] == 16.0


def test_matmul_peak_micro_benchmark():
    p = measure.measure_matmul_peak(torch.float32, "cpu", budget_s=0.2, sizes=(64, 128))
    assert p["flops_per_s"] > 0 and p["n"] in (64, 128) and p["dtype"] == "float32"
    assert torch.get_float32_matmul_precision() == "highest"  # restored


def test_runner_reports_a_hung_run(tmp_path, monkeypatch):
    monkeypatch.setenv(worker.TEST_CRASH_ENV, "bf16-mixed:hang")
    spec = runner.RunSpec(recipe="bf16-mixed", repeat=0, seed=3, config={}, warmup_steps=0)
    seen = []
    rows = runner.execute_matrix([spec], str(tmp_path), timeout=2, on_done=lambda i, n, r: seen.append((i, n, r)))
    assert [(i, n) for i, n, _ in seen] == [(1, 1)] and seen[0][2] is rows[0]
    assert rows[0]["status"] == "failed" and rows[0]["reason"].startswith("timed out after 2 s")
    assert rows[0]["returncode"] is None and rows[0]["seed"] == 3
    assert (tmp_path / "runs" / "bf16-mixed-r0.spec.json").exists()


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
