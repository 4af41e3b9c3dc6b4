"""What a training run reports: one :class:`EpochRecord` per epoch, one :class:`RunSummary`, a :class:`TrainResult`.

Each number has one name: the attribute, the ``--metrics-json`` key and the checkpoint ``history`` key. Every
record names its ``task`` and its main ``metric`` (the key that holds it); other tasks' fields appear in
``to_dict()`` only when set. Records are read-only mappings too (``rec["epoch_time_s"]``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

__all__ = ["EpochRecord", "EvalRecord", "RunSummary", "TrainResult"]


class _Record(Mapping):
    """A frozen dataclass that reads like the dict :meth:`to_dict` returns."""

    _OMIT_IF_NONE: ClassVar[tuple[str, ...]] = ()

    def _keys(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self)
                if not (f.name in self._OMIT_IF_NONE and getattr(self, f.name) is None)]

    def to_dict(self) -> dict[str, Any]:
        """Plain data in field order (nested dicts and lists copied), without the unset optional fields."""
        return {k: _copy(getattr(self, k)) for k in self._keys()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Any:
        """The inverse of :meth:`to_dict`; an unknown or missing required key raises TypeError naming it."""
        return cls(**d)

    def __getitem__(self, key: str) -> Any:
        if key not in self._keys():
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys())

    def __len__(self) -> int:
        return len(self._keys())


def _copy(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _copy(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_copy(x) for x in v]
    return v


_TASK_FIELDS = ("test_f1", "test_r2", "test_mse", "test_mae", "test_token_accuracy", "test_perplexity",
                "bits_per_char", "bits_per_token")

METRIC_KEYS = {"accuracy": "test_accuracy", "f1": "test_f1", "r2": "test_r2", "mse": "test_mse", "mae": "test_mae",
               "loss": "test_loss", "token_accuracy": "test_token_accuracy", "perplexity": "test_perplexity",
               "bits_per_char": "bits_per_char", "bits_per_token": "bits_per_token"}
"""A task's metric name (:meth:`mixprec.train.tasks.Task.finish`) -> the record key that holds it."""


def _task_of_old(d: Mapping[str, Any]) -> dict[str, Any]:
    """``task`` and ``metric`` of a record written before records named them (classify or a char-level lm)."""
    if "task" in d:
        return {}
    lm = d.get("bits_per_char") is not None
    return {"task": "lm" if lm else "classify", "metric": "test_loss" if lm else "test_accuracy"}


class _TaskRecord(_Record):
    """A record that names its ``task`` and the ``metric`` key holding the task's main metric (fields of the
    dataclasses below)."""

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Any:
        """As :meth:`_Record.from_dict`; a record written before records named their task gets one."""
        return cls(**{**_task_of_old(d), **d})

    @property
    def main(self) -> float | None:
        """The value of the task's main metric."""
        return getattr(self, self.metric)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EpochRecord(_TaskRecord):
    """One epoch of training and its evaluation."""

    _OMIT_IF_NONE: ClassVar[tuple[str, ...]] = _TASK_FIELDS

    epoch: int
    """0-based epoch index."""
    steps: int
    """Optimizer steps taken in the epoch (all of them, also when a resume split it)."""
    train_loss: float
    """Mean training loss over the epoch's steps (averaged over ranks)."""
    task: str
    """The task (classify, binary, multilabel, regression, lm; loss: only an explicit ``--loss``'s value)."""
    metric: str
    """The key of this record that holds the task's main metric (``test_accuracy``, ``test_r2``...)."""
    test_loss: float
    """Mean loss over the test split, under the recipe's autocast."""
    test_accuracy: float | None
    """Fraction of test samples classified right (binary: at logit 0; multilabel: per label); None for
    regression and language models."""
    test_f1: float | None = None
    """binary, multilabel: F1 of the positive class (micro-averaged over labels)."""
    test_r2: float | None = None
    """regression: R² (averaged over outputs)."""
    test_mse: float | None = None
    """regression: mean squared error."""
    test_mae: float | None = None
    """regression: mean absolute error."""
    test_token_accuracy: float | None = None
    """Language models: fraction of next tokens predicted right (None when the model shifts its labels inside)."""
    test_perplexity: float | None = None
    """Language models: ``exp(test_loss)``."""
    bits_per_char: float | None = None
    """Language models on characters: ``test_loss / ln 2``."""
    bits_per_token: float | None = None
    """Language models on tokens: ``test_loss / ln 2``."""
    epoch_time_s: float
    """Wall time of the epoch's steps (evaluation excluded; the slowest rank's)."""
    samples_per_s: float
    """Training samples per second over the epoch, all ranks together."""
    step_times_s: list[float]
    """Wall time of every optimizer step (bench drops the warm-up steps from these)."""
    loss_curve: list[float]
    """The loss of every optimizer step (averaged over ranks)."""
    skipped_steps: int
    """Steps skipped for inf/nan gradients by the loss scaler."""
    loss_scale: float
    """The loss scale at the end of the epoch (1.0 without loss scaling)."""
    memory: dict[str, Any] | None
    """The memory sample of one step (:meth:`mixprec.memory.MemoryReport.to_dict`), or None."""



