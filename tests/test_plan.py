"""mixprec plan: memory by category predicted under fake tensors equals the exact accounting of a real step."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from mixprec.planning import TARGETS, Target, TargetError, TraceError, get_target, plan

# a CPU target with fixed figures: the memory categories do not depend on them, and nothing is measured
CPU = Target(name="cpu", description="test CPU", kind="cpu", memory_bytes=16 * 2**30,
             peak_flops={"fp32": 1e12, "bf16": 2e12, "fp16": 2e12}, bandwidth=50e9, source="test")
FLAGS = dict(dataset="digits", optimizer="adamw", lr=1e-3)


def measured(precision: str, model: str, batch_size: int, **flags):
    """Bench's exact accounting of a real steady-state step (the second) of the same config on this CPU."""
    from mixprec.memory import SavedTensorTracker, static_memory
    from mixprec.train.build import build_run
    from mixprec.train.config import TrainConfig
    from mixprec.train.step import train_step

    run = build_run(TrainConfig.from_flags(model=model, precision=precision, batch_size=batch_size, device="cpu",
                                           **{**FLAGS, **flags}))
    xb, yb = next(iter(run.train_loader))
    train_step(run.ctx, xb, yb)
    tracker = SavedTensorTracker(exclude=run.model.parameters())
    train_step(run.ctx, xb, yb, tracker=tracker)
    return static_memory(run.model, run.optimizer, run.recipe.master).add_saved(tracker)


@pytest.mark.parametrize("model,precision", [("mlp", "fp32"), ("mlp", "bf16-mixed"), ("mlp", "bf16-master"),
                                             ("cnn", "bf16-mixed"),
                                             pytest.param("transformer", "fp8-mixed", marks=pytest.mark.slow)])
def test_categories_equal_the_exact_accounting_of_a_real_step(model, precision):
    p = plan(precisions=precision, target=CPU, model=model, batch_size=32, **FLAGS).recipes[0]
    real = measured(precision, model, 32)
    for c in ("parameters", "gradients", "optimizer_state", "master_weights"):
        assert p.memory[c] == getattr(real, c), c
    for c in ("activations", "autocast_weight_copies", "fp8_buffers"):
        assert p.memory[c] == pytest.approx(getattr(real, c), rel=0.10), c
    assert sum(p.at_peak.values()) == p.peak_bytes


