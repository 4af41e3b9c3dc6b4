"""mixprec.watch in a plain PyTorch loop: planted faults, GradScaler skips, lost updates, syncs, bad input."""

from __future__ import annotations

import copy
import json
import math
import os

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import mixprec
from mixprec.errors import NonFiniteError
from mixprec.watching import WatchError, analyze_capture

from conftest import DEVICES
from watch_models import BACKWARD, FORWARD, Net, SplitNet, batches

pytestmark = pytest.mark.usefixtures("one_thread")


def _loop(model, opt, data, *, dtype=torch.bfloat16, scaler=None, watch=None, on_step=None, device="cpu",
          logged=lambda loss: loss):
    """The user's loop, unchanged whether watched or not (``logged``: what it hands ``watch.log(loss=...)``)."""
    for i, (x, y) in enumerate(data):
        x, y = x.to(device), y.to(device)
        opt.zero_grad()
        with torch.autocast(torch.device(device).type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = nn.functional.cross_entropy(model(x).float(), y)
        if watch is not None:
            watch.log(loss=logged(loss))
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        if on_step is not None:
            on_step(i)


def _run(tmp_path, *, mode=FORWARD, dtype=torch.bfloat16, scaler=None, steps=6, fault_at=3, **kw):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    out = tmp_path / "watch"
    kw.setdefault("plots", False)  # drawing PNGs is what costs most here; two tests draw them
    with mixprec.watch(model, opt, scaler=scaler, out=str(out), every=kw.pop("every", 2), **kw) as w:
        _loop(model, opt, batches(steps, fault_at=fault_at, mode=mode), dtype=dtype, scaler=scaler, watch=w)
    return w, json.loads((out / "watch.json").read_text()), (out / "report.txt").read_text(), out


def _first_fault(report):
    return report["nonfinite"]["first_fault"]


def test_forward_overflow_bf16_is_named_with_module_phase_step(tmp_path):
    w, rep, text, out = _run(tmp_path, mode=FORWARD)
    fault = _first_fault(rep)
    assert fault["step"] == 3 and fault["classification"] == "forward overflow"
    assert fault["event"]["module"] == "boost" and fault["event"]["phase"] == "forward"
    assert "step 3, forward overflow" in text and "forward: aten." in text and " in boost " in text
    assert rep["triggers"][0]["step"] == 3 and os.path.exists(rep["triggers"][0]["capture"])


def test_backward_overflow_fp16_gradscaler_is_named_backward(tmp_path):
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    w, rep, text, _ = _run(tmp_path, mode=BACKWARD, dtype=torch.float16, scaler=scaler)
    fault = _first_fault(rep)
    assert fault["step"] == 3 and fault["event"]["phase"] == "backward" and fault["event"]["module"] == "boost"
    assert "backward: aten." in text and "step 3" in text
    hist = rep["loss_scale_history"]
    assert hist["summary"]["skipped"] == 1
    assert [s["skipped"] for s in hist["steps"]] == [False, False, False, True, False, False]
    assert [s["scale"] for s in hist["steps"]][2:5] == [256.0, 256.0, 128.0]


@pytest.mark.slow
def test_gradscaler_skips_and_scale_history(tmp_path):
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
    w, rep, text, out = _run(tmp_path, dtype=torch.float16, scaler=scaler, steps=12, fault_at=None, every=5,
                             plots=True, max_localized=1)
    hist = rep["loss_scale_history"]
    skipped = [s for s in hist["steps"] if s["skipped"]]
    assert skipped and skipped[0]["step"] == 0
    for s in skipped:  # every skip halves the scale
        assert s["next_scale"] == s["scale"] / 2
    assert hist["summary"]["final_scale"] < 2.0**24
    first = rep["nonfinite"]["first"]
    assert first["step"] == 0 and first["classification"] == "scale overflow"
    rows = (out / "steps.csv").read_text().splitlines()
    assert len(rows) == 13 and rows[1].split(",")[4] == "1"
    assert (out / "scale_history.png").stat().st_size > 0
    assert "Loss-scale history: 1.67772e+07 ->" in text and "scale overflow" in text


def test_bf16_weights_with_tiny_lr_show_lost_updates(tmp_path):
    torch.manual_seed(0)
    model = Net().to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-5)
    with mixprec.watch(model, opt, out=str(tmp_path), every=1, plots=False) as w:
        for x, y in batches(3):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x.bfloat16()).float(), y).backward()
            opt.step()
    rep = json.loads((tmp_path / "watch.json").read_text())
    assert rep["lost_updates"]["lost_fraction"] > 0.5
    assert rep["recipe"]["params"] == "bf16"
    assert any(r["kind"] == "master-weights" for r in rep["recommendations"])
    assert all(s["lost_updates"]["fraction"] > 0.5 for s in rep["samples"])


