"""mixprec doctor: planted faults it must find, its range arithmetic against real casts, the precision map
against torch's own autocast, and the command line."""

import contextlib
import json
import os
import re
import shutil
import subprocess
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import DEVICES
from mixprec import hardware
from mixprec.doctor import DoctorError, diagnose, find_first_nonfinite, precision_map
from mixprec.probes.attribution import display_path
from mixprec.probes.ranges import Log2Histogram
from mixprec.formats import get_format, quantize
from mixprec.train.models import build_model


def _batch(n=32, d=16, classes=4, gain=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g) * gain, torch.randint(0, classes, (n,), generator=g)


def _kinds(report):
    return [r["kind"] for r in report.recommendations()]


def _no_global_state_left():
    from mixprec.autocast import is_autocast_active

    assert torch._C._len_torch_dispatch_stack() == 0
    assert torch._C._len_torch_function_stack() == 0
    assert not torch.is_autocast_enabled("cpu") and not is_autocast_active()
    assert not nn.modules.module._global_forward_hooks and not nn.modules.module._global_forward_pre_hooks


# ---------------------------------------------------------------------------------------------------
# planted faults
# ---------------------------------------------------------------------------------------------------

class Overflowing(nn.Module):
    """`big` multiplies inputs of ~5 by weights of 1000..3000 over 64 inputs: activations ~3e5 > 65504.

    Its weights (< 65504) and everything else fit fp16; a LayerNorm right after brings values back to ~1.
    """

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(16, 64)
        self.act = nn.ReLU()
        self.big = nn.Linear(64, 32)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 4)
        with torch.no_grad():
            self.big.weight.uniform_(1000, 3000)

    def forward(self, x):
        return self.head(F.relu(self.norm(self.big(self.act(self.fc1(x))))))


def _as_on_a_cpu_without_fast_fp16(monkeypatch):
    """What `--amp-impl auto` does on a CPU without fast fp16 kernels (the scratch autocast emulating fp16),
    on any machine."""
    monkeypatch.setattr(hardware, "has_fast_fp16_training", lambda device: False)


@pytest.mark.parametrize("impl", ["emulated", "native"])
def test_forward_overflow_is_located_and_replay_keeps_exactly_that_layer_in_fp32(impl, monkeypatch):
    if impl == "emulated":
        _as_on_a_cpu_without_fast_fp16(monkeypatch)
    report = diagnose(Overflowing(), _batch(gain=10.0), F.cross_entropy, precision="fp16-mixed", steps=1,
                      amp_impl="native" if impl == "native" else "auto")
    assert report.recipe_spec["emulated"] == (impl == "emulated")
    fault = report.first_fault()
    assert fault is report.faults[0] and fault.step == 0
    assert fault.classification == "forward overflow"
    ev = fault.event
    assert (ev.phase, ev.module) == ("forward", "big") and ev.inputs_finite and ev.output.n_inf > 0
    # native fp16 overflows in the matmul itself; emulated fp16 in the rounding of its fp32 result
    assert ev.op == ("addmm" if impl == "native" else "_to_copy")
    assert fault.replay.modules == ["big"]
    assert "keep-fp32" in _kinds(report) and "--keep-fp32 big" in report.recommendations()[0]["text"]
    rows = {r["layer"]: r for r in report.ranges.layer_rows(0)}
    assert rows["big"]["activations"]["fp16"]["overflow"] > 0.5
    assert rows["big"]["activations"]["bf16"]["overflow"] == 0
    assert all(r["activations"]["fp16"]["overflow"] == 0 for n, r in rows.items() if n != "big")
    assert report.history.records[0].skipped and report.history.records[0].cause.startswith("forward overflow")
    _no_global_state_left()


def test_the_proposed_fp32_set_fixes_training_with_the_scratch_autocasts_keep_fp32():
    kept = diagnose(Overflowing(), _batch(gain=10.0), F.cross_entropy, precision="fp16-mixed", steps=2,
                    amp_impl="scratch", keep_fp32=("big",))
    assert not kept.faults and kept.history.skipped == 0
    rows = {(r.module, r.op): r.compute for r in kept.precision_map.rows if r.phase == "forward" and r.flops}
    assert rows[("big", "addmm")] == "fp32" and rows[("head", "addmm")].startswith("fp16")


