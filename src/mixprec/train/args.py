"""The flags of ``mixprec train`` (``bench`` and ``doctor`` reuse them) and the config they make.

Every flag is a field of :class:`~mixprec.train.config.TrainConfig` under the same name (``--init-scale``
→ ``init_scale``), so :func:`config_from_args` is one call to :meth:`TrainConfig.from_flags`.
"""

from __future__ import annotations

import argparse

from ..precision import ALIASES, AMP_IMPLS, RECIPES
from .config import OPTIMIZERS, STRATEGIES, TrainConfig

__all__ = ["add_train_arguments", "add_output_arguments", "config_from_args"]

_DEFAULTS = TrainConfig().flags()


def _shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(s) for s in text.replace("x", ",").split(",") if s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected sizes like 1,28,28, got {text!r}") from None
    if not shape:
        raise argparse.ArgumentTypeError(f"expected sizes like 1,28,28, got {text!r}")
    return shape


def _names(text: str) -> tuple[str, ...]:
    return tuple(s.strip() for s in text.split(",") if s.strip())


def add_train_arguments(p: argparse.ArgumentParser, *, with_precision: bool = True) -> None:
    """Every flag of ``mixprec train`` but the output ones (bench reuses them, minus --precision)."""
    _recipe_arguments(p.add_argument_group("recipe"), with_precision)
    _model_and_data_arguments(p.add_argument_group("model and data"))
    _optim_arguments(p.add_argument_group("optimisation"))
    _run_arguments(p.add_argument_group("run"))


def _recipe_arguments(g, with_precision: bool) -> None:
    d = _DEFAULTS
    recipes = ", ".join(list(RECIPES) + [a for a in ALIASES if a not in RECIPES])
    if with_precision:
        g.add_argument("--precision", default=d["precision"], metavar="RECIPE",
                       help=f"precision recipe (default {d['precision']}): {recipes}")
    g.add_argument("--amp-impl", default=d["amp_impl"], choices=AMP_IMPLS,
                   help="mechanism: native torch.autocast + GradScaler, mixprec's scratch engine, or auto "
                        "(native, except emulated fp16 on CPUs without fast fp16)")
    g.add_argument("--init-scale", type=float, default=d["init_scale"], help="initial loss scale (default 65536)")
    g.add_argument("--growth-factor", type=float, default=d["growth_factor"], help="loss-scale growth factor")
    g.add_argument("--backoff-factor", type=float, default=d["backoff_factor"], help="loss-scale backoff factor")
    g.add_argument("--growth-interval", type=int, default=d["growth_interval"],
                   help="finite steps before the loss scale grows")
    g.add_argument("--hysteresis", type=int, default=d["hysteresis"],
                   help="overflows tolerated before backing off (scratch scaler)")
    g.add_argument("--stochastic-rounding", action="store_true",
                   help="round updates into low-precision params stochastically (bf16-true, *-master)")
    g.add_argument("--keep-fp32", type=_names, default=(), metavar="NAMES",
                   help="comma-separated module names/types to keep in fp32 (scratch autocast)")
    g.add_argument("--max-consecutive-skips", type=int, default=d["max_consecutive_skips"],
                   help="stop after this many skipped (inf/nan) steps in a row")