def _trained(watched: bool, tmp_path, device="cpu") -> tuple[nn.Module, torch.optim.Optimizer, list]:
    torch.manual_seed(1)
    model = Net(dropout=0.3).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler(torch.device(device).type, init_scale=2.0**24)  # skips: the recorder replays them
    data = batches(8, fault_at=5, mode=BACKWARD)
    if watched:
        with mixprec.watch(model, opt, scaler=scaler, out=str(tmp_path), every=2, plots=False) as w:
            _loop(model, opt, data, dtype=torch.float16, scaler=scaler, watch=w, device=device)
        assert w.faults and w.sampler.samples  # replays and sampled steps did run
    else:
        _loop(model, opt, data, dtype=torch.float16, scaler=scaler, device=device)
    rng = [torch.get_rng_state()] + ([torch.cuda.get_rng_state(device)] if device == "cuda" else [])
    return model, opt, rng


@pytest.mark.parametrize("device", DEVICES)
def test_watched_run_is_bit_identical(tmp_path, device):
    """On CUDA the replays restore the step's CUDA RNG state inside ``fork_rng`` and leave the loop's generator
    as it was: the next steps' dropout masks, hence the weights, are the unwatched run's."""
    m0, o0, rng0 = _trained(False, tmp_path, device)
    m1, o1, rng1 = _trained(True, tmp_path, device)
    for a, b in zip(m0.parameters(), m1.parameters()):
        assert torch.equal(a, b)
    for s0, s1 in zip(o0.state.values(), o1.state.values()):
        assert all(torch.equal(s0[k], s1[k]) for k in s0)
    assert all(torch.equal(a, b) for a, b in zip(rng0, rng1))  # no RNG drawn, on the CPU or the GPU


class _Ops(TorchDispatchMode):
    """Counts the calls of one ATen op (any overload) while active."""

    def __init__(self, op):
        super().__init__()
        self.op, self.n = op, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func.overloadpacket is self.op
        return func(*args, **(kwargs or {}))


def _syncs() -> _Ops:
    """Counts host reads: every ``.item()``/``bool()``/``float()`` is an ``_local_scalar_dense``; ``tolist`` is
    counted apart (on a CPU tensor it reads memory without an op)."""
    return _Ops(torch.ops.aten._local_scalar_dense)


def _syncs_per_step(watched: bool, scaled: bool, monkeypatch, steps=6, check="exact", log=False) -> list[int]:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if scaled else None
    counter = _syncs()
    tolist = torch.Tensor.tolist

    def counted_tolist(self):
        counter.n += 1
        return tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)
    per_step, last = [], [0]

    def mark(i):
        per_step.append(counter.n - last[0])
        last[0] = counter.n

    w = mixprec.watch(model, opt, scaler=scaler, every=100, plots=False, check=check) if watched else None
    with counter:
        _loop(model, opt, batches(steps), dtype=torch.float16 if scaled else torch.bfloat16, scaler=scaler,
              on_step=mark, watch=w if log else None)
    if w is not None:
        w.close()
        assert w.unsampled_reads == (steps - 1 if not scaled and check == "exact" else 0)
    monkeypatch.undo()
    return per_step


@pytest.mark.parametrize("scaled, check, added", [(False, "exact", 1), (True, "exact", 0), (False, "deferred", 0)])
@pytest.mark.parametrize("log", [False, True], ids=["", "logged-loss"])
def test_syncs_added_per_unsampled_step(monkeypatch, scaled, check, added, log):
    """Without a scaler the exact check reads its flag once a step (a logged loss rides in that read); with one the
    scaler's own decision costs the watch nothing, and ``check="deferred"`` leaves the flag for the next sample."""
    plain = _syncs_per_step(False, scaled, monkeypatch)
    watched = _syncs_per_step(True, scaled, monkeypatch, check=check, log=log)
    # step 0 is sampled; steps 1.. are not: the watch adds exactly `added` reads to each of them
    assert [b - a for a, b in zip(plain[1:], watched[1:])] == [added] * (len(plain) - 1)


