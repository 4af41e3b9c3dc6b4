"""``mixprec.bench.compare``: the benchmark from a notebook or script. It runs the same session as ``mixprec
bench`` (every run in a fresh worker process), so the model, data and loss must be importable there:
``module:callable`` strings, built-in names, or callables defined at the top level of a module or ``.py`` file.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import check_keywords
from ..train.config import TrainConfig
from ..train.usercode import reference_of
from .config import RUN_TRAIN_DEFAULTS, BenchConfig
from .report import as_rows, table
from .results import RunResult, SummaryRow
from .session import Session

__all__ = ["compare", "Comparison", "TRAIN_SETTINGS"]

_DEFAULT = BenchConfig()

TRAIN_SETTINGS = tuple(k for k in TrainConfig().flags()
                       if k not in ("precision", "model", "dataset", "loss", "out", "checkpoint_every", "resume",
                                    "overwrite", "metrics_json"))
"""The ``mixprec train`` settings :func:`compare` takes as keyword arguments: all but the recipe, the model,
data and loss (arguments of their own) and the outputs."""


@dataclasses.dataclass
class Comparison:
    """What a comparison produced: the ``results.json`` document, where it lies, and the exit status."""

    doc: dict[str, Any]
    out_dir: str
    exit_code: int

    @property
    def rows(self) -> list[SummaryRow]:
        return as_rows(self.doc["summary"])

    @property
    def runs(self) -> list[RunResult]:
        return [RunResult.from_dict(r) for r in self.doc["runs"]]

    def table(self) -> str:
        return table(self.rows)

    @property
    def results_json(self) -> str:
        return os.path.join(self.out_dir, "results.json")

    @property
    def plots(self) -> list[str]:
        return list(self.doc.get("plots") or [])


_OWN = {"precisions", "repeats", "out", "loss", "warmup_steps", "timeout", "peak_seconds", "plots", "predict"}


def compare(model: Callable | str = "mlp", data: Callable | str = "fashion-mnist", *,
            precisions: Sequence[str] | str = _DEFAULT.precisions, repeats: int = _DEFAULT.repeats,
            out: str | os.PathLike | None = None, loss: Callable | str | None = None,
            warmup_steps: int = _DEFAULT.warmup_steps, timeout: float | None = _DEFAULT.timeout,
            peak_seconds: float = _DEFAULT.peak_seconds, plots: bool = _DEFAULT.plots,
            predict: bool = _DEFAULT.predict, **train_settings: Any) -> Comparison:
    """Train ``model`` on ``data`` under each recipe ``repeats`` times and compare them (see ``mixprec bench``).

    ``train_settings``: :data:`TRAIN_SETTINGS` by their Python names (``epochs=3``); any other keyword is an
    ``UnknownKeywordError`` before anything runs.
    """
    check_keywords("compare", train_settings, set(TRAIN_SETTINGS) | _OWN, hints={"precision": "precisions"})
    flags = {**RUN_TRAIN_DEFAULTS, **train_settings, "model": reference_of(model, "--model"),
             "dataset": reference_of(data, "--dataset")}
    if loss is not None:
        flags["loss"] = reference_of(loss, "--loss")
    if callable(flags.get("optimizer")):  # a factory: the worker processes import it by reference
        flags["optimizer"] = reference_of(flags["optimizer"], "--optimizer")
    config = BenchConfig(train=TrainConfig.from_flags(**flags), precisions=precisions, repeats=repeats,
                         out=None if out is None else os.fspath(out), warmup_steps=warmup_steps, timeout=timeout,
                         peak_seconds=peak_seconds, plots=plots, predict=predict)
    session = Session(config)
    code = session.run()
    return Comparison(doc=session.doc, out_dir=session.plan.out_dir, exit_code=code)
