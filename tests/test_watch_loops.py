"""mixprec.watch in loops that end an iteration without an optimizer step: the careful loop that skips a non-finite
loss or gradient, a GradScaler's skip, a loop that stops at the fault; gradient accumulation is not one. Also the
advice in the loop's own terms, a non-finite batch named as the data, and the deferred check."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from torch.nn import functional as F

import mixprec
from mixprec.probes.advice import recommend
from mixprec.probes.replay import ReplayResult
from mixprec.watching.api import start

from conftest import DEVICES
from watch_models import BACKWARD, FORWARD, Net, batches

pytestmark = pytest.mark.usefixtures("one_thread")

FAULT_AT, STEPS = 7, 10


def _finite_grads(model):
    return all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def _guarded(model, opt, data, *, scaler=None, watch=None, on_step=None, device="cpu"):
    """The issue's careful loop: autocast, skip a non-finite loss before backward and non-finite gradients before
    the step (``scaler``: fp16 with a GradScaler, whose own skip handles the gradients)."""
    dtype = torch.float16 if scaler is not None else torch.bfloat16
    for i, (x, y) in enumerate(data):
        x, y = x.to(device), y.to(device)
        with torch.autocast(torch.device(device).type, dtype=dtype):
            loss = F.cross_entropy(model(x), y)
        if watch is not None:
            watch.log(loss=loss)
        if not torch.isfinite(loss):
            opt.zero_grad(set_to_none=True)
            continue
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            if _finite_grads(model):
                opt.step()
        opt.zero_grad(set_to_none=True)
        if on_step is not None:
            on_step(i)


def _watched(tmp_path, loop, *, mode=FORWARD, fault_at=FAULT_AT, steps=STEPS, scaler=None, source="user loop",
             **kw):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    log = kw.pop("log", False)
    kw = {"every": 5, "plots": False, "tensorboard": False, **kw}
    with start(model, opt, scaler=scaler, out=str(tmp_path), source=source, **kw) as w:
        loop(model, opt, batches(steps, fault_at=fault_at, mode=mode), scaler=scaler, watch=w if log else None)
    return w, json.loads((tmp_path / "watch.json").read_text()), (tmp_path / "report.txt").read_text()


def _fault(rep):
    f = rep["nonfinite"]["first_fault"]
    return f["step"], f["classification"], f["event"]["module"], f["event"]["phase"]


@pytest.mark.parametrize("mode, phase", [(FORWARD, "forward"), (BACKWARD, "backward")])
@pytest.mark.parametrize("scaled", [False, True], ids=["bf16", "fp16-gradscaler"])
def test_a_guarded_loops_skipped_iteration_is_counted_and_its_fault_named(tmp_path, mode, phase, scaled):
    """The loop skips the faulty iteration (a non-finite loss before backward; non-finite gradients, or the
    GradScaler, before the step) and drops its gradients: the watch counts it as its own step and names the fault
    as it does for an applied one."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if scaled else None
    w, rep, text = _watched(tmp_path, _guarded, mode=mode, scaler=scaler)
    assert rep["watch"]["steps"] == STEPS and w.nonfinite_steps == 1
    assert _fault(rep) == (FAULT_AT, f"{phase} overflow", "boost", phase)
    steps = rep["loss_scale_history"]["steps"]
    assert [s["step"] for s in steps] == list(range(STEPS))
    assert [s["step"] for s in steps if s["skipped"]] == [FAULT_AT]
    assert f"{phase} overflow" in steps[FAULT_AT]["cause"]
    scaler_skip = scaled and mode == BACKWARD  # the GradScaler skipped it; in the other cases the loop did
    assert rep["watch"]["dropped"] == (0 if scaler_skip else 1)
    assert f"trigger at step {FAULT_AT}: nonfinite: step {FAULT_AT}, {phase} overflow" in text
    assert ("1 ended by the loop without an optimizer step" in text) != scaler_skip
    assert rep["triggers"][0]["capture"]