@pytest.mark.parametrize("case", ["huge-finite", "inf-gradient", "nan-gradient"])
def test_finite_check_tells_an_overflowing_reduction_from_a_nonfinite_gradient(case):
    """No scaler: the flag is each gradient's sum (unsampled steps) or squared norm (sampled ones); gradients of
    3e38 are finite but their sums and squares overflow fp32 (inf), so the step is checked exactly with one more
    read -- and is not a fault; an inf or NaN gradient (finite loss) is."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    bad = 2  # the step whose gradients are changed (step 2: sampled with every=2; step 1 and 3 are not)
    reads, norms = [], []
    with mixprec.watch(model, opt, every=2, plots=False, localize=False) as w:
        for i, (x, y) in enumerate(batches(4)):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                nn.functional.cross_entropy(model(x).float(), y).backward()
            if case == "huge-finite" and i >= 1:
                for p in model.parameters():
                    p.grad.fill_(3e38)
            elif i == bad:
                model.head.weight.grad[0, 0] = math.inf if case == "inf-gradient" else math.nan
            before = w.host_reads["check"]
            opt.step()
            reads.append(w.host_reads["check"] - before)
            norms.append(w.last.grad_l2)
    if case == "huge-finite":
        assert w.nonfinite_steps == 0 and not w.triggers
        assert reads == [1, 2, 2, 2]  # the reduction, then the exact check, on every step with huge gradients
        assert norms[2] == math.inf and norms[0] > 0  # sampled steps keep the norm; unsampled ones only the flag
        assert norms[1] is None and norms[3] is None
    else:  # (the update makes the weights non-finite: the step after is a fault too)
        assert w.triggers[0]["step"] == bad and w._first_nonfinite == bad
        # an inf norm is re-checked (it could be finite squares overflowing), a NaN norm is a fault outright
        assert reads[:3] == [1, 1, 2 if case == "inf-gradient" else 1]


def test_unsampled_finite_check_catches_a_fault_in_any_gradient():
    """On unsampled steps: a NaN in a large or a small gradient is caught; a large gradient whose norm overflows
    fp32 (3e38 everywhere) is re-checked exactly and is not a fault."""
    for which in ("big", "small", "big-huge"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        with mixprec.watch(model, opt, every=100, plots=False, localize=False) as w:
            for i in range(3):
                opt.zero_grad()
                model(torch.randn(4, 256)).sum().backward()
                if i == 2 and which == "big-huge":
                    model[0].weight.grad.fill_(3e38)
                elif i == 2:
                    (model[0] if which == "big" else model[1]).weight.grad[1, 1] = math.nan
                opt.step()
        if which == "big-huge":
            assert w.nonfinite_steps == 0 and w.host_reads["check"] == 3 + 1  # step 0 sampled; step 2 twice
        else:
            assert w.nonfinite_steps == 1 and w.triggers[0]["step"] == 2, which


def test_a_logged_grad_norm_stands_in_for_the_pass_over_the_gradients():
    """``w.log(grad_norm=clip_grad_norm_(...))`` before the step: an unsampled step reads that norm (and the loss)
    instead of summing every gradient itself, and a NaN gradient is still caught at its step (the norm is NaN)."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    n_grads = len(list(model.parameters()))
    sums = {}
    with mixprec.watch(model, opt, every=100, plots=False, localize=False) as w:
        for i, (x, y) in enumerate(batches(5)):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            logged = i in (1, 3, 4)
            if i == 4:
                model.head.weight.grad[0, 0] = math.nan
            if logged:
                w.log(grad_norm=torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))
            before, counter = w.host_reads["check"], _Ops(torch.ops.aten.sum)
            with counter:
                opt.step()
            sums[i] = (counter.n, w.host_reads["check"] - before)
    # step 0 is sampled (squared norms); 2 sums every gradient; 1 and 3 only read the logged norm: one read each
    assert sums[1] == sums[3] == (0, 1) and sums[2] == (n_grads, 1)
    assert w.triggers[0]["step"] == 4 and w.nonfinite_steps == 1


def _state(model, opt):
    return ([p.detach().clone() for p in model.parameters()],
            (len(model._forward_pre_hooks), len(model._forward_hooks), len(opt._optimizer_step_pre_hooks),
             len(opt._optimizer_step_post_hooks)))


class _Empty(nn.Module):
    def forward(self, x):
        return x


@pytest.mark.parametrize("case, fix", [
    ("no-params", "pass the nn.Module the optimizer trains"),
    ("foreign-optimizer", "the optimizer steps none of the model's parameters"),
    ("unknown-scaler", "unknown loss scaler"),
    ("every-0", "every must be an integer >= 1"),
    ("sample-elements-negative", "sample_elements must be an integer >= 0"),
    ("out-is-file", "is a file, not a folder"),
])
def test_bad_input_is_one_line_and_changes_nothing(tmp_path, case, fix):
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kwargs = {"out": str(tmp_path / "w")}
    target = model
    if case == "no-params":
        target = _Empty()
    elif case == "foreign-optimizer":
        opt = torch.optim.SGD(nn.Linear(3, 3).parameters(), lr=0.1)
    elif case == "unknown-scaler":
        kwargs["scaler"] = object()
    elif case == "every-0":
        kwargs["every"] = 0
    elif case == "sample-elements-negative":
        kwargs["sample_elements"] = -1
    else:
        (tmp_path / "file").write_text("x")
        kwargs["out"] = str(tmp_path / "file" / "w")
    before = _state(model, opt)
    with pytest.raises(WatchError) as e:
        mixprec.watch(target, opt, **kwargs)
    msg = str(e.value)
    assert "\n" not in msg and fix in msg and msg.startswith("mixprec.watch(")
    after = _state(model, opt)
    assert after[1] == before[1] and all(torch.equal(a, b) for a, b in zip(before[0], after[0]))
    assert not (tmp_path / "w").exists()