def test_peak_equals_memtrackers_peak():
    """Our recorder keeps PyTorch's MemTracker's books: the same step, the same peak."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    from mixprec.planning.recorder import StepRecorder

    with FakeTensorMode():
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
        opt = torch.optim.AdamW(model.parameters(), foreach=True)
        x, y = torch.randn(128, 64), torch.randint(0, 10, (128,))

        def step():
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()
        mt = MemTracker()
        mt.track_external(model, opt, x, y)
        with mt:
            step()
        rec = StepRecorder()
        rec.register([*model.parameters(), *(v for s in opt.state.values() for v in s.values()), x, y], "resident")
        with rec:
            step()
    assert rec.peak == max(mt._peak_mem.values())


class LinearNormLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.norm, self.head = nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 10)

    def forward(self, x):
        return self.head(self.norm(self.a(x.flatten(1))))


@pytest.mark.slow
def test_gpu_target_applies_cudas_autocast_lists_and_real_fp8(monkeypatch):
    import mixprec.planning.api as api

    traces = {}
    real_trace = api.trace_step

    def spy(**kw):
        out = real_trace(**kw)
        traces[kw["target"].name] = out
        return out

    monkeypatch.setattr(api, "trace_step", spy)
    for target in ("h100-sxm", CPU):
        plan(precisions="bf16-mixed", target=target, model=LinearNormLinear, batch_size=16, **FLAGS)

    def norm_dtypes(trace):
        return {o.dtype for o in trace.ops if o.name == "native_layer_norm"}

    assert norm_dtypes(traces["h100-sxm"]) == {"fp32"}  # CUDA's autocast runs layer_norm in fp32
    assert norm_dtypes(traces["cpu"]) == {"bf16"}  # CPU's leaves it in its input's bf16
    monkeypatch.undo()
    # the tiny transformer's layers are all below torchao's FP8 size rule: --fp8-layers all converts them anyway
    gpu = plan(precisions="fp8-mixed", target="h100-sxm", model="transformer", batch_size=16, fp8_layers="all", **FLAGS)
    a100 = plan(precisions="fp8-mixed", target="a100-80gb", model="transformer", batch_size=16, fp8_layers="all",
                **FLAGS)
    assert "fp8" in gpu.recipes[0].flops  # torch._scaled_mm on an H100
    assert "fp8" not in a100.recipes[0].flops  # no FP8 GEMMs on an A100: the emulated bf16 path


def test_largest_batch_scales_linearly():
    small = plan(precisions="bf16-mixed", target=CPU, model="cnn", batch_size=32, **FLAGS).recipes[0]
    big = plan(precisions="bf16-mixed", target=CPU, model="cnn", batch_size=64, **FLAGS).recipes[0]
    fixed = small.peak_bytes - small.at_peak["activations"] - small.at_peak["temporary"]
    predicted = fixed + 2 * (small.peak_bytes - fixed)
    assert big.peak_bytes == pytest.approx(predicted, rel=0.05)
    tiny = Target(**{**CPU.to_dict(), "memory_bytes": big.peak_bytes})
    fit = plan(precisions="bf16-mixed", target=tiny, model="cnn", batch_size=32, **FLAGS).recipes[0]
    assert 60 <= fit.max_batch_size <= 68 and fit.fits


def test_a_batch_that_does_not_fit_says_the_largest_that_does():
    p0 = plan(precisions="fp32", target=CPU, model="mlp", batch_size=256, **FLAGS)
    r = p0.recipes[0]
    small = Target(**{**CPU.to_dict(), "memory_bytes": (r.peak_bytes + r.memory["parameters"] * 4) // 2})
    p = plan(precisions="fp32", target=small, model="mlp", batch_size=256, **FLAGS)
    assert not p.recipes[0].fits and 0 < p.recipes[0].max_batch_size < 256
    assert f"largest batch that fits is {p.recipes[0].max_batch_size}" in p.verdict()


def test_unknown_target_lists_the_known_ones(cli):
    with pytest.raises(TargetError, match="h100-sxm.*rtx4090"):
        get_target("tpu-v5")
    code, _, err = cli("plan", "--target", "tpu-v5")
    assert code == 2 and "unknown --target 'tpu-v5'" in err and "a100-80gb" in err
    assert {"a100-80gb", "h100-sxm", "h200", "b200", "rtx3090", "rtx4090", "l4"} <= set(TARGETS)
    for t in TARGETS.values():
        assert t.source and t.peak_flops["bf16"] > t.peak_flops["fp32"] and t.bandwidth > 0


class ReadsValues(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 10)

    def forward(self, x):
        if x.sum().item() > 1e9:  # a host read in forward: cannot be traced under fake tensors
            x = x * 0
        return self.fc(x.flatten(1))


def test_untraceable_model_names_the_op_and_falls_back_to_a_real_step_when_asked():
    with pytest.raises(TraceError, match="_local_scalar_dense.*--fallback-real"):
        plan(precisions="fp32", target=CPU, model=ReadsValues, batch_size=32, **FLAGS)
    p = plan(precisions="fp32", target=CPU, model=ReadsValues, batch_size=32, fallback_real=True, **FLAGS)
    r = p.recipes[0]
    assert p.traced == "real" and r.memory["parameters"] == 4 * (64 * 10 + 10)
    assert any("traced for real" in n for n in r.notes)


def test_cli_writes_json_with_the_issues_keys(cli, tmp_path):
    out = tmp_path / "plan.json"
    code, text, _ = cli("plan", "--model", "mlp", "--dataset", "digits", "--target", "rtx3090",
                        "--precisions", "fp32,amp", "--json", out)
    assert code == 0 and "verdict on rtx3090" in text
    assert "limit: the step is traced on fake CPU tensors, so model code that branches on the device type" in text
    doc = json.loads(out.read_text())
    assert len(doc["limits"]) == 1 and "CPU branch" in doc["limits"][0]
    assert [r["recipe"] for r in doc["recipes"]] == ["fp32", "fp16-mixed"]
    for r in doc["recipes"]:
        assert {"recipe", "memory", "peak_bytes", "max_batch_size", "flops", "step_time_s"} <= set(r)
        assert r["memory"]["parameters"] > 0 and r["step_time_s"] > 0


def test_plan_is_exported():
    import mixprec

    assert mixprec.plan is plan


@pytest.mark.slow
def test_small_hugging_face_llama_plans_exact_parameters():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    ids = torch.randint(0, 256, (2, 32))
    p = plan(precisions="fp32,bf16-mixed,bf16-true", target="h100-sxm",
             model=lambda: transformers.LlamaForCausalLM(cfg), batch={"input_ids": ids, "labels": ids},
             optimizer="adamw")
    d, f, v, kv = 64, 128, 256, 32
    n = 2 * v * d + 2 * (2 * d * d + 2 * d * kv + 3 * d * f + 2 * d) + d
    assert p.by_name("fp32").memory["parameters"] == 4 * n
    assert p.by_name("bf16-true").memory["parameters"] == 2 * n
    assert p.by_name("bf16-mixed").memory["autocast_weight_copies"] > 0
    assert p.by_name("fp32").memory["optimizer_state"] == 2 * 4 * n + 4 * len(list(
        transformers.LlamaForCausalLM(cfg).parameters()))


@pytest.mark.slow
def test_llama_8b_plan_matches_the_hand_calculation(tmp_path):
    """Llama-3-8B at 1 x 2048, three recipes, planned in a subprocess with under 3 GB of RSS (and of address
    space: more fails instead of being killed); parameter, gradient and optimizer bytes equal the hand
    calculation. (Its wall time is a benchmark: benchmarks/plan_llama.py.)"""
    pytest.importorskip("transformers")
    import resource
    import subprocess
    import sys

    from conftest import ROOT

    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "plan_llama.py"), "--target", "h100-sxm",
                        "--json", str(tmp_path / "llama.json")], capture_output=True, text=True, timeout=600,
                       cwd=ROOT, env={**__import__("os").environ, "PYTHONPATH": str(ROOT / "src")},
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30)))
    assert r.returncode == 0, r.stderr[-2000:]
    rss = float(r.stdout.rsplit("peak RSS ", 1)[1].split()[0])
    assert rss < 3.0
    doc = json.loads((tmp_path / "llama.json").read_text())
    n = 8_030_261_248
    assert doc["recipes"][0]["memory"]["parameters"] == 4 * n


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 1)

    def forward(self, x):
        return self.fc(x)


def test_default_loss_is_the_tasks_as_in_train():
    """Float targets against one output per sample are a regression: train's task resolution gives MSE."""
    from mixprec.planning.api import Planner
    from mixprec.train.config import TrainConfig

    batch = (torch.randn(16, 8), torch.randn(16))
    planner = Planner(config=TrainConfig.from_flags(optimizer="adamw"), target=CPU, model=Regressor, batch=batch)
    ops = {o.name for o in planner.trace("fp32")[0].ops}
    assert planner.default_loss.task.name == "regression"
    assert "mse_loss" in ops and not any("nll_loss" in o or "log_softmax" in o for o in ops)
    classify = Planner(config=TrainConfig.from_flags(optimizer="adamw"), target=CPU, model=LinearNormLinear,
                       batch=(torch.randn(16, 64), torch.randint(0, 10, (16,))))
    assert "nll_loss_forward" in {o.name for o in classify.trace("fp32")[0].ops}


