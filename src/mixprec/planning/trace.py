"""One training step of one recipe, traced under ``FakeTensorMode`` through the real build path.

What runs is what ``mixprec train`` runs, on fake CPU tensors: ``build_recipe``, ``convert_module``,
``build_optimizer``, the model contract, the scaler, masters and the optimizer step, in the steady state (the
optimizer's state made first by a step on zero gradients, untraced). A GPU target is traced as its device would
run the recipe: CUDA's autocast lists (through the scratch autocast, on CPU tensors), no emulation, real FP8 GEMMs
where it has them; the built-in models' attention is told the target.

The step is the unguarded ``Recipe.backward`` and ``Recipe.step`` (train's step guard adds a few 0-dim device
ops), its value checks modelled as the healthy branch (fake tensors have no values):

1. ``Recipe.backward``: the finite-loss check -- finite;
2. ``Recipe.step``: the skip decision of loss-scaled recipes -- no skip (``unscale_``'s check is traced);
3. ``Recipe.step`` with ``--clip-grad-norm``: the finite-norm check -- finite;
4. the FP8 scale on CPU tensors reads ``amax``; fake tensors take its device path.

The host reads a guarded step still makes (:meth:`mixprec.precision.Recipe.step_reads`: a native GradScaler's or a
non-fused optimizer's skip decision) are where :attr:`StepTrace.syncs` has the host wait for a GPU.

Memory categories are :mod:`mixprec.memory`'s, plus buffers and **temporary** (everything else alive at the peak;
on the cpu target also kernel workspace, :mod:`.workspace`). Initialisation that reads values is a
:class:`TraceError` unless ``--fallback-real``; nothing runs for real under :func:`planning_fake_mode`.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode, UnsupportedOperatorException
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import UsageError, one_line
from ..hardware import Capabilities, capabilities
from ..memory import CATEGORIES, SavedTensorTracker, static_memory
from ..precision import Recipe, build_recipe, resolve_recipe
from ..recipes import dtype_name
from .recorder import OpRecord, StepRecorder
from .workspace import cpu_workspace
from .targets import Target

__all__ = ["TraceError", "StepTrace", "FakeModelSource", "trace_step", "recipe_for_target", "planning_fake_mode",
           "AT_PEAK_CATEGORIES", "NO_FAKE_KERNEL"]

AT_PEAK_CATEGORIES = (*CATEGORIES, "buffers", "temporary")
"""Every category of the memory alive at the peak; they add up to the peak."""


class TraceError(UsageError):
    """The model cannot be traced under fake tensors; the message names the op and the way out."""


@dataclasses.dataclass
class StepTrace:
    """What one traced step of one recipe holds and does (bytes, ops), before any target's roofline."""

    recipe: str
    label: str
    batch_size: int
    totals: dict[str, int]
    """Exact bytes per category over the step (``CATEGORIES`` and ``buffers``)."""
    at_peak: dict[str, int]
    """Bytes alive at the step's peak per :data:`AT_PEAK_CATEGORIES`; they add up to ``peak_bytes``."""
    peak_bytes: int
    phase_peak: dict[str, int]
    batch_bytes: dict[str, int]
    """Bytes alive at each phase's peak that grow with the batch."""
    ops: list[OpRecord]
    notes: list[str]
    path: str
    """``fake`` (the model built under fake tensors) or ``real-then-fake``."""
    syncs: tuple[int, ...] = ()
    """Where a guarded step reads a value on the host: before ``ops[i]`` for each ``i``."""
    lowp_layers: int = 0
    """Linear layers the recipe converted to low precision."""
    module_calls: tuple[int, ...] = ()
    """GPU targets: for each ``nn.Module`` call of the step, the number of ops before it."""
    saved_outputs: int = 0
    """Forward ``detach`` ops an unhooked run dispatches that the trace does not record (one per saved output)."""


# ------------------------------------------------------------------------------------------ fake mode

NO_FAKE_KERNEL = frozenset({"_fused_sgd_", "_fused_adagrad_"})
"""Aten ops without a fake kernel that update their inputs in place and return nothing (fused optimizer steps)."""


def planning_fake_mode() -> FakeTensorMode:
    """The planner's fake mode: no fallback kernels (nothing runs for real), and ``copy.deepcopy`` keeps the mode
    (a copy would be a second, foreign one)."""
    mode = FakeTensorMode(allow_fallback_kernels=False)
    mode.__deepcopy__ = lambda memo: mode  # copy.deepcopy looks __deepcopy__ up on the instance
    return mode