@pytest.mark.parametrize("mode, phase", [(FORWARD, "forward"), (BACKWARD, "backward")])
@pytest.mark.parametrize("stop", ["break", "raise"])
def test_a_loop_that_stops_at_the_fault_gets_it_named(tmp_path, mode, phase, stop):
    """The loop stops at a non-finite loss (before backward) or at non-finite gradients (after it, the gradients
    still there), by ``break`` or by raising its own error through the ``with`` block."""

    def stopping(model, opt, data, **_):
        for x, y in data:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y)
            ok = bool(torch.isfinite(loss))
            if ok:
                loss.backward()
                ok = _finite_grads(model)
            if not ok and stop == "break":
                break
            if not ok:
                raise ArithmeticError("non-finite loss or gradients")
            opt.step()
            opt.zero_grad(set_to_none=True)

    if stop == "raise":
        with pytest.raises(ArithmeticError):
            _watched(tmp_path, stopping, mode=mode)
        rep = json.loads((tmp_path / "watch.json").read_text())
    else:
        _, rep, _ = _watched(tmp_path, stopping, mode=mode)
    assert rep["watch"]["steps"] == FAULT_AT + 1 and rep["watch"]["dropped"] == 1
    assert _fault(rep) == (FAULT_AT, f"{phase} overflow", "boost", phase)


def test_gradient_accumulation_and_two_forwards_per_step_are_one_step_each():
    """Micro-batches whose backwards accumulate, and a step that calls the model twice before one backward, are
    not iterations without a step; nothing is replayed and no read is added."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = batches(12)
    with mixprec.watch(model, opt, every=100, plots=False) as w:
        for i in range(0, 6, 3):  # 3 micro-batches a step
            for x, y in data[i:i + 3]:
                F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        for i in range(6, 12, 2):  # two forwards, one backward
            (a, ya), (b, yb) = data[i], data[i + 1]
            (F.cross_entropy(model(a), ya) + F.cross_entropy(model(b), yb)).backward()
            opt.step()
            opt.zero_grad(set_to_none=False)  # zeroed in place: seen as a reset only without a step
    assert (w.step, w.dropped, w.skipped, w.nonfinite_steps) == (5, 0, 0, 0)
    assert w.host_reads["check"] == 5 and "dropped" not in w.host_reads


def _trained(watched: bool, tmp_path, fault_at):
    torch.manual_seed(1)
    model = Net(dropout=0.3)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = batches(STEPS, fault_at=fault_at, mode=BACKWARD)
    if watched:
        with mixprec.watch(model, opt, out=str(tmp_path), every=3, plots=False) as w:
            _guarded(model, opt, data)
        assert w.sampler.samples and w.dropped == (fault_at is not None) and bool(w.faults) == w.dropped
    else:
        _guarded(model, opt, data)
    return model, opt, torch.get_rng_state()


@pytest.mark.parametrize("fault_at", [None, FAULT_AT], ids=["no-fault", "replayed-fault"])
def test_a_watched_guarded_run_is_bit_identical(tmp_path, fault_at):
    """Dropout draws from the RNG every step; the replay of a skipped iteration runs inside a fork of it."""
    m0, o0, rng0 = _trained(False, tmp_path, fault_at)
    m1, o1, rng1 = _trained(True, tmp_path, fault_at)
    assert all(torch.equal(a, b) for a, b in zip(m0.parameters(), m1.parameters()))
    for s0, s1 in zip(o0.state.values(), o1.state.values()):
        assert all(torch.equal(s0[k], s1[k]) for k in s0)
    assert torch.equal(rng0, rng1)


# ------------------------------------------------------------------------------------------------ advice


@pytest.mark.parametrize("source, says, never", [
    ("user loop", ["torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)", "learning rate"], "--"),
    ("mixprec train", ["--clip-grad-norm 1.0", "--lr"], "clip_grad_norm_"),
    ("lightning Trainer", ["gradient_clip_val=1.0", "configure_optimizers"], "--"),
    ("transformers Trainer", ["max_grad_norm=1.0", "learning_rate"], "--"),
])
def test_advice_names_what_the_watched_loop_can_do(tmp_path, source, says, never):
    """A fault that fp32 does not fix (the planted overflow overflows fp32 too): in a user's loop the advice names
    clip_grad_norm_ and the optimizer's learning rate, under ``mixprec train --watch`` its flags, under a Trainer
    its settings."""
    w, rep, text = _watched(tmp_path, _guarded, source=source)
    (rec,) = [r for r in rep["recommendations"] if r["kind"] == "not-precision"]
    assert all(s in rec["text"] for s in says) and never not in rec["text"]
    assert rec["text"] in text


@pytest.mark.parametrize("loop, says, never", [
    ("torch", ["keep boost in fp32", 'torch.autocast("cpu", enabled=False)', "keep_fp32=('boost',)"], "--keep"),
    ("mixprec", ["keep boost in fp32", "--keep-fp32 boost --amp-impl scratch"], "torch.autocast"),
])
def test_keep_fp32_advice_in_the_loops_terms(tmp_path, loop, says, never):
    """A fault the fp32 replay fixes: a user's loop is told how to run the module with autocast off."""
    w, _, _ = _watched(tmp_path, _guarded)
    findings = w.output.report(collective=False).findings
    fault = dataclasses.replace(findings.faults[0], replay=ReplayResult(["boost"], [], "finite with boost in fp32"))
    (rec,) = recommend(dataclasses.replace(findings, faults=[fault], loop=loop))[:1]
    assert rec["kind"] == "keep-fp32" and all(s in rec["text"] for s in says) and never not in rec["text"]