@pytest.mark.slow
def test_replayed_fp8_scales_give_the_trace_of_running_them(monkeypatch):
    """The FP8 scale computations after the first of each kind are replayed, not dispatched: same ops, same
    memory."""
    import contextlib

    import mixprec.lowp.quant as fp8
    import mixprec.planning.trace as T
    from mixprec.planning.api import Planner
    from mixprec.train.config import TrainConfig

    calls = []
    real = fp8._device_scale
    monkeypatch.setattr(fp8, "_device_scale", lambda *a: calls.append(1) or real(*a))
    batch = (torch.randn(16, 64), torch.randint(0, 10, (16,)))

    def trace():
        calls.clear()
        tr = Planner(config=TrainConfig.from_flags(optimizer="adamw", fp8_layers="all"), target="h100-sxm",
                     model=LinearNormLinear, batch=batch).trace("fp8-mixed")[0]
        return [(o.name, o.flops, o.dtype, o.nbytes, o.phase) for o in tr.ops], tr.peak_bytes, tr.totals, len(calls)

    ops, peak, totals, ran = trace()
    monkeypatch.setattr(T, "_replayed_scales", lambda rec, fake: contextlib.nullcontext())
    ops_all, peak_all, totals_all, ran_all = trace()
    assert ran < ran_all and ran_all >= 3  # x, w and the output gradient are scaled; the later ones replayed
    assert ops == ops_all and peak == peak_all and totals == totals_all
    assert sum(o[0] == "frexp" for o in ops) == ran_all  # one frexp per scale, replayed or not