def _tiny_head_mlp():
    """Gradients reaching the hidden layers are scaled by a 1e-5 head: many fall below fp16's 6e-8."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    with torch.no_grad():
        m[4].weight.mul_(1e-5)
    return m


def test_gradient_underflow_is_measured_and_the_recommended_scale_removes_it():
    model, batch = _tiny_head_mlp(), _batch(n=64)
    unscaled = diagnose(model, batch, F.cross_entropy, precision="fp16-mixed", steps=2, init_scale=1.0,
                        growth_interval=10**6)
    now = unscaled.gradient_fractions("fp16")
    assert unscaled.loss_scale == 1.0 and now["underflow"] > 0.1
    assert unscaled.gradient_loss.fraction > 0.05  # really lost in the recipe's backward, not just projected
    k = unscaled.recommended_log2_scale()
    assert k is not None and k > 10
    rec = unscaled.gradient_fractions("fp16", k)
    assert rec["underflow"] <= 1e-6 and rec["overflow"] == 0
    init = [r for r in unscaled.recommendations() if r["kind"] == "init-scale"]
    assert init and f"--init-scale {2.0**k:g}" in init[0]["text"]

    scaled = diagnose(model, batch, F.cross_entropy, precision="fp16-mixed", steps=2, init_scale=2.0**k,
                      growth_interval=10**6)
    assert scaled.loss_scale == 2.0**k and scaled.history.skipped == 0
    # what remains is not underflow but the rare element where rounded operands cancel to an exact zero
    assert scaled.gradient_loss.nonzero > 0 and scaled.gradient_loss.fraction < 1e-3
    assert scaled.gradient_fractions("fp16")["underflow"] <= 1e-6
    assert "init-scale" not in _kinds(scaled)


@pytest.mark.slow
def test_a_too_large_loss_scale_is_classified_as_scale_overflow_not_as_a_fault():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    report = diagnose(model, _batch(), lambda out, y: 1000.0 * F.cross_entropy(out, y), precision="fp16-mixed",
                      steps=2)
    assert [r.skipped for r in report.history.records] == [True, True]
    assert [r.scale for r in report.history.records] == [65536.0, 32768.0]  # the scaler backs off
    fa = report.faults[0]
    assert fa.classification == "scale overflow" and fa.event.phase == "backward" and not fa.is_fault
    assert 1 <= fa.max_finite_scale < 32768 and fa.replay is None and report.first_fault() is None
    init = [r for r in report.recommendations() if r["kind"] == "init-scale"]
    assert init and "skipped while the scaler backed off" in init[0]["text"]
    assert 2.0 ** report.recommended_log2_scale() <= fa.max_finite_scale  # the advice agrees with the replay


@pytest.mark.slow
def test_init_scale_advice_names_the_runs_initial_scale_not_the_backed_off_one():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    report = diagnose(model, _batch(), lambda out, y: 1000.0 * F.cross_entropy(out, y), precision="fp16-mixed",
                      steps=2)
    assert report.history.records[0].scale == 2.0**16 and report.loss_scale == 2.0**14  # backed off twice
    text = next(r["text"] for r in report.recommendations() if r["kind"] == "init-scale")
    k = report.recommended_log2_scale()
    assert f"at 2^{k} = {2.0**k:g} (--init-scale {2.0**k:g}) instead of 2^16:" in text
    # the before -> after fractions compare the same two scales: the initial one and the recommended one
    from mixprec.probes.advice import _pct

    init, rec = report.gradient_fractions("fp16", 16), report.gradient_fractions("fp16", k)
    assert f"overflow {_pct(init['overflow'])} -> {_pct(rec['overflow'])}" in text
    assert init["overflow"] != report.gradient_fractions("fp16")["overflow"]  # the final scale would differ


class _Explode(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by 1e7 (overflows fp16, not fp32)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * 1e7


class Spike(nn.Module):
    def forward(self, x):
        return _Explode.apply(x)


class BackwardOnly(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(16, 32)
        self.act = nn.ReLU()
        self.spike = Spike()
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        return self.head(self.spike(self.act(self.fc1(x))))


@pytest.mark.parametrize("impl", ["native", "emulated"])
def test_backward_only_overflow_is_located_in_backward(impl, monkeypatch):
    if impl == "emulated":
        _as_on_a_cpu_without_fast_fp16(monkeypatch)
    report = diagnose(BackwardOnly(), _batch(), F.cross_entropy, precision="fp16-mixed", steps=1,
                      amp_impl="native" if impl == "native" else "auto", init_scale=1.0)
    assert report.recipe_spec["emulated"] == (impl == "emulated")
    fault = report.first_fault()
    assert fault.classification == "backward overflow"  # the forward replayed finite; scale 1 cannot help
    assert fault.event.phase == "backward" and fault.event.inputs_finite
    rec = report.history.records[0]
    assert rec.skipped and rec.loss == rec.loss  # finite loss, skipped step
    if impl == "native":  # fp16 arithmetic in the custom backward itself
        assert (fault.event.module, fault.event.op, fault.event.node) == ("spike", "mul", "_ExplodeBackward")
    else:  # emulated: fp32 arithmetic, the overflow happens where the gradient is rounded to fp16
        assert fault.event.op == "_to_copy" and fault.event.module in ("fc1", "act")
    assert fault.replay.modules  # some fp32 set makes the step finite
    _no_global_state_left()


def test_lost_updates_in_bf16_weights_and_none_with_master_weights():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    true = diagnose(model, _batch(n=64), F.cross_entropy, precision="bf16-true", steps=2, lr=1e-3)
    lu = true.lost_updates
    assert lu.steps == 2 and lu.lost_fraction > 0.9
    for layer in lu.layers:
        assert layer.dtype == "bf16" and layer.updated > 0
        assert layer.lost == layer.unchanged  # the formula low(w + d) == w matches what the real step did
    master = [r for r in true.recommendations() if r["kind"] == "master-weights"]
    assert master and "bf16-master" in master[0]["text"]

    with_master = diagnose(model, _batch(n=64), F.cross_entropy, precision="bf16-master", steps=2, lr=1e-3)
    assert with_master.lost_updates.lost_fraction == 0.0
    assert all(layer.dtype == "fp32" and layer.updated > 0 for layer in with_master.lost_updates.layers)
    assert "master-weights" not in _kinds(with_master)


class ZeroInitResidual(nn.Module):
    """Two residual blocks initialised the way timm and transformers do it, so each starts as the identity:
    ``h + bn(fc(h))`` with the BatchNorm's gamma (and, as always, its beta) zero, and
    ``h + proj(relu(up(h)))`` with the output projection's weight and bias zero."""

    def __init__(self, d=32):
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Linear(16, d)
        self.fc = nn.Linear(d, d)
        self.bn = nn.BatchNorm1d(d)
        self.up = nn.Linear(d, 2 * d)
        self.proj = nn.Linear(2 * d, d)
        self.head = nn.Linear(d, 4)
        nn.init.zeros_(self.bn.weight)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, x):
        h = F.relu(self.stem(x))
        h = F.relu(h + self.bn(self.fc(h)))
        h = h + self.proj(F.relu(self.up(h)))
        return self.head(h)


