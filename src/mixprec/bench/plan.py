"""Everything a bench decides before its first run, so a mistake exits 2 at once, not after an hour of runs:
every recipe's config checked, the preflight, the fp32 reference run built, warm-up checked, the (recipe, repeat)
matrix laid out, the folder writable; after ``--resume`` only the runs the folder lacks (:mod:`.resume`)."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import math
import os

from .. import hardware
from ..errors import ConfigError
from ..precision import RecipeConfig, build_recipe, layers_entry
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
    configs: dict[str, TrainConfig]
    checks: dict[str, Preflight]
    reference: Run | None
    """The fp32 run the FLOPs are counted on (dropped once they are)."""
    specs: list[RunSpec]
    """Repeat-major."""
    kept: list[RunResult]
    """Finished runs of earlier invocations (``--resume``)."""
    to_run: list[RunSpec]
    invocation: int
    """1 for a new bench, one more than the folder's last for a resumed one."""
    previous: Previous | None
    recipes: tuple[str, ...] = ()
    """The rows, in table order: ``--precisions``, then ``<base>+layers`` with a layer-formats file
    (:func:`mixprec.precision.layers_entry`)."""

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
    """Raises UsageError (exit 2) before anything runs."""
    config.validate()
    base = config.train
    device = hardware.resolve_device(base.run.device)
    configs, checks = {}, {}
    layered = layers_entry(base.recipe, config.precisions)
    recipes = config.precisions + ((layered,) if layered else ())
    for name in recipes:
        recipe_config, notes = base.recipe.for_recipe(name)
        configs[name] = dataclasses.replace(base, recipe=recipe_config)
        configs[name].validate()
        checks[name] = preflight(build_recipe(recipe_config, device=device, seed=base.run.seed), notes)
    reference = build_run(dataclasses.replace(base, recipe=RecipeConfig()))
    _check_warmup(config.warmup_steps, base, len(reference.train_loader))
    specs = [RunSpec(recipe=name, repeat=r, seed=seed, config=configs[name].with_flags(seed=seed).to_dict(),
                     warmup_steps=config.warmup_steps)
             for r, seed in enumerate(config.seeds) for name in recipes]
    out_dir = config.resume or config.out or os.path.join("runs", _dt.datetime.now().strftime("bench-%Y%m%d-%H%M%S"))
    _prepare_out_dir(out_dir)
    kept = previous.finished(specs) if previous is not None else []
    done = {(r.recipe, r.repeat) for r in kept}
    return Plan(config=dataclasses.replace(config, out=out_dir), configs=configs, checks=checks, reference=reference,
                specs=specs, kept=kept, to_run=[s for s in specs if (s.recipe, s.repeat) not in done],
                invocation=previous.invocation + 1 if previous is not None else 1, previous=previous,
                recipes=recipes)


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
    check_folder(path, "--out")
