"""``mixprec.train.fit``: train from a notebook or script, no command line.

Everything ``mixprec train`` does, with Python objects where the CLI takes names: a model may be a module
instance, a factory or a ``module:callable`` string; data a built-in name, a factory, a string, or the
``(train, test)`` pair a factory would return (datasets or ``(inputs, labels)`` tensor pairs); the loss a
callable or a string. The model is called as the model contract says (:mod:`mixprec.train.contract`): tuple
and dict batches, tensor / tuple / ``ModelOutput`` outputs, its own loss when it returns one. Other settings are the CLI's flags as keywords (``epochs=3``, ``init_scale=1024``).
"""

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
        model: an ``nn.Module`` (trained in place: it is converted to the recipe's param dtype and device),
            a factory (called with the arguments it declares among ``input_shape``, ``num_classes``,
            ``vocab_size``, ``block_size``), a ``module:callable`` string, or a built-in name.
        data: a built-in name (``fashion-mnist``, ``digits``, ``text``...), a factory or ``module:callable``
            returning ``(train, test)``, or that pair itself.
        precision: a recipe name (``fp32``, ``amp``, ``bf16-mixed``, ``fp8-mixed``...).
        loss: ``loss(model output, targets) -> scalar`` (the raw output: a tensor, a tuple, a ``ModelOutput``);
            default: the loss the model returns, else the task's (cross-entropy, BCE, MSE; see ``task``).
        flags: any ``mixprec train`` flag by its Python name (``epochs``, ``batch_size``, ``lr``, ``out``,
            ``task="regression"``...); ``optimizer`` may also be a factory ``(params, [lr, ...]) ->
            torch.optim.Optimizer``. Callables are used as handed (this process trains; nothing is imported
            again); the run's config records them as ``module:qualname``. ``resume`` without ``out`` continues in
            the checkpoint's folder, as ``mixprec train --resume`` does.
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
