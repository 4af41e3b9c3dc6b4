"""What one bench is asked to do: :class:`BenchConfig`, built from ``mixprec bench``'s flags and from
:func:`mixprec.bench.compare`'s keywords alike, and stored in ``results.json``. Recipe names are stored canonical,
so a stored bench compares equal to the same bench asked for by an alias."""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Sequence
from typing import Any

from ..errors import ConfigError
from ..precision import resolve_recipe
from ..train.config import TrainConfig
from ..validate import flag_name, nonnegative_int, positive, positive_int

__all__ = ["BenchConfig", "parse_precisions", "BENCH_FLAGS", "RESUME_MAY_CHANGE", "MAX_REPEATS",
           "RUN_TRAIN_DEFAULTS", "SWITCHES", "bench_flag"]

MAX_REPEATS = 1000

RUN_TRAIN_DEFAULTS = {"log_every": 0, "progress": "off"}
"""Train settings bench runs with: no ``.item()`` or log line in the timed steps, no progress bar."""

_RUN_OUTPUTS = ("out", "checkpoint_every", "resume", "overwrite", "metrics_json")
"""Train settings bench owns: every run writes into the bench folder."""


def parse_precisions(precisions: str | Sequence[str]) -> tuple[str, ...]:
    """Canonical recipe names, in order, without repeats, from ``"fp32,amp"`` or ``["fp32", "amp"]``."""
    parts = precisions.split(",") if isinstance(precisions, str) else list(precisions)
    names = tuple(dict.fromkeys(resolve_recipe(str(p)).name for p in parts if str(p).strip()))
    if not names:
        text = precisions if isinstance(precisions, str) else ",".join(map(str, precisions))
        raise ConfigError(f"--precisions {text!r} names no recipe; e.g. --precisions fp32,amp,bf16-mixed")
    return names


