"""The flags of ``mixprec train`` (``bench`` and ``doctor`` reuse them) and the config they make.

Every flag is a :class:`~mixprec.train.config.TrainConfig` field of the same name, and its default and help's
"(default X)" come from the config dataclasses. With ``typed_only=True`` (``mixprec train``) an untyped flag is
absent from the namespace, so :func:`typed_flags` is exactly what ``--resume`` applies.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..precision import ALIASES, AMP_IMPLS, FP8_IMPL_CHOICES, FP8_LAYERS, RECIPES
from .config import COMPILE, OPTIMIZERS, PROGRESS, SCHEDULES, STRATEGIES, TrainConfig

__all__ = ["add_train_arguments", "add_output_arguments", "config_from_args", "typed_flags"]

_DEFAULTS = TrainConfig().flags()
"""Every flag's default, from the config dataclasses."""


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


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 0.9,0.95, got {text!r}") from None


def _int_or_none(text: str) -> int | None:
    """An integer, or ``none`` for no limit (a resumed run can lift the checkpoint's ``--max-steps``)."""
    if text.strip().lower() == "none":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'none', got {text!r}") from None


class _Flags:
    """Adds flags to an argument group, each with its default taken from the config dataclasses."""

    def __init__(self, group: Any, typed_only: bool) -> None:
        self.group, self.typed_only = group, typed_only

    def __call__(self, *names: str, **kw: Any) -> None:
        action = self.group.add_argument(*names, **kw)
        default = _DEFAULTS[action.dest]
        default = tuple(default) if isinstance(default, list) else default
        action.default = argparse.SUPPRESS if self.typed_only else default
        shown = _show(default)
        if shown:
            action.help = f"{action.help} (default {shown})"


def _show(default: Any) -> str:
    if default is None or isinstance(default, bool) or default == ():
        return ""
    if isinstance(default, tuple):
        return ",".join(map(str, default))
    return f"{default:g}" if isinstance(default, float) else str(default)


def add_train_arguments(p: argparse.ArgumentParser, *, with_precision: bool = True, typed_only: bool = False) -> None:
    """Every flag of ``mixprec train`` but the output ones; ``typed_only`` leaves untyped flags out."""
    _recipe_arguments(_Flags(p.add_argument_group("recipe"), typed_only), with_precision)
    _model_and_data_arguments(_Flags(p.add_argument_group("model and data"), typed_only))
    _optim_arguments(_Flags(p.add_argument_group("optimisation"), typed_only))
    _run_arguments(_Flags(p.add_argument_group("run"), typed_only))