class _FakeKernels(TorchDispatchMode):
    """Above the fake mode: the ops of :data:`NO_FAKE_KERNEL` return nothing; every other op goes on down."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in NO_FAKE_KERNEL:
            return None
        return func(*args, **(kwargs or {}))


# ------------------------------------------------------------------------------------------- the model

@contextlib.contextmanager
def _swappable(fake_mode: FakeTensorMode | None) -> Iterator[None]:
    """Let ``Module._apply`` swap fake parameters: ``swap_tensors`` refuses tensors with weak references, which
    the converter's memo holds, so it is a plain dict for the duration, then restored empty."""
    if fake_mode is None:
        yield
        return
    conv = fake_mode.fake_tensor_converter.meta_converter
    old = conv.tensor_memo
    old.clear()
    conv.tensor_memo = _PlainMemo()
    try:
        yield
    finally:
        conv.tensor_memo.clear()
        conv.tensor_memo = old


class _PlainMemo(dict):
    """The converter's memo while modules are converted: plain references, and never deep-copied (copying a
    fake module copies its tensors' fake mode, whose memo would change size while being copied)."""

    def __deepcopy__(self, memo):
        return self


def _to_fake(model: nn.Module, fake_mode: FakeTensorMode) -> nn.Module:
    """A copy of real ``model`` whose parameters and buffers are fake (tied parameters stay tied)."""
    memo: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor, param: bool) -> torch.Tensor:
        if id(t) not in memo:
            f = fake_mode.from_tensor(t.detach())
            memo[id(t)] = nn.Parameter(f, requires_grad=t.requires_grad) if param else f
        return memo[id(t)]

    return _clone_structure(model, fake)


def _clone_structure(model: nn.Module, convert: Callable[[torch.Tensor, bool], torch.Tensor]) -> nn.Module:
    """A deep copy of ``model``'s modules with every parameter and buffer replaced by ``convert(t, is_param)``."""
    replaced = {}
    for m in model.modules():
        for name, p in m._parameters.items():
            if p is not None:
                replaced[id(p)] = (p, True)
        for name, b in m._buffers.items():
            if b is not None:
                replaced[id(b)] = (b, False)
    memo = {k: convert(t, is_param) for k, (t, is_param) in replaced.items()}
    return copy.deepcopy(model, memo)


class FakeModelSource:
    """Makes a fresh fake model per recipe, from ``build`` run under the fake mode (``fallback_real``: built for
    real once, copied fake) or from an existing ``real`` model (copied fake, never changed). Without a fake mode
    every call builds a fresh real model."""

    def __init__(self, build: Callable[[], nn.Module], fake_mode: FakeTensorMode | None, *,
                 fallback_real: bool = False, real: nn.Module | None = None) -> None:
        self._build = build
        self._fake_mode = fake_mode
        self._fallback_real = fallback_real
        self._real = real
        self.path = "fake" if fake_mode is not None else "real"
        self.fake_error: str | None = None

    def make(self) -> nn.Module:
        if self._fake_mode is None:  # --fallback-real's real step: a fresh real model per recipe
            return self._build()
        if self._real is None and self.path == "fake":
            try:
                with self._fake_mode, _swappable(self._fake_mode), warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
                    model = self._build()  # (a model may call .to() or deepcopy layers as it is built)
                foreign = [t for t in model.parameters() if getattr(t, "fake_mode", None) is not self._fake_mode]
                if not foreign:
                    return model
                error = f"{len(foreign)} of its parameters were made outside the planner's fake mode"
            except Exception as e:  # noqa: BLE001 -- an init that needs values, or an op with no fake kernel
                if not _needs_real_tensors(e):
                    raise
                error = one_line(e)
            if not self._fallback_real:
                raise TraceError(f"the model cannot be built under fake tensors: {error}; plan with --fallback-real "
                                 "to build it for real on this CPU (every parameter is allocated) and trace a "
                                 "fake copy")
            self.fake_error, self.path = error, "real-then-fake"
        if self._real is None:
            self._real = self._build()
        return _to_fake(self._real, self._fake_mode)


