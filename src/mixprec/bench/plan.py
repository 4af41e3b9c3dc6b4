"""Everything a bench decides before its first run, so a mistake exits 2 at once, not after an hour of runs.

:func:`plan` checks the :class:`~mixprec.bench.config.BenchConfig` and every recipe's own config (flag
contradictions per recipe), says per recipe what this machine does with its dtypes (the preflight),
builds the fp32 reference run once through the one build path (it checks the dataset and the model, and
its FLOPs are counted later), checks that warm-up leaves timed steps, lays out the (recipe, repeat)
matrix and makes sure the bench folder can be written. A resumed bench (``--resume``) also gets the runs
its folder already holds (:mod:`mixprec.bench.resume`) and runs only the others.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import math
import os

from .. import hardware
from ..errors import ConfigError
from ..precision import RecipeConfig, build_recipe
from ..train.build import Run, build_run
from ..train.config import TrainConfig
from ..train.outputs import check_folder
from .config import BenchConfig
from .preflight import Preflight, preflight
from .results import RunResult
from .resume import Previous
from .runner import RunSpec

__all__ = ["Plan", "plan"]


@dataclasses.dataclass
class Plan:
    """What one invocation will do."""

    config: BenchConfig
    """The bench, with ``out`` set to the folder actually used."""
    configs: dict[str, TrainConfig]
    """Recipe name -> its TrainConfig (the bench's, with this recipe and the flags that apply to it)."""
    checks: dict[str, Preflight]
    """Recipe name -> what this machine does with its dtypes."""
    reference: Run | None
    """The fp32 run the FLOPs are counted on (dropped once they are)."""
    specs: list[RunSpec]
    """Every (recipe, repeat) of the bench, repeat-major."""
    kept: list[RunResult]
    """Finished runs an earlier invocation left in the folder (``--resume``), kept as they are."""
    to_run: list[RunSpec]
    """The specs this invocation runs: all of them, or after ``--resume`` the missing and failed ones."""
    invocation: int
    """1 for a new bench, one more than the folder's last for a resumed one."""
    previous: Previous | None
    """What the resumed folder held (None for a new bench)."""

    @property
    def recipes(self) -> tuple[str, ...]:
        return self.config.precisions

    @property
    def base(self) -> TrainConfig:
        return self.config.train

    @property
    def out_dir(self) -> str:
        return self.config.out

    @property
    def accum(self) -> int:
        return self.base.optim.grad_accum


def plan(config: BenchConfig, previous: Previous | None = None) -> Plan:
    """Check every setting and recipe, build the reference run, lay out the matrix; raises UsageError
    (exit 2) before anything runs."""
    config.validate()
    base = config.train
    device = hardware.resolve_device(base.run.device)
    configs, checks = {}, {}
    for name in config.precisions:
        recipe_config, notes = base.recipe.for_recipe(name)
        configs[name] = dataclasses.replace(base, recipe=recipe_config)
        configs[name].validate()
        checks[name] = preflight(build_recipe(recipe_config, device=device, seed=base.run.seed), notes)
    reference = build_run(dataclasses.replace(base, recipe=RecipeConfig()))
    _check_warmup(config.warmup_steps, base, len(reference.train_loader))
    specs = [RunSpec(recipe=name, repeat=r, seed=seed, config=configs[name].with_flags(seed=seed).to_dict(),
                     warmup_steps=config.warmup_steps)
             for r, seed in enumerate(config.seeds) for name in config.precisions]
    out_dir = config.resume or config.out or os.path.join("runs", _dt.datetime.now().strftime("bench-%Y%m%d-%H%M%S"))
    _prepare_out_dir(out_dir)
    kept = previous.finished(specs) if previous is not None else []
    done = {(r.recipe, r.repeat) for r in kept}
    return Plan(config=dataclasses.replace(config, out=out_dir), configs=configs, checks=checks, reference=reference,
                specs=specs, kept=kept, to_run=[s for s in specs if (s.recipe, s.repeat) not in done],
                invocation=previous.invocation + 1 if previous is not None else 1, previous=previous)


def _check_warmup(warmup_steps: int, base: TrainConfig, n_batches: int) -> None:
    accum, max_steps = base.optim.grad_accum, base.optim.max_steps
    steps_per_epoch = math.ceil(n_batches / accum)
    first_epoch = min(steps_per_epoch, max_steps or steps_per_epoch)
    if warmup_steps >= first_epoch:
        raise ConfigError(
            f"--warmup-steps {warmup_steps} leaves no timed step: the first epoch has {first_epoch} steps "
            f"({n_batches} batches of {base.optim.batch_size}"
            + (f" / --grad-accum {accum}" if accum > 1 else "")
            + (f", --max-steps {max_steps}" if max_steps else "")
            + "); lower --warmup-steps or train longer")


def _prepare_out_dir(path: str) -> None:
    """Create the bench folder and test-write a file in it, so an unusable place exits 2 before the first run
    (the check train and doctor use: :func:`mixprec.train.outputs.check_folder`)."""
    check_folder(path, "--out")