@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalRecord(_TaskRecord):
    """One ``--eval-every`` evaluation of the test split, mid-epoch or not; its metrics as in
    :class:`EpochRecord`."""

    _OMIT_IF_NONE: ClassVar[tuple[str, ...]] = _TASK_FIELDS

    step: int
    """Optimizer steps taken when it was evaluated."""
    epoch: int
    """The epoch the step belongs to (0-based)."""
    lr: float
    """The learning rate of the last step before it (of the first parameter group)."""
    task: str
    """The task (see :class:`EpochRecord`)."""
    metric: str
    """The key of this record that holds the task's main metric."""
    test_loss: float
    """Mean loss over the test split, under the recipe's autocast."""
    test_accuracy: float | None
    """Fraction of test samples classified right; None for regression and language models."""
    test_f1: float | None = None
    test_r2: float | None = None
    test_mse: float | None = None
    test_mae: float | None = None
    test_token_accuracy: float | None = None
    """Language models: fraction of next tokens predicted right."""
    test_perplexity: float | None = None
    """Language models: ``exp(test_loss)``."""
    bits_per_char: float | None = None
    """Language models on characters: ``test_loss / ln 2``."""
    bits_per_token: float | None = None
    """Language models on tokens: ``test_loss / ln 2``."""
    eval_time_s: float
    """Wall time of the evaluation (left out of the epoch's time and step times)."""



@dataclasses.dataclass(frozen=True, kw_only=True)
class RunSummary(_TaskRecord):
    """The run in one row: the summary table, ``--metrics-json``'s ``summary`` and bench's rows read it."""

    _OMIT_IF_NONE: ClassVar[tuple[str, ...]] = _TASK_FIELDS

    recipe: str
    """Canonical recipe name."""
    impl: str
    """The mechanism that ran: native or scratch."""
    model: str
    dataset: str
    device: str
    world_size: int
    strategy: str
    """The resolved multi-process strategy (none, ddp, fsdp)."""
    grad_accum: int
    epochs: int
    """Epochs recorded (fewer than asked when the run stopped early)."""
    peak_memory_bytes: int | None
    """Total of the largest memory sample (weights, grads, optimizer state, activations)."""
    memory: dict[str, Any] | None
    """That sample, by part."""
    cuda_peak_allocated_bytes: int | None
    """CUDA's allocator peak during the sampled step; None off CUDA."""
    avg_epoch_time_s: float
    task: str
    """The task (see :class:`EpochRecord`)."""
    metric: str
    """The key of this summary that holds the task's main metric (bench's table, parity and plots use it)."""
    test_accuracy: float | None
    test_loss: float
    test_f1: float | None = None
    test_r2: float | None = None
    test_mse: float | None = None
    test_mae: float | None = None
    test_token_accuracy: float | None = None
    test_perplexity: float | None = None
    """Language models: of the last epoch."""
    bits_per_char: float | None = None
    """Language models on characters: of the last epoch."""
    bits_per_token: float | None = None
    """Language models on tokens: of the last epoch."""
    final_train_loss: float
    skipped_steps: int
    """Skipped steps over the whole run."""
    final_loss_scale: float
    stopped: str | None
    """Why the run stopped early, or None."""
    compile_time_s: float | None = None
    """Seconds ``--compile`` spent compiling before the first timed step; None without it."""


    @classmethod
    def from_history(cls, history: list[EpochRecord], *, stopped: str | None, skipped_steps: int,
                     task: str, metric: str, **run: Any) -> RunSummary:
        """The summary of ``history``; ``run`` holds the fields that describe the run itself."""
        mems = [h.memory for h in history if h.memory]
        peak = max(mems, key=lambda m: m["total"]) if mems else None
        cuda_peak = max((m.get("cuda_peak_allocated") or 0 for m in mems), default=0)
        times = [h.epoch_time_s for h in history]
        last = history[-1] if history else None
        return cls(
            **run,
            epochs=len(history),
            peak_memory_bytes=peak["total"] if peak else None,
            memory=peak,
            cuda_peak_allocated_bytes=cuda_peak or None,
            avg_epoch_time_s=sum(times) / len(times) if times else math.nan,
            task=task,
            metric=metric,
            test_accuracy=last.test_accuracy if last else math.nan,
            test_loss=last.test_loss if last else math.nan,
            **{k: getattr(last, k) if last else None for k in _TASK_FIELDS},
            final_train_loss=last.train_loss if last else math.nan,
            skipped_steps=skipped_steps,
            final_loss_scale=last.loss_scale if last else math.nan,
            stopped=stopped,
        )


@dataclasses.dataclass
class TrainResult:
    """What :func:`mixprec.train.loop.train` returns."""

    history: list[EpochRecord]
    """One record per epoch, a resumed run's earlier epochs included."""
    summary: RunSummary
    stopped: str | None = None
    """Why the run stopped early (non-finite loss, too many skipped steps), or None."""
    evals: list[EvalRecord] = dataclasses.field(default_factory=list)
    """The ``--eval-every`` evaluations, a resumed run's earlier ones included."""
