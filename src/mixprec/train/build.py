"""The one place a config becomes a run: :func:`build_run`, called by ``train`` (and bench through it) and
``doctor``. The build order lives only here (docs/architecture.md): output and ``--resume`` checks → process
group and device → recipe → data → seeded model → :func:`probe` → ``recipe.convert_module`` → DDP/FSDP wrapper
→ ``recipe.build_optimizer`` → the rank's loader.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import hardware
from ..errors import ConfigError, one_line
from ..precision import Recipe, build_recipe
from . import distributed
from .config import DataConfig, ModelConfig, OptimConfig, TrainConfig
from .contract import Batch, ContractError, ModelCall, Objective, Output, as_batch, describe_output, parse_output
from .data.builtin import load_dataset
from .data.protocol import DataError, DataSource, Loader
from .data.sources import user_data
from .models import build_model
from .outputs import OutputLock, check_outputs
from .resume import check_resume, stored_config
from .schedule import LRSchedule, planned_steps
from .step import StepContext
from .tasks import LossOnly, Task, check_fit, infer_task, make_task
from .tasks import cross_entropy as tasks_cross_entropy
from .usercode import UserCodeError, call_declared, is_reference, load_callable

__all__ = ["Run", "build_run", "build_schedule", "optimizer_factory", "load_data", "model_from_config",
           "loss_from_config", "cross_entropy", "probe"]

OptimizerFactory = Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer]
LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


@dataclasses.dataclass
class Run:
    """Everything a training run is made of; built once by :func:`build_run`."""

    config: TrainConfig
    env: distributed.DistEnv
    data: DataSource
    """The data source (a built-in dataset, text, the user's data, or the batches a doctor user passed)."""
    train_loader: Loader
    """This rank's training batches: ``set_epoch(epoch)``, ``iter_from(batch)``, ``__iter__``, ``__len__``."""
    ctx: StepContext
    """What a step needs: model, recipe, optimizer, objective (call, task, loss), device, clip."""
    schedule: LRSchedule | None = None
    """The learning-rate schedule the loop applies before every optimizer step (None: the rate stays)."""
    lock: OutputLock | None = None
    """This process's hold on ``--out`` (the writing rank of a run with one); :func:`train` releases it."""
    notes: tuple[str, ...] = ()
    """What the run says once at its start about the data and the model contract (dtypes converted, keys
    left out of the call, labels not passed to a model that would shift them twice)."""

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
    def objective(self) -> Objective:
        return self.ctx.objective

    @property
    def task(self) -> Task:
        return self.ctx.objective.task

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
    """``params -> optimizer`` for the config's optimizer: fused where PyTorch has it for these tensors (plain
    fp32), else foreach; ``--optimizer module:callable`` is the user's factory (:mod:`.optimizers`), checked now.
    """

    if is_reference(config.optimizer):
        from .optimizers import user_optimizer_factory

        return user_optimizer_factory(config)
    betas = {} if config.betas is None else {"betas": tuple(config.betas)}

    def make(params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
        params = list(params)
        kind = _implementation(params)
        if config.optimizer == "adamw":
            return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay, **betas, **kind)
        return torch.optim.SGD(params, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay,
                               **kind)

    return make


def _implementation(params: list[torch.Tensor]) -> dict[str, bool]:
    plain = all(type(p) in (torch.Tensor, nn.Parameter) or _is_fake(p) for p in params)  # fake: mixprec plan
    fusable = plain and params and all(p.device.type in ("cpu", "cuda") and p.dtype in _FUSED_DTYPES for p in params)
    return {"fused": True} if fusable else {"foreach": True}


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


_FUSED_DTYPES = (torch.float32,)
"""fp32 only: torch 2.13's fused CPU SGD on bf16 parameters (bf16-true) did not learn digits where the for-loop
implementation does (tests/test_recipes.py); low-precision params get foreach."""


def build_schedule(config: TrainConfig, optimizer: torch.optim.Optimizer,
                   batches_per_epoch: int) -> tuple[TrainConfig, LRSchedule | None]:
    """The run's schedule over ``optimizer``'s groups, and the config with its total steps fixed (the planned
    optimizer steps, or a resumed run's checkpoint's, so extending a run does not re-shape the schedule)."""
    o = config.optim
    if o.lr_schedule == "constant" and not o.lr_warmup_steps:
        return config, None
    total = o.lr_total_steps
    if o.lr_schedule != "constant" and total is None:
        stored = stored_config(config.run.resume) if config.run.resume else None
        total = stored.optim.lr_total_steps if stored is not None else None
        total = total or planned_steps(o.epochs, batches_per_epoch, o.grad_accum, o.max_steps)
        config = config.with_flags(lr_total_steps=total)
    schedule = LRSchedule.for_optimizer(optimizer, kind=o.lr_schedule, lr=o.lr, warmup_steps=o.lr_warmup_steps,
                                        min_lr=o.min_lr, total_steps=total)
    return config, schedule


def load_data(config: DataConfig, *, seed: int, block_size: int = 64) -> DataSource:
    """The data source a data section names: a built-in dataset, text, or the user's factory."""
    if is_reference(config.name):
        return user_data(config.name, seed=seed)
    if config.name == "text":
        from .data.text import text_data

        return text_data(config.data_path, block_size=block_size, limit_test=config.limit_test)
    options = dataclasses.asdict(config)
    for key in ("name", "data_path", "num_workers"):
        options.pop(key)
    options["synthetic_shape"] = tuple(options["synthetic_shape"])
    return load_dataset(config.name, seed=seed, **options)


def model_from_config(config: ModelConfig, data: DataSource) -> nn.Module:
    """The model a model section names (built-in or the user's factory), shaped for ``data``."""
    vocab = getattr(data, "vocab_size", data.num_classes)
    offered = {"input_shape": tuple(data.input_shape), "num_classes": data.num_classes, "vocab_size": vocab,
               "block_size": getattr(data, "block_size", config.block_size)}
    if is_reference(config.name):
        model = call_declared(load_callable(config.name, "--model"), offered, ref=config.name, flag="--model")
        if not isinstance(model, nn.Module):
            raise UserCodeError(f"--model {config.name!r} returned {type(model).__name__}, not a torch.nn.Module")
        return model
    lm = data.task == "lm"
    if (config.name == "gpt") != lm:
        raise ConfigError(f"--model {config.name} and --dataset {data.name} do not go together: gpt is a language "
                          "model for --dataset text, the other built-in models classify"
                          + (" (use --model gpt or your own model)" if lm else " (use --dataset text)"))
    if lm:
        from .gpt import GPT

        return GPT(vocab, offered["block_size"], n_layers=config.n_layers, n_heads=config.n_heads,
                   d_model=config.d_model)
    return build_model(config, input_shape=data.input_shape, num_classes=data.num_classes)


def cross_entropy(outputs: Any, targets: torch.Tensor) -> torch.Tensor:
    """``--loss cross-entropy``: over the last dimension of the output's logits (a tensor, ``.logits``, a
    tuple's first): (B, C) logits with (B,) labels, or (B, T, V) with (B, T)."""
    return tasks_cross_entropy(outputs if isinstance(outputs, torch.Tensor) else parse_output(outputs).logits,
                               targets)


def loss_from_config(config: ModelConfig) -> LossFn | None:
    """The explicit loss a config names, or None for ``auto`` (the model's own loss, else the task's)."""
    if config.loss == "auto":
        return None
    if config.loss == "cross-entropy":
        return cross_entropy
    if is_reference(config.loss):
        return load_callable(config.loss, "--loss")
    raise ConfigError(f"unknown --loss {config.loss!r}; use auto, cross-entropy or package.module:callable")


def probe(model: nn.Module, data: DataSource, config: TrainConfig, loss_fn: LossFn | None, *,
          seed: int = 0) -> tuple[Objective, tuple[str, ...]]:
    """One no-grad forward of two samples through the model contract: settles the task and returns the run's
    objective and what the run says once. User code that does not fit raises UserCodeError / ContractError."""
    call = ModelCall(model)
    batch = _probe_batch(data, seed)
    first = next(iter(model.parameters()), None)
    if first is not None and first.device.type != "cpu":  # a module handed over on its device (the APIs)
        batch = batch.to(first.device)
    who = f"--model {config.model.name}"
    notes: list[str] = []
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = _forward(call, model, batch, who)
            task, note = _settle_task(out, batch, data, config, loss_fn)
            notes += note
            if task.name == "lm" and loss_fn is None and out.loss is not None:
                shifted = _shifted_inside(out, batch)
                if shifted and _targets_are_next_tokens(batch):
                    call.pass_targets = False
                    notes.append(f"{call.name} shifts its labels inside forward and the data's targets are already "
                                 "the next tokens: mixprec does not pass them to forward (they would be shifted "
                                 "twice) and trains it with cross-entropy on its logits")
                    out = _forward(call, model, batch, who)
                elif shifted is not False:
                    task = make_task("lm", unit=task.unit, aligned=False)
                    notes.append(f"{call.name} computes its loss on labels shifted inside forward"
                                 + ("" if shifted else " (or on something mixprec cannot tell)")
                                 + ": test loss, perplexity and bits are the model's, token accuracy is not "
                                 "reported")
            objective = Objective(call, task, loss_fn)
            loss = _loss(objective, out, batch, config)
            if task.n_sums and out.logits is not None and batch.targets is not None:
                task.sums(out.logits, batch.targets)
    finally:
        model.train(was_training)
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
        raise UserCodeError(f"--loss {config.model.loss} returned {type(loss).__name__}"
                            f"{'' if not isinstance(loss, torch.Tensor) else f' of shape {tuple(loss.shape)}'}; "
                            "it must return a scalar tensor")
    notes.insert(0, _task_line(objective, config, out))
    if call.dropped:
        notes.append(f"the batches' keys {', '.join(repr(k) for k in call.dropped)} are not arguments of "
                     f"{call.name}.forward: they are left out of the call")
    return objective, tuple(notes)


def _task_line(objective: Objective, config: TrainConfig, out: Output) -> str:
    """``task regression (inferred): trained with ..., judged by test r2``."""
    task = objective.task
    how = "--task" if config.model.task != "auto" else "inferred"
    loss = (f"--loss {config.model.loss}" if objective.loss_fn is not None
            else f"{objective.call.name}'s own loss" if out.loss is not None else f"the task's {_LOSS_NAMES[task.name]}")
    return f"task {task.name} ({how}): trained with {loss}, judged by test {task.main}"


_LOSS_NAMES = {"classify": "cross-entropy", "binary": "BCE with logits", "multilabel": "BCE with logits",
               "regression": "MSE", "lm": "cross-entropy", "loss": "loss"}


def _probe_batch(data: DataSource, seed: int) -> Batch:
    """Two samples: of the test split (as before any training), else of the first training batch."""
    if data.n_test:
        raw = next(iter(data.eval_batches(torch.arange(min(2, data.n_test)), 2)), None)
    else:
        raw = next(iter(data.loader(2, seed=seed, num_workers=0)), None)
    if raw is None:
        raise DataError(f"--dataset {data.name}: no batches to train on (the data is empty)")
    return as_batch(raw).head(2)


def _forward(call: ModelCall, model: nn.Module, batch: Batch, who: str) -> Output:
    try:
        return call(model, batch)
    except ContractError:
        raise
    except Exception as e:  # noqa: BLE001 -- the user's model does not take the data's inputs
        raise UserCodeError(f"{who} does not fit the data: called with {batch.describe()} it raised "
                            f"{one_line(e)}") from None


def _settle_task(out: Output, batch: Batch, data: DataSource, config: TrainConfig,
                 loss_fn: LossFn | None) -> tuple[Task, list[str]]:
    """The task: ``--task``, else inferred; its targets checked against the logits (values included)."""
    asked = config.model.task
    targets = batch.targets
    if asked == "auto":
        try:
            name = infer_task(out.logits, targets, hint=data.task)
        except ContractError:
            if loss_fn is None:
                raise
            return LossOnly(), [f"the targets ({_text(targets)}) fit no task mixprec knows against logits "
                                f"{_text(out.logits)}: --loss {config.model.loss} trains it and only the test loss "
                                "is reported (--task names a task)"]
    else:
        name = asked
    if not (name == "lm" and out.logits is None and out.loss is not None):
        check_fit(name, out.logits, targets)
    if name == "classify" and data.num_classes > out.logits.shape[-1]:
        raise UserCodeError(f"--model {config.model.name} does not fit --dataset {config.data.name}: the labels "
                            f"go up to {data.num_classes - 1} but the model outputs {out.logits.shape[-1]} classes; "
                            f"make it output {data.num_classes}")
    from .data.text import TextCorpus

    return make_task(name, targets=targets, unit="char" if isinstance(data, TextCorpus) else "token"), []


def _text(t: Any) -> str:
    return f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}" if isinstance(t, torch.Tensor) else "none"