def _recipe_arguments(add: _Flags, with_precision: bool) -> None:
    recipes = ", ".join(list(RECIPES) + [a for a in ALIASES if a not in RECIPES])
    if with_precision:
        add("--precision", metavar="RECIPE", help=f"precision recipe: {recipes}")
    add("--amp-impl", choices=AMP_IMPLS,
        help="mechanism: native torch.autocast + GradScaler, mixprec's scratch engine, or auto (native, except "
             "emulated fp16 on CPUs)")
    add("--init-scale", type=float, help="initial loss scale")
    add("--growth-factor", type=float, help="loss-scale growth factor")
    add("--backoff-factor", type=float, help="loss-scale backoff factor")
    add("--growth-interval", type=int, help="finite steps before the loss scale grows")
    add("--hysteresis", type=int, help="overflows tolerated before backing off (scratch scaler)")
    add("--stochastic-rounding", action="store_true",
        help="round updates into low-precision params stochastically (bf16-true, *-master)")
    add("--keep-fp32", type=_names, metavar="NAMES",
        help="comma-separated module names/types to keep in fp32 (scratch autocast)")
    add("--max-consecutive-skips", type=int, help="stop after this many skipped (inf/nan) steps in a row")
    add("--fp8-impl", choices=FP8_IMPL_CHOICES,
        help="whose layers run the FP8/FP4 recipes' GEMMs: mixprec's scratch layers, torchao's (pip install "
             "'mixprec[fp8]'), or auto (torchao where the GPU has units for the format, else scratch)")
    add("--wgrad-hp", action="store_true",
        help="fp8-rowwise, mxfp8, mxfp4, nvfp4: the weight-gradient GEMM in bf16 (fp8-rowwise: torchao's "
             "rowwise_with_gw_hp)")
    add("--mx-scale-rule", choices=("rceil", "floor"),
        help="mxfp8, mxfp4: e8m0 scale rule (default rceil, as NVIDIA hardware; floor: the OCP MX spec)")
    add("--fp4-hadamard", action="store_true",
        help="nvfp4: random Hadamard transform of the weight-gradient GEMM's inputs (TransformerEngine's RHT)")
    add("--fp4-stochastic-rounding", action="store_true",
        help="nvfp4: round output gradients to FP4 stochastically in backward (as TransformerEngine)")
    add("--fp8-layers", choices=FP8_LAYERS,
        help="fp8-mixed, fp8-rowwise: auto (default: on a GPU with FP8 units, only the layers where FP8 pays, by "
             "torchao's measured size rule; emulated, every eligible layer) or all (every eligible layer)")
    add("--layer-formats", metavar="FILE",
        help="a layer-formats file (mixprec tune writes one): its linear layers run in their formats (fp32, bf16, "
             "fp16, fp8-mixed, fp8-rowwise, mxfp8, mxfp4, nvfp4), the rest in the recipe's, which must be an "
             "autocast recipe with fp32 params; it wins over the FP8 layer filter, and a --keep-fp32 module it "
             "puts in another format is an error. bench and plan add one entry <base>+layers beside the uniform "
             "recipes, the base being the first of --precisions that can carry the file")


def _model_and_data_arguments(add: _Flags) -> None:
    add("--model", metavar="NAME|MODULE:CALLABLE",
        help="simplenet, mlp, cnn, transformer, gpt, or your own: package.module:factory or path/to/file.py:factory "
             "returning an nn.Module")
    add("--width", type=int, help="mlp hidden width")
    add("--depth", type=int, help="mlp hidden layers")
    add("--channels", type=int, help="cnn base channels")
    add("--d-model", type=int, help="transformer / gpt width")
    add("--n-heads", type=int, help="transformer / gpt heads")
    add("--n-layers", type=int, help="transformer / gpt blocks")
    add("--patch-size", type=int, help="transformer patch size")
    add("--block-size", type=int, help="gpt / text: context length")
    add("--loss", metavar="auto|cross-entropy|MODULE:CALLABLE",
        help="auto: the model's own loss, else the task's; or loss(model output, targets) -> scalar")
    add("--task", choices=("auto", "classify", "binary", "multilabel", "regression", "lm"),
        help="what the model predicts (auto: inferred from the targets and the model's output)")
    add("--dataset", metavar="NAME|MODULE:CALLABLE",
        help="fashion-mnist, mnist, digits, synthetic, text, or your own: module:factory returning (train, test) "
             "datasets or tensor pairs")
    add("--data-dir", help="folder with the IDX files (fashion-mnist, mnist)")
    add("--data-path", metavar="FILE_OR_DIR", help="text: UTF-8 file or folder (default: the Debian package fortunes)")
    add("--num-workers", type=int, help="DataLoader workers for map-style datasets")
    add("--synthetic-train", type=int, help="synthetic train samples")
    add("--synthetic-test", type=int, help="synthetic test samples")
    add("--synthetic-shape", type=_shape, help="synthetic sample shape")
    add("--limit-train", type=int, help="use only the first N training samples")
    add("--limit-test", type=_int_or_none, help="use only the first N test samples ('none': all)")


