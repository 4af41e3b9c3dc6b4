"""The watch: the probes (:mod:`mixprec.probes`) inside the user's own training loop, through hooks only.

It hooks the model's forward (a pre and a post hook on the root module: a training forward opens a step or adds
a micro-batch; the flight recorder, :mod:`.recorder`, keeps what a replay needs), the optimizer's step (pre: the
gradients are final and not applied; post: the update was applied), and reads the scaler through
:class:`~mixprec.probes.loss_scale.ScalerReader` (never calls it). Framework callbacks (:mod:`mixprec.integrations`)
drive the same events where a hook cannot see them.

A step is one iteration of the loop. It ends when the optimizer applied it; when the scaler finished the
iteration without ``optimizer.step()`` (a skip, seen at the next forward or at close); or when the loop ended it
without a step of its own (*dropped*, as a loop does that skips a non-finite loss or gradient): the gradients
were reset after its backward (``zero_grad``: seen at the next forward, from a mark the end of each backward
leaves on one gradient, or at a step with no gradients left), no backward reached its forward (seen at the next
step; a micro-batch of gradient accumulation has one), or the loop stopped (at close). A dropped iteration is
counted; what is left of it (its losses, seeds and gradients) is checked in one read, else it is replayed
(:func:`~.recorder.localize`): its fault is named as any other.

Host reads: every step's numbers stay on the device until the next sampled step reads them in one go. An
unsampled step reads at most one small tensor of the watch's own: without a loss scaler, the finite flag of
the gradients and losses in the step pre-hook (:meth:`Watch._check_finite`), before the update can mutate
anything (``check="deferred"``: none, the flag waits for the next sample); with one, nothing (the scaler's own
``found_inf`` decides), except a fused optimizer's ``found_inf`` and the new scale after a skip. A dropped
iteration costs a read or a replay. Sampled steps (every ``every``) read the probes and write the reports;
triggers replay the step. :attr:`Watch.host_reads` counts the reads.

Numerics are never changed: hooks only read, replays run on deep copies (inert copies of the hooks) with the
step's RNG state inside ``fork_rng`` and the autocast cache off, and the shadow optimizer step steps copies.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import NonFiniteError
from ..memory import local_tensor
from ..probes.loss_scale import ScalerReader, iteration_changed
from ..probes.ranges import InertHook
from ..probes.replay import FaultAnalysis, ModelInputs, rng_state, step_device
from .config import WatchConfig
from .output import Output
from .recorder import AutocastState, MicroBatch, localize, save_capture
from .sample import Sampler

__all__ = ["Watch"]

_FLUSH_AT = 512
"""Pending per-step device values read in one go at the latest after this many steps."""
ADVICE_LOOPS = {"user loop": "torch", "mixprec train": "mixprec", "transformers Trainer": "transformers",
                "lightning Trainer": "lightning"}
"""A watch's ``source`` (who drives it), and the loop whose terms its advice is in."""
DEFERRED = ("non-finite loss or gradients, read after the update (check='deferred'): not replayed; "
            "check='exact' catches it before the update")


@dataclasses.dataclass
class _Step:
    """The step being watched."""

    index: int
    sampled: bool
    iteration: Any
    """The scaler's iteration token at the step's first forward (compared by ``iteration_changed``)."""
    scale: torch.Tensor | float
    """The loss scale this step's backward uses (a device copy)."""
    batches: list[MicroBatch] = dataclasses.field(default_factory=list)
    logged: list[torch.Tensor] = dataclasses.field(default_factory=list)
    """Losses logged before the step's first forward (later ones belong to their micro-batch)."""
    grad_norm: Any = None
    checked: bool = False
    applied: bool = False
    closure: bool = False
    dropped: bool = False
    """The loop ended the iteration without a step of its own (see the module docstring)."""
    nonfinite: bool | torch.Tensor | None = None
    """Known after the check; a device flag until the next read with ``check="deferred"``; None: unknown."""
    cause: str | None = None
    grad_l2: float | None = None
    norms: dict[int, torch.Tensor] | None = None
    """A sampled step's per-gradient squared L2 norms from the finite check (by ``id(param)``), for the
    sampler's per-layer norms."""

    @property
    def model_losses(self) -> list[torch.Tensor]:
        return [mb.loss for mb in self.batches if mb.loss is not None]

    @property
    def logged_losses(self) -> list[torch.Tensor]:
        return self.logged + [t for mb in self.batches for t in mb.logged]