def test_on_fault_raise_stops_before_the_update(tmp_path):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = batches(6, fault_at=3)
    seen = []
    with pytest.raises(NonFiniteError) as e:
        with mixprec.watch(model, opt, out=str(tmp_path), on_fault="raise", every=10, plots=False):
            _loop(model, opt, data, on_step=lambda i: seen.append([p.detach().clone() for p in model.parameters()]))
    assert e.value.step == 3 and "boost" in str(e.value) and "\n" not in str(e.value)
    assert len(seen) == 3 and all(torch.equal(a, b) for a, b in zip(seen[-1], model.parameters()))
    assert json.loads((tmp_path / "watch.json").read_text())["nonfinite"]["first_fault"]["step"] == 3
    assert not model._forward_pre_hooks and not opt._optimizer_step_pre_hooks  # removed on the way out


def test_capture_loads_weights_only_and_reruns(tmp_path):
    w, rep, _, out = _run(tmp_path, mode=FORWARD)
    data = torch.load(out / "capture.pt", weights_only=True)
    assert data["step"] == 3 and rep["triggers"][0]["capture_bytes"] == (out / "capture.pt").stat().st_size
    again = analyze_capture(str(out / "capture.pt"), Net())
    assert again.step == 3 and again.classification == "forward overflow" and again.event.module == "boost"


def test_watch_json_shares_doctor_json_keys(tmp_path):
    from mixprec.doctor import diagnose

    doctor = diagnose(Net(), batches(1), nn.functional.cross_entropy, precision="bf16-mixed", steps=1).to_dict()
    _, rep, _, _ = _run(tmp_path, steps=2, fault_at=None)
    shared = set(doctor) - {"precision_map"}
    assert shared <= set(rep)
    for section in ("ranges", "nonfinite", "lost_updates", "loss_scale_history"):
        assert set(doctor[section]) <= set(rep[section]), section
    assert set(doctor["title"]) - {"data"} <= set(rep["title"])


@pytest.mark.slow
def test_reports_and_tensorboard_are_written(tmp_path):
    pytest.importorskip("tensorboard")
    _, rep, text, out = _run(tmp_path, steps=4, fault_at=None, plots=True)
    assert text.startswith("mixprec watch:") and "2. Range profile" in text and "5. Loss-scale history" in text
    assert any(f.startswith("events.") for f in os.listdir(out / "tensorboard"))
    assert {"watch.json", "report.txt", "steps.csv", "underflow_over_time.png", "ranges_gradients.png",
            "lost_updates_over_time.png"} <= set(
        os.listdir(out))
    assert not [f for f in os.listdir(out) if f.startswith(".tmp")]


def test_a_deep_copy_of_the_watched_model_does_not_call_the_watch(tmp_path):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with mixprec.watch(model, opt, plots=False) as w:
        twin = copy.deepcopy(model)
        twin(batches(1)[0][0]).sum().backward()
        assert w._open is None and w.step == 0
        _loop(model, opt, batches(2))
        assert w.step == 2
    assert not model._forward_pre_hooks and not opt._optimizer_step_post_hooks