def _needs_real_tensors(e: BaseException) -> bool:
    """Whether ``e`` (or an exception it came from) is fake tensors' limit: a value read on the host, an output
    shape that depends on values, or an op with no fake kernel."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    while e is not None:
        if isinstance(e, (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException)):
            return True
        text = str(e)
        if "data-dependent" in text or "_local_scalar_dense" in text or "Cannot copy out of meta" in text:
            return True
        e = e.__cause__ or e.__context__
    return False


# ---------------------------------------------------------------------------------------- the recipe

def recipe_for_target(recipe_config, target: Target) -> tuple[Recipe, Callable[[nn.Module], Any], str | None]:
    """``(recipe, autocast_for(model), fp8_path)``: the recipe built for this CPU, the autocast the target would
    apply and its FP8 GEMM path (None for the ``cpu`` target: the device decides)."""
    import dataclasses as dc

    if target.kind == "cpu":
        recipe = build_recipe(recipe_config, device="cpu")
        return recipe, lambda model: _recipe_autocast(recipe), None
    impl = recipe_config.amp_impl
    if impl == "auto":
        impl = "native"  # every GPU target has fast fp16, so auto is native there (precision.build_recipe)
    changes = {"amp_impl": impl}
    lowp = resolve_recipe(recipe_config.precision).fp8 is not None or file_recipes(recipe_config)
    if recipe_config.fp8_impl == "auto" and lowp:
        changes["fp8_impl"] = "scratch"  # what the target would run, traced through mixprec's own layers
    recipe = build_recipe(dc.replace(recipe_config, **changes), device="cpu", capabilities=_target_capabilities(target))

    def autocast_for(model: nn.Module):
        if not recipe.spec.autocast:
            return contextlib.nullcontext()
        from ..autocast import autocast
        from ..autocast.policy import default_policy

        policy = dc.replace(default_policy("cuda", recipe.spec.compute_dtype), device_type="cpu")
        return autocast(recipe.spec.compute_dtype, policy=policy, emulate=False, keep_fp32=recipe.keep_fp32,
                        model=model)

    return recipe, autocast_for, ("real" if target.fp8_matmul else "emulated")


def file_recipes(recipe_config) -> list:
    """The low-precision linear recipes a ``--layer-formats`` file puts layers in (as Recipe.compiles counts)."""
    if not recipe_config.layer_formats:
        return []
    from ..lowp.layer_formats import LOWP_FORMATS, load
    from ..lowp.recipes import linear_recipe

    return [linear_recipe(resolve_recipe(f).fp8) for f in sorted(load(recipe_config.layer_formats).formats())
            if f in LOWP_FORMATS]


def _target_capabilities(target: Target) -> Capabilities:
    """What the recipe may assume of a GPU target while it is built on this CPU: the target's FP8 units (so the
    layers where FP8 would not pay there stay out, as on the GPU itself); the CPU's answers for the rest."""
    return dataclasses.replace(capabilities("cpu"), fp8_matmul=target.fp8_matmul, rowwise_fp8=target.rowwise_fp8)


def _recipe_autocast(recipe: Recipe):
    ac = recipe.autocast
    return ac() if callable(ac) and hasattr(ac, "__self__") else ac  # a method today, a property elsewhere


# ------------------------------------------------------------------------------------------ the step

def _fake_batch(batch, fake_mode: FakeTensorMode | None):
    from ..train.contract import Batch

    if fake_mode is None:
        return batch

    def f(t):
        return fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t

    return Batch(tuple(f(a) for a in batch.args), {k: f(v) for k, v in batch.kwargs.items()}, f(batch.targets))