def _model_and_data_arguments(g) -> None:
    d = _DEFAULTS
    g.add_argument("--model", default=d["model"], metavar="NAME|MODULE:CALLABLE",
                   help="simplenet, mlp, cnn, transformer, gpt, or your own: package.module:factory or "
                        "path/to/file.py:factory returning an nn.Module (default simplenet)")
    g.add_argument("--width", type=int, default=d["width"], help="mlp hidden width")
    g.add_argument("--depth", type=int, default=d["depth"], help="mlp hidden layers")
    g.add_argument("--channels", type=int, default=d["channels"], help="cnn base channels")
    g.add_argument("--d-model", type=int, default=d["d_model"], help="transformer / gpt width")
    g.add_argument("--n-heads", type=int, default=d["n_heads"], help="transformer / gpt heads")
    g.add_argument("--n-layers", type=int, default=d["n_layers"], help="transformer / gpt blocks")
    g.add_argument("--patch-size", type=int, default=d["patch_size"], help="transformer patch size")
    g.add_argument("--block-size", type=int, default=d["block_size"], help="gpt / text: context length")
    g.add_argument("--loss", default=d["loss"], metavar="cross-entropy|MODULE:CALLABLE",
                   help="loss(outputs, targets) -> scalar (default cross-entropy)")
    g.add_argument("--dataset", default=d["dataset"], metavar="NAME|MODULE:CALLABLE",
                   help="fashion-mnist, mnist, digits, synthetic, text, or your own: module:factory returning "
                        "(train, test) datasets or tensor pairs")
    g.add_argument("--data-dir", default=None, help="folder with the IDX files (fashion-mnist, mnist)")
    g.add_argument("--data-path", default=None, metavar="FILE_OR_DIR",
                   help="text: UTF-8 file or folder (default: the Debian package fortunes)")
    g.add_argument("--num-workers", type=int, default=d["num_workers"],
                   help="DataLoader workers for map-style datasets (default 0)")
    g.add_argument("--synthetic-train", type=int, default=d["synthetic_train"], help="synthetic train samples")
    g.add_argument("--synthetic-test", type=int, default=d["synthetic_test"], help="synthetic test samples")
    g.add_argument("--synthetic-shape", type=_shape, default=tuple(d["synthetic_shape"]),
                   help="synthetic sample shape")
    g.add_argument("--limit-train", type=int, default=None, help="use only the first N training samples")
    g.add_argument("--limit-test", type=int, default=None, help="use only the first N test samples")


def _optim_arguments(g) -> None:
    d = _DEFAULTS
    g.add_argument("--epochs", type=int, default=d["epochs"], help="epochs (default 5)")
    g.add_argument("--batch-size", type=int, default=d["batch_size"], help="batch size (default 64)")
    g.add_argument("--optimizer", default=d["optimizer"], choices=OPTIMIZERS, help="optimizer (default sgd)")
    g.add_argument("--lr", type=float, default=d["lr"], help="learning rate (default 0.01)")
    g.add_argument("--momentum", type=float, default=d["momentum"], help="SGD momentum")
    g.add_argument("--weight-decay", type=float, default=d["weight_decay"], help="weight decay")
    g.add_argument("--clip-grad-norm", type=float, default=None, metavar="X",
                   help="clip the L2 norm of the true (unscaled) gradients to X")
    g.add_argument("--max-steps", type=int, default=None, help="stop after N optimizer steps")
    g.add_argument("--grad-accum", type=int, default=d["grad_accum"], metavar="K",
                   help="accumulate gradients of K batches per optimizer step (effective batch: "
                        "batch size x K x processes)")


def _run_arguments(g) -> None:
    d = _DEFAULTS
    g.add_argument("--seed", type=int, default=d["seed"], help="seed (weights, data order, rounding)")
    g.add_argument("--device", default=d["device"], help="auto (cuda if available), cpu or cuda")
    g.add_argument("--log-every", type=int, default=d["log_every"], help="log line every N batches (0: never)")
    g.add_argument("--progress", default=d["progress"], choices=("auto", "on", "off"),
                   help="progress bar (auto: only on a terminal)")
    g.add_argument("--strategy", default=d["strategy"], choices=STRATEGIES,
                   help="multi-process strategy under torchrun: auto (default: ddp with several processes), "
                        "ddp (replicate), fsdp (shard), none (one process only)")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile the model (inductor; needs a C++ compiler on CPU); compile time is "
                        "reported apart from epoch times")
    g.add_argument("--check-consistency", type=int, default=None, metavar="N",
                   help="every N steps, check that all ranks hold the same loss scale, skipped-step count "
                        "and parameters; stop on divergence (debug)")


def add_output_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output")
    g.add_argument("--out", default=None, metavar="DIR", help="write checkpoints (last.pt) here, every epoch")
    g.add_argument("--checkpoint-every", type=int, default=None, metavar="N", help="also every N steps")
    g.add_argument("--resume", default=None, metavar="DIR|FILE", help="resume from a checkpoint")
    g.add_argument("--metrics-json", default=None, metavar="PATH", help="write metrics as JSON")
    g.add_argument("--overwrite", action="store_true",
                   help="replace a checkpoint already in --out that this run does not --resume from")


def config_from_args(args: argparse.Namespace, **overrides) -> TrainConfig:
    """The config the parsed flags describe (flags the config does not know, like bench's, are left out)."""
    flags = {k: v for k, v in vars(args).items() if k in _DEFAULTS}
    flags.update(overrides)
    return TrainConfig.from_flags(**flags)
