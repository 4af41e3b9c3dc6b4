"""Typed records of a bench: one run's result (:class:`RunResult`), its timing, memory probe and device busy time,
and one summary row per recipe (:class:`SummaryRow`), each with ``to_dict()`` (its JSON form) and ``from_dict()``.

Any run result is readable: ``from_dict`` accepts anything, a field of the wrong type or a non-finite number
becomes "not measured" (None), ``status`` is "ok" only when it says so. Every computation treats None as not
measured (:func:`number`, :func:`ratio`), so a damaged field is a dash in its cell, never a crash of the report.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import statistics
from typing import Any

from ..jsonio import to_jsonable
from .parity import ParityResult

__all__ = ["number", "ratio", "host_bound", "HOST_BOUND_BELOW", "Spread", "Timing", "MemoryProbe", "DeviceBusy",
           "RunResult", "Failure", "Prediction", "SummaryRow"]


def number(x: Any) -> float | int | None:
    """``x`` if it is a finite real number (not a bool), else None: the one test of "was it measured"."""
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        return None
    return x if math.isfinite(x) else None


def ratio(a: Any, b: Any) -> float | None:
    """``a / b`` when both are numbers and ``b`` is not 0, else None."""
    a, b = number(a), number(b)
    return a / b if a is not None and b else None


HOST_BOUND_BELOW = 0.8
"""A step whose device was busy for less than this share of its wall time is host-bound: the GPU waits for the
host (Python, kernel launches, host reads) for the rest."""


def host_bound(busy_s: Any, step_s: Any) -> bool | None:
    """Whether a step of wall time ``step_s`` that kept the device busy for ``busy_s`` is host-bound (busy under
    :data:`HOST_BOUND_BELOW` of it); None when either was not measured."""
    share = ratio(busy_s, step_s)
    return None if share is None else share < HOST_BOUND_BELOW


def _dict(x: Any) -> dict:
    return x if isinstance(x, dict) else {}


def _int(x: Any) -> int | None:
    x = number(x)
    return int(x) if x is not None and x == int(x) else None


def _str(x: Any) -> str | None:
    return x if isinstance(x, str) else None


def _ints(x: Any) -> list[int]:
    return [i for i in map(_int, x) if i is not None] if isinstance(x, list) else []


def _read(cls: type, d: Any, kinds: dict[str, Any]) -> Any:
    """``cls`` from the dict ``d``, each field read by its kind (a damaged one becomes None)."""
    d = _dict(d)
    return cls(**{name: kind(d.get(name)) for name, kind in kinds.items()})


@dataclasses.dataclass(frozen=True, kw_only=True)
class Spread:
    """A number over the repeats of one recipe."""

    median: float | None = None
    min: float | None = None
    max: float | None = None
    n: int = 0

    @classmethod
    def of(cls, values: Any) -> Spread | None:
        vals = [v for v in map(number, values) if v is not None]
        if not vals:
            return None
        return cls(median=statistics.median(vals), min=min(vals), max=max(vals), n=len(vals))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> Spread | None:
        if not isinstance(d, dict):
            return None
        return cls(median=number(d.get("median")), min=number(d.get("min")), max=number(d.get("max")),
                   n=_int(d.get("n")) or 0)


def _median(spread: Spread | None) -> float | None:
    return spread.median if spread is not None else None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Timing:
    """One run's timing, warm-up steps of every epoch left out (:func:`mixprec.bench.measure.timing_from_history`)."""

    timed_steps: int | None = None
    warmup_steps_per_epoch: int | None = None
    step_time_s: float | None = None
    """Median time of a timed optimizer step."""
    step_time_p10_s: float | None = None
    step_time_p90_s: float | None = None
    epoch_time_s: float | None = None
    """Steady epoch: mean timed step x steps per epoch, averaged over epochs."""
    raw_epoch_time_s: float | None = None
    """The trainer's own epoch clock, warm-up included, averaged over epochs."""
    samples_per_s: float | None = None
    """Samples per optimizer step / median step time."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> Timing:
        counts = ("timed_steps", "warmup_steps_per_epoch")
        return _read(cls, d, {f.name: _int if f.name in counts else number for f in dataclasses.fields(cls)})


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryProbe:
    """The measured peak of one training step (:func:`mixprec.bench.measure.probe_step_memory`)."""

    method: str | None = None
    """How it was measured; None when it could not be (then ``reason`` says why)."""
    reason: str | None = None
    step_peak_bytes: int | None = None
    """What one step adds at its peak above the resident state (``method`` says how)."""
    rss_step_peak_bytes: int | None = None
    """CPU: the resident set's rise over the step (``VmHWM``), the largest over ``repeats``."""
    rss_method: str | None = None
    exact_activations: int | None = None
    """Bytes saved for backward in the same step (all :data:`mixprec.memory.SAVED_CATEGORIES`)."""
    exact_gradients: int | None = None
    repeats: int | None = None
    cuda_peak_reserved_bytes: int | None = None

    @property
    def exact_total(self) -> int | None:
        """Exact activations + gradients: what the measured peak is compared with."""
        a, g = number(self.exact_activations), number(self.exact_gradients)
        return a + g if a is not None and g is not None else None

    def to_dict(self) -> dict[str, Any]:
        out = {"method": self.method, "reason": self.reason, "step_peak_bytes": self.step_peak_bytes,
               "rss_step_peak_bytes": self.rss_step_peak_bytes, "rss_method": self.rss_method,
               "exact_activations_plus_gradients": None, "repeats": self.repeats,
               "cuda_peak_reserved_bytes": self.cuda_peak_reserved_bytes}
        if self.exact_total is not None:
            out["exact_activations_plus_gradients"] = {"activations": self.exact_activations,
                                                       "gradients": self.exact_gradients, "total": self.exact_total}
        return out

    @classmethod
    def from_dict(cls, d: Any) -> MemoryProbe:
        d = _dict(d)
        exact = _dict(d.get("exact_activations_plus_gradients"))
        return cls(method=_str(d.get("method")), reason=_str(d.get("reason")),
                   step_peak_bytes=_int(d.get("step_peak_bytes")),
                   rss_step_peak_bytes=_int(d.get("rss_step_peak_bytes")),
                   rss_method=_str(d.get("rss_method")), exact_activations=_int(exact.get("activations")),
                   exact_gradients=_int(exact.get("gradients")), repeats=_int(d.get("repeats")),
                   cuda_peak_reserved_bytes=_int(d.get("cuda_peak_reserved_bytes")))


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeviceBusy:
    """How long the accelerator worked per optimizer step (:func:`mixprec.bench.measure.probe_device_busy`)."""

    method: str | None = None
    """How it was measured; None when it was not (then ``reason`` says why: a CPU run, a profiler error)."""
    reason: str | None = None
    busy_s: float | None = None
    """Per step: the time the device ran kernels, copies or memsets (their intervals' union, overlaps once)."""
    kernels_per_step: float | None = None
    profiled_step_s: float | None = None
    """Wall time per profiled step, the profiler's overhead included (compare ``busy_s`` with the timed step)."""
    steps: int | None = None
    """Steps profiled, after warm-up steps."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> DeviceBusy:
        kinds = {"method": _str, "reason": _str, "busy_s": number, "kernels_per_step": number,
                 "profiled_step_s": number, "steps": _int}
        return _read(cls, d, kinds)


def _records(x: Any) -> list[dict[str, Any]]:
    return [to_jsonable(h) for h in x if isinstance(h, dict)] if isinstance(x, list) else []


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunResult:
    """One (recipe, repeat): what its worker wrote, completed by the runner (exit status, wall time, log)."""

    status: str = "failed"
    reason: str | None = None
    recipe: str | None = None
    repeat: int | None = None
    seed: int | None = None
    """The seed it ran with (base seed + r)."""
    impl: str | None = None
    describe: str | None = None
    history: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    summary: dict[str, Any] = dataclasses.field(default_factory=dict)
    timing: Timing = dataclasses.field(default_factory=Timing)
    memory_probe: MemoryProbe = dataclasses.field(default_factory=MemoryProbe)
    device_busy: DeviceBusy = dataclasses.field(default_factory=DeviceBusy)
    wall_s: float | None = None
    """The worker's own time for building, training and probing."""
    returncode: int | None = None
    """The worker's exit status (None: it timed out and was killed)."""
    process_wall_s: float | None = None
    log: str | None = None
    invocation: int | None = None
    """Which invocation of ``mixprec bench`` on this folder ran it (one more per ``--resume``)."""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def name(self) -> str:
        """``RECIPE-rN``, the stem of its files in ``runs/`` and ``logs/``."""
        return f"{self.recipe}-r{self.repeat}"

    def loss_curve(self) -> list[float]:
        """Per-step training losses over all epochs (a missing or non-finite loss is NaN)."""
        curves = [h.get("loss_curve") for h in self.history]
        return [math.nan if number(v) is None else float(v) for c in curves if isinstance(c, list) for v in c]

    def to_dict(self) -> dict[str, Any]:
        return {f.name: to_jsonable(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, d: Any) -> RunResult:
        d = _dict(d)
        return cls(status="ok" if d.get("status") == "ok" else "failed", reason=_str(d.get("reason")),
                   recipe=_str(d.get("recipe")), repeat=_int(d.get("repeat")), seed=_int(d.get("seed")),
                   impl=_str(d.get("impl")), describe=_str(d.get("describe")), history=_records(d.get("history")),
                   summary=to_jsonable(_dict(d.get("summary"))), timing=Timing.from_dict(d.get("timing")),
                   memory_probe=MemoryProbe.from_dict(d.get("memory_probe")),
                   device_busy=DeviceBusy.from_dict(d.get("device_busy")), wall_s=number(d.get("wall_s")),
                   returncode=_int(d.get("returncode")), process_wall_s=number(d.get("process_wall_s")),
                   log=_str(d.get("log")), invocation=_int(d.get("invocation")))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Failure:
    """A failed run of a recipe, as listed under the table."""

    repeat: int | None = None
    seed: int | None = None
    reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> Failure:
        return _read(cls, d, {"repeat": _int, "seed": _int, "reason": _str})


def _parity(d: Any) -> ParityResult | None:
    if not isinstance(d, dict) or not isinstance(d.get("verdict"), str):
        return None
    return ParityResult(verdict=d["verdict"], inside_fraction=number(d.get("inside_fraction")),
                        max_excursion=number(d.get("max_excursion")), steps=_int(d.get("steps")) or 0,
                        reason=_str(d.get("reason")) or "")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Prediction:
    """What ``mixprec plan`` predicted for one recipe (:mod:`mixprec.bench.predict`), and the measured ratios."""

    target: str | None = None
    peak_bytes: int | None = None
    """Predicted peak of the step, the resident state included."""
    step_peak_bytes: int | None = None
    """Predicted peak above the resident state (what ``measured_step_peak_bytes`` measures)."""
    step_time_s: float | None = None
    """Predicted time of one optimizer step (``--grad-accum`` micro-batches of forward and backward)."""
    peak_compared_with: str | None = None
    """The measured figure the peak is compared with (``cuda_peak_allocated_bytes``: with ``peak_bytes``)."""
    peak_ratio: float | None = None
    step_time_ratio: float | None = None
    reason: str | None = None

    @property
    def compared_peak(self) -> int | None:
        return self.peak_bytes if self.peak_compared_with == "cuda_peak_allocated_bytes" else self.step_peak_bytes

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> Prediction | None:
        if not isinstance(d, dict):
            return None
        kinds = {"target": _str, "peak_bytes": _int, "step_peak_bytes": _int, "step_time_s": number,
                 "peak_compared_with": _str, "peak_ratio": number, "step_time_ratio": number, "reason": _str}
        return _read(cls, d, kinds)


_SPREADS = ("epoch_time_s", "raw_epoch_time_s", "step_time_s", "samples_per_s", "test_accuracy", "test_loss",
            "bits_per_char", "test_metric")
_NUMBERS = ("memory_total_bytes", "cuda_peak_allocated_bytes", "cuda_peak_reserved_bytes",
            "measured_step_peak_bytes", "measured_step_rss_peak_bytes", "exact_activations_plus_gradients_bytes",
            "peak_flops_per_s", "mfu", "device_busy_s", "device_busy_fraction", "kernels_per_step",
            "final_train_loss", "skipped_steps", "final_loss_scale", "speedup_vs_fp32", "memory_saving_vs_fp32",
            "accuracy_delta_vs_fp32_pp", "test_loss_delta_vs_fp32", "metric_delta_vs_fp32")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SummaryRow:
    """One recipe's line of the comparison: medians (and spreads) over its successful repeats, and its ratios to
    fp32 (:func:`mixprec.bench.aggregate.aggregate`). Byte and loss figures are medians."""

    recipe: str
    impl: str | None = None
    runs_ok: int = 0
    runs_total: int = 0
    failures: list[Failure] = dataclasses.field(default_factory=list)
    invocations: list[int] = dataclasses.field(default_factory=list)
    epoch_time_s: Spread | None = None
    raw_epoch_time_s: Spread | None = None
    step_time_s: Spread | None = None
    samples_per_s: Spread | None = None
    memory: dict[str, Any] | None = None
    """Exact memory accounting of a sampled step, by category."""
    memory_total_bytes: int | None = None
    cuda_peak_allocated_bytes: float | None = None
    """CUDA: the trainer's peak allocated memory."""
    cuda_peak_reserved_bytes: float | None = None
    measured_step_peak_bytes: float | None = None
    """The probe's step peak above the resident state (compared with the plan's ``step_peak_bytes``)."""
    measured_step_rss_peak_bytes: float | None = None
    """CPU: the probe's resident-set (``VmHWM``) rise over the step."""
    measured_step_peak_method: str | None = None
    exact_activations_plus_gradients_bytes: float | None = None
    matmul_dtype: str | None = None
    """The dtype the recipe's matmuls run in, whose peak MFU is measured against."""
    peak_flops_per_s: float | None = None
    mfu: float | None = None
    """Model FLOPs per step / median step time / peak."""
    device_busy_s: float | None = None
    """CUDA: the device's busy time per step (:class:`DeviceBusy`), median over repeats."""
    device_busy_fraction: float | None = None
    """``device_busy_s`` / median step time: under :data:`HOST_BOUND_BELOW`, the step is host-bound."""
    kernels_per_step: float | None = None
    final_train_loss: float | None = None
    task: str | None = None
    """classify, binary, multilabel, regression, lm; loss: an explicit --loss only."""
    metric: str | None = None
    """The summaries' key of the task's main metric (``test_accuracy``, ``test_r2``...)."""
    test_metric: Spread | None = None
    test_accuracy: Spread | None = None
    test_loss: Spread | None = None
    bits_per_char: Spread | None = None
    language_model: bool | None = None
    """Its runs report bits per character (the table shows test loss, not accuracy)."""
    skipped_steps: int | None = None
    """Most skipped (non-finite) steps of a repeat."""
    final_loss_scale: float | None = None
    speedup_vs_fp32: float | None = None
    """fp32's median epoch time / this recipe's."""
    memory_saving_vs_fp32: float | None = None
    """1 - this recipe's memory total / fp32's."""
    accuracy_delta_vs_fp32_pp: float | None = None
    """Test accuracy minus fp32's, in percentage points."""
    test_loss_delta_vs_fp32: float | None = None
    metric_delta_vs_fp32: float | None = None
    """In the metric's own units (accuracy as a fraction)."""
    parity: ParityResult | None = None
    prediction: Prediction | None = None
    """None with ``--no-plan``."""

    def to_dict(self) -> dict[str, Any]:
        return {f.name: to_jsonable(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, d: Any) -> SummaryRow:
        """Any dict as a row (damaged fields become None)."""
        d = _dict(d)
        failures = d.get("failures")
        return cls(recipe=str(d.get("recipe")), impl=_str(d.get("impl")), runs_ok=_int(d.get("runs_ok")) or 0,
                   runs_total=_int(d.get("runs_total")) or 0,
                   failures=[Failure.from_dict(f) for f in failures] if isinstance(failures, list) else [],
                   invocations=_ints(d.get("invocations")),
                   memory=to_jsonable(d["memory"]) if isinstance(d.get("memory"), dict) else None,
                   measured_step_peak_method=_str(d.get("measured_step_peak_method")),
                   matmul_dtype=_str(d.get("matmul_dtype")), task=_str(d.get("task")),
                   metric=_str(d.get("metric")),
                   language_model=d.get("language_model") if isinstance(d.get("language_model"), bool) else None,
                   parity=_parity(d.get("parity")), prediction=Prediction.from_dict(d.get("prediction")),
                   **{k: Spread.from_dict(d.get(k)) for k in _SPREADS}, **{k: number(d.get(k)) for k in _NUMBERS})

    def median(self, field: str) -> float | None:
        """The median of one of its spreads (``epoch_time_s``, ``test_accuracy``...), or None."""
        return _median(getattr(self, field))

    @property
    def host_bound(self) -> bool | None:
        """Its step is host-bound (:func:`host_bound`); None where the device's busy time was not measured."""
        return host_bound(self.device_busy_s, self.median("step_time_s"))
