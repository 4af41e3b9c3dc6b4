"""One bench invocation, start to end: plan → measure the machine → predict → run the matrix → report.

Every finished run is in ``OUT/runs/RECIPE-rN.json`` and the reports are rewritten after each, so an interrupt
loses nothing (``--resume OUT`` runs the rest). Exit status: 0; 1 when a run failed or the report could not be
written; 2 for usage errors (raised); 128 + the signal number when interrupted.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any

from ..errors import OutputError
from ..train.outputs import OutputLock
from .config import BenchConfig
from .console import announce, progress_line, say
from .document import build_document, draw_plots, write_documents
from .machine import Machine, measure_machine
from .plan import Plan, plan
from .predict import predict
from .report import table
from .results import RunResult
from .resume import load_previous
from .runner import execute_matrix, signal_of

__all__ = ["Session"]


class Session:
    """One invocation's state, so an interrupt at any point knows what there is to keep."""

    def __init__(self, config: BenchConfig) -> None:
        self.config = config
        self.plan: Plan | None = None
        self.machine: Machine | None = None
        self.results: list[RunResult] = []
        """The kept runs of a resumed bench, then this invocation's."""
        self.doc: dict[str, Any] | None = None
        self.lock: OutputLock | None = None
        self.predicting = False

    def run(self) -> int:
        """The exit status. After an interrupt the folder stays held until :meth:`interrupted` has run."""
        interrupted = False
        try:
            return self._run()
        except KeyboardInterrupt:
            interrupted = True
            raise
        finally:
            if not interrupted:
                self.release()

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()

    def _run(self) -> int:
        given = self.config.resume or self.config.out
        if given is not None and os.path.isdir(given):  # a live bench there is named before anything is read
            self.lock = OutputLock.acquire(given, command="mixprec bench")
        previous = None
        if self.config.resume is not None:
            previous = load_previous(self.config.resume)
            previous.check_same_bench(self.config)
        self.plan = plan(self.config, previous)
        if self.lock is None:
            self.lock = OutputLock.acquire(self.plan.out_dir, command="mixprec bench")
        self.machine = measure_machine(self.plan)
        announce(self.plan, self.machine)
        self.predicting = True
        self.machine = dataclasses.replace(self.machine, prediction=predict(self.plan, self.machine, say=say))
        self.predicting = False
        self.results = list(self.plan.kept)
        execute_matrix(self.plan.to_run, self.plan.out_dir, timeout=self.config.timeout, on_done=self.finished,
                       invocation=self.plan.invocation)
        return self.report()

    def finished(self, i: int, n: int, result: RunResult) -> None:
        self.results.append(result)
        progress_line(i, n, result)
        try:
            write_documents(self.plan.out_dir, build_document(self.plan, self.machine, self.results, "running"))
        except OutputError as e:
            print(f"mixprec bench: warning: {e}; the run's own result is in {self.plan.out_dir}/runs/",
                  file=sys.stderr, flush=True)

    def report(self) -> int:
        p = self.plan
        doc = self.doc = build_document(p, self.machine, self.results, "complete")
        say("")
        say(table(doc["summary"]))
        try:
            write_documents(p.out_dir, doc)  # before the plots: a plot that fails or hangs loses nothing
            if p.config.plots:
                draw_plots(p, self.machine, doc)
                write_documents(p.out_dir, doc)
        except OutputError as e:
            print(f"mixprec bench: {e}; each run's result is in {p.out_dir}/runs/", file=sys.stderr)
            return 1
        say(f"\nwrote {p.out_dir}/results.json, results.md" + (", " + ", ".join(doc["plots"]) if doc["plots"] else "")
            + " and logs/")
        failed = sum(not r.ok for r in self.results)
        if failed:
            say(f"mixprec bench: {failed} of {len(self.results)} runs failed; their rows and {p.out_dir}/logs/ say why")
        return 1 if failed else 0

    def interrupted(self, e: BaseException) -> int:
        """Write what the finished runs give, say what was kept; 128 + the signal number."""
        sig = signal_of(e)
        p, done = self.plan, len(self.results)
        head = f"mixprec bench: interrupted by {sig.name}"
        if p is None or self.machine is None:
            print(f"{head} before the first run; nothing was run", file=sys.stderr, flush=True)
            self.release()
            return 128 + sig
        ran = done - len(p.kept)  # finished in this invocation
        if self.predicting:
            head += " while the planner predicted the recipes (before the first run), its process stopped"
        elif ran < len(p.to_run):
            spec = p.to_run[ran]
            head += (f" during {spec.recipe} seed {spec.seed} (run {ran + 1} of {len(p.to_run)}"
                     + (" in this invocation" if p.kept else "") + "), its worker stopped")
        else:
            head += " while writing the report"
        try:
            write_documents(p.out_dir, build_document(p, self.machine, self.results, f"interrupted by {sig.name}"))
            kept = (f"kept the {done} finished run{'s' if done != 1 else ''}: "
                    f"{os.path.join(p.out_dir, 'results.json')} (partial), results.md and runs/*.json; "
                    f"--resume {p.out_dir} runs the rest"
                    if done else f"no run had finished; the started run's log is in {p.out_dir}/logs/")
        except OutputError as err:
            kept = f"could not write the report ({err}); finished runs are in {p.out_dir}/runs/"
        print(f"{head}; {kept}", file=sys.stderr, flush=True)
        self.release()
        return 128 + sig