def test_zero_initialised_weights_with_a_sane_lr_do_not_call_the_lr_too_large():
    # the second batch is 3x larger, so the zero-initialised tensors' gradient (and update) at step 1 is ~3x the
    # step-0 update they consist of: |d/w| ~ 3 there, whatever the learning rate
    batches = [_batch(seed=0), _batch(seed=1, gain=3.0)]
    report = diagnose(ZeroInitResidual(), batches, F.cross_entropy, precision="bf16-mixed", steps=2,
                      optimizer=torch.optim.SGD, lr=1e-2)
    assert "not-precision" not in _kinds(report), report.recommendations()
    layers = {lu.name: lu for lu in report.lost_updates.layers}
    assert layers["bn"].median_ratio is None and layers["bn"].unjudged == ["bn.weight", "bn.bias"]
    assert layers["proj"].median_ratio is None and layers["proj"].unjudged == ["proj.weight", "proj.bias"]
    for name in ("stem", "fc", "up", "head"):  # the weights with a scale of their own are still judged, and are fine
        assert layers[name].unjudged == [] and 0 < layers[name].median_ratio < 0.1


def test_a_too_large_lr_is_reported_with_the_layers_that_show_it():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    report = diagnose(model, _batch(), F.cross_entropy, precision="bf16-mixed", steps=2,
                      optimizer=torch.optim.SGD, lr=30.0)
    lr_recs = [r["text"] for r in report.recommendations() if "learning rate is far too large" in r["text"]]
    assert len(lr_recs) == 1
    huge = sorted((lu for lu in report.lost_updates.layers if lu.median_ratio and lu.median_ratio > 1),
                  key=lambda lu: -lu.median_ratio)
    assert huge
    for lu in huge:  # every layer that shows it is named, worst first, with its median |d/w|
        assert f"{display_path(lu.name)} ({lu.median_ratio:.3g})" in lr_recs[0]
    shown = [display_path(lu.name) + " (" for lu in huge]
    assert [lr_recs[0].index(s) for s in shown] == sorted(lr_recs[0].index(s) for s in shown)


class NanModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc(x) * torch.sqrt(-1.0 - x.abs().sum())  # NaN in every precision


def test_nan_in_fp32_too_is_reported_as_not_a_precision_problem():
    report = diagnose(NanModel(), _batch(), F.cross_entropy, precision="bf16-mixed", steps=3)
    assert len(report.history.records) == 1 and report.history.records[0].stopped  # training would stop
    fault = report.first_fault()
    assert fault.classification == "forward nan" and fault.event.op == "sqrt"
    assert fault.event.module == "" and fault.replay.modules is None
    assert "not-precision" in _kinds(report)


def test_a_nan_loss_is_written_as_null_in_strict_json_and_the_files_replace_old_ones(tmp_path):
    (tmp_path / "doctor.json").write_text("stale")
    report = diagnose(NanModel(), _batch(), F.cross_entropy, precision="bf16-mixed", steps=1, replay=False)
    assert report.history.records[0].loss != report.history.records[0].loss  # NaN in the report itself
    paths = report.write(str(tmp_path), plots=False)
    assert [p.rsplit("/", 1)[-1] for p in paths] == ["doctor.json", "report.txt"]
    text = (tmp_path / "doctor.json").read_text()
    d = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    assert d["loss_scale_history"]["steps"][0]["loss"] is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["doctor.json", "report.txt"]  # no temp files left


def test_find_first_nonfinite_on_a_healthy_and_a_faulty_model():
    assert find_first_nonfinite(nn.Linear(16, 4), _batch(), F.cross_entropy) is None
    fa = find_first_nonfinite(Overflowing(), _batch(gain=10.0), F.cross_entropy, amp_impl="native")
    assert fa.event.module == "big" and fa.replay.modules == ["big"]


