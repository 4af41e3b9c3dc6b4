"""``mixprec.train.fit``: everything ``mixprec train`` does, from Python, with objects where the CLI takes names."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from ..errors import check_keywords
from .build import build_run
from .config import TrainConfig
from .loop import TrainResult, train
from .resume import resume_folder
from .data.sources import data_from_splits
from .usercode import UserCodeError, in_process_reference

__all__ = ["fit"]


def fit(model: nn.Module | Callable | str = "mlp", data: Any = "fashion-mnist", *, precision: str = "bf16-mixed",
        loss: Callable | str | None = None, **flags: Any) -> TrainResult:
    """Train ``model`` on ``data`` with a precision recipe; returns the per-epoch history and the summary.

    Args:
        model: an ``nn.Module`` (trained in place: converted to the recipe's param dtype and device), a factory,
            a ``module:callable`` string, or a built-in name.
        data: a built-in name, a factory or ``module:callable`` returning ``(train, test)``, or that pair.
        loss: ``loss(model output, targets) -> scalar`` on the raw output; default: the model's own loss, else
            the task's.
        flags: any ``mixprec train`` flag by its Python name; ``optimizer`` may also be a factory
            ``(params, [lr, ...])``. Callables are used as handed and recorded as ``module:qualname``.
    """
    check_keywords("fit", flags, (set(TrainConfig().flags()) - {"dataset"}) | {"data"}, hints={"dataset": "data"})
    if flags.get("resume") is not None and "out" not in flags:
        flags["out"] = resume_folder(flags["resume"])
    if callable(flags.get("optimizer")):
        flags["optimizer"] = in_process_reference(flags["optimizer"], "--optimizer")
    instance = model if isinstance(model, nn.Module) else None
    names = {"model": type(model).__name__ if instance is not None else _name(model, "--model"),
             "dataset": _name(data, "--dataset") if not isinstance(data, (tuple, list)) else "user data"}
    loss_fn = loss if callable(loss) else None
    if isinstance(loss, str):
        names["loss"] = loss
    config = TrainConfig.from_flags(precision=precision, **names, **flags)
    source = data_from_splits(data, "data") if isinstance(data, (tuple, list)) else None
    run = build_run(config, data=source, model=instance, loss_fn=loss_fn)
    return train(run)


def _name(obj: Any, flag: str) -> str:
    if isinstance(obj, str):
        return obj
    if callable(obj):
        return in_process_reference(obj, flag)
    raise UserCodeError(f"{flag}: expected a name, a 'module:callable' string or a callable, got {type(obj).__name__}")