# ------------------------------------------------------------------------------------------------ the data


@pytest.mark.parametrize("loop", ["guarded", "unguarded"])
def test_a_non_finite_batch_is_named_as_the_data(tmp_path, loop):
    """A batch that holds a NaN is the data's fault, named with its tensor and count, whether the loop skips the
    iteration or applies it."""

    def unguarded(model, opt, data, **_):
        for x, y in data:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()

    data = batches(STEPS)
    data[FAULT_AT][0][1, 3] = math.nan

    def run(model, opt, _data, **kw):
        (_guarded if loop == "guarded" else unguarded)(model, opt, data, **kw)

    _, rep, text = _watched(tmp_path, run)
    fault = rep["nonfinite"]["first_fault"]
    assert fault["step"] == FAULT_AT and fault["classification"] == "non-finite batch"
    assert fault["data"] == [f"input 0: 1 nan, 0 inf of {data[0][0].numel()} values"]
    assert "the data is at fault, not the model" in text
    assert rep["recommendations"][0]["kind"] == "not-precision" and "holds inf/nan" in rep["recommendations"][0]["text"]


# ------------------------------------------------------------------------------------------------ deferred check


def test_deferred_check_reads_nothing_on_unsampled_steps_and_still_names_a_skipped_fault(tmp_path):
    """``check="deferred"``: no read on an unsampled step; the guarded loop's skipped iteration is replayed and
    named all the same (the read is a dropped iteration's own)."""
    w, rep, _ = _watched(tmp_path, _guarded, mode=BACKWARD, check="deferred", every=100)
    assert w.unsampled_reads == 0 and w.host_reads["check"] == 1  # step 0, sampled
    assert _fault(rep) == (FAULT_AT, "backward overflow", "boost", "backward")
    assert rep["watch"]["check"] == "deferred" and "0: check='deferred'" in rep["watch"]["host_reads"][
        "per_unsampled_step"]


