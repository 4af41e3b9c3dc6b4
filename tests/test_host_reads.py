"""A training step that neither logs, evaluates, checks nor checkpoints reads nothing on the host (mixprec.guard).

What is proven here:
- Counted per step in mixprec train's own loop (a dispatch mode sees ``_local_scalar_dense``, ``is_nonzero`` and
  ``equal``; ``Tensor.item``/``tolist``/``cpu``/``numpy``, which it does not see, are patched): no read for every
  recipe without loss scaling and for fp16 under the scratch scaler with the built-in sgd and adamw (fused), with
  clipping and with gradient accumulation; one read, named in the run's notes, where it must stay (torch.amp's
  GradScaler, an optimizer that is not fused).
- Planted faults never reach the weights: a NaN loss or an inf gradient without a loss scaler halts the run on the
  device; the loop finds it at its next read (the epoch's end, a log line, a checkpoint) and stops naming that step,
  with the weights, the saved checkpoint and the epoch's record of the run that stopped there. Under fp16's scaler
  they are skipped steps, counted, and the epoch's NaN mean loss names the step.
- A guarded step is bit-identical to an unguarded one when nothing goes wrong, and skips exactly what the host
  path skips (fused SGD with momentum, whose first buffers a device skip would leave uninitialised, reads until
  its first applied step); DynamicLossScaler.step_on_device equals step, and hold leaves its state as it was.
- On CUDA (cuda-marked): no step of the loop synchronizes (``torch.cuda.set_sync_debug_mode("error")``).
"""

import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import DEVICES
from mixprec.guard import StepGuard
from mixprec.scaler import DynamicLossScaler
from mixprec.train import loop
from mixprec.train.build import build_run
from mixprec.train.checkpoint import load_checkpoint
from mixprec.train.config import TrainConfig
from mixprec.train.step import accumulate_step

FLAGS = dict(dataset="synthetic", synthetic_train=256, synthetic_test=32, synthetic_shape=(16,), model="mlp",
             width=16, depth=1, batch_size=32, epochs=1, log_every=0, progress="off", lr=0.05, momentum=0.9)
READ_OPS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default,
            torch.ops.aten.equal.default}
PATCHED = ("item", "tolist", "cpu", "numpy")


class HostReads(TorchDispatchMode):
    """Counts host reads (with where they happened) while active."""

    def __init__(self, monkeypatch):
        super().__init__()
        self.reads: list[str] = []
        self._inside = 0
        for name in PATCHED:
            monkeypatch.setattr(torch.Tensor, name, self._patched(name, getattr(torch.Tensor, name)))

    def _record(self, what):
        frames = [f for f in traceback.extract_stack()[:-3] if "mixprec" in f.filename]
        self.reads.append(f"{what} at " + " < ".join(f"{f.filename.split('/')[-1]}:{f.lineno}" for f in frames[-3:]))

    def _patched(self, name, real):
        def method(t, *args, **kwargs):
            if not self._inside:
                self._record(f"Tensor.{name}")
            self._inside += 1
            try:
                return real(t, *args, **kwargs)
            finally:
                self._inside -= 1
        return method

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in READ_OPS and not self._inside:
            self._record(str(func))
        return func(*args, **(kwargs or {}))


def _reads_per_step(monkeypatch, run):
    """Train ``run``; the reads between one step's start and the next one's, from the second step (the first
    applied step makes the optimizer's state) to the one before the last (whose interval holds the epoch's end)."""
    counter = HostReads(monkeypatch)
    marks = []
    real = loop.accumulate_step

    def step(*args, **kwargs):
        marks.append(len(counter.reads))
        return real(*args, **kwargs)

    monkeypatch.setattr(loop, "accumulate_step", step)
    with counter:
        result = loop.train(run)
    assert result.stopped is None, result.stopped
    assert len(marks) >= 5
    return [counter.reads[a:b] for a, b in zip(marks[1:-1], marks[2:])]


# (the FP8/FP4 recipes read their CPU scales on the host by design, free for CPU tensors: the CUDA test covers them)
NO_READS = [
    dict(precision="fp32"),
    dict(precision="fp32", clip_grad_norm=1.0),
    dict(precision="fp32", grad_accum=2, synthetic_train=512),
    dict(precision="bf16-mixed", amp_impl="native"),
    dict(precision="bf16-mixed", amp_impl="scratch"),
    dict(precision="bf16-master"),
    dict(precision="bf16-true", stochastic_rounding=True),  # fp32 masters: the optimizer is fused
    dict(precision="fp16-mixed", amp_impl="scratch", optimizer="sgd"),
    dict(precision="fp16-mixed", amp_impl="scratch", optimizer="adamw", momentum=0.0, clip_grad_norm=1.0),
    dict(precision="fp16-master", amp_impl="scratch"),
]