def test_dynamic_loss_scaler_skip_is_seen(tmp_path):
    scaler = mixprec.DynamicLossScaler(init_scale=2.0**8)
    w, rep, text, _ = _run(tmp_path, mode=BACKWARD, dtype=torch.float16, scaler=scaler)
    assert rep["loss_scale_history"]["summary"]["skipped"] == 1
    assert _first_fault(rep)["event"]["phase"] == "backward"


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed"])
def test_train_watch_flag_reports_and_changes_nothing(cli, tmp_path, precision):
    """``mixprec train --watch N`` is the same watch over mixprec's own run: its reports appear in OUT/watch and the
    trained weights equal an unwatched run's bit for bit (under a loss scaler too)."""
    flags = ["train", "--dataset", "synthetic", "--synthetic-train", "256", "--synthetic-test", "64", "--model", "mlp",
             "--width", "32", "--depth", "1", "--epochs", "2", "--precision", precision, "--log-every", "0"]
    assert cli(*flags, "--out", tmp_path / "plain")[0] == 0
    assert cli(*flags, "--out", tmp_path / "watched", "--watch", "3")[0] == 0
    doc = json.loads((tmp_path / "watched" / "watch" / "watch.json").read_text())
    assert doc["watch"]["steps"] == 8 and (tmp_path / "watched" / "watch" / "steps.csv").exists()
    assert doc["watch"]["source"] == "mixprec train" and doc["watch"]["dropped"] == 0  # advice in its flags' terms
    plain = torch.load(tmp_path / "plain" / "last.pt", weights_only=True)["model"]
    watched = torch.load(tmp_path / "watched" / "last.pt", weights_only=True)["model"]
    assert plain.keys() == watched.keys() and all(torch.equal(plain[k], watched[k]) for k in plain)
    code, _, err = cli(*flags, "--out", tmp_path / "bad", "--watch", "0")
    assert code == 2 and "--watch must be a positive integer" in err


# ------------------------------------------------------------------------------------------ two processes