# ---------------------------------------------------------------------------------------------------
# range arithmetic: exact against the casts
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["fp16", "bf16", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("k", [0, 5])
def test_binade_projection_matches_rounding_into_the_format(fmt, k):
    # 1.5 * 2**e sits inside its binade, away from the ties at the edges, so one-binade resolution is exact
    f = get_format(fmt)
    for e in range(-160, 128):
        x = torch.tensor([1.5 * 2.0**e], dtype=torch.float64).float()
        if x.item() == 0 or not torch.isfinite(x):
            continue
        h = Log2Histogram()
        h.add(-x)
        got = h.fractions(fmt, k)
        scaled = x.double() * 2.0**k
        q = quantize(scaled, fmt).double()
        assert got["overflow"] == float(scaled.abs().item() > f.max), (e, got)
        assert got["underflow"] == float(q.item() == 0), (e, got)
        assert got["subnormal"] == float(0 < abs(q.item()) < f.smallest_normal), (e, got)


def test_histogram_counts_zeros_nonfinite_and_fp32_subnormals():
    h = Log2Histogram()
    h.add(torch.tensor([0.0, -0.0, 1.0, 1.5, -3.0, float("inf"), float("nan"), 2.0**-149, 1.5 * 2.0**-127, 3e38]))
    assert (h.zeros, h.nonfinite, h.nonzero) == (2, 2, 6)
    assert h.binade_range() == (-149, 127)


# ---------------------------------------------------------------------------------------------------
# precision map: the scratch autocast and torch.autocast run the same ops in the same dtypes
# ---------------------------------------------------------------------------------------------------

def _compute_rows(pm):
    """(phase, module, op, dtype) of every op that does FLOPs, counted; emulated fp16 counts as fp16."""
    return Counter((r.phase, r.module, r.op, r.compute.split(" ")[0]) for r in pm.rows if r.flops
                   for _ in range(r.count))


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed"])
@pytest.mark.parametrize("model", ["simplenet", "mlp", pytest.param("cnn", marks=pytest.mark.slow), "transformer"])
def test_precision_map_scratch_autocast_agrees_with_native(model, precision):
    torch.manual_seed(0)
    m = build_model(model, input_shape=(1, 12, 12), num_classes=10, width=32, depth=2, channels=4, d_model=16,
                    n_heads=2, n_layers=1, patch_size=4)
    batch = (torch.randn(4, 1, 12, 12), torch.randint(0, 10, (4,)))
    native = precision_map(m, batch, F.cross_entropy, precision=precision, amp_impl="native")
    scratch = precision_map(m, batch, F.cross_entropy, precision=precision, amp_impl="scratch")
    assert _compute_rows(native) == _compute_rows(scratch)
    assert native.low_flop_share == scratch.low_flop_share == 1.0
    assert native.total_flops == scratch.total_flops > 0
    if precision == "bf16-mixed":  # real bf16 on both sides: also the same ops kept in fp32
        assert native.kept_fp32() == scratch.kept_fp32()
        assert {"_log_softmax", "nll_loss_forward"} <= set(native.kept_fp32())
    else:  # fp16: scratch emulates it on CPUs without fast fp16 kernels, and the map says so
        assert not native.emulated
        assert scratch.emulated == (not hardware.has_fast_fp16_training(torch.device("cpu")))
    _no_global_state_left()


# ---------------------------------------------------------------------------------------------------
# API and CLI
# ---------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_diagnose_a_user_module_leaves_it_untouched_and_writes_the_report(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batches = [_batch(seed=s) for s in range(2)]
    report = diagnose(model, batches, F.cross_entropy, precision="bf16-mixed", steps=3,
                      optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), out=str(tmp_path))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not model._forward_hooks and not model[0]._forward_pre_hooks
    _no_global_state_left()
    assert len(report.history.records) == 3 and report.lost_updates.steps == 3
    for name in ("doctor.json", "report.txt", "ranges_activations.png", "ranges_gradients.png", "loss_scale.png",
                 "lost_updates.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    d = json.loads((tmp_path / "doctor.json").read_text())
    assert {"precision_map", "ranges", "nonfinite", "lost_updates", "loss_scale_history", "recommendations"} <= set(d)
    assert d["title"]["recipe"] == "bf16-mixed" and d["precision_map"]["summary"]["low_flop_share"] == 1.0
    assert d["nonfinite"]["first"] is None and d["recommendations"][0]["kind"] == "keep-recipe"
    assert (tmp_path / "report.txt").read_text().startswith("mixprec doctor: bf16-mixed")


def test_diagnose_rejects_a_malformed_batch():
    with pytest.raises(DoctorError, match="batch must be an"):
        diagnose(nn.Linear(4, 2), torch.randn(3, 4), F.cross_entropy)


@pytest.mark.slow
def test_cli_doctor_on_digits(cli, tmp_path):
    code, out, err = cli("doctor", "--dataset", "digits", "--model", "mlp", "--width", "32", "--depth", "1",
                         "--batch-size", "32", "--steps", "3", "--out", tmp_path)
    assert code == 0, err
    for section in ("1. Precision map", "2. Range profile", "3. First non-finite", "4. Lost updates",
                    "5. Loss-scale history", "Recommendations"):
        assert section in out
    assert "fp16-mixed" in out and "digits" in out
    d = json.loads((tmp_path / "doctor.json").read_text())
    assert d["title"]["model"] == "mlp" and len(d["loss_scale_history"]["steps"]) == 3
    assert (tmp_path / "ranges_gradients.png").exists()


@pytest.mark.parametrize("args,needle", [
    (["--steps", "0"], "--steps must be >= 1"),
    (["--precision", "fp12"], "unknown precision 'fp12'"),
    (["--grad-accum", "2"], "drop --grad-accum 2"),
])
def test_cli_doctor_usage_errors_exit_2(cli, tmp_path, args, needle):
    code, _, err = cli("doctor", "--dataset", "digits", "--out", tmp_path, *args)
    assert code == 2 and needle in err and "Traceback" not in err


# ---------------------------------------------------------------------------------------------------
# --out: checked before the diagnosis; a disk that fills up later is one line naming the file
# ---------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _tmpfs(path, size: str, read_only: bool = False):
    """A real filesystem of ``size`` (read-only if asked) mounted at ``path``: a full disk and EROFS for real,
    not a patched ``open``. Skips where nothing can be mounted (not root, or a container without the right)."""
    path.mkdir()
    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root and mount(8)")
    opts = f"size={size}" + (",ro" if read_only else "")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


DOCTOR = ["doctor", "--dataset", "digits", "--model", "mlp", "--width", "16", "--depth", "1", "--batch-size", "32",
          "--steps", "2", "--no-replay"]


@pytest.fixture
def read_only_fs(tmp_path):
    with _tmpfs(tmp_path / "ro", "64k", read_only=True) as path:
        yield path


@pytest.mark.parametrize("where", ["a_file", "read_only_folder", "below_read_only"])
def test_doctor_out_is_checked_before_the_diagnosis_runs(cli, tmp_path, monkeypatch, request, where):
    """Through the check train and bench use: --out naming a file, a read-only filesystem (a real EROFS mount)
    → exit 2, one line, before anything is built; they used to be tracebacks after the whole diagnosis."""
    import mixprec.train.build as build

    built = []
    monkeypatch.setattr(build, "build_run", lambda *a, **k: built.append(1))
    if where == "a_file":
        out = tmp_path / "notes.txt"
        out.write_text("mine")
        expected = f"--out {out} is a file, not a folder; pass a folder (it is created if missing)"
    elif where == "read_only_folder":
        out = request.getfixturevalue("read_only_fs")
        expected = f"--out {out}: cannot write into the folder: Read-only file system; pick a writable place"
    else:
        out = request.getfixturevalue("read_only_fs") / "doctor"
        expected = f"--out {out}: cannot create the folder: Read-only file system; pick a writable place"
    code, stdout, err = cli(*DOCTOR, "--out", out)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0] == f"mixprec doctor: error: {expected}"
    assert built == [] and "observing" not in stdout
    if where == "a_file":
        assert out.read_text() == "mine"