def _shifted_inside(out: Output, batch: Batch) -> bool | None:
    """Whether the model's own loss is cross-entropy on its logits shifted one position against the labels
    (True), on the logits as they are (False), or neither (None)."""
    logits, y = out.logits, batch.targets
    if logits is None or y is None or logits.dim() != 3 or logits.shape[:2] != y.shape or y.shape[1] < 2:
        return None
    own = float(out.loss)
    v = logits.shape[-1]
    aligned = float(F.cross_entropy(logits.float().reshape(-1, v), y.reshape(-1)))
    shifted = float(F.cross_entropy(logits[:, :-1].float().reshape(-1, v), y[:, 1:].reshape(-1)))
    tol = 1e-3 * max(1.0, abs(own))
    near_a, near_s = abs(own - aligned) <= tol, abs(own - shifted) <= tol
    if near_a == near_s:
        return None if not near_a else False  # both: the labels do not tell (take them as aligned)
    return near_s


def _targets_are_next_tokens(batch: Batch) -> bool:
    """Whether the targets are the inputs moved one position left (the data did the shift already)."""
    y = batch.targets
    x = batch.args[0] if batch.args else next((v for k, v in batch.kwargs.items() if k == "input_ids"), None)
    return (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.shape == y.shape and x.dim() == 2
            and x.shape[1] > 1 and torch.equal(x[:, 1:], y[:, :-1]))


