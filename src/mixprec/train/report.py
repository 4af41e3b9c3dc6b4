"""What a training run shows: log lines, a progress bar on terminals only, per-epoch lines, the summary table.

Log lines go to stdout exactly as the tutorial prints them. The progress bar (rich) appears only when
stdout is a terminal, so piped logs stay clean; ``--progress on|off`` overrides the detection.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Iterator
from typing import Any

from .results import EpochRecord, RunSummary

__all__ = ["Reporter", "summary_table", "quality", "format_bytes"]


def format_bytes(n: float | None) -> str:
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "—"
    return f"{n / 2**20:.2f} MiB"


def write_line(stream, msg: str) -> None:
    """One line in one write: under torchrun every rank shares the terminal, and ``print`` writes the text and its
    newline separately when unbuffered, so another rank's line could land between them."""
    stream.write(msg + "\n")
    stream.flush()


class _NoBar:
    def advance(self, n: int = 1) -> None:
        pass


class _RichBar:
    def __init__(self, progress, task) -> None:
        self._p, self._t = progress, task

    def advance(self, n: int = 1) -> None:
        self._p.advance(self._t, n)


class Reporter:
    """Prints the run's output; one instance per run."""

    def __init__(self, *, progress: str = "auto", stream=None, rank: int = 0) -> None:
        self.stream = stream or sys.stdout
        self.rank = rank
        isatty = getattr(self.stream, "isatty", lambda: False)()
        self.show_progress = rank == 0 and (progress == "on" or (progress == "auto" and isatty))
        self._progress = None

    def _print(self, msg: str, *, err: bool = False) -> None:
        if self.rank != 0:
            return
        if self._progress is not None and not err:
            self._progress.console.print(msg, markup=False, highlight=False, soft_wrap=True)
        else:
            write_line(sys.stderr if err else self.stream, msg)

    def log(self, msg: str) -> None:
        self._print(msg)

    def info(self, msg: str) -> None:
        self._print(msg)

    def error(self, msg: str) -> None:
        self._print(f"mixprec: {msg}", err=True)

    def stopped(self, msg: str, *, step: int, world_size: int = 1) -> None:
        """Why the run stops, on stderr. Under torchrun every rank logs it, prefixed with its rank and the step
        it stopped at (the same on every rank); one process prints it as :meth:`error` does."""
        if world_size == 1:
            self.error(msg)
            return
        # one write (print writes the newline apart), so the ranks' lines do not interleave on a shared stderr
        sys.stderr.write(f"mixprec: [rank {self.rank} of {world_size}, step {step}] {msg}\n")
        sys.stderr.flush()

    def epoch_done(self, rec: EpochRecord, recipe: str) -> None:
        mem = rec.memory or {}
        self._print(
            f"[{recipe}] epoch {rec.epoch}: train loss {rec.train_loss:.4f}, {quality(rec)}, "
            f"{rec.epoch_time_s:.2f} s ({rec.samples_per_s:,.0f} samples/s), "
            f"memory {format_bytes(mem.get('total'))}, skipped steps {rec.skipped_steps}, "
            f"loss scale {rec.loss_scale:g}"
        )

    def summary(self, table: str) -> None:
        self._print("\n" + table)

    @contextlib.contextmanager
    def progress_bar(self, *, total: int, completed: int = 0) -> Iterator[_NoBar | _RichBar]:
        if not self.show_progress:
            yield _NoBar()
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        progress = Progress(
            TextColumn("training"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
            console=Console(file=self.stream, force_terminal=True), transient=True,
        )
        task = progress.add_task("train", total=total, completed=completed)
        self._progress = progress
        try:
            with progress:
                yield _RichBar(progress, task)
        finally:
            self._progress = None


def quality(rec: EpochRecord) -> str:
    """How good the model is, in the task's terms: accuracy; accuracy and F1; R², MSE and MAE; a language
    model's loss, perplexity and bits per char (or token)."""
    if rec.task == "lm":
        unit, bits = ("char", rec.bits_per_char) if rec.bits_per_char is not None else ("token", rec.bits_per_token)
        return (f"test loss {rec.test_loss:.4f}, perplexity {_num(rec.test_perplexity, '.2f')}, "
                f"{_num(bits, '.3f')} bits/{unit}")
    if rec.task == "regression":
        return (f"test R² {_num(rec.test_r2, '.4f')}, MSE {_num(rec.test_mse, '.4g')}, "
                f"MAE {_num(rec.test_mae, '.4g')}")
    if rec.task == "multilabel":
        return f"test F1 {_num(rec.test_f1, '.4f')}, per-label accuracy {_pct(rec.test_accuracy)}"
    if rec.task == "binary":
        return f"test accuracy {_pct(rec.test_accuracy)}, F1 {_num(rec.test_f1, '.4f')}"
    if rec.task == "loss":
        return f"test loss {rec.test_loss:.4f}"
    return f"test accuracy {_pct(rec.test_accuracy)}"


_HEADS = {"test_accuracy": "test accuracy", "test_f1": "test F1", "test_r2": "test R²",
          "test_loss": "test loss"}


def _main_cell(r: RunSummary) -> str:
    if r.task == "lm":
        bits = r.bits_per_char if r.bits_per_char is not None else r.bits_per_token
        return f"{r.test_loss:.4f} / {bits:.3f}" if _finite(bits) else "—"
    if r.metric == "test_accuracy":
        return _pct(r.test_accuracy)
    return _num(r.main, ".4f")


def summary_table(rows: list[RunSummary]) -> str:
    """The tutorial's comparison table: recipe | peak memory | avg epoch time | main metric | skipped | scale."""
    first = rows[0] if rows else None
    if first is not None and first.task == "lm":
        quality_head = f"test loss / bits per {'char' if first.bits_per_char is not None else 'token'}"
    else:
        quality_head = _HEADS.get(first.metric if first else "test_accuracy", "test accuracy")
    head = ["recipe", "peak memory", "avg epoch time", quality_head, "skipped steps", "final loss scale"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        cuda = r.cuda_peak_allocated_bytes
        mem = format_bytes(r.peak_memory_bytes) + (f" (CUDA peak {format_bytes(cuda)})" if cuda else "")
        lines.append("| " + " | ".join([
            r.recipe,
            mem,
            f"{r.avg_epoch_time_s:.2f} s" if _finite(r.avg_epoch_time_s) else "—",
            _main_cell(r),
            str(r.skipped_steps),
            f"{r.final_loss_scale:g}",
        ]) + " |")
    return "\n".join(lines)


def _pct(x: Any) -> str:
    return f"{100 * x:.2f}%" if _finite(x) else "—"


def _num(x: Any, spec: str) -> str:
    return format(x, spec) if _finite(x) else "—"


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)
