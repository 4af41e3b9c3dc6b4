"""``mixprec bench --resume DIR``: continue an interrupted (or partly failed) bench in its own folder.

The bench is the one ``DIR/results.json`` describes; the command line may change only
:data:`~mixprec.bench.config.RESUME_MAY_CHANGE`. A run is kept when ``DIR/runs/RECIPE-rN.json`` holds a successful
result of that recipe, repeat and seed; every other runs again. Each row carries the number of the invocation
that ran it, and ``results.json`` lists the invocations with their peaks.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable
from typing import Any

from ..errors import ConfigError
from .config import BENCH_FLAGS, RESUME_MAY_CHANGE, BenchConfig, bench_flag
from .results import RunResult

__all__ = ["Previous", "load_previous", "resume_config", "check_resume_changes", "changed_settings", "SCHEMA"]

SCHEMA = "mixprec.bench/3"
"""``results.json``'s schema: the one this version writes and resumes."""


@dataclasses.dataclass(frozen=True)
class Previous:
    """What a bench folder holds from its earlier invocations."""

    path: str
    config: BenchConfig
    invocation: int
    """The number of its last invocation."""
    invocations: list[dict[str, Any]]

    def finished(self, specs: Iterable[Any]) -> list[RunResult]:
        """The successful results the folder holds for these specs, in spec order."""
        kept = []
        for spec in specs:
            result = RunResult.from_dict(_read_json(os.path.join(self.path, "runs", f"{spec.name}.json")))
            if result.ok and (result.recipe, result.repeat, result.seed) == (spec.recipe, spec.repeat, spec.seed):
                kept.append(result if result.invocation else dataclasses.replace(result, invocation=self.invocation))
        return kept

    def check_same_bench(self, config: BenchConfig) -> None:
        """Refuse ``config`` when it differs from this folder's bench beyond :data:`RESUME_MAY_CHANGE`."""
        changed = [n for n in changed_settings(self.config, config) if n not in ("out", "resume")]
        check_resume_changes(self.path, changed)


def changed_settings(a: BenchConfig, b: BenchConfig) -> list[str]:
    """The settings (by Python name) in which ``b`` differs from ``a``."""
    fa, fb = a.train.flags(), b.train.flags()
    return ([k for k in BENCH_FLAGS if getattr(a, k) != getattr(b, k)]
            + [k for k in fa if fa[k] != fb.get(k)])


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def load_previous(path: str) -> Previous:
    """Read the bench folder ``path``; ConfigError when this version cannot continue it."""
    head = f"--resume {path}"
    if not os.path.exists(path):
        raise ConfigError(f"{head}: no such folder; pass the --out folder of an earlier mixprec bench")
    if not os.path.isdir(path):
        raise ConfigError(f"{head} is a file, not a bench folder; pass the --out folder of an earlier mixprec bench")
    results = os.path.join(path, "results.json")
    if not os.path.isfile(results):
        raise ConfigError(f"{head}: not a bench folder (no results.json); pass the --out folder of an earlier "
                          "mixprec bench")
    try:
        with open(results, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{head}: {results} is damaged ({type(e).__name__}: {e}); cannot resume it, start a "
                          "new bench") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        found = doc.get("schema") if isinstance(doc, dict) else type(doc).__name__
        raise ConfigError(f"{head}: {results} is not a results.json this version continues (schema {found!r}, "
                          f"expected {SCHEMA!r}); start a new bench")
    try:
        config = BenchConfig.from_dict(doc.get("bench"))
    except ConfigError as e:
        raise ConfigError(f"{head}: {results} is damaged ({e}); cannot resume it, start a new bench") from None
    invocations = [i for i in doc.get("invocations") or [] if isinstance(i, dict)]
    number = doc.get("invocation")
    if not (isinstance(number, int) and not isinstance(number, bool) and number >= 1):
        raise ConfigError(f"{head}: {results} is damaged (invocation {number!r}); cannot resume it, start a new bench")
    return Previous(path=path, config=config, invocation=number, invocations=invocations)


def check_resume_changes(path: str, given: Iterable[str]) -> None:
    """Refuse the first setting in ``given`` that a resumed bench may not change."""
    for name in given:
        if name not in RESUME_MAY_CHANGE and name != "resume":
            shown = bench_flag(name)
            allowed = ", ".join(bench_flag(n) for n in RESUME_MAY_CHANGE)
            raise ConfigError(f"--resume {path}: {shown} cannot change in a resumed bench (the runs it keeps "
                              f"were measured with the folder's settings); it may change only {allowed} — drop "
                              f"{shown}, or start a new bench with --out")


def resume_config(path: str, changes: dict[str, Any]) -> BenchConfig:
    """The bench of folder ``path`` with ``changes`` applied (only those :data:`RESUME_MAY_CHANGE` allows, checked
    before anything is read)."""
    check_resume_changes(path, changes)
    previous = load_previous(path)
    config = previous.config
    bench = {k: v for k, v in changes.items() if k in BENCH_FLAGS and k != "resume"}
    train = {k: v for k, v in changes.items() if k not in BENCH_FLAGS}
    return dataclasses.replace(config, train=config.train.with_flags(**train) if train else config.train,
                               out=path, resume=path, **bench)