def _loss(objective: Objective, out: Output, batch: Batch, config: TrainConfig) -> Any:
    try:
        return objective.loss(out, batch)
    except ContractError:
        raise
    except Exception as e:  # noqa: BLE001 -- the loss does not take this output and these targets
        which = (f"--loss {config.model.loss}" if objective.loss_fn is not None
                 else f"the {objective.task.name} task's loss")
        raise UserCodeError(f"{which} failed on the model's output ({describe_output(out.raw)}) and the targets "
                            f"({_text(batch.targets)}): {one_line(e)}") from None


def default_objective(model: nn.Module, data: DataSource, loss_fn: LossFn | None) -> Objective:
    """A built-in model on a built-in dataset: no probe, the data source's task (the golden path)."""
    from .data.text import TextCorpus

    unit = "char" if isinstance(data, TextCorpus) else "token"
    return Objective(ModelCall(model), make_task(data.task, unit=unit), loss_fn)


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
    data: DataSource | None = None,
    model: nn.Module | None = None,
    loss_fn: LossFn | None = None,
    make_optimizer: OptimizerFactory | None = None,
) -> Run:
    """Resolve device and recipe, load data, build, convert and wrap the model, create the optimizer.

    ``data``, ``model``, ``loss_fn``, ``make_optimizer`` replace what the config names; a given model is not
    re-seeded but is converted and wrapped; ``loss_fn(output, targets)`` gets the model's raw output.
    """
    config.validate()
    lock = check_outputs(config.run, lock=True)
    check_resume(config)
    config = config.with_flags(strategy=distributed.resolve_strategy(config.run.strategy))
    make_optimizer = make_optimizer or optimizer_factory(config.optim)  # a user factory is imported now
    seed = config.run.seed
    env, device = distributed.setup(config.run.strategy, hardware.resolve_device(config.run.device))
    recipe = build_recipe(config.recipe, device=device, seed=seed, world_size=env.world_size)
    if data is None:
        data = load_data(config.data, seed=seed, block_size=config.model.block_size)
    loss_fn = loss_fn or loss_from_config(config.model)
    with _allocation_is_a_usage_error(config.model):
        given = model is not None
        if model is None:
            torch.manual_seed(seed)
            model = model_from_config(config.model, data)
        if given or data.task is None or config.model.task != "auto" \
                or any(is_reference(n) for n in (config.model.name, config.data.name, config.model.loss)):
            objective, notes = probe(model, data, config, loss_fn, seed=seed)
        else:
            objective, notes = default_objective(model, data, loss_fn), ()
        model = recipe.convert_module(model)
    model = distributed.wrap_model(model, recipe, config.run.strategy, device)  # DDP / FSDP2, or as it is
    compiles, why = recipe.compiles(config.run.compile)
    config = dataclasses.replace(config, run=dataclasses.replace(config.run, compile="on" if compiles else "off"))
    if compiles:
        recipe.check_compile()
        model.compile()  # in place: state-dict keys and the module object stay the same
    optimizer = recipe.build_optimizer(model, make_optimizer)
    loader = data.loader(config.optim.batch_size, seed=seed, rank=env.rank, world_size=env.world_size,
                         num_workers=config.data.num_workers, device=device)
    config, schedule = build_schedule(config, optimizer, len(loader))
    ctx = StepContext(model=model, recipe=recipe, optimizer=optimizer, objective=objective,
                      device=device, clip_grad_norm=config.optim.clip_grad_norm)
    reads = recipe.step_reads(optimizer)  # where the training loop's steps still wait for the device, and why
    return Run(config=config, env=env, data=data, train_loader=loader, ctx=ctx, schedule=schedule, lock=lock,
               notes=tuple(data.notes) + tuple(notes) + ((why,) if why else ()) + ((reads,) if reads else ()))
