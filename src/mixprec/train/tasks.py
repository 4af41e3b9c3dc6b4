"""Tasks: what a model's logits and the targets mean, the default loss and the metrics that say how good it is.

| task | targets | logits | default loss | metrics (main first) |
|---|---|---|---|---|
| ``classify`` | class indices, int (B,) | (B, C) | cross-entropy | accuracy |
| ``binary`` | 0/1, int or float (B,) | (B,) or (B, 1) | BCE with logits | accuracy at logit 0, F1 |
| ``multilabel`` | 0/1 per label (B, L) | (B, L) | BCE with logits | F1 (micro), per-label accuracy |
| ``regression`` | float (B,) or (B, K) | same number per sample | MSE | R² (mean over outputs), MSE, MAE |
| ``lm`` | token ids (B, T) | (B, T, V) | cross-entropy per token | loss, perplexity, bits per char/token, token accuracy |

:func:`infer_task` picks the task from the first batch (``--task`` overrides it; :func:`check_fit` checks the
targets). Targets ``-100`` are left out of ``classify`` and ``lm`` accuracy, as out of the loss. Metrics are
float64 sums on the device (:meth:`Task.sums`, no host read per batch), read once (:meth:`Task.finish`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from .contract import ContractError

__all__ = ["TASKS", "Task", "Classify", "Binary", "MultiLabel", "Regression", "LanguageModel", "LossOnly", "infer_task",
           "make_task", "check_fit", "cross_entropy", "IGNORE_INDEX"]

TASKS = ("classify", "binary", "multilabel", "regression", "lm")
IGNORE_INDEX = -100


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the last dimension: (B, C) logits with (B,) labels, or (B, T, V) with (B, T)."""
    if logits.dim() > 2:
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
    return F.cross_entropy(logits, targets)


class Task:
    """One task's loss and metrics (see the module table)."""

    name = ""
    main = ""
    """Key of the main metric in :meth:`finish` (bench's table, parity and plots use it)."""
    higher_is_better = True
    n_sums = 0

    def default_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def sums(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """This batch's metric sums, float64, on the logits' device (no host read)."""
        raise NotImplementedError

    def finish(self, sums: list[float], n: int, loss: float) -> dict[str, float | None]:
        """The metrics (by their record names, without the ``test_`` prefix) from summed :meth:`sums` over
        ``n`` samples and the mean loss."""
        raise NotImplementedError

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "main": self.main, "higher_is_better": self.higher_is_better}