def _warm_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state with one step on zero gradients (the steady-state step has it)."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def trace_step(
    *, recipe_config, target: Target, models: FakeModelSource, fake_mode: FakeTensorMode | None, batch,
    make_optimizer: Callable, loss_fn: Callable | None, default_loss: Callable, clip_grad_norm: float | None,
) -> StepTrace:
    """Trace one steady-state training step of one recipe; without a ``fake_mode`` it runs for real on the CPU."""
    from ..lowp.fp8 import planned_gemm_path
    from ..train.attention import planned_device

    recipe, autocast_for, fp8_path = recipe_for_target(recipe_config, target)
    model = models.make()
    kernels = _FakeKernels() if fake_mode is not None else contextlib.nullcontext()
    device = None if target.kind == "cpu" else target.kind
    with fake_mode or contextlib.nullcontext(), kernels, recipe.run_context(), planned_gemm_path(fp8_path), \
            planned_device(device):
        with _swappable(fake_mode):
            model = recipe.convert_module(model)
            optimizer = recipe.build_optimizer(model, make_optimizer)
        _warm_optimizer(optimizer)
        fbatch = _fake_batch(batch, fake_mode)
        optimizer_state = static_memory(model, optimizer, recipe.master).optimizer_state
        rec = _recorder_with_residents(model, optimizer, recipe, fbatch, target)
        params = list(model.parameters())
        tracker = _Tracker(rec, exclude=params)
        saved: list[tuple[Any, str]] = []
        tracker.on_save = lambda t, c: saved.append((rec.alloc_of(t), c))
        try:
            with rec, _replayed_scales(rec, fake_mode is not None), _module_calls(rec, target):
                syncs = _step(model, recipe, optimizer, fbatch, rec, tracker, autocast_for(model),
                              loss_fn=loss_fn, default_loss=default_loss, clip_grad_norm=clip_grad_norm)
        except UsageError:  # a TraceError, or the model contract's (targets that fit no task...)
            raise
        except Exception as e:  # noqa: BLE001 -- the model does something fake tensors cannot
            raise _trace_error(e, recipe.name) from None
        final = static_memory(model, optimizer, recipe.master).add_saved(tracker)
        grads = [p.grad for p in params if p.grad is not None]
        if recipe.master is not None:
            grads += [m.grad for m in recipe.master.master_params if m.grad is not None]
        for a, category in saved + [(rec.alloc_of(g), "gradients") for g in grads]:
            if a is not None and a.category is None:
                a.category = category
    totals = {c: getattr(final, c) for c in CATEGORIES}
    totals["optimizer_state"] = optimizer_state  # the steady state's (the warm-up made it)
    totals["buffers"] = sum(b.numel() * b.element_size() for b in model.buffers())
    notes = [] if models.path != "real-then-fake" else [
        f"the model could not be built under fake tensors ({models.fake_error}), so it was built for real once "
        "(--fallback-real) and traced as a fake copy"]
    notes += _kept_out(recipe)
    conversion = recipe.fp8_conversion
    return StepTrace(recipe=recipe.name, label=recipe.label, batch_size=len(batch), totals=totals,
                     at_peak=_at_peak(rec), peak_bytes=rec.peak, phase_peak=dict(rec.phase_peak),
                     batch_bytes=_batch_bytes(rec), ops=rec.ops, notes=notes, path=models.path, syncs=syncs,
                     lowp_layers=len(conversion.converted) if conversion is not None else 0,
                     module_calls=tuple(rec.module_calls), saved_outputs=rec.saved_outputs)


@contextlib.contextmanager
def _module_calls(rec: StepRecorder, target: Target) -> Iterator[None]:
    """On GPU targets, tell ``rec`` of every module call (a forward pre-hook on all modules, removed on exit)."""
    if target.kind == "cpu":
        yield
        return
    handle = nn.modules.module.register_module_forward_pre_hook(lambda module, args: rec.note_module_call())
    try:
        yield
    finally:
        handle.remove()


class _Tracker(SavedTensorTracker):
    """The saved-tensor tracker, telling the recorder of each unpack (:meth:`.recorder.StepRecorder.note_unpack`)."""

    def __init__(self, rec: StepRecorder, **kwargs) -> None:
        super().__init__(**kwargs)
        self._rec = rec

    def _unpack(self, t: torch.Tensor) -> torch.Tensor:
        self._rec.note_unpack(t)
        return t


def _kept_out(recipe: Recipe) -> list[str]:
    """One note naming the linear layers the FP8/FP4 recipe keeps out where FP8 would not pay on the target."""
    conv = recipe.fp8_conversion
    small = [name for name, why in (conv.skipped if conv else ()) if "to pay" in why]
    if not small:
        return []
    shown = ", ".join(small[:6]) + (f" and {len(small) - 6} more" if len(small) > 6 else "")
    return [f"{len(small)} linear layer(s) stay in {dtype_name(recipe.spec.compute_dtype)} where {recipe.name} would "
            f"not pay on this target (torchao's size rule; --fp8-layers all converts them): {shown}"]