def test_a_cuda_device_name_finds_its_table_entry_or_none():
    from mixprec.planning.targets import target_for_gpu

    names = {"NVIDIA H100 80GB HBM3": "h100-sxm", "NVIDIA H200": "h200", "NVIDIA A100-SXM4-80GB": "a100-80gb",
             "NVIDIA GeForce RTX 4090": "rtx4090", "NVIDIA L4": "l4", "NVIDIA B200": "b200"}
    for name, key in names.items():
        assert target_for_gpu(name).name == key, name
    for other in ("NVIDIA L40S", "NVIDIA H100 PCIe", "NVIDIA A100-SXM4-40GB", "NVIDIA GH200 480GB", "Tesla T4"):
        assert target_for_gpu(other) is None, other


def test_cpu_kernel_workspace_follows_the_operands():
    """planning.workspace: batch-norm backward's input-sized temporary; channels-last max-pool backward's
    contiguous copies of the indices and the input gradient (a contiguous input needs none)."""
    from mixprec.planning.workspace import cpu_workspace

    x = torch.randn(4, 3, 8, 8)
    assert cpu_workspace("native_batch_norm_backward", [torch.randn(4, 3, 8, 8), x], []) == x.numel() * 4
    assert cpu_workspace("native_batch_norm_backward", [x, x.bfloat16()], []) == x.numel() * 2
    idx = torch.zeros(4, 3, 4, 4, dtype=torch.int64)
    cl = x.to(memory_format=torch.channels_last)
    assert cpu_workspace("max_pool2d_with_indices_backward", [torch.randn(4, 3, 4, 4), cl, [2, 2], idx], []) \
        == idx.numel() * 8 + x.numel() * 4
    assert cpu_workspace("max_pool2d_with_indices_backward", [torch.randn(4, 3, 4, 4), x, [2, 2], idx], []) == 0
    assert cpu_workspace("mm", [x, x], []) == 0


