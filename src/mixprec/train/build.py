"""The one place a config becomes a run: :func:`build_run`.

``train``, bench's worker (through ``train``) and ``doctor`` (CLI and API) all call it; nothing else builds a
recipe, data, model, wrapper and optimizer for training. The order matters and lives only here: join the
process group (it picks this rank's device) → recipe (for that device and world size) → data → seeded
model → ``recipe.convert_module`` → DDP/FSDP wrapper → ``recipe.build_optimizer`` (over fp32 master copies
where the recipe has them) → the rank's loader.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .. import hardware
from ..errors import ConfigError
from ..precision import Recipe, build_recipe
from . import distributed
from .config import DataConfig, ModelConfig, OptimConfig, TrainConfig
from .data import Dataset, load_dataset
from .models import build_model
from .step import StepContext

__all__ = ["Run", "build_run", "optimizer_factory", "load_data", "model_from_config"]

OptimizerFactory = Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer]


@dataclasses.dataclass
class Run:
    """Everything a training run is made of; built once by :func:`build_run`."""

    config: TrainConfig
    env: distributed.DistEnv
    data: Dataset
    """The data source (in-memory tensors, or the batches a doctor user passed)."""
    train_loader: object
    """This rank's training batches: ``__iter__``, ``__len__`` and ``set_epoch(epoch)``."""
    ctx: StepContext
    """What a step needs: model, recipe, optimizer, loss, device, clip."""

    @property
    def model(self) -> nn.Module:
        return self.ctx.model

    @property
    def recipe(self) -> Recipe:
        return self.ctx.recipe

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.ctx.optimizer

    @property
    def loss_fn(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        return self.ctx.loss_fn

    @property
    def device(self) -> torch.device:
        return self.ctx.device

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size


def optimizer_factory(config: OptimConfig) -> OptimizerFactory:
    """``params -> optimizer`` for the config's optimizer (the recipe decides which tensors it gets)."""

    def make(params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
        params = list(params)
        if config.optimizer == "adamw":
            return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
        return torch.optim.SGD(params, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay)

    return make


def load_data(config: DataConfig, *, seed: int) -> Dataset:
    """The built-in dataset a data section names."""
    options = dataclasses.asdict(config)
    name = options.pop("name")
    options["synthetic_shape"] = tuple(options["synthetic_shape"])
    return load_dataset(name, seed=seed, **options)


def model_from_config(config: ModelConfig, data: Dataset) -> nn.Module:
    """The built-in model a model section names, shaped for ``data``."""
    options = dataclasses.asdict(config)
    name = options.pop("name")
    return build_model(name, input_shape=data.input_shape, num_classes=data.num_classes, **options)


@contextlib.contextmanager
def _allocation_is_a_usage_error(config: ModelConfig) -> Iterator[None]:
    """A model too big for this machine is a setting to change, not a crash: say how much was asked."""
    try:
        yield
    except RuntimeError as e:
        text = str(e)
        if "allocate" not in text and "out of memory" not in text.lower():
            raise
        asked = re.search(r"allocate (\d+) bytes", text)
        size = f" ({int(asked.group(1)) / 2**30:.1f} GiB for one tensor)" if asked else ""
        raise ConfigError(f"model {config.name} does not fit in memory{size}; lower its size flags "
                          "(--width, --depth, --channels, --d-model, --n-layers)") from None


def build_run(
    config: TrainConfig,
    *,
    data: Dataset | None = None,
    model: nn.Module | None = None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    make_optimizer: OptimizerFactory | None = None,
) -> Run:
    """Resolve device and recipe, load data, build, convert and wrap the model, create the optimizer.

    Under torchrun this joins the process group (``--strategy ddp|fsdp``) and shards the data by rank.

    Args:
        data, model, loss_fn, make_optimizer: use these instead of what the config names (the doctor API
            passes the user's batches, a copy of the user's module, their loss and optimizer). A given
            model is used as it is (not re-seeded); it is converted and wrapped like a built-in one.
    """
    config.validate()
    seed = config.run.seed
    env, device = distributed.setup(config.run.strategy, hardware.resolve_device(config.run.device))
    recipe = build_recipe(config.recipe, device=device, seed=seed, world_size=env.world_size)
    if data is None:
        data = load_data(config.data, seed=seed)
    with _allocation_is_a_usage_error(config.model):
        if model is None:
            torch.manual_seed(seed)
            model = model_from_config(config.model, data)
        model = recipe.convert_module(model)
    model = distributed.wrap_model(model, recipe, config.run.strategy, device)  # DDP / FSDP2, or as it is
    optimizer = recipe.build_optimizer(model, make_optimizer or optimizer_factory(config.optim))
    loader = data.loader(config.optim.batch_size, seed=seed, rank=env.rank, world_size=env.world_size)
    ctx = StepContext(model=model, recipe=recipe, optimizer=optimizer, loss_fn=loss_fn or F.cross_entropy,
                      device=device, clip_grad_norm=config.optim.clip_grad_norm)
    return Run(config=config, env=env, data=data, train_loader=loader, ctx=ctx)
