"""Resume from the run itself: ``mixprec train --resume DIR [--epochs 10 ...]``.

A resumed run takes the checkpoint's config and applies the flags the user typed; only
:data:`RESUME_MAY_CHANGE` may differ, anything else is refused in one line naming each flag with both values,
before anything is built. Values compare as the config stores them (aliases equal); ``--device`` and
``--amp-impl`` must resolve to the checkpoint's mechanism (:func:`mixprec.train.checkpoint.mechanism`), checked
even when not typed. A resumed run continues in the checkpoint's folder, not the first ``--out``
(:func:`continue_in`).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from .. import hardware
from ..errors import CheckpointError, UsageError
from ..precision import build_recipe
from . import distributed
from .checkpoint import mechanism, read_run
from .config import TrainConfig

__all__ = ["RESUME_MAY_CHANGE", "resume_config", "check_resume", "stored_config", "resume_folder", "continue_in"]

RESUME_MAY_CHANGE = ("epochs", "max_steps", "out", "checkpoint_every", "resume", "overwrite", "metrics_json",
                     "log_every", "eval_every", "progress", "data_dir", "data_path", "num_workers", "limit_test",
                     "check_consistency", "max_consecutive_skips", "watch")
"""Flags a resumed run may change: how long to train, where outputs go, what is shown and how often the test
split is evaluated, where the data lies and how many processes load it, how often ranks are compared, when
skipped steps stop the run. ``--device`` and ``--amp-impl`` may change only to values that resolve to the
checkpoint's mechanism. Every other flag (recipe, loss scaler, optimizer and its hyperparameters, the
learning-rate schedule, model, data, seed, processes, compile) must equal the checkpoint's, or the resumed run
would not be the run that was saved. (A config that leaves ``lr_total_steps`` unset takes the checkpoint's,
which :func:`mixprec.train.build.build_schedule` fixed when the run was first built.)"""

_MECHANISM_FLAGS = ("device", "amp_impl")
"""Compared through what they resolve to, not as typed."""


def resume_config(typed: dict[str, Any]) -> TrainConfig:
    """The checkpoint's config with the ``typed`` flags applied (``--overwrite`` is not inherited). Raises
    CheckpointError naming every refused flag with both values."""
    path = typed["resume"]
    stored, mech = _stored(path)
    config = stored.with_flags(**{"overwrite": False, **continue_in(stored, path, typed), **typed})
    _check(path, stored, mech, config)
    return config


def resume_folder(path: str | os.PathLike) -> str:
    """The folder a resume from ``path`` continues in: ``path`` itself if it is a folder, else the file's."""
    path = os.fspath(path)
    return path if os.path.isdir(path) else (os.path.dirname(path) or ".")


def continue_in(stored: TrainConfig, path: str | os.PathLike, typed: dict[str, Any]) -> dict[str, Any]:
    """The output flags that make a resume from ``path`` continue in place (see the module docstring): ``out``
    (unless typed) and a stored ``metrics_json`` that lay inside the stored ``out`` (unless typed)."""
    moved: dict[str, Any] = {}
    out = typed["out"] if "out" in typed else resume_folder(path)
    if "out" not in typed:
        moved["out"] = out
    old, metrics = stored.run.out, stored.run.metrics_json
    if "metrics_json" not in typed and out is not None and old is not None and metrics is not None:
        inside = os.path.relpath(os.path.abspath(metrics), os.path.abspath(old))
        if inside != os.curdir and inside.split(os.sep)[0] != os.pardir:
            moved["metrics_json"] = os.path.join(out, inside)
    return moved


def check_resume(config: TrainConfig) -> None:
    """Refuse ``config`` if it does not continue the run in ``config.run.resume`` (see the module docstring);
    build_run calls it before it builds anything."""
    path = config.run.resume
    if path is not None:
        stored, mech = _stored(path)
        _check(path, stored, mech, config)


def stored_config(path: str | os.PathLike) -> TrainConfig:
    """The config of the run saved at ``path`` (read without its tensors)."""
    return _stored(path)[0]


def _stored(path: str | os.PathLike) -> tuple[TrainConfig, dict[str, Any]]:
    config, mech = read_run(path)
    try:
        return TrainConfig.from_dict(config), mech
    except (UsageError, TypeError, AttributeError) as e:
        raise CheckpointError(f"--resume {path}: the checkpoint's config is unreadable ({e})") from None


def _check(path: str | os.PathLike, stored: TrainConfig, stored_mech: dict[str, Any], config: TrainConfig) -> None:
    theirs, ours = _comparable(stored), _comparable(config)
    for flags, c in ((theirs, stored), (ours, config)):
        if flags["compile"] == "auto":  # compared as resolved: the run's config stores on/off
            flags["compile"] = _resolved_compile(c)
    if ours["lr_total_steps"] is None:  # unset: the run's planned steps, i.e. the checkpoint's (build_schedule)
        ours["lr_total_steps"] = theirs["lr_total_steps"]
    diffs = [_diff(k, theirs[k], v) for k, v in ours.items()
             if k not in RESUME_MAY_CHANGE and k not in _MECHANISM_FLAGS and v != theirs[k]]
    if dataclasses.replace(stored.recipe, amp_impl=config.recipe.amp_impl) == config.recipe:
        diffs += _mechanism_diffs(theirs, stored_mech, ours, config)  # (another recipe is named above)
    if diffs:
        raise CheckpointError(
            f"--resume {path}: the checkpoint is from a different run: " + "; ".join(diffs)
            + ". Drop these flags to continue the run as it was saved (a resume may change only "
            + ", ".join("--" + k.replace("_", "-") for k in RESUME_MAY_CHANGE) + ")"
        )


def _resolved_compile(config: TrainConfig) -> str:
    """``--compile auto`` as it resolves for ``config``'s recipe on its device (a device this machine lacks, as a
    checkpoint's may be, is asked as a target)."""
    device = hardware.resolve_device("auto") if config.run.device == "auto" else torch.device(config.run.device)
    recipe = build_recipe(config.recipe, device=device, seed=config.run.seed, for_target=True)
    return "on" if recipe.compiles(config.run.compile)[0] else "off"


def _comparable(config: TrainConfig) -> dict[str, Any]:
    flags = config.flags()
    flags["strategy"] = distributed.resolve_strategy(flags["strategy"])
    return flags


def _diff(flag: str, theirs: Any, ours: Any) -> str:
    return f"--{flag.replace('_', '-')} {theirs!r} in the checkpoint vs {ours!r} now"


def _mechanism_diffs(theirs: dict[str, Any], stored_mech: dict[str, Any], ours: dict[str, Any],
                     config: TrainConfig) -> list[str]:
    """What differs between the mechanism the checkpoint ran and the one ``config`` resolves to here."""
    recipe = build_recipe(config.recipe, device=hardware.resolve_device(config.run.device), seed=config.run.seed)
    now = mechanism(recipe)
    changed = [f"{k} {now.get(k)} instead of {v}" for k, v in stored_mech.items() if now.get(k) != v]
    if not changed:
        return []
    typed = [_diff(k, theirs[k], ours[k]) for k in _MECHANISM_FLAGS if theirs[k] != ours[k]]
    cause = "; ".join(typed) or (f"--device {ours['device']!r} with --amp-impl {ours['amp_impl']!r} resolves "
                                 f"differently on this machine (pass --amp-impl {stored_mech['impl']} to keep it)")
    return [f"{cause} ({recipe.name} would run with {', '.join(changed)})"]