@dataclasses.dataclass
class StepValues:
    """One closed step; tensors until the next flush reads them."""

    step: int
    scale: Any
    loss: Any
    grad_l2: Any
    grad_norm: Any
    skipped: bool
    nonfinite: bool | None
    sampled: bool
    cause: str | None = None
    next_scale: Any = None


class Watch:
    """Created by :func:`mixprec.watch`; use as a context manager or call :meth:`close`."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, scaler: Any, config: WatchConfig,
                 driver: str = "hooks", source: str = "user loop") -> None:
        self.model, self.optimizer, self.scaler, self.config = model, optimizer, scaler, config
        self.source = source
        self.advice_loop = ADVICE_LOOPS.get(source, "torch")
        """Whose terms the report's advice is in (:data:`mixprec.probes.advice.LOOPS`)."""
        self._auto = driver == "hooks"
        self.device = step_device(model)
        """Where the step computes (its autocast, its CUDA RNG state) and where the watch's own tensors live: the
        model's first accelerator; values from other devices (a CPU loss, a model split over devices) move here."""
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.step = 0
        self.host_reads: Counter[str] = Counter()
        self.unsampled_reads = 0
        self.last: StepValues | None = None
        """The last closed step (its record waits for the next step's scale, see :meth:`flush`)."""
        self._pending: list[StepValues] = []
        self.faults: list[FaultAnalysis] = []
        self.triggers: list[dict[str, Any]] = []
        self.captures: list[dict[str, Any]] = []
        self.skipped = self.nonfinite_steps = self.consecutive_skips = self.dropped = 0
        """Steps without an applied update (the scaler's skips and the loop's), non-finite ones, the current run
        of skips, and the iterations the loop ended without a step of its own."""
        self._fired: set[str] = set()
        self._first_nonfinite: int | None = None
        self._open: _Step | None = None
        self._compute_dtype: torch.dtype | None = None
        self._mb: MicroBatch | None = None
        self._closing = self.closed = False
        self.reader = ScalerReader(scaler, optimizer)
        stepped = [p for g in optimizer.param_groups for p in g["params"]]
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._grad_mark: tuple[torch.Tensor, Any, int] | None = None
        """One gradient as the last backward left it: (parameter, weak reference to its grad, grad version)."""
        self._dtensor = any(hasattr(p, "to_local") for p in stepped)
        """Sharded (DTensor) parameters: local gradients, and the flag is reduced over the ranks."""
        self._devices_differ = any(p.device != self.device for p in stepped)
        self._norm_dtype = torch.float32 if any(p.dtype == torch.float16 for p in stepped) else None
        """fp16 gradients' norms are taken in fp32 (an fp16 norm overflows at 65504)."""
        self.sampler = Sampler(model, optimizer, tuple(config.formats), config.lost_updates, config.sample_elements,
                               device=self.device)
        self.output = Output(self)
        self._handles = [
            model.register_forward_pre_hook(InertHook(self._on_forward), with_kwargs=True),
            model.register_forward_hook(InertHook(self._on_forward_end), with_kwargs=True),
            optimizer.register_step_pre_hook(self._on_pre_step),
            optimizer.register_step_post_hook(self._on_post_step),
        ]

    # -- context ------------------------------------------------------------------------------------
    def __enter__(self) -> Watch:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self.close(_interrupted=exc_type is not None and not issubclass(exc_type, Exception))

    def close(self, *, _interrupted: bool = False) -> None:
        """End the watch: account for the last step, write the final reports, remove every hook.

        An iteration the loop left without a step (it stopped, or raised at a fault) is checked as a dropped
        one; not after an interrupt (KeyboardInterrupt, SystemExit), and not a forward that raised.
        """
        if self.closed:
            return
        self._closing = True
        try:
            st = self._open
            if st is not None and (self._scaler_finished(st) or st.applied):
                self.close_step()
            elif st is not None and st.batches and not _interrupted:
                if self._mb is not None:  # a forward that raised: it has no output to replay against
                    st.batches.remove(self._mb)
                if st.batches:
                    self._close_dropped()
            self._open = None
            self.flush(final=True)
            self.output.write(final=True, collective=True)
        finally:
            for h in self._handles:
                h.remove()
            self.sampler.remove()
            self.output.close()
            self.closed = True

    def log(self, *, loss: Any = None, grad_norm: Any = None) -> None:
        """Attach the loop's loss and (unscaled) global gradient norm to the current step (or the last one).

        Tensors are kept as they are (no sync); a loss given before the optimizer step joins the finite check,
        and a ``grad_norm`` tensor given before it replaces the check's own pass over the gradients on unsampled
        steps (so it must be the norm of all the optimizer's gradients, as ``clip_grad_norm_`` returns it).
        """
        st = self._open
        if st is not None:
            if loss is not None:
                (st.batches[-1].logged if st.batches else st.logged).append(_scalar(loss, self.device))
            if grad_norm is not None:
                st.grad_norm = grad_norm.detach() if isinstance(grad_norm, torch.Tensor) else grad_norm
            return
        rec = self.last
        if rec is not None:  # still pending: it waits for the next step's scale
            rec.loss = rec.loss if loss is None else _scalar(loss, self.device)
            rec.grad_norm = rec.grad_norm if grad_norm is None else grad_norm

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The low dtype the forward runs in: the autocast around the model, else what its layers returned."""
        return self._compute_dtype or self.sampler.low_dtype

    # -- reads --------------------------------------------------------------------------------------
    def _read(self, t: torch.Tensor, why: str) -> Any:
        """Every host read of the watch's own goes through here, counted by ``why``: ``check`` (the finite flag),
        ``skipped-step`` (the new scale), ``dropped`` (what is left of a dropped iteration), ``sample``,
        ``flush`` (the pending per-step values), ``trigger``."""
        self.host_reads[why] += 1
        if why in ("check", "skipped-step") and (self._open is None or not self._open.sampled):
            self.unsampled_reads += 1
        return t.tolist()

    # -- events -------------------------------------------------------------------------------------
    def _on_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not (torch.is_grad_enabled() and module.training):
            return
        st = self._open
        if st is not None and not st.applied:
            if self._auto and self._scaler_finished(st):
                self.close_step()
            elif any(mb.backward for mb in st.batches) and self._grads_reset():
                self._close_dropped()  # its gradients were reset after its backward, and no step came
        st = self._open or self.open_step()
        self._mb = MicroBatch(ModelInputs(tuple(args), dict(kwargs)), rng_state(self.device),
                              AutocastState.now(self.device.type))
        st.batches.append(self._mb)
        if self._compute_dtype is None:
            self._compute_dtype = self._mb.autocast.low

    def _on_forward_end(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        mb, self._mb = self._mb, None
        if mb is None or self._open is None:
            return
        loss = mb.attach_seed(output, self._on_backward)
        if loss is not None:
            mb.loss = loss.detach().to(self.device)

    def _on_backward(self) -> None:
        """Inside a backward that reached the model's output: mark the gradients once it has ended. The mark is
        queued from a callback queued now, so it runs after every callback the backward queues (DDP's copy of
        the averaged gradients, FSDP's reduce-scatter)."""
        engine = torch.autograd.Variable._execution_engine
        engine.queue_callback(lambda: engine.queue_callback(self._mark_grads))

    def _mark_grads(self) -> None:
        p = next((p for p in self._params if p.grad is not None), None)
        self._grad_mark = None if p is None else (p, weakref.ref(p.grad), p.grad._version)

    def _grads_reset(self) -> bool:
        """The marked gradient was set to None, replaced or changed in place (zeroed) since the last backward."""
        if self._grad_mark is None:
            return False
        p, ref, version = self._grad_mark
        g = p.grad
        return g is None or g is not ref() or g._version != version

    def _on_pre_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        st = self._open or self.open_step()
        if kwargs.get("closure") is not None or (args and callable(args[0])):
            st.closure = True  # the closure computes the gradients inside step(): see before_step()
            return
        self.before_step(in_step=True)
        if st.sampled and not self.sampler.pre_done and not st.nonfinite:
            if self.reader.unscaled:
                self.sampler.pre_update(optimizer)  # a fused optimizer's gradients are still scaled: not measured

    def _on_post_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        st = self._open or self.open_step()
        if st.closure and not st.checked:
            self.before_step(in_step=True)  # too late to stop it: the closure ran inside step()
        st.applied = True
        if st.nonfinite is True and not st.dropped and not self.reader.enabled and not self._with_grads():
            st.dropped = True  # the loop reset the non-finite gradients after the check: step() applied nothing
        if st.sampled:
            self.sampler.post_update(optimizer)
        if self._auto:
            self.close_step()

    # -- the step -----------------------------------------------------------------------------------
    def open_step(self) -> _Step:
        r = self.reader
        sampled = self.step % self.config.every == 0
        t = r.scale_or_init()
        scale = t.detach().clone() if isinstance(t, torch.Tensor) else t
        st = self._open = _Step(self.step, sampled, r.iteration(), scale)
        if sampled:
            value = self._read(scale, "sample") if isinstance(scale, torch.Tensor) else scale
            self.sampler.arm(round(math.log2(value)) if value > 0 else 0)
        return st

    def before_step(self, *, in_step: bool = False) -> None:
        """The step's gradients are final and not applied yet: check them (the one read of a bf16/fp32 loop).

        ``in_step``: called from inside ``optimizer.step()`` (its pre-hook), where a loss scaler has already
        decided the step is finite; a framework callback calls it before the scaler's step.
        """
        st = self._open or self.open_step()
        if st.checked:
            return
        st.checked = True
        self._split_dropped(st)
        if self._updates_nothing(st):  # the loop ended the iteration and still called step(): nothing to apply
            st.dropped = True
            self._check_dropped(st)
            return
        r = self.reader
        if r.enabled:
            if in_step and r.fused:
                found = getattr(self.optimizer, "found_inf", None)
                found = found if found is not None else r.found_inf()
                st.nonfinite = found is not None and self._read(found, "check") > 0
            elif in_step:
                st.nonfinite = False
        else:
            self._check_finite(st)
        if st.sampled:
            self.sampler.before_step(0 if r.unscaled else self._log2(st.scale), st.norms)
            if not r.enabled and not st.nonfinite and not self.sampler.pre_done:
                self.sampler.pre_update(self.optimizer)

    def _check_finite(self, st: _Step) -> None:
        """The finite flag of a loop without a loss scaler: one pass over the gradients, one read.

        Unsampled steps: one value per gradient (:func:`_reductions`: an inf or NaN anywhere makes it non-finite),
        stacked with the losses; finite values whose reduction overflows are re-checked exactly (a second read,
        rare); ``check="deferred"`` keeps the flag on the device for the next read instead. A gradient norm
        the loop logged before the step (``w.log(grad_norm=...)``) replaces the pass (not for sharded parameters,
        whose own pass keeps the ranks agreeing). Sampled steps: each gradient's squared 2-norm
        (:func:`_squared_norms`), which also gives the per-layer norms and ``grad_l2``; a NaN square is a fault.
        """
        losses = st.model_losses + st.logged_losses
        norm = st.grad_norm if not (st.sampled or self._dtensor) and isinstance(st.grad_norm, torch.Tensor) else None
        params = self._with_grads() if norm is None else []
        grads = [p.grad for p in params]
        if self._dtensor:
            grads = [local_tensor(g) for g in grads]
        if not grads and not losses and norm is None:
            return
        sharded = self._dtensor and self.world_size > 1
        reduced: list[torch.Tensor] = []
        if norm is not None:
            reduced = [norm.detach().float().reshape(()).to(self.device)]
        elif st.sampled:
            reduced = _squared_norms(grads, self._norm_dtype)
            if not self._dtensor:
                st.norms = dict(zip(map(id, params), reduced))
        else:
            reduced = _reductions(grads)
        if self._devices_differ:
            reduced = [n.to(self.device) for n in reduced]
        vals = [n.reshape(()) for n in reduced] + [t.float().reshape(()) for t in losses]
        both = torch.stack(vals) if len(vals) > 1 or sharded else vals[0]  # a copy where it is reduced
        if sharded:  # every rank must agree: each gradient's reduction summed over the shards, and the losses
            dist.all_reduce(both)
        if self.config.check == "deferred" and not st.sampled:
            st.nonfinite = torch.isfinite(both).all().logical_not()  # read with the step's other values
            return
        read = self._read(both, "check")
        values = read if isinstance(read, list) else [read]
        head, rest = values[:len(reduced)], values[len(reduced):]
        finite = all(math.isfinite(v) for v in values)
        if reduced:
            head_finite, nan = all(map(math.isfinite, head)), any(map(math.isnan, head))
            if st.sampled:  # the squares (a logged norm stands in on unsampled steps only)
                st.grad_l2 = math.sqrt(math.fsum(head)) if head_finite else math.nan if nan else math.inf
            # finite values can overflow a sum, a norm or a square; only squares (>= 0) of finite values are never NaN
            if not head_finite and not (st.sampled and nan) and all(math.isfinite(v) for v in rest):
                finite = self._grads_finite(grads if norm is None else [p.grad for p in self._with_grads()], sharded)
        st.nonfinite = not finite
        if st.nonfinite:
            self._on_nonfinite(st, scaled=False)

    # -- iterations the loop ended without a step ----------------------------------------------------
    def _split_dropped(self, st: _Step) -> None:
        """Forwards of this step that no backward reached, before the first one that had its backward: each was
        an iteration the loop ended without a step (a non-finite loss it skipped). They become steps of their
        own, closed before this one (whose number moves on; a sample armed at the first forward goes on with
        it). A forward without backward after the first backward stays in the step (a skipped micro-batch of
        an accumulation, or an extra forward the loop made)."""
        first = next((i for i, mb in enumerate(st.batches) if mb.backward), 0)
        dropped = [mb for mb in st.batches[:first] if mb.skipped]
        if not dropped:
            return
        st.batches = [mb for mb in st.batches if mb not in dropped]  # (compared by identity)
        for mb in dropped:
            self._open = _Step(self.step, False, st.iteration, st.scale, batches=[mb])
            self._close_dropped()
        st.index = self.step
        self._open = st

    def _updates_nothing(self, st: _Step) -> bool:
        """``step()`` was called on a step that has forwards and no gradient: none was backpropagated (a framework
        that calls ``step()`` after a skipped backward), or the loop reset them after the backward."""
        if not st.batches:
            return False
        if any(mb.backward for mb in st.batches):
            if self._grad_mark is None or self._grad_mark[0].grad is not None:
                return False
        elif not any(mb.skipped for mb in st.batches):
            return False  # no output needed a gradient: nothing tells a backward happened
        return not self._with_grads()

    def _close_dropped(self) -> None:
        """Close the open step as an iteration the loop ended without a step of its own."""
        st = self._open
        if not st.dropped:
            st.dropped = True
            if st.nonfinite is None:
                self._check_dropped(st)
        self.close_step()

    def _check_dropped(self, st: _Step) -> None:
        """Was a dropped iteration non-finite? What is left of it (losses, the seeds its backward sent, the
        gradients if the loop kept them) in one read; where that is finite or nothing is left (the loss the loop
        tested never reaches the watch; ``zero_grad`` dropped the gradients), a replay decides and names the
        fault (past ``max_localized``, the first non-finite op only)."""
        scaled = self.reader.enabled
        tensors = st.model_losses + st.logged_losses + [g for mb in st.batches for g in mb.seed if g is not None]
        if any(mb.backward for mb in st.batches) and not self._grads_reset():
            tensors += [local_tensor(p.grad) for p in self._with_grads()]
        flag = None
        if tensors:
            ok = torch.stack([torch.isfinite(t).all().to(self.device) for t in tensors]).all()
            flag = not self._read(ok, "dropped")
        if flag:
            st.nonfinite = True
            self._on_nonfinite(st, scaled=scaled)
        elif self.config.localize and not self._dtensor:
            full = self._may_localize()
            analysis = localize(self.model, st.batches, step=st.index, scale=self._scale_value(st), search=full,
                                bisect=full and scaled)
            st.nonfinite = analysis.classification != "not reproduced"
            if st.nonfinite:
                st.cause = analysis.describe(short=True)
                self._on_nonfinite(st, scaled=scaled, analysis=analysis if full else None)
        else:
            st.nonfinite = flag

    def _with_grads(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]

    def _grads_finite(self, grads: list[torch.Tensor], sharded: bool) -> bool:
        ok = torch.stack([torch.isfinite(g).all().to(self.device) for g in grads]).all().float()
        if sharded:
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        return bool(self._read(ok, "check"))

    def _scaler_finished(self, st: _Step) -> bool:
        """The scaler ended the step's iteration without an applied optimizer step (a skip)."""
        if st.applied or not self.reader.enabled:
            return False
        return iteration_changed(st.iteration, self.reader.iteration())

    def step_finished(self) -> bool:
        """A step is open and reached its optimizer step (checked, applied or skipped by the scaler)."""
        st = self._open
        return st is not None and (st.checked or st.applied or self._scaler_finished(st))

    def close_step(self) -> None:
        """The step is over (applied, or skipped by the scaler): account for it, sample, trigger."""
        st, self._open = self._open, None
        if st is None:
            return
        enabled = self.reader.enabled
        if st.dropped:
            skipped, nonfinite = True, st.nonfinite
        else:
            skipped = bool(st.nonfinite) if (st.applied and enabled) else not st.applied
            nonfinite = skipped if enabled else st.nonfinite
        losses = st.logged_losses or st.model_losses
        loss = (losses[0] if len(losses) == 1 else torch.stack(losses).mean()) if losses else None
        rec = StepValues(st.index, st.scale, loss, st.grad_l2, st.grad_norm, skipped, nonfinite, st.sampled)
        if st.dropped or (not st.applied and not enabled):
            rec.cause = st.cause or "no optimizer step"
        if self.last is not None:
            self.last.next_scale = st.scale  # the scale this step used is the one the last step left
        self.last = rec
        self._pending.append(rec)
        self.step += 1
        self.skipped += skipped
        self.dropped += st.dropped
        self.consecutive_skips = self.consecutive_skips + 1 if skipped else 0
        self._open = st  # the triggers and the sample still belong to this step
        try:
            if skipped and enabled and not st.dropped:
                self._on_skipped(st, rec)
            elif st.nonfinite is True and self.faults and self.faults[-1].step == st.index:
                rec.cause = self.faults[-1].describe(short=True)
            if st.sampled:
                self.sampler.finish(st.index, self._scale_value(st))
                if rec.grad_l2 is None and self.sampler.step_norms:
                    rec.grad_l2 = math.sqrt(sum(v * v for v in self.sampler.step_norms.values()))
                self.flush()
                self.output.write(final=False, collective=True)
            elif len(self._pending) >= _FLUSH_AT:
                self.flush()
        finally:
            self._open = None
            st.batches = []

    # -- triggers -----------------------------------------------------------------------------------
    def _on_skipped(self, st: _Step, rec: StepValues) -> None:
        self._on_nonfinite(st, scaled=True)
        if self.faults and self.faults[-1].step == st.index:
            rec.cause = self.faults[-1].describe(short=True)
        scale = self.reader.scale_or_init()
        new_scale = self._read(scale, "skipped-step") if isinstance(scale, torch.Tensor) else scale
        if new_scale < self.config.collapse_below and "collapse" not in self._fired:
            self._trigger("collapse", st, f"the loss scale fell to {new_scale:g}, below "
                                          f"{self.config.collapse_below:g}", raising=True)
        if self.consecutive_skips >= self.config.skip_run and "skip-run" not in self._fired:
            self._trigger("skip-run", st, f"{self.consecutive_skips} skipped steps in a row", raising=True)

    def _may_localize(self) -> bool:
        """Another fault may be replayed and classified (``max_localized``; the search stops at the first fault)."""
        cfg = self.config
        return (cfg.localize and not self._dtensor and len(self.faults) < cfg.max_localized
                and not any(f.is_fault for f in self.faults))

    def _on_nonfinite(self, st: _Step, *, scaled: bool, analysis: FaultAnalysis | None = None) -> None:
        """Count a non-finite step; replay and classify it (``analysis``: done already); trigger on the first."""
        self.nonfinite_steps += 1
        first = self._first_nonfinite is None
        self._first_nonfinite = st.index if first else self._first_nonfinite
        cfg = self.config
        if analysis is None and self._may_localize():
            analysis = localize(self.model, st.batches, step=st.index, scale=self._scale_value(st), bisect=scaled)
        if analysis is not None:
            self.faults.append(analysis)
        if first or (analysis is not None and analysis.is_fault):
            what = analysis.describe() if analysis is not None else \
                f"step {st.index}: {st.cause or 'non-finite loss or gradients'}"
            if analysis is None and cfg.localize and self._dtensor:
                what += (" (not localised: the model is sharded (FSDP2) and the replay needs a whole copy of it on "
                         "one rank; each rank's capture holds its own shard)")
            if st.dropped:
                what += " (the loop ended this iteration without an optimizer step)"
            raising = not scaled or (analysis is not None and analysis.is_fault)
            self._trigger("nonfinite", st, what, raising=raising, analysis=analysis)

    def _trigger(self, kind: str, st: _Step, description: str, *, raising: bool,
                 analysis: FaultAnalysis | None = None) -> None:
        self._fired.add(kind)
        entry: dict[str, Any] = {"step": st.index, "kind": kind, "description": description, "capture": None,
                                 "capture_bytes": None}
        if self.output.out is not None and st.batches and len(self.captures) < self.config.max_captures:
            n = len(self.captures) + 1
            name = ("capture.pt" if n == 1 else f"capture-{n}.pt")
            if self.world_size > 1:
                name = name.replace(".pt", f"-rank{self.rank}.pt")
            path = self.output.path(name)
            size = save_capture(path, model=self.model, batches=st.batches, step=st.index, reason=description,
                                scale=self._scale_value(st), scaler=self.scaler, analysis=analysis)
            entry.update(capture=path, capture_bytes=size)
            self.captures.append(entry)
        self.triggers.append(entry)
        self.flush()
        self.output.write(final=False, collective=False, plots=True)
        if raising and self.config.on_fault == "raise" and not self._closing:
            where = f"; report in {self.output.out}" if self.output.out else ""
            raise NonFiniteError(f"mixprec.watch stopped the run at step {st.index}: {description}{where}",
                                 step=st.index, what="gradient")

    # -- values -------------------------------------------------------------------------------------
    def _scale_value(self, st: _Step) -> float:
        return float(self._read(st.scale, "trigger")) if isinstance(st.scale, torch.Tensor) else float(st.scale)

    def _log2(self, scale: Any) -> int:
        v = self._read(scale, "sample") if isinstance(scale, torch.Tensor) else scale
        return round(math.log2(v)) if v > 0 else 0

    def flush(self, *, final: bool = False) -> None:
        """Read the pending per-step device values in one go (the sampled step's read of the history).

        The last closed step waits for the next one, whose scale is its ``next_scale``; ``final`` takes it
        from the scaler instead (after the loop's last ``update()``).
        """
        if final and self.last is not None and self.last.next_scale is None:
            scale = self.reader.scale_or_init()
            self.last.next_scale = scale.detach().clone() if isinstance(scale, torch.Tensor) else scale
        ready = [r for r in self._pending if r.next_scale is not None]
        if not ready:
            return
        slots: list[tuple[StepValues, str]] = []
        tensors: list[torch.Tensor] = []
        deferred = [rec for rec in ready if isinstance(rec.nonfinite, torch.Tensor)]
        for rec in ready:
            for field in ("scale", "loss", "grad_l2", "grad_norm", "next_scale", "nonfinite"):
                v = getattr(rec, field)
                if isinstance(v, torch.Tensor):
                    slots.append((rec, field))
                    tensors.append(v.detach().float().reshape(()).to(self.device))
        if tensors:
            for (rec, field), v in zip(slots, self._read(torch.stack(tensors), "flush")):
                setattr(rec, field, v)
        for rec in deferred:
            rec.nonfinite = bool(rec.nonfinite)
            rec.cause = rec.cause or (DEFERRED if rec.nonfinite else None)
        self.output.add_steps(ready)
        self._pending = [r for r in self._pending if r.next_scale is None]
        for rec in deferred:
            if rec.nonfinite:
                self._deferred_fault(rec)

    def _deferred_fault(self, rec: StepValues) -> None:
        """``check="deferred"``: an applied step whose flag, read now, was non-finite (its pre-update weights are
        gone, so it is counted and reported, not replayed)."""
        self.nonfinite_steps += 1
        if self._first_nonfinite is None:
            self._first_nonfinite = rec.step
            self._trigger("nonfinite", _Step(rec.step, False, None, rec.scale), f"step {rec.step}: {DEFERRED}",
                          raising=True)


def _scalar(v: Any, device: torch.device) -> torch.Tensor:
    """A logged value as a 0-dim fp32 tensor on ``device`` (a tensor from another device is copied there, no
    host read; a number becomes a tensor there)."""
    if isinstance(v, torch.Tensor):
        t = v.detach().float()
        return (t.reshape(()) if t.numel() == 1 else t.mean()).to(device)
    return torch.tensor(float(v), device=device)


def _reductions(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """An unsampled check's one value per gradient, non-finite if the gradient is (finite values can overflow it:
    the caller re-checks those): fp32 sums of CPU gradients (on a CPU the fastest pass over the bytes), and one
    fused ``torch._foreach_norm`` per device and dtype for the others (one multi-tensor kernel, not one per
    gradient)."""
    out: list[torch.Tensor] = []
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        if g.device.type == "cpu":
            out.append(g.sum(dtype=torch.float32))
        else:
            groups.setdefault((g.device, g.dtype), []).append(g)
    for gs in groups.values():
        out += torch._foreach_norm(gs, 2, dtype=torch.float32)
    return out


def _squared_norms(grads: list[torch.Tensor], dtype: torch.dtype | None) -> list[torch.Tensor]:
    """``||g||^2`` per gradient: an fp32 CPU gradient as a BLAS dot product with itself, the others by
    ``torch._foreach_norm`` squared in fp32; an inf or NaN makes its square non-finite (finite values may overflow
    it too: the caller re-checks those exactly)."""
    out: list[torch.Tensor | None] = [None] * len(grads)
    rest = []
    for i, g in enumerate(grads):
        if g.device.type == "cpu" and g.dtype == torch.float32 and g.is_contiguous() and type(g) is torch.Tensor:
            v = g.view(-1)
            out[i] = torch.dot(v, v)
        else:
            rest.append(i)
    if rest:
        for i, n in zip(rest, torch._foreach_norm([grads[i] for i in rest], 2, dtype=dtype)):
            out[i] = n.float().square()
    return out  # type: ignore[return-value]