def _complete(path) -> bool:
    """The file is whole: JSON that parses, a PNG that ends in its IEND chunk, text that ends its last line."""
    data = path.read_bytes()
    if path.suffix == ".json":
        return bool(json.loads(data))
    if path.suffix == ".png":
        return data.startswith(b"\x89PNG\r\n\x1a\n") and data.endswith(b"IEND\xaeB`\x82")
    return data.endswith(b"\n") and b"Recommendations" in data


@pytest.mark.slow
def test_a_disk_that_fills_up_while_doctor_writes_is_one_line_naming_the_file(cli, tmp_path):
    """A filesystem that holds doctor.json and report.txt but no plot (sized from a first run on a normal disk:
    the same seed writes as much): exit 1, one line naming the file that did not fit and the ones
    written before it, which are whole; no temporary or half file is left."""
    ref = tmp_path / "ref"
    assert cli(*DOCTOR, "--out", ref)[0] == 0
    pages = sum(-(-(ref / n).stat().st_size // 4096) for n in ("doctor.json", "report.txt"))
    smallest_plot = min(p.stat().st_size for p in ref.glob("*.png"))
    assert smallest_plot > 8192
    with _tmpfs(tmp_path / "small", f"{4 * pages + 4}k") as disk:  # room for the two, less than a page over
        out = disk / "doctor"
        code, stdout, err = cli(*DOCTOR, "--out", out)
        lines = err.strip().splitlines()
        assert code == 1 and len(lines) == 1 and "Traceback" not in err, err
        assert "1. Precision map" in stdout  # the diagnosis ran and was printed before the writes
        failed = re.search(r"could not write (\S+\.png) \(No space left on device\)", lines[0])
        assert failed and failed.group(1).startswith(str(out)), lines[0]
        kept = lines[0].split("written before it, intact: ")[1].split(", ")
        assert [os.path.basename(k) for k in kept] == ["doctor.json", "report.txt"]
        assert sorted(os.listdir(out)) == ["doctor.json", "report.txt"]  # no half file, no temporary file
        assert all(_complete(out / n) for n in ("doctor.json", "report.txt"))


def test_lost_update_counts_match_an_element_by_element_reference():
    """The monitor counts on the device and reads once; a per-parameter reference with boolean indexing (how it
    used to count) gives the same counts and the same median update/weight ratio, zeros and ties included."""
    from mixprec.probes.lost_updates import LostUpdateMonitor

    class Counts:
        def __init__(self):
            self.updated = self.lost = self.unchanged = 0
            self.ratios = []

    def reference(p, before, delta, c, judged):
        moved = delta != 0
        c.updated += int(moved.sum())
        c.lost += int((moved & ((before.double() + delta.double()).to(p.dtype) == before)).sum())
        c.unchanged += int((moved & (p == before)).sum())
        nz = moved & (before != 0)
        if judged and bool(nz.any()):
            c.ratios.append(float((delta[nz].abs() / before[nz].float().abs()).median()))

    g = torch.Generator().manual_seed(0)
    for trial in range(60):
        pending, expected = [], []
        for dt in (torch.bfloat16, torch.float16, torch.float32):
            n = int(torch.randint(1, 40, (), generator=g))
            before = (torch.randn(n, generator=g) * 10.0 ** (trial % 5 - 2)).to(dt)
            before[torch.rand(n, generator=g) < 0.2] = 0
            delta = torch.randn(n, generator=g) * 1e-3 * (trial % 4 != 0)  # every 4th trial: nothing moved
            delta[torch.rand(n, generator=g) < 0.3] = 0
            p = (before.double() + delta.double()).to(dt)
            got, want = Counts(), Counts()
            pending.append((p, before, delta, got, trial % 3 != 0))
            reference(p, before, delta, want, trial % 3 != 0)
            expected.append(want)
        monitor = LostUpdateMonitor.__new__(LostUpdateMonitor)
        monitor._pending, monitor.steps = pending, 0
        monitor._count()
        for (*_, got, _), want in zip(pending, expected):
            assert vars(got) == vars(want), (trial, vars(got), vars(want))


# ---------------------------------------------------------------------------------------------------
# the replay on a device
# ---------------------------------------------------------------------------------------------------

class _DictInput(nn.Module):
    """A model called with a dict (a nested input: no tensor among the call's top-level arguments)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, batch):
        return self.inner(batch["x"])


def test_the_replays_device_comes_from_the_model_and_from_nested_inputs():
    """Decided once for the watch and the replay: the first non-CPU device among the model's parameters and
    buffers and the input's tensors at any depth (the meta device stands in for a GPU); the CPU otherwise."""
    from mixprec.probes.replay import ModelInputs, cuda_devices, step_device

    meta, cpu = torch.device("meta"), torch.device("cpu")
    nested = ModelInputs(({"x": torch.ones(2), "ids": [torch.ones(1)]},), {})
    assert step_device(nn.Linear(2, 2, device="meta"), nested) == meta  # not the CPU for want of a top-level tensor
    assert step_device(nn.Linear(2, 2), ModelInputs(({"x": [torch.ones(2, device="meta")]},), {})) == meta
    assert step_device(nn.Linear(2, 2), ModelInputs((), {"batch": {"x": torch.ones(2, device="meta")}})) == meta
    split = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))  # a CPU first layer, a device body
    assert step_device(split) == step_device(split, torch.ones(2)) == meta
    assert step_device(nn.Linear(2, 2), nested) == step_device(nn.Linear(2, 2)) == cpu
    assert cuda_devices(split, nested) == []


