"""The results document: ``results.json`` (schema ``mixprec.bench/3``) and ``results.md``, written atomically,
then the plots (a failed plot loses nothing: ``plots_error``)."""

from __future__ import annotations

import datetime as _dt
import os
from typing import Any

from ..jsonio import to_jsonable, write_json, write_text
from . import plots
from .aggregate import aggregate
from .console import say
from .machine import Machine
from .plan import Plan
from .predict import predictions
from .report import columns, markdown_report
from .results import RunResult
from .resume import SCHEMA

__all__ = ["build_document", "write_documents", "draw_plots", "ordered"]


def ordered(p: Plan, results: list[RunResult]) -> list[RunResult]:
    """``results`` in the bench's run order (repeat-major), whichever invocation ran them."""
    index = {(s.recipe, s.repeat): i for i, s in enumerate(p.specs)}
    return sorted(results, key=lambda r: index.get((r.recipe, r.repeat), len(index)))


def _now() -> str:
    return _dt.datetime.now().astimezone().isoformat(timespec="seconds")


def build_document(p: Plan, machine: Machine, results: list[RunResult], state: str) -> dict[str, Any]:
    """``results.json``'s content for the runs finished so far, as plain JSON data."""
    accum, flops, created = p.accum, machine.flops, _now()
    results = ordered(p, results)
    rows = aggregate(p.recipes, results, flops_per_step=flops.total * accum, peaks=machine.peaks,
                     matmul_dtype={n: p.checks[n].matmul_dtype for n in p.recipes},
                     impl={n: p.checks[n].impl for n in p.recipes},
                     predictions=predictions(machine.prediction))
    this = {"number": p.invocation, "created": created, "environment": machine.env, "peaks": machine.peaks,
            "runs": [r.name for r in results if r.invocation == p.invocation]}
    earlier = p.previous.invocations if p.previous is not None else []
    return to_jsonable({
        "schema": SCHEMA,
        "created": created,
        "command": p.config.command(),
        "invocation": p.invocation,
        "progress": {"state": state, "finished": len(results), "planned": len(p.specs)},
        "bench": p.config.to_dict(),
        "configs": {name: config.to_dict() for name, config in p.configs.items()},
        "seeds": p.config.seeds,
        "environment": machine.env,
        "preflight": [p.checks[n].to_dict() for n in p.recipes],
        "peaks": machine.peaks,
        "flops_per_step": {**flops.to_dict(), "micro_batches_per_step": accum, "per_step": flops.total * accum},
        "prediction": machine.prediction,
        "invocations": [i for i in earlier if i.get("number") != p.invocation] + [this],
        "columns": columns(rows),
        "summary": rows,
        "runs": results,
        "plots": [],
    })


def write_documents(out_dir: str, doc: dict[str, Any]) -> None:
    write_json(os.path.join(out_dir, "results.json"), doc)
    write_text(os.path.join(out_dir, "results.md"), markdown_report(doc))


def draw_plots(p: Plan, machine: Machine, doc: dict[str, Any]) -> None:
    """Draw the plots into ``doc["plots"]``; a failure is one line and ``doc["plots_error"]``."""
    title = (f"{p.base.model.name} on {p.base.data.name}, batch {p.base.optim.batch_size} — "
             f"{machine.env['device_name']}, {doc['created'][:10]}")
    try:
        doc["plots"] = plots.write_plots(doc["summary"], doc["runs"], p.out_dir, title=title)
    except Exception as e:  # noqa: BLE001 -- the results are written already; the plots are extra
        doc["plots_error"] = f"{type(e).__name__}: {e}"
        say(f"mixprec bench: plots failed: {doc['plots_error']} (results.json and results.md are complete)")
