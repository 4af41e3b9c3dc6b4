"""mixprec plan's step time on a GPU target: the host's dispatch queued against the GPU, host reads, torchao's
eager layers, compiled steps; and against the H200 bench run its constants were not fitted on."""

from __future__ import annotations

import collections
import dataclasses
import importlib.util
import sys

import pytest
from conftest import ROOT
from torch.utils._python_dispatch import TorchDispatchMode

from mixprec.planning import Target, get_target
from mixprec.planning.recorder import OpRecord
from mixprec.planning.roofline import Efficiency, Execution, HostCost, step_time

GPU = Target(name="gpu", description="test GPU", kind="cuda", memory_bytes=2**30, peak_flops={"bf16": 1.0},
             bandwidth=1.0, source="test", launch_s=0.0)
EFF = Efficiency(gemm={"bf16": 1.0}, memory=1.0)
HOST = HostCost(op_s=1e-3, module_s=0.1, torchao_layer_s=10.0)


def op(name="add", flops=0, nbytes=0, phase="forward", **kw) -> OpRecord:
    return OpRecord(name=name, flops=flops, dtype="bf16", nbytes=nbytes, phase=phase, **kw)


def gpu_time(ops, **execution):
    return step_time(ops, GPU, EFF, execution=Execution(**execution), host=HOST)


def test_the_host_dispatches_ahead_of_the_gpu_until_the_step_reads_a_value():
    """Host-bound: every op's dispatch; device-bound: the kernels; a host read between the forward's device work and
    the backward's dispatch serialises them, one op's dispatch more (the read itself)."""
    assert gpu_time([op(nbytes=1e-6) for _ in range(10)]).total_s == pytest.approx(10e-3)
    assert gpu_time([op("mm", flops=2.0)]).total_s == pytest.approx(2.0)
    ops = [op("mm", flops=1.0)] + [op("view", phase="backward") for _ in range(500)]  # 1 s on the GPU, 0.5 s host
    overlapped = gpu_time(ops)
    assert overlapped.total_s == pytest.approx(1.0) and overlapped.host_s == pytest.approx(0.501)
    assert overlapped.overhead_s == 0 and overlapped.gemm_s == 1.0 and overlapped.ops == 1
    assert gpu_time(ops, syncs=(1,)).total_s == pytest.approx(1.0 + 0.501 + 1e-3)


def test_what_an_eager_run_does_not_dispatch_costs_nothing_and_module_calls_cost_their_python():
    ops = [op(nbytes=1e-6) for _ in range(10)]
    ghosts = [op("device", dispatched=False), op("detach", phase="backward", dispatched=False)] * 50
    assert gpu_time(ops + ghosts).total_s == pytest.approx(10e-3)
    assert gpu_time(ops, module_calls=(0, 0, 5)).total_s == pytest.approx(10e-3 + 0.3)
    assert gpu_time(ops, untraced_ops=4).total_s == pytest.approx(14e-3)


def test_torchao_layers_cost_their_host_time_per_layer_in_place_of_their_ops():
    ops = [op(nbytes=1e-6)] + [op("mul", nbytes=1e-6, lowp=True) for _ in range(100)]
    assert gpu_time(ops).total_s == pytest.approx(101e-3)  # mixprec's layers: every op dispatched
    assert gpu_time(ops, torchao=True, lowp_layers=2).total_s == pytest.approx(1e-3 + 2 * 10.0)


def test_a_compiled_step_fuses_bandwidth_bound_runs_and_drops_the_per_op_dispatch():
    """Between GEMMs the bandwidth-bound ops of a phase become one kernel moving the largest op's bytes; views and
    module calls vanish; the optimizer stays eager."""
    cast = [op("abs", nbytes=4.0, lowp=True), op("view"), op("amax", nbytes=2.0, lowp=True),
            op("_to_copy", nbytes=3.0, lowp=True)]
    ops = [*cast, op("_scaled_mm", flops=1.0, nbytes=1.0), *cast, op("_fused_sgd_", nbytes=1.0, phase="optimizer")]
    eager = gpu_time(ops, module_calls=(0,))
    assert eager.memory_s == pytest.approx(2 * 9.0 + 1.0) and eager.host_s == pytest.approx(10e-3 + 0.1)
    compiled = gpu_time(ops, module_calls=(0,), compiled=True)
    assert compiled.ops == 4 and compiled.memory_s == pytest.approx(2 * 4.0 + 1.0)
    assert compiled.host_s == pytest.approx(1e-3) and compiled.total_s == pytest.approx(4.0 + 1.0 + 4.0 + 1.0)


