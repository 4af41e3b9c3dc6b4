"""``mixprec.bench.compare``: the benchmark from a notebook or script, no command line.

It runs exactly what ``mixprec bench`` runs — every (recipe, repeat) in a fresh worker process — so the
model, data and loss must be importable there: pass ``module:callable`` strings, built-in names, or
callables defined at the top level of a module or ``.py`` file (their import path is worked out).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any

from ..train.usercode import reference_of

__all__ = ["compare", "Comparison"]


@dataclasses.dataclass
class Comparison:
    """What a comparison produced: the ``results.json`` document, where it lies, and the exit status."""

    doc: dict[str, Any]
    out_dir: str
    exit_code: int

    @property
    def rows(self) -> list[dict[str, Any]]:
        """One summary row per recipe (the table's numbers)."""
        return self.doc["summary"]

    def table(self) -> str:
        from .report import table

        return table(self.rows)

    @property
    def results_json(self) -> str:
        return os.path.join(self.out_dir, "results.json")

    @property
    def plots(self) -> list[str]:
        return list(self.doc.get("plots") or [])


def compare(model: Callable | str = "mlp", data: Callable | str = "fashion-mnist", *,
            precisions: Sequence[str] = ("fp32", "amp", "bf16-mixed"), repeats: int = 2, out: str | None = None,
            loss: Callable | str | None = None, **flags: Any) -> Comparison:
    """Train ``model`` on ``data`` under each recipe ``repeats`` times and compare them (see ``mixprec bench``).

    ``flags`` are ``mixprec bench`` flags by their Python names (``epochs=3``, ``batch_size=256``,
    ``max_steps=50``, ``no_plots=True``...). Returns a :class:`Comparison`; its ``table()`` is the printed table.
    """
    from ..cli import build_parser
    from .command import Session

    argv = ["bench", "--model", reference_of(model, "--model"), "--dataset", reference_of(data, "--dataset"),
            "--precisions", ",".join(precisions), "--repeats", str(repeats)]
    if out is not None:
        argv += ["--out", os.fspath(out)]
    if loss is not None:
        argv += ["--loss", reference_of(loss, "--loss")]
    for key, value in flags.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value not in (None, False):
            argv += [flag, ",".join(map(str, value)) if isinstance(value, (tuple, list)) else str(value)]
    session = Session()
    code = session.run(build_parser().parse_args(argv))
    return Comparison(doc=session.doc, out_dir=session.plan.out_dir, exit_code=code)