def test_the_recorders_peak_counts_a_kernels_workspace_while_its_op_runs():
    """A step whose peak is batch norm's backward: with the cpu target's workspace the peak grows by exactly the
    copy of the batch norm's input; without it (GPU targets) the same step peaks lower."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from mixprec.planning.recorder import StepRecorder
    from mixprec.planning.workspace import cpu_workspace

    peaks = {}
    for name, ws in (("cpu", cpu_workspace), ("gpu", None)):
        with FakeTensorMode():
            model = nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))
            x = torch.randn(256, 1, 8, 8)
            rec = StepRecorder(workspace=ws)
            with rec:
                model(x).sum().backward()
            peaks[name] = (rec.peak, rec.peak_workspace)
    bn_input = 256 * 32 * 8 * 8 * 4
    assert peaks["cpu"][1] == bn_input and peaks["gpu"][1] == 0
    assert peaks["gpu"][0] < peaks["cpu"][0] <= peaks["gpu"][0] + bn_input


def test_roofline_host_overheads_per_op_per_low_precision_gemm_and_per_step():
    from mixprec.planning.recorder import OpRecord
    from mixprec.planning.roofline import Efficiency, step_time

    cpu = Target(name="cpu", description="test", kind="cpu", memory_bytes=2**30, peak_flops={"fp32": 1e12},
                 bandwidth=1e12, source="test", launch_s=0.0)
    ops = [OpRecord(name="add", flops=0, dtype="fp32", nbytes=1, phase="forward"),
           OpRecord(name="_to_copy", flops=0, dtype="bf16", nbytes=1, phase="forward"),  # a cast: no GEMM cost
           OpRecord(name="mm", flops=2, dtype="bf16", nbytes=1, phase="forward"),
           OpRecord(name="view", flops=0, dtype="fp32", nbytes=0, phase="forward")]  # a view: no kernel, no cost
    eff = Efficiency(gemm={"bf16": 1.0}, memory=1.0, op_overhead_s=1e-3, lowp_gemm_overhead_s=5e-3,
                     step_overhead_s=0.1)
    t = step_time(ops, cpu, eff)
    assert t.ops == 3 and t.overhead_s == pytest.approx(3 * 1e-3 + 5e-3 + 0.1)
    same = step_time(ops, cpu, Efficiency(gemm={"bf16": 1.0}, memory=1.0, op_overhead_s=1e-3))
    assert same.overhead_s == pytest.approx(3e-3)  # no low-precision figure: every op pays op_overhead_s


def test_timed_kernels_replace_their_roofline_terms_but_keep_the_host_overhead():
    from mixprec.planning.kernels import KernelSpec, TensorSpec
    from mixprec.planning.recorder import OpRecord
    from mixprec.planning.roofline import Efficiency, step_time

    cpu = Target(name="cpu", description="test", kind="cpu", memory_bytes=2**30, peak_flops={"bf16": 1.0},
                 bandwidth=1.0, source="test", launch_s=0.0)
    spec = KernelSpec(torch.ops.aten.mm.default, (TensorSpec((2, 2), (2, 1), torch.bfloat16),) * 2, ())
    ops = [OpRecord(name="mm", flops=100, dtype="bf16", nbytes=24, phase="forward", kernel=spec),
           OpRecord(name="add", flops=0, dtype="fp32", nbytes=4, phase="forward")]
    eff = Efficiency(gemm={"bf16": 1.0}, memory=1.0, op_overhead_s=1e-3, lowp_gemm_overhead_s=5e-3)
    roof = step_time(ops, cpu, eff)
    assert roof.total_s == pytest.approx(100 + 4 + 2e-3 + 5e-3) and roof.timed_ops == 0
    t = step_time(ops, cpu, eff, kernel_times={spec: 0.25})
    assert t.timed_s == 0.25 and t.timed_ops == 1 and t.gemm_s == 0 and t.flops_by_dtype == {"bf16": 100}
    assert t.total_s == pytest.approx(0.25 + 4 + 2e-3)  # the call's own time holds its operand conversion


def test_cpu_target_times_gemms_convolutions_and_attention_once_per_distinct_call():
    """The cpu target records the calls of TIMED_OPS with their shapes and times each distinct one once;
    GPU targets keep the roofline; an RNN's fused kernel (a workspace its backward trusts) is not replayed."""
    from mixprec.planning.kernels import TIMED_OPS, KernelTimes
    from mixprec.planning.recorder import StepRecorder

    def step(rec):
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode() as mode:
            torch.manual_seed(0)
            layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])
            conv, lstm = nn.Conv2d(1, 2, 3), nn.LSTM(8, 8)
            x, img = mode.from_tensor(torch.randn(4, 8)), mode.from_tensor(torch.randn(2, 1, 6, 6))
            with rec:
                h = x
                for layer in layers:  # three calls of the same shapes: one distinct spec per op
                    h = layer(h)
                q = h.view(1, 1, 4, 8)
                out = (h.sum() + conv(img).sum() + F.scaled_dot_product_attention(q, q, q).sum()
                       + lstm(h.view(4, 1, 8))[0].sum())
                out.backward()
        return rec

    cpu = step(StepRecorder(time_kernels=True))
    kept = [op for op in cpu.ops if op.kernel is not None]
    assert {op.name for op in kept} <= TIMED_OPS
    assert {"addmm", "convolution", "_scaled_dot_product_flash_attention_for_cpu"} <= {op.name for op in kept}
    assert not any(op.name.startswith("mkldnn_rnn") and op.kernel for op in cpu.ops)
    assert all(op.kernel is None for op in step(StepRecorder()).ops)  # a GPU target's recorder
    addmm = [op.kernel for op in kept if op.name == "addmm" and op.phase == cpu.ops[0].phase]
    assert len(addmm) >= 3 and len(set(addmm)) < len(addmm)
    times = KernelTimes(repeats=2)
    measured = times.measure(op.kernel for op in kept)
    assert set(measured) == {op.kernel for op in kept} and all(t > 0 for t in measured.values())
    assert len(times.seconds) == len(set(measured))
    spent = KernelTimes(total_budget_s=0.0)  # a budget spent before the first call: every call keeps the roofline
    assert spent.measure(op.kernel for op in kept) == {} and spent.untimed == len(set(measured))
    from mixprec.planning.api import _measured

    slow = Target(name="cpu", description="test", kind="cpu", memory_bytes=2**30, peak_flops={"fp32": 1.0},
                  bandwidth=1.0, source="test", launch_s=0.0)  # 1 FLOP/s: every call priced far above a second
    assert _measured(cpu.ops, slow, KernelTimes()) == {}
    assert _measured(cpu.ops, get_target("cpu"), KernelTimes()).keys() == set(measured)


