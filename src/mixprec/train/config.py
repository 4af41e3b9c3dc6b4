"""Training configuration: one keyword-only dataclass, a docstring under every field.

Defaults reproduce the tutorial: SimpleNet (one Linear 784→10) on Fashion-MNIST, SGD lr 0.01, batch 64,
5 epochs, a log line every 100 batches.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from ..errors import ConfigError

__all__ = ["TrainConfig", "OPTIMIZERS", "RESUME_MUST_MATCH"]

OPTIMIZERS = ("sgd", "adamw")


@dataclasses.dataclass(kw_only=True)
class TrainConfig:
    # what to train
    precision: str = "fp32"
    """Recipe name or alias (fp32, tf32, amp/fp16-mixed, bf16-mixed, fp16-master, bf16-master, bf16-true)."""
    amp_impl: str = "auto"
    """Mechanism behind the recipe: native (torch.autocast + GradScaler), scratch (mixprec engine), auto."""
    model: str = "simplenet"
    """simplenet, mlp, cnn or transformer."""
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
    dataset: str = "fashion-mnist"
    """fashion-mnist, mnist, digits or synthetic."""
    data_dir: str | None = None
    """Folder with the four IDX files (default for fashion-mnist: the Debian package's folder)."""
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
    # optimisation
    epochs: int = 5
    """Number of passes over the training set."""
    batch_size: int = 64
    """Samples per optimizer step (per process)."""
    optimizer: str = "sgd"
    """sgd or adamw."""
    lr: float = 0.01
    """Learning rate."""
    momentum: float = 0.0
    """SGD momentum."""
    weight_decay: float = 0.0
    """Weight decay (decoupled for AdamW)."""
    clip_grad_norm: float | None = None
    """Clip the total L2 norm of the true (unscaled) gradients to this value."""
    max_steps: int | None = None
    """Stop after this many optimizer steps in total (for quick runs)."""
    seed: int = 0
    """Seed for initial weights, data order and stochastic rounding."""
    # loss scaling and recipe options
    init_scale: float = 2.0**16
    """Initial loss scale (loss-scaled recipes)."""
    growth_factor: float = 2.0
    """Loss-scale growth factor after growth_interval finite steps."""
    backoff_factor: float = 0.5
    """Loss-scale backoff factor on overflow."""
    growth_interval: int = 2000
    """Finite steps between loss-scale growths."""
    hysteresis: int = 1
    """Overflows tolerated before backoff (scratch scaler)."""
    stochastic_rounding: bool = False
    """Round updates into low-precision params stochastically (bf16-true, *-master)."""
    keep_fp32: tuple[str, ...] = ()
    """Module names or types kept in fp32 (scratch autocast)."""
    max_consecutive_skips: int = 100
    """Stop when this many optimizer steps in a row are skipped for inf/nan gradients."""
    # run
    device: str = "auto"
    """auto, cpu or cuda."""
    log_every: int = 100
    """Print the tutorial's log line every N batches (0 = never)."""
    out: str | None = None
    """Folder for checkpoints (last.pt, written atomically every epoch)."""
    checkpoint_every: int | None = None
    """Also checkpoint every N optimizer steps."""
    resume: str | None = None
    """Checkpoint file or folder to resume from."""
    metrics_json: str | None = None
    """Write per-epoch records and the summary as JSON here."""
    progress: str = "auto"
    """Progress bar: auto (only on a terminal), on, off."""
    strategy: str = "none"
    """Multi-process strategy under torchrun: none, ddp or fsdp."""
    grad_accum: int = 1
    """Micro-batches per optimizer step: gradients of K batches of batch_size are accumulated (no
    gradient all-reduce until the last), then one unscale/clip/step. Effective batch: batch_size x K x ranks."""
    check_consistency: int | None = None
    """Every N optimizer steps, compare loss scale, skipped steps and a parameter checksum across ranks and
    stop on divergence (debug; one all-gather each time)."""

    def validate(self) -> None:
        """Raise ConfigError naming the flag for values that cannot work."""

        def positive(flag: str, value: float | int | None, allow_none: bool = False) -> None:
            if value is None and allow_none:
                return
            if value is None or not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigError(f"--{flag} must be a positive number, got {value!r}")

        for flag in ("epochs", "batch_size", "lr", "width", "depth", "channels", "d_model", "n_heads",
                     "n_layers", "patch_size", "synthetic_train", "synthetic_test"):
            positive(flag.replace("_", "-"), getattr(self, flag))
        for flag in ("clip_grad_norm", "max_steps", "checkpoint_every", "limit_train", "limit_test",
                     "check_consistency"):
            positive(flag.replace("_", "-"), getattr(self, flag), allow_none=True)
        if self.momentum < 0 or self.weight_decay < 0:
            raise ConfigError("--momentum and --weight-decay must be >= 0")
        if self.log_every < 0:
            raise ConfigError(f"--log-every must be >= 0, got {self.log_every}")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"unknown --optimizer {self.optimizer!r}; choose one of: {', '.join(OPTIMIZERS)}")
        if self.optimizer == "adamw" and self.momentum:
            raise ConfigError("--momentum applies to sgd only; AdamW has its own betas")
        if self.checkpoint_every is not None and self.out is None:
            raise ConfigError("--checkpoint-every needs --out DIR to write checkpoints into")
        if self.progress not in ("auto", "on", "off"):
            raise ConfigError(f"--progress must be auto, on or off, got {self.progress!r}")
        if self.strategy not in ("none", "ddp", "fsdp"):
            raise ConfigError(f"unknown --strategy {self.strategy!r}; choose none, ddp or fsdp")
        if any(d <= 0 for d in self.synthetic_shape):
            raise ConfigError(f"--synthetic-shape must be positive sizes, got {self.synthetic_shape}")
        if self.max_consecutive_skips < 1:
            raise ConfigError("--max-consecutive-skips must be >= 1")
        if not isinstance(self.grad_accum, int) or isinstance(self.grad_accum, bool) or self.grad_accum < 1:
            raise ConfigError(f"--grad-accum must be a positive integer (micro-batches per step), "
                              f"got {self.grad_accum!r}")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for k, v in d.items():
            if isinstance(v, tuple):
                d[k] = list(v)
        return d


RESUME_MUST_MATCH = (
    "precision", "model", "width", "depth", "channels", "d_model", "n_heads", "n_layers", "patch_size",
    "dataset", "synthetic_train", "synthetic_shape", "limit_train", "batch_size", "optimizer", "seed",
    "strategy", "grad_accum",
)
"""Fields a resumed run must share with the checkpoint's run (others, like --epochs, may change)."""