@pytest.mark.parametrize("flags", NO_READS, ids=lambda f: "-".join(f"{v}" for v in f.values()))
def test_a_step_that_neither_logs_nor_checkpoints_reads_nothing(monkeypatch, flags):
    run = build_run(TrainConfig.from_flags(**{**FLAGS, **flags}))
    assert not any("host read" in n for n in run.notes), run.notes
    per_step = _reads_per_step(monkeypatch, run)
    assert all(r == [] for r in per_step), per_step


@pytest.mark.parametrize("flags, named", [
    (dict(precision="fp16-mixed", amp_impl="native"), "GradScaler decides on the host"),
    (dict(precision="bf16-true"), "since SGD is not a fused optimizer"),  # bf16 params: foreach
    (dict(precision="fp32", optimizer="userpkg.optimizers:sgd_lr_only", momentum=0.0), "since SGD is not a fused"),
    (dict(precision="fp16-mixed", amp_impl="scratch", optimizer="userpkg.optimizers:sgd_lr_only", momentum=0.0),
     "skip it for inf/nan gradients, since SGD"),
], ids=["native-grad-scaler", "bf16-true-foreach", "user-optimizer", "user-optimizer-scratch-fp16"])
def test_a_read_that_must_stay_is_one_and_the_run_says_why(monkeypatch, flags, named):
    run = build_run(TrainConfig.from_flags(**{**FLAGS, **flags}))
    note = [n for n in run.notes if n.startswith("one host read per step")]
    assert len(note) == 1 and named in note[0], run.notes
    per_step = _reads_per_step(monkeypatch, run)
    assert all(len(r) == 1 for r in per_step), per_step


# ------------------------------------------------------------------------------------------- planted faults

def _plant(run, kind, at):
    """A NaN loss, or an inf in the first gradient after backward, at global step ``at``."""
    if kind == "nan loss":
        default, calls = run.task.default_loss, []

        def loss(out, y):
            calls.append(1)
            value = default(out, y)
            return value * float("nan") if len(calls) == at + 1 else value

        run.ctx.objective.loss_fn = loss
        return
    backward = run.recipe.backward

    def inject(loss, *, step=None, guard=None):
        backward(loss, step=step, guard=guard)
        if step == at:
            next(run.model.parameters()).grad.view(-1)[0] = float("inf")

    run.recipe.backward = inject


def _weights(run):
    return [p.detach().clone() for p in run.model.parameters()]


@pytest.mark.parametrize("kind", ["nan loss", "inf gradient"])
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_a_planted_fault_never_reaches_the_weights_and_the_stop_names_its_step(tmp_path, kind, precision):
    """The fault at step 3 of 8 halts the run there; the steps after it run but change nothing; at the epoch's end
    the run stops naming step 3, with the weights of a run that stopped after 3 steps, and saves them as step 3."""
    flags = {**FLAGS, "precision": precision}
    ref = build_run(TrainConfig.from_flags(**flags, max_steps=3))
    ref_result = loop.train(ref)
    assert ref_result.stopped is None
    run = build_run(TrainConfig.from_flags(**flags, out=str(tmp_path / "o")))
    _plant(run, kind, at=3)
    result = loop.train(run)
    what = kind.split()[1]
    assert result.stopped.startswith(f"non-finite {what} at step 3 (epoch 0, batch 3) with {precision}, "), \
        result.stopped
    assert "the last good state (before step 3) is saved" in result.stopped
    assert all(torch.equal(a, b) for a, b in zip(_weights(ref), _weights(run)))
    assert result.history[0]["steps"] == 3
    assert result.history[0]["loss_curve"] == ref_result.history[0]["loss_curve"]
    ck = load_checkpoint(tmp_path / "o")
    assert (ck["global_step"], ck["epoch"], ck["batch"]) == (3, 0, 3)
    assert all(torch.equal(a, ck["model"][k]) for a, k in zip(_weights(ref), ck["model"]))