def test_a_gemm_is_no_faster_than_the_large_gemm_measured_on_the_board():
    h200 = get_target("h200")
    mm = op("mm", flops=int(1e12))
    assert h200.measured_flops["fp32"] < 0.85 * h200.peak_flops["fp32"]
    fp32 = dataclasses.replace(mm, dtype="fp32")
    eff = Efficiency(gemm={"fp32": 0.85, "bf16": 0.7}, memory=1.0)
    t = step_time([fp32], h200, eff, execution=Execution(), host=HostCost(op_s=0, module_s=0, torchao_layer_s=0))
    assert t.total_s == pytest.approx(1e12 / h200.measured_flops["fp32"])
    t = step_time([mm], h200, eff, execution=Execution(), host=HostCost(op_s=0, module_s=0, torchao_layer_s=0))
    assert t.total_s == pytest.approx(1e12 / (0.7 * h200.peak_flops["bf16"]))  # under the measured bf16 rate


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_the_trace_prices_exactly_the_ops_an_eager_step_dispatches(model):
    """A real fp32 step on this CPU dispatches the ops the GPU trace prices: its dispatched ops and the forward's
    detach of each saved output (which the planner's saved-tensor hook moves), plus the loss read of an unguarded
    step (train's guarded one reads nothing here: the trace has no host read)."""
    from mixprec.planning.api import Planner
    from mixprec.train.build import build_run
    from mixprec.train.config import TrainConfig
    from mixprec.train.step import train_step

    flags = dict(model=model, batch_size=16, dataset="synthetic", precision="fp32", width=64, depth=2)
    run = build_run(TrainConfig.from_flags(**flags, device="cpu"))
    xb, yb = next(iter(run.train_loader))
    train_step(run.ctx, xb, yb)
    count = _Count()
    with count:
        train_step(run.ctx, xb, yb)
    trace, _, _ = Planner(config=TrainConfig.from_flags(**flags), target="h200").trace("fp32")
    traced = collections.Counter(o.name for o in trace.ops if o.dispatched)
    assert trace.syncs == () and sum(traced.values()) + trace.saved_outputs + 1 == sum(count.ops.values())
    assert {k for k in set(count.ops) | set(traced) if count.ops[k] != traced[k]} == {"detach", "_local_scalar_dense"}
    assert not any(o.dispatched for o in trace.ops if o.name == "device")  # fake tensors' queries


def test_the_trace_records_the_host_reads_module_calls_and_low_precision_layers():
    from mixprec.planning.api import Planner
    from mixprec.train.config import TrainConfig

    planner = Planner(config=TrainConfig.from_flags(model="mlp", width=64, depth=2, batch_size=16, dataset="synthetic",
                                                    fp8_layers="all"), target="h200")
    bf16, _, _ = planner.trace("bf16-mixed")
    assert bf16.syncs == ()  # a guarded step with a fused optimizer reads nothing
    assert len(bf16.module_calls) == 1 + 1 + 3 * 2 + 1  # the model, its body, (linear, relu, identity) x 2, head
    fp16, _, _ = planner.trace("fp16-mixed")
    check = next(i for i, o in enumerate(fp16.ops) if o.name == "_amp_foreach_non_finite_check_and_unscale_")
    assert fp16.syncs == (check + 1,)  # GradScaler's skip decision, after unscale_
    fp8, _, _ = planner.trace("fp8-mixed")
    assert fp8.lowp_layers == 2  # the head stays in bf16
    gemms = [o for o in fp8.ops if o.flops and o.phase == "forward"]
    assert [o.lowp for o in gemms] == [True, True, False] and gemms[0].name == "_scaled_mm"
    ex = planner.execution(fp8)
    assert ex.syncs == fp8.syncs and ex.lowp_layers == 2 and ex.compiled  # --compile auto: real FP8 GEMMs


def test_compile_auto_compiles_fp8_recipes_on_cuda_and_torchao_runs_where_auto_picks_it():
    from mixprec.planning.api import _compiles, _torchao_layers
    from mixprec.precision import RecipeConfig

    h200, a100 = get_target("h200"), get_target("a100-80gb")
    fp8, bf16 = RecipeConfig(precision="fp8-mixed"), RecipeConfig(precision="bf16-mixed")
    assert _compiles("auto", fp8, h200) and not _compiles("auto", bf16, h200) and _compiles("on", bf16, h200)
    assert not _compiles("auto", fp8, a100) and not _compiles("auto", RecipeConfig(precision="mxfp8"), h200)
    assert not _compiles("off", fp8, h200)  # emulated GEMMs (no FP8 or no MX units) stay eager under auto
    assert _torchao_layers(RecipeConfig(precision="fp8-mixed", fp8_impl="torchao"), h200)
    assert not _torchao_layers(RecipeConfig(precision="fp8-mixed", fp8_impl="scratch"), h200)
    assert not _torchao_layers(RecipeConfig(precision="fp8-mixed"), a100)  # no FP8 units: scratch, emulated
    assert not _torchao_layers(RecipeConfig(precision="mxfp8"), h200)  # no MX units on Hopper
    assert not _torchao_layers(RecipeConfig(precision="bf16-mixed"), h200)


def _calibration():
    spec = importlib.util.spec_from_file_location("gpu_step_time", ROOT / "benchmarks" / "gpu_step_time.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_planned_step_time_within_25_percent_on_the_held_out_h200_run():
    """The host constants were fitted on demo_cnn and mlp_lowp (benchmarks/gpu_step_time.py --fit); bench_tf, the
    transformer the H200 session benchmarked (fp32 GEMM-bound, tf32/bf16/fp16 host-bound, fp8-mixed on torchao's
    eager layers), is planned from the config it stored, and every recipe lands within 25% of its measured median
    step."""
    cal = _calibration()
    traced = cal.trace_runs(cal.RUNS_DIR, ["bench_tf"])
    assert [t.recipe for t in traced] == ["fp32", "tf32", "bf16-mixed", "fp16-mixed", "fp8-mixed"]
    for t in traced:
        assert cal.planned(t) / t.measured == pytest.approx(1.0, abs=0.25), t.recipe
