"""Training configuration in sections: one small frozen dataclass per component, the one place a default lives.

``TrainConfig`` holds :class:`ModelConfig`, :class:`DataConfig`, :class:`~mixprec.precision.RecipeConfig`,
:class:`OptimConfig` and :class:`RunConfig`. :meth:`TrainConfig.from_flags` / :meth:`TrainConfig.flags` are the
flat flag view; :meth:`TrainConfig.to_dict` / :meth:`TrainConfig.from_dict` the nested form in checkpoints and
``results.json`` (``from_dict`` also reads flat dicts). Recipe names are canonical, so equal runs have equal
configs. Defaults reproduce the tutorial (SimpleNet on Fashion-MNIST, SGD lr 0.01, batch 64, 5 epochs).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..errors import ConfigError, RecipeError
from ..precision import RecipeConfig, ScalerConfig, resolve_recipe
from ..validate import F32_MAX, is_int, is_real, nonnegative, nonnegative_int, one_of, positive, positive_int
from .schedule import SCHEDULES
from .tasks import TASKS
from .usercode import is_reference

__all__ = ["TrainConfig", "ModelConfig", "DataConfig", "OptimConfig", "RunConfig", "OPTIMIZERS", "STRATEGIES",
           "PROGRESS", "COMPILE", "SCHEDULES"]

OPTIMIZERS = ("sgd", "adamw")
STRATEGIES = ("auto", "none", "ddp", "fsdp")
PROGRESS = ("auto", "on", "off")
COMPILE = ("auto", "on", "off")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    name: str = "simplenet"
    """A built-in model (simplenet, mlp, cnn, transformer, gpt) or user code, ``package.module:callable`` or
    ``path/to/file.py:callable`` returning an ``nn.Module`` (flag ``--model``)."""
    width: int = 512
    """mlp: hidden width."""
    depth: int = 2
    """mlp: number of hidden layers."""
    channels: int = 32
    """cnn: base number of channels."""
    d_model: int = 128
    """transformer: embedding width."""
    n_heads: int = 4
    """transformer: attention heads."""
    n_layers: int = 2
    """transformer: encoder blocks."""
    patch_size: int = 7
    """transformer: image patch size."""
    block_size: int = 64
    """gpt and text data: context length in tokens."""
    loss: str = "auto"
    """auto (the loss the model returns, else the task's default: cross-entropy, BCE, MSE), cross-entropy (over
    the last dimension of the logits, so (B, C) and (B, T, V) both work) or user code ``module:callable``
    taking (the model's raw output, targets) and returning a scalar (flag ``--loss``)."""
    task: str = "auto"
    """classify, binary, multilabel, regression, lm, or auto: inferred from the first batch's targets and the
    model's output (flag ``--task``; see :mod:`mixprec.train.tasks`)."""

    def validate(self) -> None:
        for flag in ("width", "depth", "channels", "d_model", "n_heads", "n_layers", "patch_size", "block_size"):
            positive_int(flag, getattr(self, flag))
        one_of("task", self.task, ("auto", *TASKS))


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    name: str = "fashion-mnist"
    """fashion-mnist, mnist, digits, synthetic, text, or user code ``module:callable`` returning (train, test)
    as map-style datasets or (inputs, labels) tensor pairs (flag ``--dataset``)."""
    data_dir: str | None = None
    """Folder with the four IDX files (default for fashion-mnist: the Debian package's folder)."""
    data_path: str | None = None
    """text: a UTF-8 file or a folder of them (default: the Debian package fortunes' folder)."""
    num_workers: int = 0
    """Map-style datasets: DataLoader worker processes (0 = load in the training process)."""
    synthetic_train: int = 4096
    """synthetic: number of training samples."""
    synthetic_test: int = 1024
    """synthetic: number of test samples."""
    synthetic_shape: tuple[int, ...] = (1, 28, 28)
    """synthetic: shape of one sample."""
    limit_train: int | None = None
    """Use only the first N training samples."""
    limit_test: int | None = None
    """Use only the first N test samples."""

    def validate(self) -> None:
        for flag in ("synthetic_train", "synthetic_test"):
            positive_int(flag, getattr(self, flag))
        for flag in ("limit_train", "limit_test"):
            positive_int(flag, getattr(self, flag), allow_none=True)
        nonnegative_int("num_workers", self.num_workers)
        if not self.synthetic_shape or not all(is_int(d) and d > 0 for d in self.synthetic_shape):
            raise ConfigError(f"--synthetic-shape must be positive sizes, got {self.synthetic_shape}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimConfig:
    optimizer: str = "sgd"
    """sgd, adamw, or user code ``module:callable`` (or ``file.py:callable``): a factory called with the
    parameters the recipe's optimizer steps (fp32 master copies for the ``*-master`` recipes, DTensor shards
    under FSDP) and whichever of ``lr``, ``weight_decay``, ``momentum``, ``betas`` it declares, returning a
    ``torch.optim.Optimizer`` (flag ``--optimizer``)."""
    lr: float = 0.01
    """Learning rate (the schedule's peak)."""
    momentum: float = 0.0
    """SGD momentum."""
    weight_decay: float = 0.0
    """Weight decay (decoupled for AdamW)."""
    betas: tuple[float, ...] | None = None
    """AdamW's (beta1, beta2) (default PyTorch's 0.9, 0.999); not for sgd, and for a user optimizer only if its
    factory takes ``betas``."""
    lr_schedule: str = "constant"
    """constant, cosine or linear, applied before every optimizer step (skipped steps count; see
    :mod:`mixprec.train.schedule`)."""
    lr_warmup_steps: int = 0
    """Optimizer steps of linear warmup from 0 to ``lr`` (any schedule)."""
    min_lr: float = 0.0
    """cosine / linear: the rate they decay to (at ``lr_total_steps``)."""
    lr_total_steps: int | None = None
    """cosine / linear: the optimizer step at which the rate reaches ``min_lr``. None: the run's planned
    optimizer steps, ``min(epochs x ceil(batches per epoch / grad_accum), max_steps)``, fixed when the run is
    built (the built run's config holds the number; a resume keeps it)."""
    clip_grad_norm: float | None = None
    """Clip the total L2 norm of the true (unscaled) gradients to this value."""
    epochs: int = 5
    """Number of passes over the training set."""
    batch_size: int = 64
    """Samples per optimizer step (per process, per micro-batch)."""
    grad_accum: int = 1
    """Micro-batches per optimizer step: gradients of K batches of batch_size are accumulated (no
    gradient all-reduce until the last), then one unscale/clip/step. Effective batch: batch_size x K x ranks."""
    max_steps: int | None = None
    """Stop after this many optimizer steps in total (for quick runs)."""

    def validate(self) -> None:
        for flag in ("epochs", "batch_size", "grad_accum"):
            positive_int(flag, getattr(self, flag))
        positive("lr", self.lr)
        nonnegative("momentum", self.momentum)
        nonnegative("weight_decay", self.weight_decay)
        for flag in ("lr", "momentum", "weight_decay"):  # the optimizers multiply fp32 tensors by them
            if abs(getattr(self, flag)) > F32_MAX:
                raise ConfigError(f"--{flag.replace('_', '-')} {getattr(self, flag):g} does not fit in float32 "
                                  f"(max {F32_MAX:.3g}); use a sane value")
        positive("clip_grad_norm", self.clip_grad_norm, allow_none=True)
        positive_int("max_steps", self.max_steps, allow_none=True)
        if not is_reference(self.optimizer):
            one_of("optimizer", self.optimizer, OPTIMIZERS + ("MODULE:CALLABLE",))
        if self.optimizer == "adamw" and self.momentum:
            raise ConfigError("--momentum applies to sgd only; AdamW has its own betas")
        self._validate_betas()
        self._validate_schedule()

    def _validate_betas(self) -> None:
        if self.betas is None:
            return
        if self.optimizer == "sgd":
            raise ConfigError(f"--betas {','.join(map(str, self.betas))} applies to adamw (and user optimizers that "
                              "take betas), not sgd; use --momentum for sgd")
        if len(self.betas) != 2 or not all(is_real(b) and 0 <= b < 1 for b in self.betas):
            raise ConfigError(f"--betas must be two numbers in [0, 1) like 0.9,0.95, got {self.betas!r}")

    def _validate_schedule(self) -> None:
        one_of("lr_schedule", self.lr_schedule, SCHEDULES)
        nonnegative_int("lr_warmup_steps", self.lr_warmup_steps)
        nonnegative("min_lr", self.min_lr)
        positive_int("lr_total_steps", self.lr_total_steps, allow_none=True)
        if self.lr_schedule == "constant":
            for flag, default in (("min_lr", 0.0), ("lr_total_steps", None)):
                if getattr(self, flag) != default:
                    raise ConfigError(f"--{flag.replace('_', '-')} {getattr(self, flag)} applies to --lr-schedule "
                                      "cosine or linear, not constant")
        elif self.min_lr > self.lr:
            raise ConfigError(f"--min-lr {self.min_lr:g} is above --lr {self.lr:g}; the schedule decays from --lr "
                              "down to --min-lr")
        if self.lr_total_steps is not None and self.lr_warmup_steps >= self.lr_total_steps:
            raise ConfigError(f"--lr-warmup-steps {self.lr_warmup_steps} leaves no steps to decay over with "
                              f"--lr-total-steps {self.lr_total_steps}; use fewer warmup steps")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    seed: int = 0
    """Seed for initial weights, data order and stochastic rounding."""
    device: str = "auto"
    """auto, cpu or cuda."""
    strategy: str = "auto"
    """Multi-process strategy: auto (ddp when torchrun started several processes, else none), none (one
    process only), ddp or fsdp. A built run holds the resolved one."""
    log_every: int = 100
    """Print the tutorial's log line every N batches (0 = never)."""
    eval_every: int | None = None
    """Also evaluate on the test split every N optimizer steps, mid-epoch too (language models); the records
    go to ``TrainResult.evals`` and ``--metrics-json``'s ``evals``. Epochs are evaluated at their end as
    always (an evaluation that falls on an epoch's last step is not run twice)."""
    progress: str = "auto"
    """Progress bar: auto (only on a terminal), on, off."""
    out: str | None = None
    """Folder for checkpoints (last.pt, written atomically every epoch)."""
    checkpoint_every: int | None = None
    """Also checkpoint every N optimizer steps."""
    resume: str | None = None
    """Checkpoint file or folder to resume from."""
    overwrite: bool = False
    """Allow replacing a checkpoint in ``out`` that this run did not resume from."""
    metrics_json: str | None = None
    """Write per-epoch records and the summary as JSON here."""
    compile: str = "auto"
    """``torch.compile`` the model (inductor): on, off, or auto (the FP8/FP4 recipes on CUDA where their GEMMs
    are real; nothing elsewhere). A stored true/false reads as on/off. The compile time is reported apart."""
    max_consecutive_skips: int = 100
    """Stop when this many optimizer steps in a row are skipped for inf/nan gradients."""
    check_consistency: int | None = None
    """Every N optimizer steps, compare loss scale, skipped steps and a parameter checksum across ranks and
    stop on divergence (debug; one all-gather each time)."""
    watch: int | None = None
    """Watch the run with :func:`mixprec.watch`, sampling every N optimizer steps (reports in ``OUT/watch``, or
    ``mixprec-watch`` without ``--out``); the watch never changes the numerics."""

    def validate(self) -> None:
        if not (is_int(self.seed) and 0 <= self.seed < 2**63):
            raise ConfigError(f"--seed must be an integer in [0, 2^63), got {self.seed!r}")
        for flag in ("checkpoint_every", "check_consistency", "eval_every", "watch"):
            positive_int(flag, getattr(self, flag), allow_none=True)
        nonnegative_int("log_every", self.log_every)
        if self.checkpoint_every is not None and self.out is None:
            raise ConfigError("--checkpoint-every needs --out DIR to write checkpoints into")
        one_of("progress", self.progress, PROGRESS)
        one_of("compile", self.compile, COMPILE)
        one_of("strategy", self.strategy, STRATEGIES)
        positive_int("max_consecutive_skips", self.max_consecutive_skips)


# section name -> its class; (section, field) pairs whose flag has another name
_SECTIONS: dict[str, type] = {"model": ModelConfig, "data": DataConfig, "recipe": RecipeConfig,
                              "optim": OptimConfig, "run": RunConfig}
_RENAMED = {("model", "name"): "model", ("data", "name"): "dataset"}


def _flag_paths() -> dict[str, tuple[str, ...]]:
    """Every flag name and where it lives, e.g. ``init_scale -> ("recipe", "scaler", "init_scale")``."""
    paths: dict[str, tuple[str, ...]] = {}
    for section, cls in _SECTIONS.items():
        for f in dataclasses.fields(cls):
            if f.name == "scaler":
                for g in dataclasses.fields(ScalerConfig):
                    paths[g.name] = (section, "scaler", g.name)
            else:
                paths[_RENAMED.get((section, f.name), f.name)] = (section, f.name)
    return paths


_FLAG_PATHS = _flag_paths()


def _build(cls: type, values: dict[str, Any]) -> Any:
    """``cls(**values)`` with JSON lists turned back into tuples and nested sections built."""
    kw = {}
    names = {f.name: f for f in dataclasses.fields(cls)}
    for k, v in values.items():
        if k not in names:
            raise ConfigError(f"unknown setting {k!r} in the {cls.__name__} section")
        if k == "scaler" and isinstance(v, dict):
            v = _build(ScalerConfig, v)
        elif k == "compile" and isinstance(v, bool):  # configs stored before --compile auto
            v = "on" if v else "off"
        elif isinstance(v, list) and "tuple" in str(names[k].type):
            v = tuple(v)
        kw[k] = v
    return cls(**kw)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    """What network to build."""
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    """What to train on."""
    recipe: RecipeConfig = dataclasses.field(default_factory=RecipeConfig)
    """Which precision recipe, its mechanism and its loss scaler."""
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    """Optimizer, batch and schedule length."""
    run: RunConfig = dataclasses.field(default_factory=RunConfig)
    """Seed, device, processes, logging, checkpoints and outputs."""

    def __post_init__(self) -> None:
        """Store the canonical recipe name, so ``--precision bf16`` and ``bf16-mixed`` make equal configs."""
        try:
            canonical = resolve_recipe(self.recipe.precision).name
        except (RecipeError, AttributeError):  # not a recipe name: validate() says so, naming the flag
            return
        if canonical != self.recipe.precision:
            object.__setattr__(self, "recipe", dataclasses.replace(self.recipe, precision=canonical))

    # -- flat views (flags) --------------------------------------------------------------------------------
    @classmethod
    def from_flags(cls, **flags: Any) -> TrainConfig:
        """Build from flag names (``precision="bf16-mixed", model="mlp", init_scale=1024.0`` ...)."""
        return cls().with_flags(**flags)

    def with_flags(self, **flags: Any) -> TrainConfig:
        """A copy with the named flags changed."""
        nested = self.to_dict()
        for flag, value in flags.items():
            if flag not in _FLAG_PATHS:
                raise ConfigError(f"unknown setting {flag!r}")
            *parents, leaf = _FLAG_PATHS[flag]
            d = nested
            for p in parents:
                d = d[p]
            d[leaf] = list(value) if isinstance(value, tuple) else value
        return TrainConfig.from_dict(nested)

    def flags(self) -> dict[str, Any]:
        """Every setting by its flag name (tuples as lists, as in JSON)."""
        nested = self.to_dict()
        out = {}
        for flag, path in _FLAG_PATHS.items():
            v: Any = nested
            for p in path:
                v = v[p]
            out[flag] = v
        return out

    # -- nested form (checkpoints, results.json) ------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)

        def lists(o: Any) -> Any:
            if isinstance(o, dict):
                return {k: lists(v) for k, v in o.items()}
            return list(o) if isinstance(o, tuple) else o

        return lists(d)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        """The inverse of :meth:`to_dict`; a flat dict of flags (checkpoints before version 2) also works."""
        if not all(isinstance(d.get(s, {}), dict) for s in _SECTIONS):
            return cls.from_flags(**d)
        unknown = set(d) - set(_SECTIONS)
        if unknown:
            raise ConfigError(f"unknown config section(s): {', '.join(sorted(unknown))}")
        return cls(**{s: _build(c, d.get(s, {})) for s, c in _SECTIONS.items()})

    def validate(self) -> None:
        """Raise ConfigError (or RecipeError) naming the flag for values that cannot work."""
        for section in _SECTIONS:
            getattr(self, section).validate()