def _ddp_worker(rank: int, port: int, tmp: str, strategy: str = "ddp") -> None:
    """One of two gloo ranks: a DDP-wrapped (or FSDP2-sharded) Net in the plain bf16 loop, watched; rank 1's batch
    at step 3 overflows in ``boost``. Each rank gets its own ``out`` (anything rank 1 writes would show in its
    folder) and leaves what it saw itself in local{rank}.json, for the test to reduce."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        if strategy == "fsdp":
            from torch.distributed.fsdp import fully_shard

            model = fully_shard(Net())
        else:
            model = DistributedDataParallel(Net())
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        data = batches(4, seed=rank, fault_at=3 if rank == 1 else None, mode=FORWARD)
        with mixprec.watch(model, opt, out=os.path.join(tmp, f"out{rank}"), every=2, plots=False,
                           tensorboard=False) as w:
            norms = []
            _loop(model, opt, data, watch=w, on_step=lambda i: norms.append(w.last.grad_l2))
        lost = w.sampler.monitor.result().layers
        local = {"histograms": w.sampler.profile().to_dict()["histograms"], "nonfinite_steps": w.nonfinite_steps,
                 "lost": {lu.name: [lu.updated, lu.lost] for lu in lost},
                 "triggers": [[t["step"], t["kind"], t["description"]] for t in w.triggers],
                 "grad_l2": norms}
        with open(os.path.join(tmp, f"local{rank}.json"), "w") as f:
            json.dump(local, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_reduce_their_statistics_and_only_rank_0_writes(tmp_path, strategy):
    """DDP (each rank holds whole gradients) and FSDP2 (each rank a shard: the finite check's squares are
    summed over the ranks, so both agree on the step)."""
    import socket

    from conftest import spawn_two

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spawn_two(_ddp_worker, port, str(tmp_path), strategy, timeout=60, what=f"the 2-process watch ({strategy})")
    local = [json.loads((tmp_path / f"local{r}.json").read_text()) for r in (0, 1)]
    rep = json.loads((tmp_path / "out0" / "watch.json").read_text())
    # only rank 0 writes the reports; a faulting rank writes its own capture, nothing else
    assert {"watch.json", "report.txt", "steps.csv"} <= set(os.listdir(tmp_path / "out0"))
    assert sorted(os.listdir(tmp_path / "out1")) == ["capture-rank1.pt"]
    # rank 0's report holds the sum of both ranks' histograms (their batches differ, so both count)
    hists = rep["ranges"]["histograms"]
    assert set(hists) == set(local[0]["histograms"]) == set(local[1]["histograms"])
    for layer, kinds in hists.items():
        for kind, h in kinds.items():
            a, b = local[0]["histograms"][layer][kind], local[1]["histograms"][layer][kind]
            binades = set(a["binade_counts"]) | set(b["binade_counts"])
            assert h["binade_counts"] == {e: a["binade_counts"].get(e, 0) + b["binade_counts"].get(e, 0)
                                          for e in binades}, (layer, kind)
            assert (h["zeros"], h["nonfinite"]) == (a["zeros"] + b["zeros"], a["nonfinite"] + b["nonfinite"])
    assert sum(h["activations"]["nonfinite"] for h in hists.values()) == 0  # the fault is at step 3: unsampled
    for row in rep["lost_updates"]["layers"]:
        assert [row["updated"], row["lost"]] == [sum(x) for x in zip(*(r["lost"][row["layer"]] for r in local))]
    # rank 1's planted overflow (DDP's all-reduce makes rank 0's gradients non-finite too, unexplained there)
    assert [[t["step"], t["kind"], t["description"], t["rank"]] for t in rep["triggers"]] == [
        [*t, r] for r in (0, 1) for t in local[r]["triggers"]]
    if strategy == "ddp":
        assert "not reproduced" in local[0]["triggers"][0][2] and " in boost " in local[1]["triggers"][0][2]
        fault = rep["nonfinite"]["first_fault"]
        assert fault["step"] == 3 and fault["classification"] == "forward overflow"
        assert fault["event"]["module"] == "boost"
    else:  # both ranks see the step as non-finite (the shards' squares are summed); no replay of a sharded model
        assert [t[:2] for r in (0, 1) for t in local[r]["triggers"]] == [[3, "nonfinite"]] * 2
        assert all("not localised: the model is sharded (FSDP2)" in local[r]["triggers"][0][2] for r in (0, 1))
        shard = torch.load(tmp_path / "out1" / "capture-rank1.pt", weights_only=True)["state_dict"]
        assert shard["embed.weight"].shape[0] == Net().embed.weight.shape[0] // 2  # this rank's half
    # the sampled steps' (0 and 2) norms: the whole model's on every rank (DDP: the same gradients; FSDP: the
    # shards' squares summed over the ranks); unsampled steps take only the flag
    assert [local[0]["grad_l2"][i] for i in (0, 2)] == pytest.approx([local[1]["grad_l2"][i] for i in (0, 2)],
                                                                     rel=1e-6)
    assert all(local[0]["grad_l2"][i] > 0 for i in (0, 2)) and local[0]["grad_l2"][1] is None
    assert rep["watch"]["ranks_nonfinite"] == [local[0]["nonfinite_steps"], local[1]["nonfinite_steps"]] == [1, 1]
    assert rep["watch"]["world_size"] == 2 and rep["watch"]["steps"] == 4


# ------------------------------------------------------------------------------------------ subsampled sampled steps


def _edge_values(n, g, dtype=torch.float32):
    t = torch.randn(n, generator=g) * 10.0 ** torch.randint(-30, 30, (n,), generator=g).float()
    t[::7] = 0.0
    t[3] = 1e-40  # an fp32 subnormal
    t[5], t[6] = math.inf, math.nan
    return t.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_subsample_of_a_tensor_under_the_limit_equals_the_whole_histogram(dtype):
    from mixprec.probes.ranges import Log2Histogram
    from mixprec.probes.ranges import HistogramBatch

    g = torch.Generator().manual_seed(0)
    # transposed: non-contiguous too
    tensors = [_edge_values(r * c, g, dtype).reshape(r, c).t() for r, c in ((2, 5), (20, 25), (64, 64))]
    batch = HistogramBatch(limit=4096)
    for i, t in enumerate(tensors):
        batch.add(i, t)
    for (i, got), t in zip(batch.read(), tensors):
        want = Log2Histogram()
        want.add(t)
        assert torch.equal(got.counts, want.counts) and (got.zeros, got.nonfinite) == (want.zeros, want.nonfinite)


def test_subsample_of_a_large_tensor_keeps_the_exact_top_binade_and_nonfinite_presence():
    from mixprec.probes.ranges import Log2Histogram
    from mixprec.probes.ranges import HistogramBatch
    from mixprec.probes.subsample import flat_sample, stride_for

    g = torch.Generator().manual_seed(1)
    t = torch.randn(512, 784, generator=g)
    s = stride_for(t, 4096)
    assert s > 1 and math.gcd(s, 784) == 1
    assert {int(i) % 784 for i in torch.arange(t.numel())[::s]} == set(range(784))  # every column is visited
    t.view(-1)[s * 10 + 1] = 1e30  # off the subsample's positions
    big = t.clone()
    big.view(-1)[s * 20 + 3] = math.inf
    batch = HistogramBatch(limit=4096)
    batch.add("one huge value", t)
    batch.add("one inf", big)
    (_, h), (_, hi) = batch.read()
    whole = Log2Histogram()
    whole.add(t)
    assert h.binade_range()[1] == whole.binade_range()[1] == 99  # 1e30 is in [2**99, 2**100)
    assert h.fractions("fp16")["overflow"] > 0 and whole.fractions("fp16")["overflow"] > 0
    assert not flat_sample(big, s).isinf().any() and hi.nonfinite >= 1 and h.nonfinite == 0
    # the rest is an estimate: each sampled element stands for s elements
    assert abs(h.total - t.numel()) <= s
    for fmt in ("fp16", "fp8_e4m3"):
        for k in (0, 8):
            est, exact = h.fractions(fmt, k), whole.fractions(fmt, k)
            assert all(abs(est[key] - exact[key]) < 0.02 for key in exact), (fmt, k, est, exact)


@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, torch.optim.AdamW])
def test_lost_updates_on_a_subsample_are_the_whole_steps_positions(opt_cls):
    """An elementwise optimizer's shadow step over a subsample gives exactly the subsample of the whole shadow
    step (state included); the lost-update fraction is close to the whole tensor's, a small tensor is whole."""
    from mixprec.probes.lost_updates import LostUpdateMonitor
    from mixprec.probes.subsample import flat_sample, stride_for

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(300, 200), nn.Linear(200, 3)).to(torch.bfloat16)
    opt = opt_cls(model.parameters(), lr=1e-3, **({"momentum": 0.9} if opt_cls is torch.optim.SGD else {}))
    names = {id(p): n for n, p in model.named_parameters()}
    for _ in range(2):  # the state exists after one step
        opt.zero_grad()
        model(torch.randn(8, 300).bfloat16()).float().pow(2).mean().backward()
        opt.step()
    opt.zero_grad()
    model(torch.randn(8, 300).bfloat16()).float().pow(2).mean().backward()
    whole = LostUpdateMonitor(opt, names)._shadow_updates(opt)
    part = LostUpdateMonitor(opt, names, max_elements=1000)._shadow_updates(opt)
    for (p, _, dw, n), (q, view, dp, m) in zip(whole, part):
        s = stride_for(p, 1000)
        assert p is q and n == m == p.numel() and torch.equal(flat_sample(dw.view_as(p), s), dp)
        assert (s == 1) == (p.numel() <= 1000)
    monitors = [LostUpdateMonitor(opt, names), LostUpdateMonitor(opt, names, max_elements=1000)]
    for mon in monitors:
        mon.before_step(opt)
    opt.step()
    for mon in monitors:
        mon.after_step(opt)
    a, b = (mon.result().layers for mon in monitors)
    assert a[0].examined == a[0].elements == b[0].elements > b[0].examined  # the big layer: subsampled
    assert (a[1].examined, a[1].updated, a[1].lost) == (b[1].examined, b[1].updated, b[1].lost)  # small: whole
    assert abs(a[0].lost_fraction - b[0].lost_fraction) < 0.05 and a[0].lost_fraction > 0.05