def _default_train() -> TrainConfig:
    return TrainConfig.from_flags(**RUN_TRAIN_DEFAULTS)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """One bench: the runs' training settings and how the comparison is run and kept."""

    train: TrainConfig = dataclasses.field(default_factory=_default_train)
    """Every run's training settings; run r of a recipe uses seed ``train.run.seed + r``."""
    precisions: tuple[str, ...] = ("fp32", "fp16-mixed", "bf16-mixed")
    """The recipes to compare, canonical names in table order; fp32 is the reference of the comparisons."""
    repeats: int = 2
    """Runs per recipe, with seeds seed, seed+1, ... (parity needs >= 2)."""
    out: str | None = None
    """The bench folder: results.json, results.md, plots, runs/ and logs/ (None: runs/bench-YYYYmmdd-HHMMSS)."""
    warmup_steps: int = 3
    """Steps at the start of every epoch left out of the timings."""
    timeout: float | None = None
    """Give up on a run after this many seconds (its row says so); None: no limit."""
    peak_seconds: float = 1.0
    """Time budget of the peak-matmul micro-benchmark, per dtype."""
    plots: bool = True
    """Draw time.png, memory.png and loss.png."""
    predict: bool = True
    """Show the plan's predicted step peak and step time beside the measured ones (:mod:`mixprec.bench.predict`)."""
    resume: str | None = None
    """A bench folder to continue: its missing and failed runs are run (:mod:`mixprec.bench.resume`)."""

    def __post_init__(self) -> None:
        if isinstance(self.precisions, (str, list, tuple)):
            object.__setattr__(self, "precisions", parse_precisions(self.precisions))

    def validate(self) -> None:
        """Raise a UsageError naming the flag (per-recipe train settings: :func:`mixprec.bench.plan.plan`)."""
        if not isinstance(self.train, TrainConfig):
            raise ConfigError(f"BenchConfig.train must be a TrainConfig, got {type(self.train).__name__}")
        if not (isinstance(self.precisions, tuple) and self.precisions):
            raise ConfigError("--precisions names no recipe; e.g. --precisions fp32,amp,bf16-mixed")
        positive_int("repeats", self.repeats)
        if self.repeats > MAX_REPEATS:
            raise ConfigError(f"--repeats {self.repeats}: at most {MAX_REPEATS} (each repeat trains every recipe "
                              "once, in its own process)")
        nonnegative_int("warmup_steps", self.warmup_steps)
        positive("timeout", self.timeout, allow_none=True)
        positive("peak_seconds", self.peak_seconds)
        if not isinstance(self.plots, bool):
            raise ConfigError(f"plots must be True or False, got {self.plots!r}")
        if not isinstance(self.predict, bool):
            raise ConfigError(f"predict must be True or False, got {self.predict!r}")
        run = self.train.run
        if run.log_every:
            raise ConfigError(f"--log-every {run.log_every}: bench keeps logging and .item() out of the timed "
                              "steps; drop the flag (each run's output is in OUT/logs/)")
        if run.strategy not in ("auto", "none"):
            raise ConfigError(f"--strategy {run.strategy}: bench runs single-process; drop --strategy "
                              "(run `torchrun ... mixprec train --strategy ...` per recipe instead)")
        for name in _RUN_OUTPUTS:
            if getattr(run, name) not in (None, False):
                raise ConfigError(f"{flag_name(name)}: bench writes each run's results into its own folder "
                                  "(OUT/runs/); leave the train output settings unset")
        if self.resume is not None and self.out not in (None, self.resume):
            raise ConfigError(f"--out {self.out} with --resume {self.resume}: a resumed bench writes into the "
                              "folder it resumes; drop --out")

    @property
    def seeds(self) -> list[int]:
        return [self.train.run.seed + r for r in range(self.repeats)]

    # -- stored form (results.json) -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {**d, "train": self.train.to_dict(), "precisions": list(self.precisions)}

    @classmethod
    def from_dict(cls, d: Any) -> BenchConfig:
        """The inverse of :meth:`to_dict`; a damaged or foreign dict raises ConfigError."""
        if not isinstance(d, dict) or not isinstance(d.get("train"), dict):
            raise ConfigError("not a bench configuration (no train section)")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(f"unknown bench setting(s): {', '.join(unknown)}")
        try:
            return cls(**{**d, "train": TrainConfig.from_dict(d["train"])})
        except (TypeError, ValueError) as e:  # ValueError: a UsageError from a section, or a bad value
            raise ConfigError(f"damaged bench configuration: {e}") from None

    # -- the command that asks for it ---------------------------------------------------------------------
    def command(self) -> str:
        """The ``mixprec bench`` command line that starts this bench afresh (non-default settings only)."""
        default = BenchConfig()
        base = default.train.flags()
        changed = [(k, v) for k, v in self.train.flags().items() if k != "precision" and v != base[k]]
        changed += [(k, getattr(self, k)) for k in BENCH_FLAGS
                    if k != "resume" and getattr(self, k) != getattr(default, k)]
        parts = ["mixprec", "bench"]
        for name, value in changed:
            if name in SWITCHES:
                parts.append(SWITCHES[name])
            elif value is True:
                parts.append(flag_name(name))
            elif value not in (None, False):
                text = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
                parts += [flag_name(name), text]
        return shlex.join(parts)


SWITCHES = {"plots": "--no-plots", "predict": "--no-plan"}


def bench_flag(name: str) -> str:
    """The flag of a bench or train setting (``plots`` is ``--no-plots``)."""
    return SWITCHES.get(name) or flag_name(name)


BENCH_FLAGS = ("precisions", "repeats", "out", "warmup_steps", "timeout", "peak_seconds", "plots", "predict",
               "resume")

RESUME_MAY_CHANGE = ("timeout", "plots", "predict", "data_dir", "data_path")
"""Settings ``--resume`` may change; any other would make new rows measure something else than the kept ones."""