# ------------------------------------------------------------------- nothing is built or run for real

def _corpus(tmp_path, n=21000):
    """A text corpus whose test split (10%) holds a 2048-character window."""
    path = tmp_path / "corpus.txt"
    path.write_text(("the quick brown fox jumps over the lazy dog. " * (n // 45 + 1))[:n])
    return path


@pytest.mark.slow
def test_llama_3_8b_from_a_factory_plans_under_a_3_gb_memory_limit(tmp_path):
    """`mixprec plan --model file:make` on the real Llama-3-8B config (32 GB of fp32 parameters), with the default
    fused SGD, in a subprocess whose address space is capped at 3 GB: building the model or taking its optimizer
    step for real would fail there (an allocation error), so a regression fails instead of being killed."""
    pytest.importorskip("transformers")
    import os
    import subprocess
    import sys

    from conftest import ROOT

    factory = tmp_path / "llama8b.py"
    factory.write_text(
        "from transformers import LlamaConfig, LlamaForCausalLM\n\n\n"
        "def make():\n"
        "    return LlamaForCausalLM(LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,\n"
        "        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False))\n")
    limit = "import resource; resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30)); "
    run = "import sys; from mixprec.cli import main; sys.exit(main(sys.argv[1:]))"
    r = subprocess.run([sys.executable, "-c", limit + run, "plan", "--model", f"{factory}:make", "--dataset", "text",
                        "--data-path", str(_corpus(tmp_path)), "--block-size", "2048", "--batch-size", "1",
                        "--target", "h100-sxm", "--precisions", "fp32", "--json", str(tmp_path / "plan.json")],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads((tmp_path / "plan.json").read_text())
    assert doc["traced"] == "fake" and doc["recipes"][0]["memory"]["parameters"] == 4 * 8_030_261_248


def test_the_default_fused_sgd_step_is_traced_without_running_anything_for_real(monkeypatch):
    """PyTorch's fused SGD step has no fake kernel; FakeTensorMode would run it for real on zero-filled full-size
    copies of every parameter and gradient. The planner gives it one and never takes that fallback."""
    import torch._subclasses.fake_tensor as fake_tensor

    def no_real_run(mode, func, *a, **k):
        raise AssertionError(f"{func} ran for real")

    monkeypatch.setattr(fake_tensor, "run_fallback_kernel", no_real_run)
    p = plan(precisions="fp32", target="h100-sxm", model=LinearNormLinear, batch_size=16, dataset="digits",
             optimizer="sgd", momentum=0.9)
    assert p.traced == "fake"
    for r in p.recipes:
        assert r.memory["optimizer_state"] == 4 * (64 * 64 + 64 + 2 * 64 + 64 * 10 + 10)  # the momentum buffers


INIT_READS_VALUES = """from torch import nn


class InitReadsValues(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 10)
        while (self.fc.weight.abs() > 1.0).any():  # a host read at initialisation (rejection sampling)
            nn.init.normal_(self.fc.weight)

    def forward(self, x):
        return self.fc(x.flatten(1))
"""


def test_a_model_whose_init_reads_values_is_built_for_real_only_with_fallback_real(cli, tmp_path):
    factory = tmp_path / "init_reads.py"
    factory.write_text(INIT_READS_VALUES)
    code, out, err = cli("plan", "--model", f"{factory}:InitReadsValues", "--dataset", "digits", "--target", "l4",
                         "--precisions", "fp32")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "cannot be built under fake tensors: " in err and "_local_scalar_dense" in err and "--fallback-real" in err
    p = plan(precisions="fp32", target="l4", model=f"{factory}:InitReadsValues", batch_size=8, fallback_real=True,
             **FLAGS)
    r = p.recipes[0]
    assert p.traced == "fake" and r.memory["parameters"] == 4 * (64 * 10 + 10)
    assert any("built for real once (--fallback-real)" in n for n in r.notes)


def test_built_in_and_deep_copied_models_are_built_under_fake_tensors():
    """The built-in vision transformer (no trunc_normal_ host read) and a user model whose nn.TransformerEncoder
    deep-copies its layer: fake parameters of the planner's one fake mode, as many as the real model has."""
    import sys

    from conftest import ROOT

    from mixprec.planning.trace import FakeModelSource, planning_fake_mode
    from mixprec.train.models import build_model

    sys.path.insert(0, str(ROOT / "tests"))
    from userpkg.factories import transformer

    for build in (lambda: build_model("transformer", input_shape=(1, 8, 8), num_classes=10),
                  lambda: transformer((1, 8, 8), 10)):
        mode = planning_fake_mode()
        source = FakeModelSource(build, mode)
        fake, real = source.make(), build()
        assert source.path == "fake"
        assert all(p.fake_mode is mode for p in fake.parameters())
        assert [p.shape for p in fake.parameters()] == [p.shape for p in real.parameters()]
        assert len({p.untyped_storage()._cdata for p in fake.parameters()}) == len(list(real.parameters()))


def test_a_module_instance_is_planned_as_a_fake_copy_and_left_unchanged():
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    before = [p.clone() for p in model.parameters()]
    p = plan(precisions="fp32,bf16-true", target="l4", model=model, batch_size=8, **FLAGS)
    assert p.traced == "fake" and p.by_name("bf16-true").memory["parameters"] == 2 * (64 * 10 + 10)
    assert all(q.dtype == torch.float32 and torch.equal(q, b) for q, b in zip(model.parameters(), before))


def test_the_built_in_transformer_attends_as_on_the_targets_device():
    """On the CPU a bf16 q/k/v is attended in fp32 (mixprec.train.attention); on CUDA in bf16. A GPU target's
    plan, traced on fake CPU tensors, takes the CUDA branch; the cpu target's the CPU one."""
    from mixprec.planning.api import Planner
    from mixprec.train.attention import planned_device
    from mixprec.train.config import TrainConfig

    config = TrainConfig.from_flags(model="transformer", dataset="digits", batch_size=8, optimizer="adamw")
    dtypes = {}
    for target in ("h100-sxm", CPU):
        ops = Planner(config=config, target=target).trace("bf16-mixed")[0].ops
        dtypes[target if isinstance(target, str) else "cpu"] = {
            (o.phase, o.dtype) for o in ops if o.name.startswith("_scaled_dot_product")}
    assert dtypes["h100-sxm"] == {("forward", "bf16"), ("backward", "bf16")}
    assert dtypes["cpu"] == {("forward", "fp32"), ("backward", "fp32")}
    with planned_device("cuda"):
        with planned_device(None):
            pass
        from mixprec.train import attention as A

        assert A._PLANNED.device_type == "cuda"
    assert A._PLANNED.device_type is None


def test_a_batch_larger_than_the_data_is_planned_as_asked():
    """``--batch-size 256`` on 64 samples planned a batch of 64 and said so only in its header: a plan is of a step
    that has not happened (its tensors are fake), so it plans 256 and says where the samples came from."""
    small = plan(precisions="fp32", target=CPU, model="mlp", batch_size=256, limit_train=64, width=32, **FLAGS)
    full = plan(precisions="fp32", target=CPU, model="mlp", batch_size=256, width=32, **FLAGS)
    assert small.batch_size == 256
    assert small.recipes[0].peak_bytes == full.recipes[0].peak_bytes
    assert any("holds 64 samples: the batch of 256 is planned from them" in n for n in small.recipes[0].notes)