def test_watch_json_states_the_sample_size(tmp_path):
    _, rep, _, _ = _run(tmp_path, steps=2, fault_at=None, sample_elements=32)
    s = rep["watch"]["sampling"]
    assert s["sample_elements"] == 32 and s["histogram_elements_binned"] < s["histogram_elements"]
    assert 0 < s["lost_update_elements_examined"] < s["lost_update_elements"]


# ------------------------------------------------------------------------------ devices
# The device tests run on cpu and (where present) cuda. Where a CPU run can show a bug that mixed devices cause,
# the meta device stands in for an accelerator: tensors there have no data, and a tensor on the CPU (not 0-dim)
# meeting one there raises as a CPU tensor meeting a CUDA one does.


@pytest.fixture
def meta_reads_as_zeros(monkeypatch):
    """A host read (``tolist``) of a meta tensor gives zeros of its shape; returns the devices read, in order."""
    tolist, devices = torch.Tensor.tolist, []

    def read(self):
        devices.append(self.device)
        return tolist(torch.zeros(self.shape, dtype=self.dtype) if self.device.type == "meta" else self)

    monkeypatch.setattr(torch.Tensor, "tolist", read)
    return devices


@pytest.mark.parametrize("split", [False, True], ids=["whole", "cpu-first-layer"])
@pytest.mark.parametrize("device", DEVICES)
def test_watch_runs_on_the_device_with_sampled_steps_and_a_cpu_loss(tmp_path, device, split):
    """On the device: sampled steps (ranges, per-layer norms, lost updates), a loss handed to ``w.log`` as a CPU
    tensor, the finite check and a planted forward fault localised by replay. ``split`` keeps the first layer on
    the CPU (a CPU embedding before a device body): the watch's tensors meet on the device."""
    torch.manual_seed(0)
    model = SplitNet(device) if split else Net().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    logged = []

    def on_cpu(loss):
        logged.append(loss.detach().cpu())
        return logged[-1]

    with mixprec.watch(model, opt, out=str(tmp_path), every=2, plots=False) as w:
        _loop(model, opt, batches(6, fault_at=5), device=device, watch=w, logged=on_cpu)
    assert w.device.type == torch.device(device).type
    assert [s["step"] for s in w.sampler.samples] == [0, 2, 4]
    for s in w.sampler.samples:
        norms = {r["layer"]: r["grad_norm"] for r in s["layers"]}
        assert s["lost_updates"] is not None and norms["embed"] > 0 and norms["head"] > 0
    fault = w.faults[0]
    assert (fault.step, fault.classification, fault.event.module) == (5, "forward overflow", "boost")
    rows = (tmp_path / "steps.csv").read_text().splitlines()[1:]
    assert [float(r.split(",")[1]) for r in rows[:5]] == [float(t) for t in logged[:5]]