def test_deferred_check_counts_an_applied_fault_at_the_next_read(tmp_path):
    """An unguarded loop under ``check="deferred"``: the non-finite step is applied, then counted from its flag when
    the pending values are read (here at close), not replayed (nor captured: its batch is gone)."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with mixprec.watch(model, opt, out=str(tmp_path), every=100, plots=False, check="deferred") as w:
        for i, (x, y) in enumerate(batches(4)):
            F.cross_entropy(model(x), y).backward()
            if i == 3:
                model.head.weight.grad[0, 0] = math.nan
            opt.step()
            opt.zero_grad()
        assert w.nonfinite_steps == 0  # not read yet
    assert w.nonfinite_steps == 1 and not w.faults and w.unsampled_reads == 0
    rep = json.loads((tmp_path / "watch.json").read_text())
    assert rep["triggers"][0]["step"] == 3 and "check='deferred'" in rep["triggers"][0]["description"]
    assert rep["triggers"][0]["capture"] is None
    assert [s["skipped"] for s in rep["loss_scale_history"]["steps"]] == [False] * 4


def test_a_bad_check_setting_is_one_line(tmp_path):
    model = Net()
    with pytest.raises(mixprec.watching.WatchError, match="choose check='exact'"):
        mixprec.watch(model, torch.optim.SGD(model.parameters(), lr=0.1), check="sometimes")


# ------------------------------------------------------------------------------------------------ the GPU check


def test_unsampled_check_reduces_device_gradients_in_one_foreach_call():
    """Gradients off the CPU (meta stands in for CUDA) are reduced by one ``_foreach_norm`` per device and dtype,
    not one kernel per gradient; CPU gradients by one sum each."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from mixprec.watching.core import _reductions

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    grads = [torch.ones(3, device="meta"), torch.ones(2, 2, device="meta"), torch.ones(4, device="meta")]
    with Ops() as seen:
        out = _reductions(grads + [torch.ones(5)])
    assert seen.ops.count("_foreach_norm") == 1 and seen.ops.count("sum") == 1 and len(out) == 4
    assert [t.device.type for t in out] == ["cpu", "meta", "meta", "meta"]
    grads16 = [torch.ones(3, device="meta"), torch.ones(3, device="meta", dtype=torch.bfloat16)]
    with Ops() as seen:
        _reductions(grads16)
    assert seen.ops.count("_foreach_norm") == 2  # one per dtype: the fused kernel takes one


def test_a_guarded_loop_drop_under_log_keeps_a_logged_non_finite_loss_in_one_read(tmp_path):
    """The loop logs its loss before the guard: a dropped iteration whose logged loss is non-finite is told by one
    read of what is left (no replay needed to know it), then replayed once to name it."""
    w, rep, _ = _watched(tmp_path, _guarded, log=True)
    assert w.host_reads["dropped"] == 1 and _fault(rep)[:2] == (FAULT_AT, "forward overflow")


def test_a_forward_that_raises_leaves_its_error_alone(tmp_path):
    """The loop's own error from inside a forward passes through the ``with`` unchanged; that forward has no
    output to replay, so nothing is replayed (an iteration before it is still checked)."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(RuntimeError, match="mat1 and mat2"):
        with mixprec.watch(model, opt, out=str(tmp_path), plots=False) as w:
            model(torch.ones(2, 5))
    assert w.closed and w.step == 0 and not w.faults


@pytest.mark.parametrize("check", ["exact", "deferred"])
@pytest.mark.parametrize("device", DEVICES)
def test_a_guarded_loop_on_the_device(tmp_path, device, check):
    """The guarded loop on the device: both skipped faults named; ``check="deferred"`` reads nothing on an
    unsampled step (on CUDA the exact check is one fused ``_foreach_norm`` and one read)."""
    names = []
    for mode in (FORWARD, BACKWARD):
        torch.manual_seed(0)
        model = Net().to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with mixprec.watch(model, opt, every=4, plots=False, check=check) as w:
            _guarded(model, opt, batches(STEPS, fault_at=FAULT_AT, mode=mode), device=device)
        f = w.faults[0]
        names.append((f.step, f.classification, f.event.module))
        assert w.step == STEPS and w.dropped == 1
        applied_unsampled = STEPS - len(w.sampler.samples) - 1  # (the skipped step 7 is not sampled)
        assert w.unsampled_reads == (0 if check == "deferred" else applied_unsampled)
    assert names == [(FAULT_AT, "forward overflow", "boost"), (FAULT_AT, "backward overflow", "boost")]