def _hits(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[positions whose argmax equals the target, positions counted], ignoring ``IGNORE_INDEX``."""
    keep = targets != IGNORE_INDEX
    hit = (logits.argmax(dim=-1) == targets) & keep
    return torch.stack([hit.sum().double(), keep.sum().double()])


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 and math.isfinite(a) else None


class Classify(Task):
    name, main, n_sums = "classify", "accuracy", 2

    def default_loss(self, logits, targets):
        return cross_entropy(logits, targets)

    def sums(self, logits, targets):
        return _hits(logits, targets)

    def finish(self, sums, n, loss):
        return {"accuracy": _ratio(sums[0], sums[1])}


class _Thresholded(Task):
    """Binary decisions at logit 0 (probability 0.5): counts of correct, TP, FP, FN."""

    n_sums = 4

    def default_loss(self, logits, targets):
        return F.binary_cross_entropy_with_logits(logits.reshape(targets.shape), targets.to(logits.dtype))

    def sums(self, logits, targets):
        pred = logits.reshape(targets.shape) > 0
        truth = targets > 0.5
        b = targets.shape[0]
        correct = (pred == truth).reshape(b, -1).double().mean(1).sum()
        return torch.stack([correct, (pred & truth).sum().double(), (pred & ~truth).sum().double(),
                            (~pred & truth).sum().double()])

    @staticmethod
    def _f1(tp: float, fp: float, fn: float) -> float | None:
        return 2 * tp / (2 * tp + fp + fn) if (2 * tp + fp + fn) > 0 else None


class Binary(_Thresholded):
    name, main = "binary", "accuracy"

    def finish(self, sums, n, loss):
        return {"accuracy": sums[0] / max(n, 1), "f1": self._f1(*sums[1:4])}


class MultiLabel(_Thresholded):
    name, main = "multilabel", "f1"

    def finish(self, sums, n, loss):
        return {"f1": self._f1(*sums[1:4]), "accuracy": sums[0] / max(n, 1)}


class Regression(Task):
    """Mean squared and absolute error over every output, and R² per output averaged (scikit-learn's
    ``r2_score`` default, ``uniform_average``), from per-output sums of errors and targets."""

    name, main = "regression", "r2"

    def __init__(self, outputs: int = 1) -> None:
        self.outputs = outputs
        self.n_sums = 4 * outputs + 1

    def default_loss(self, logits, targets):
        return F.mse_loss(logits.reshape(targets.shape), targets.to(logits.dtype))

    def sums(self, logits, targets):
        y = targets.reshape(targets.shape[0], -1).double()
        err = logits.reshape(y.shape).double() - y
        return torch.cat([(err * err).sum(0), err.abs().sum(0), y.sum(0), (y * y).sum(0),
                          torch.tensor([float(y.shape[0])], dtype=torch.float64, device=y.device)])

    def finish(self, sums, n, loss):
        k = self.outputs
        sse, sae, sy, syy, m = sums[:k], sums[k:2 * k], sums[2 * k:3 * k], sums[3 * k:4 * k], sums[4 * k]
        if m <= 0:
            return {"r2": None, "mse": None, "mae": None}
        r2 = []
        for j in range(k):
            sst = syy[j] - sy[j] * sy[j] / m
            r2.append(1.0 - sse[j] / sst if sst > 0 else None)
        known = [r for r in r2 if r is not None]
        return {"r2": sum(known) / len(known) if known else None, "mse": sum(sse) / (m * k), "mae": sum(sae) / (m * k)}

    def to_dict(self):
        return {**super().to_dict(), "outputs": self.outputs}


class LanguageModel(Task):
    """Next-token prediction: loss, perplexity, bits per char or token; token accuracy when ``aligned``."""

    name, main, higher_is_better, n_sums = "lm", "loss", False, 2

    def __init__(self, unit: str = "token", aligned: bool = True) -> None:
        self.unit = unit
        self.aligned = aligned

    def default_loss(self, logits, targets):
        return cross_entropy(logits, targets)

    def sums(self, logits, targets):
        if not self.aligned or logits.shape[:-1] != targets.shape:
            return torch.tensor([math.nan, 0.0], dtype=torch.float64, device=logits.device)
        return _hits(logits, targets)

    def finish(self, sums, n, loss):
        bits = loss / math.log(2) if math.isfinite(loss) else math.inf
        try:
            ppl = math.exp(loss)
        except OverflowError:
            ppl = math.inf
        return {"loss": loss, "perplexity": ppl, f"bits_per_{self.unit}": bits, "token_accuracy": _ratio(*sums[:2])}

    def to_dict(self):
        return {**super().to_dict(), "unit": self.unit, "aligned": self.aligned}


class LossOnly(Task):
    """Targets that fit none of the tasks, trained by an explicit ``--loss``: only the test loss is reported."""

    name, main, higher_is_better, n_sums = "loss", "loss", False, 0

    def default_loss(self, logits, targets):
        raise ContractError("these targets fit no task, so there is no default loss; pass --loss or --task")

    def sums(self, logits, targets):
        return torch.zeros(0, dtype=torch.float64, device=logits.device)

    def finish(self, sums, n, loss):
        return {"loss": loss}


def _per_sample(t: torch.Tensor) -> int:
    return t[0].numel() if t.dim() > 0 and t.shape[0] > 0 else 1


def _is_01(t: torch.Tensor) -> bool:
    return bool(((t == 0) | (t == 1)).all())  # reads the host once, at the probe


def infer_task(logits: torch.Tensor | None, targets: torch.Tensor | None, *, hint: str | None = None) -> str:
    """The task the first batch's logits and targets (and the data source's ``hint``) imply."""
    if hint in TASKS:
        return hint
    if targets is None or logits is None:
        return "lm"
    integer = not targets.is_floating_point()
    if integer and logits.dim() == targets.dim() + 1 and logits.shape[-1] > 1:
        return "lm" if targets.dim() >= 2 else "classify"
    if _per_sample(logits) == _per_sample(targets):
        if _is_01(targets):
            return "binary" if _per_sample(targets) == 1 else "multilabel"
        if not integer:
            return "regression"
    raise ContractError(
        f"targets of shape {tuple(targets.shape)} ({_dtype(targets)}) do not fit logits of shape "
        f"{tuple(logits.shape)}: classification wants int class indices (B,) with logits (B, C); binary/"
        "multilabel 0/1 targets with one logit per label; regression float targets with one output each; "
        "pick one with --task")


def check_fit(task: str, logits: torch.Tensor | None, targets: torch.Tensor | None) -> None:
    """Raise ContractError (one line naming the fix) when the targets cannot train ``task`` against these
    logits: wrong dtype, shape, or values (class indices out of range, non-0/1 binary targets)."""
    if targets is None or logits is None:
        if task != "lm":
            raise ContractError(f"--task {task} needs targets and logits, but the batch has no targets or the "
                                "model returned no logits")
        return
    shapes = f"targets {tuple(targets.shape)} ({_dtype(targets)}), logits {tuple(logits.shape)}"
    if task in ("classify", "lm"):
        if targets.is_floating_point():
            raise ContractError(f"--task {task} needs integer class indices as targets, got {shapes}; use "
                                "--task regression or binary for float targets")
        if logits.dim() != targets.dim() + 1 or logits.shape[:-1] != targets.shape:
            raise ContractError(f"--task {task} needs logits of shape (*targets.shape, classes), got {shapes}")
        kept = targets[targets != IGNORE_INDEX]
        if kept.numel() and (int(kept.min()) < 0 or int(kept.max()) >= logits.shape[-1]):
            raise ContractError(f"the targets go from {int(kept.min())} to {int(kept.max())} but the model outputs "
                                f"{logits.shape[-1]} classes; targets must lie in [0, {logits.shape[-1] - 1}]")
    elif task in ("binary", "multilabel", "regression"):
        if _per_sample(logits) != _per_sample(targets) or logits.shape[0] != targets.shape[0]:
            raise ContractError(f"--task {task} needs one logit per target value, got {shapes}")
        if task == "binary" and _per_sample(targets) != 1:
            raise ContractError(f"--task binary needs one target per sample, got {shapes}; use --task multilabel")
        if task != "regression" and not _is_01(targets):
            raise ContractError(f"--task {task} needs targets that are 0 or 1, got {shapes} with other values; "
                                "use --task regression or classify")
    else:
        raise ContractError(f"unknown --task {task!r}; choose one of: {', '.join(TASKS)}")


def make_task(name: str, *, targets: torch.Tensor | None = None, unit: str = "token",
              aligned: bool = True) -> Task:
    """The :class:`Task` for ``name`` (regression takes its number of outputs from ``targets``)."""
    if name == "classify":
        return Classify()
    if name == "binary":
        return Binary()
    if name == "multilabel":
        return MultiLabel()
    if name == "regression":
        return Regression(1 if targets is None or targets.dim() < 2 else _per_sample(targets))
    if name == "lm":
        return LanguageModel(unit, aligned)
    raise ContractError(f"unknown --task {name!r}; choose one of: {', '.join(TASKS)}")


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")