def test_a_replay_on_the_cpu_never_writes_a_cuda_generator(monkeypatch):
    """A step recorded with a CUDA RNG state, replayed where the model computes on the CPU (a capture analysed
    on the CPU, a nested input): the CUDA state is not restored anywhere (it would land in the live generator of
    the current CUDA device, outside the fork)."""
    from mixprec.probes.replay import ModelInputs, replay_step

    calls = []
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda *a, **k: calls.append(a))
    model = _DictInput(nn.Linear(16, 4))
    x, y = _batch(n=4)
    rng = (torch.get_rng_state(), torch.zeros(16, dtype=torch.uint8))
    ev = replay_step(model, contextlib.nullcontext, F.cross_entropy, ModelInputs(({"x": x},), {}), y, rng=rng)
    assert ev is None and calls == []


@pytest.mark.parametrize("device", DEVICES)
def test_a_replay_restores_the_steps_rng_on_its_device_and_leaves_the_callers(device):
    """The replay's dropout masks are the recorded step's (its RNG state restored on the model's device, even
    for a nested input), and the caller's generators, CPU and CUDA, are as they were."""
    from mixprec.probes.replay import ModelInputs, replay_step

    torch.manual_seed(0)
    model = _DictInput(nn.Sequential(nn.Linear(16, 64), nn.Dropout(0.5), nn.Linear(64, 4))).to(device)
    x, y = (t.to(device) for t in _batch(n=8))
    cuda = device == "cuda"

    def states():
        return [torch.get_rng_state()] + ([torch.cuda.get_rng_state(device)] if cuda else [])

    recorded = states()
    step_out = model({"x": x}).detach()
    torch.rand(100, device=device)  # the caller's generators move on
    before, seen = states(), []

    def loss_fn(out, target):
        seen.append(out.detach())
        return F.cross_entropy(out, target)

    rng = (recorded[0], recorded[1] if cuda else None)
    assert replay_step(model, contextlib.nullcontext, loss_fn, ModelInputs(({"x": x},), {}), y, rng=rng) is None
    assert torch.equal(seen[0], step_out)  # the same dropout masks
    assert all(torch.equal(a, b) for a, b in zip(states(), before))