@pytest.mark.parametrize("device", DEVICES)
def test_watch_under_a_gradscaler_on_the_device(tmp_path, device):
    """fp16 with the device's GradScaler: the skip is seen, the backward fault localised, the scale history read."""
    torch.manual_seed(0)
    model = Net().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler(torch.device(device).type, init_scale=2.0**8)
    with mixprec.watch(model, opt, scaler=scaler, out=str(tmp_path), every=2, plots=False) as w:
        _loop(model, opt, batches(6, fault_at=3, mode=BACKWARD), dtype=torch.float16, scaler=scaler, watch=w,
              device=device)
    rep = json.loads((tmp_path / "watch.json").read_text())
    fault = _first_fault(rep)
    assert fault["step"] == 3 and fault["event"]["phase"] == "backward" and fault["event"]["module"] == "boost"
    hist = rep["loss_scale_history"]
    assert [s["skipped"] for s in hist["steps"]] == [False, False, False, True, False, False]
    assert [s["scale"] for s in hist["steps"]][2:5] == [256.0, 256.0, 128.0]


def test_a_value_logged_from_another_device_moves_to_the_watchs_device():
    from mixprec.watching.core import _scalar

    meta = torch.device("meta")
    for v in (torch.tensor(2.5), torch.ones(3), torch.ones(1, 1, dtype=torch.bfloat16), 2.5):
        t = _scalar(v, meta)
        assert t.device == meta and t.shape == () and t.dtype == torch.float32, v


def test_the_exact_finite_check_gathers_gradients_from_several_devices(meta_reads_as_zeros):
    """A model over two devices: the exact re-check's per-gradient flags are stacked on the watch's device."""
    model = Net()
    with mixprec.watch(model, torch.optim.SGD(model.parameters(), lr=0.1), plots=False) as w:
        w.device = torch.device("meta")  # the watch's device stands in for a GPU
        w._grads_finite([torch.ones(3), torch.ones(2, 2, device="meta")], sharded=False)
    assert meta_reads_as_zeros[0].type == "meta"


@pytest.mark.parametrize("given", [False, True])
def test_a_sampled_steps_histograms_meet_on_one_device(given):
    """A sampled step's subsamples and extremes are kept on one device for its one ``bincount`` and read: the
    device given (the watch's), else the first tensor's."""
    from mixprec.probes.ranges import HistogramBatch

    batch = HistogramBatch(limit=16, device="meta") if given else HistogramBatch(limit=16)
    batch.add("first", torch.randn(8, device="cpu" if given else "meta"))
    batch.add("subsampled", torch.randn(40, 3))  # over the limit: its exact extremes are kept too
    batch.add("whole", torch.randn(8))
    kept = batch._subs + [e for e in batch._extremes if e is not None]
    assert len(kept) == 4 and {t.device.type for t in kept} == {"meta"}


def test_lost_update_counts_are_made_on_the_device_of_the_stepped_tensors(meta_reads_as_zeros):
    """The shadow step's counts and medians stay on the tensors' device (judged or not), and tensors on two
    devices meet on the accelerator: one read, of a tensor there."""
    from mixprec.probes.lost_updates import LayerUpdates, LostUpdateMonitor

    monitor = LostUpdateMonitor.__new__(LostUpdateMonitor)
    monitor._pending, monitor.steps = [], 0
    for device, judged in (("cpu", True), ("meta", False), ("meta", True)):
        w = torch.ones(4, dtype=torch.bfloat16, device=device)
        monitor._pending.append((w, w.clone(), torch.full((4,), 1e-5, device=device), LayerUpdates("l", "bf16"),
                                 judged))
    monitor._count()
    assert [d.type for d in meta_reads_as_zeros] == ["meta"] and monitor.steps == 1


def test_a_replays_seed_loss_takes_outputs_from_several_devices():
    """Outputs on two devices (and a seed moved elsewhere, as a capture's is): the terms meet on the first's."""
    from mixprec.watching.recorder import _Seed, _seed_loss

    outs = (torch.ones(2, 3, device="meta"), torch.ones(4))
    loss = _seed_loss(outs, _Seed("outputs", [torch.ones(2, 3), torch.ones(4)], 2.0))
    assert loss.device.type == "meta" and loss.shape == ()
    assert _seed_loss(outs, _Seed(None, [], 1.0)).device.type == "meta"