def _optim_arguments(add: _Flags) -> None:
    add("--epochs", type=int, help="epochs")
    add("--batch-size", type=int, help="batch size")
    add("--optimizer", metavar="|".join(OPTIMIZERS) + "|MODULE:CALLABLE",
        help="optimizer, or your own: a factory(params, [lr, weight_decay, momentum, betas]) returning a "
             "torch.optim.Optimizer over params (fp32 masters under the *-master recipes)")
    add("--lr", type=float, help="learning rate (the schedule's peak)")
    add("--momentum", type=float, help="SGD momentum")
    add("--weight-decay", type=float, help="weight decay")
    add("--betas", type=_floats, metavar="B1,B2", help="AdamW betas (default PyTorch's 0.9,0.999)")
    add("--lr-schedule", choices=SCHEDULES,
        help="learning rate per optimizer step: constant, or cosine/linear decay to --min-lr at the run's last "
             "planned step (skipped steps count)")
    add("--lr-warmup-steps", type=int, metavar="N", help="linear warmup from 0 over the first N optimizer steps")
    add("--min-lr", type=float, help="cosine/linear: the rate they decay to")
    add("--lr-total-steps", type=_int_or_none, metavar="N",
        help="cosine/linear: reach --min-lr at step N (default: the run's planned optimizer steps, "
             "min(epochs x steps per epoch, --max-steps), kept by --resume)")
    add("--clip-grad-norm", type=float, metavar="X", help="clip the L2 norm of the true (unscaled) gradients to X")
    add("--max-steps", type=_int_or_none, help="stop after N optimizer steps in total ('none': no limit)")
    add("--grad-accum", type=int, metavar="K",
        help="accumulate gradients of K batches per optimizer step (effective batch: batch size x K x processes)")


def _run_arguments(add: _Flags) -> None:
    add("--seed", type=int, help="seed (weights, data order, rounding)")
    add("--device", help="auto (cuda if available), cpu or cuda")
    add("--log-every", type=int, help="log line every N batches (0: never)")
    add("--eval-every", type=_int_or_none, metavar="N",
        help="also evaluate the test split every N optimizer steps, mid-epoch too ('none': only per epoch)")
    add("--progress", choices=PROGRESS, help="progress bar (auto: only on a terminal)")
    add("--strategy", choices=STRATEGIES,
        help="multi-process strategy under torchrun: auto (ddp with several processes), ddp (replicate), fsdp "
             "(shard), none (one process only)")
    add("--compile", nargs="?", const="on", choices=COMPILE,
        help="torch.compile the model (inductor; needs a C++ compiler on CPU): on (a bare --compile), off, or auto "
             "(default: the FP8/FP4 recipes on CUDA where their GEMMs are real, whose casts only pay fused; "
             "nothing elsewhere); compile time is reported apart from epoch times")
    add("--check-consistency", type=_int_or_none, metavar="N",
        help="every N steps, check that all ranks hold the same loss scale, skipped-step count and parameters; "
             "stop on divergence (debug)")
    add("--watch", type=_int_or_none, metavar="N",
        help="watch the run with mixprec.watch, sampling every N steps (reports in OUT/watch or mixprec-watch)")


def add_output_arguments(p: argparse.ArgumentParser, *, typed_only: bool = False) -> None:
    add = _Flags(p.add_argument_group("output"), typed_only)
    add("--out", metavar="DIR", help="write checkpoints (last.pt) here, every epoch")
    add("--checkpoint-every", type=_int_or_none, metavar="N", help="also every N steps ('none': only per epoch)")
    add("--resume", metavar="DIR|FILE",
        help="continue the run saved there, with its flags; only the flags a resume may change can be given")
    add("--metrics-json", metavar="PATH", help="write metrics as JSON")
    add("--overwrite", action="store_true",
        help="replace a checkpoint already in --out that this run does not --resume from")


def typed_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The config flags in a parsed namespace: for ``mixprec train`` exactly those the user typed."""
    return {k: v for k, v in vars(args).items() if k in _DEFAULTS}


def config_from_args(args: argparse.Namespace, **overrides: Any) -> TrainConfig:
    """The config the parsed flags describe (flags the config does not know, like bench's, are left out)."""
    return TrainConfig.from_flags(**{**typed_flags(args), **overrides})