@pytest.mark.parametrize("where", ["log line", "checkpoint"])
def test_the_stop_comes_at_the_next_read(tmp_path, monkeypatch, where):
    """A fault at step 3: with a log line every 2 batches the read after step 4 finds it (step 5 never runs); with a
    checkpoint every 2 steps the save after it (the 4th step) finds it, and saves step 3's state instead."""
    extra = dict(log_every=2) if where == "log line" else dict(checkpoint_every=2)
    run = build_run(TrainConfig.from_flags(**{**FLAGS, **extra}, precision="fp32", out=str(tmp_path / "o")))
    _plant(run, "nan loss", at=3)
    steps = []
    real = loop.accumulate_step
    monkeypatch.setattr(loop, "accumulate_step",
                        lambda ctx, mb, **kw: (steps.append(kw["step"]), real(ctx, mb, **kw))[1])
    result = loop.train(run)
    assert steps == ([0, 1, 2, 3, 4] if where == "log line" else [0, 1, 2, 3])
    assert result.stopped.startswith("non-finite loss at step 3 (epoch 0, batch 3)"), result.stopped
    assert load_checkpoint(tmp_path / "o")["global_step"] == 3


@pytest.mark.parametrize("kind", ["nan loss", "inf gradient"])
def test_fp16_scratch_skips_a_planted_fault_and_counts_it(monkeypatch, kind):
    """Under the loss scaler a fault is a skipped step (weights untouched by it), counted on the device; a NaN loss
    makes the epoch's mean loss NaN, and the stop at the epoch's end names its step."""
    run = build_run(TrainConfig.from_flags(**FLAGS, precision="fp16-mixed", amp_impl="scratch"))
    _plant(run, kind, at=3)
    before = {}
    real = loop.accumulate_step

    def step(ctx, mb, **kw):
        out = real(ctx, mb, **kw)
        before[kw["step"]] = _weights(run)
        return out

    monkeypatch.setattr(loop, "accumulate_step", step)
    result = loop.train(run)
    assert all(torch.equal(a, b) for a, b in zip(before[2], before[3]))
    assert not all(torch.equal(a, b) for a, b in zip(before[3], before[4]))
    assert result.history[0]["skipped_steps"] == 1 and result.history[0]["steps"] == 8
    if kind == "nan loss":
        assert result.stopped.startswith("epoch 0: the mean training loss is nan; step 3 was the first with a "
                                         "non-finite loss"), result.stopped
    else:
        assert result.stopped is None


@pytest.mark.parametrize("impl", ["native", "scratch"])
def test_too_many_skips_halt_the_run_with_the_scale_as_it_was(tmp_path, impl):
    """Every step overflows: the second skip in a row halts the run on the device; the steps after it change
    nothing, not even the scale, and the stop at the epoch's end is the one the limit meant: step 2, scale / 4."""
    out = tmp_path / "o"
    run = build_run(TrainConfig.from_flags(**FLAGS, precision="fp16-mixed", amp_impl=impl, init_scale=2.0**40,
                                           max_consecutive_skips=2, out=str(out)))
    result = loop.train(run)
    assert result.stopped.startswith(f"stopped at step 2: 2 optimizer steps in a row were skipped for inf/nan "
                                     f"gradients (loss scale now {2.0**38:g})"), result.stopped
    ck = load_checkpoint(out)
    assert (ck["global_step"], ck["batch"], ck["counters"]["consecutive_skips"]) == (2, 2, 2)
    assert ck["recipe"]["scaler"]["scale"] == 2.0**38 and ck["partial"]["skipped"] == 2
    assert result.history[0]["steps"] == 2 and result.history[0]["skipped_steps"] == 2


# ------------------------------------------------------------------------------ bit-identical, skips as before

def _steps(flags, guarded, n=6, plant=None):
    run = build_run(TrainConfig.from_flags(**{**FLAGS, **flags}))
    if plant:
        _plant(run, "inf gradient", at=plant)
    run.ctx.guard = StepGuard(run.device) if guarded else None
    run.train_loader.set_epoch(0)
    skipped = []
    with run.recipe.run_context():
        for step, batch in zip(range(n), run.train_loader):
            _, res = accumulate_step(run.ctx, [batch], step=step)
            skipped.append(bool(res.skipped))
    return run, skipped