@pytest.mark.parametrize("device", DEVICES)
def test_the_fp32_range_pass_runs_on_the_models_device_for_a_nested_input(device):
    """The doctor's fp32 pass of a model called with a dict (no top-level tensor) turns off the autocast of the
    model's device (the activation above fp16's range stays finite) and draws its dropout in a fork of that
    device's generator (the caller's RNG is as it was)."""
    from mixprec.probes.ranges import RangeProfiler
    from mixprec.train.contract import ModelCall, Objective, as_batch
    from mixprec.train.tasks import Classify

    model = _DictInput(nn.Sequential(Overflowing(), nn.Dropout(0.5))).to(device)
    x, y = (t.to(device) for t in _batch(gain=10.0))
    profiler = RangeProfiler(model)

    def states():
        return [torch.get_rng_state()] + ([torch.cuda.get_rng_state(device)] if device == "cuda" else [])

    before = states()
    with torch.autocast(torch.device(device).type, dtype=torch.float16):
        profiler.observe(Objective(ModelCall(model), Classify()), as_batch(({"x": x}, y)))
    assert all(torch.equal(a, b) for a, b in zip(states(), before))
    big = next(lr for lr in profiler.result().layers if lr.name == "inner.0.big")
    assert big.activations.nonfinite == 0 and big.activations.binade_range()[1] >= 16  # above 65504, in fp32


@pytest.mark.parametrize("device", DEVICES)
def test_the_fp32_search_turns_off_the_devices_autocast_for_a_nested_input(device):
    """The fp32 modules run with the autocast of the model's device off (a CUDA model's, not the CPU's), so the
    search finds the one layer that overflows fp16 whatever the input looks like."""
    from mixprec.probes.replay import ModelInputs, minimal_fp32_set

    model = _DictInput(Overflowing()).to(device)
    x, y = (t.to(device) for t in _batch(gain=10.0))
    result = minimal_fp32_set(model, lambda: torch.autocast(torch.device(device).type, dtype=torch.float16),
                              F.cross_entropy, ModelInputs(({"x": x},), {}), y)
    assert result.modules == ["inner.big"], result.note
    _no_global_state_left()