@contextlib.contextmanager
def _replayed_scales(rec: StepRecorder, fake: bool) -> Iterator[None]:
    """Trace each kind of FP8 scale computation once, then replay its op records.

    ``fp8._device_scale`` (about twenty 0-dim ops) depends only on the dtypes, so later calls of a kind append the
    first call's op records (in the current phase) and get a fresh fake 0-dim fp32 output; only the 0-dim
    temporaries between those ops are left out."""
    if not fake:
        yield
        return
    from ..lowp import quant as fp8

    real = fp8._device_scale
    kinds: dict[tuple, list[OpRecord]] = {}

    def scale(amax: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
        key = (amax.dtype, tuple(amax.shape), fp8_dtype)
        ops = kinds.get(key)
        if ops is None or amax.dim() != 0:
            start = len(rec.ops)
            out = real(amax, fp8_dtype)
            kinds[key] = rec.ops[start:]
            return out
        out = torch.empty((), dtype=torch.float32, device=amax.device)  # recorded as one op, replaced below
        del rec.ops[-1]
        rec.ops.extend(dataclasses.replace(op, phase=rec.phase) for op in ops)
        rec.seq += len(ops) - 1
        return out

    fp8._device_scale = scale
    try:
        yield
    finally:
        fp8._device_scale = real


def _recorder_with_residents(model, optimizer, recipe, fbatch, target: Target) -> StepRecorder:
    cpu = target.kind == "cpu"
    rec = StepRecorder(workspace=cpu_workspace if cpu else None,  # see .workspace
                       time_kernels=cpu,  # see .kernels
                       mark_lowp=not cpu)  # see .roofline: priced apart on GPU targets
    rec.register(model.parameters(), "parameters")
    rec.register(model.buffers(), "buffers")
    rec.register((v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)),
                 "optimizer_state")
    if recipe.master is not None:
        rec.register(recipe.master.master_params, "master_weights")
    rec.register(fbatch.inputs() + ([fbatch.targets] if fbatch.targets is not None else []), None)
    return rec


def _step(model, recipe, optimizer, fbatch, rec: StepRecorder, tracker, autocast_ctx, *, loss_fn, default_loss,
          clip_grad_norm) -> tuple[int, ...]:
    """What ``Recipe.backward`` and ``Recipe.step`` do, with their value checks modelled; returns where a guarded
    step reads on the host (before the optimizer's step, where :meth:`Recipe.step_reads` says it reads)."""
    from ..train.contract import ModelCall, compute_loss

    reads = recipe.step_reads(optimizer) is not None
    optimizer.zero_grad(set_to_none=True)
    rec.phase = "forward"
    with tracker, autocast_ctx:
        out = ModelCall(model)(model, fbatch)
        loss = compute_loss(out, fbatch, loss_fn=loss_fn, default=default_loss)
    del out
    rec.phase = "backward"
    recipe.scaler.scale(loss).backward()  # check 1: the loss is finite
    loss.detach()  # the step's loss, kept for the epoch's mean (train.step.accumulate_step)
    del loss
    rec.phase = "optimizer"
    if recipe.master is not None:
        recipe.master.copy_grads_to_master()
    recipe.scaler.unscale_(optimizer)
    if clip_grad_norm is not None:  # check 3: the norm is finite
        torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"] if p.grad is not None],
                                       clip_grad_norm, error_if_nonfinite=False)
    syncs = (len(rec.ops),) if reads else ()
    optimizer.step()  # check 2: the gradients are finite, the step is taken
    recipe.scaler.update()
    if recipe.master is not None:
        recipe.master.write_back()
    return syncs


def _at_peak(rec: StepRecorder) -> dict[str, int]:
    out = dict.fromkeys(AT_PEAK_CATEGORIES, 0)
    for a in rec.live_at(rec.peak_seq):
        out[a.category or "temporary"] += a.nbytes
    out["temporary"] += rec.peak_workspace  # a kernel's own workspace (cpu target, .workspace)
    return out


def _batch_bytes(rec: StepRecorder) -> dict[str, int]:
    """Per phase, the bytes alive at its peak that grow with the batch: activations, and temporaries and kernel
    workspace outside the optimizer step (whose temporaries are parameter-sized)."""
    out = {}
    for phase, seq in rec.phase_peak_seq.items():
        workspace = rec.phase_peak_workspace.get(phase, 0) if phase != "optimizer" else 0
        out[phase] = workspace + sum(a.nbytes for a in rec.live_at(seq) if (a.category or "temporary") == "activations"
                                     or (a.category is None and phase != "optimizer"))
    return out


def _trace_error(e: BaseException, recipe: str) -> TraceError:
    op = getattr(e, "func", None)
    where = f" at {op}" if op is not None else ""
    return TraceError(f"the model cannot be traced under fake tensors with {recipe}{where}: {one_line(e)}; "
                      "plan with --fallback-real to measure a few real steps on a small batch instead")