@pytest.mark.parametrize("flags", [
    dict(precision="fp32"), dict(precision="bf16-mixed"), dict(precision="bf16-true"),
    dict(precision="bf16-master", stochastic_rounding=True),
    dict(precision="fp16-mixed", amp_impl="scratch", init_scale=2.0**20, growth_interval=2),
    dict(precision="fp16-mixed", amp_impl="scratch", optimizer="adamw", momentum=0.0, init_scale=2.0**20),
    dict(precision="fp16-mixed", amp_impl="native", init_scale=2.0**20),
    dict(precision="fp16-master", amp_impl="scratch", stochastic_rounding=True),
], ids=lambda f: "-".join(f"{v}" for v in f.values()))
def test_a_guarded_step_is_bit_identical_and_skips_what_the_host_skips(flags):
    """With a large initial scale the first steps overflow (fused SGD reads until it applied one), and the planted
    inf at step 5 is skipped on the device: the same params, scale and skips as the host-read path."""
    plant = 5 if flags["precision"].startswith("fp16") else None
    host, host_skips = _steps(flags, False, n=8, plant=plant)
    dev, dev_skips = _steps(flags, True, n=8, plant=plant)
    assert dev_skips == host_skips
    assert all(torch.equal(a, b) for a, b in zip(host.model.parameters(), dev.model.parameters()))
    assert host.recipe.scaler.state_dict() == dev.recipe.scaler.state_dict()
    if "init_scale" in flags:
        assert host_skips[0] and host_skips[plant] and not host_skips[plant - 1]


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_step_on_device_equals_step_and_hold_changes_nothing(optimizer):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(8)) for _ in range(2)]
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    make = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True),
            "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.1, fused=True)}[optimizer]
    opts, scalers = [make(params), make(copies)], [DynamicLossScaler(init_scale=1024.0, growth_interval=2)
                                                   for _ in range(2)]
    for i in range(6):
        for k, (ps, opt, s) in enumerate(zip((params, copies), opts, scalers)):
            loss = sum((p * p).sum() for p in ps) * (float("inf") if i in (3, 5) else 1.0)
            s.scale(loss).backward()
            if k == 0:
                s.step(opt)
            elif i == 5:  # held: nothing changes, nothing is counted
                state = s.state_dict()
                before = [p.detach().clone() for p in ps]
                s.hold(torch.ones(()))
                s.step_on_device(opt)
            else:
                s.step_on_device(opt)
            s.update()
            opt.zero_grad()
        if i < 5:
            assert all(torch.equal(a, b) for a, b in zip(params, copies))
            assert scalers[0].state_dict() == scalers[1].state_dict()
    assert scalers[1].state_dict() == state and all(torch.equal(a, b) for a, b in zip(before, copies))
    assert scalers[0].skipped_steps == 2 and scalers[1].skipped_steps == 1


def test_a_halted_guard_reads_where_and_why_and_counts_nothing_after():
    guard = StepGuard("cpu", max_consecutive_skips=2)
    for step, found in enumerate([1.0, 0.0, 1.0, 1.0, 1.0, 0.0]):
        guard.skip(torch.tensor(found), step)
    r = guard.read()
    assert (r.halted, r.step, r.what, r.skipped, r.consecutive) == (True, 3, "skips", 3, 2)
    guard = StepGuard("cpu")
    assert guard.fault(torch.tensor(0.0), 0).item() == 0
    assert guard.fault(torch.tensor(1.0), 1).item() == 1 and guard.fault(torch.tensor(2.0), 2).item() == 1
    r = guard.read()
    assert (r.halted, r.step, r.what) == (True, 1, "gradient")


# ---------------------------------------------------------------------------------------------------- CUDA

@pytest.mark.cuda
@pytest.mark.parametrize("flags", [
    dict(precision="bf16-mixed"), dict(precision="fp32", clip_grad_norm=1.0), dict(precision="fp8-mixed"),
    dict(precision="fp16-mixed", amp_impl="scratch"), dict(precision="fp16-mixed", amp_impl="scratch",
                                                           optimizer="adamw", momentum=0.0),
], ids=lambda f: "-".join(f"{v}" for v in f.values()))
def test_no_step_synchronizes_on_cuda(monkeypatch, flags):
    """From the second step to the one before the last, the loop runs under set_sync_debug_mode("error"): any
    synchronizing call (an .item(), a blocking copy) raises."""
    run = build_run(TrainConfig.from_flags(**{**FLAGS, **flags}, device="cuda"))
    real, calls = loop.accumulate_step, []
    n = len(run.train_loader)

    def step(*args, **kwargs):
        calls.append(1)
        torch.cuda.set_sync_debug_mode("error" if 2 <= len(calls) < n else "default")
        return real(*args, **kwargs)

    monkeypatch.setattr(loop, "accumulate_step", step)
    try:
        result = loop.train(run)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert result.stopped is None and len(calls) == n
    assert all(t > 0 for t in result.history[0]["step_times_s"])


@pytest.mark.parametrize("device", DEVICES)
def test_step_times_are_measured_per_step(device):
    run = build_run(TrainConfig.from_flags(**FLAGS, precision="fp32", device=device))
    result = loop.train(run)
    times = result.history[0]["step_times_s"]
    assert len(times) == 8 and all(t > 0 for t in times)
