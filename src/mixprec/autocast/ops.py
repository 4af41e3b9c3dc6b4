"""Python call -> ATen op name: the key under which a :class:`~mixprec.autocast.policy.CastPolicy` lists an op.

Most calls share the ATen name (``F.linear`` -> ``linear``). The rest are renamed here, by a fixed name
(``F.cross_entropy`` -> ``cross_entropy_loss``) or by a function of the call's arguments (``F.pad(mode="reflect")``
on a 4-D input -> ``reflection_pad2d``). An overload-specific entry is written ``name.overload``
(``_convolution.deprecated``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["RENAME", "BANNED_MESSAGE"]


def _arg(args: tuple, kwargs: Mapping, index: int, name: str, default: Any) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else default


def _pad_op(args: tuple, kwargs: Mapping) -> str:
    # F.pad(input, pad, mode="constant", value=None): aten::pad picks the kernel by mode and by
    # the number of padded dims
    mode = _arg(args, kwargs, 2, "mode", "constant")
    if mode in ("reflect", "replicate"):
        dims = len(_arg(args, kwargs, 1, "pad", ())) // 2
        return f"{'reflection' if mode == 'reflect' else 'replication'}_pad{dims}d"
    return "pad"


def _interpolate_op(args: tuple, kwargs: Mapping) -> str:
    # F.interpolate(input, size, scale_factor, mode="nearest", align_corners,
    #               recompute_scale_factor, antialias=False)
    x = _arg(args, kwargs, 0, "input", None)
    mode = _arg(args, kwargs, 3, "mode", "nearest")
    antialias = _arg(args, kwargs, 6, "antialias", False)
    if not isinstance(x, torch.Tensor):
        return "interpolate"
    d = x.dim() - 2
    if mode == "nearest":
        return f"upsample_nearest{d}d"
    if mode == "nearest-exact":
        return f"_upsample_nearest_exact{d}d"
    if mode in ("bilinear", "bicubic"):
        return f"_upsample_{mode}2d_aa" if antialias else f"upsample_{mode}2d"
    if mode in ("linear", "trilinear"):
        return f"upsample_{mode}{d}d"
    if mode == "area":
        return f"adaptive_avg_pool{d}d"
    return "interpolate"


def _max_pool3d_op(args: tuple, kwargs: Mapping) -> str:
    # F.max_pool3d(input, kernel_size, stride, padding, dilation, ceil_mode, return_indices)
    return "max_pool3d_with_indices" if _arg(args, kwargs, 6, "return_indices", False) else "max_pool3d"


def _convolution_op(args: tuple, kwargs: Mapping) -> str:
    # aten::_convolution takes 13 arguments (the last is allow_tf32); its `deprecated` overload
    # takes the first 12. Neither has defaults, so the count tells them apart.
    return "_convolution.deprecated" if len(args) + len(kwargs) == 12 else "_convolution"


#: Python function ``__name__`` -> ATen name (a str), or a function of the call's arguments.
RENAME: dict[str, str | Callable[[tuple, Mapping], str]] = {
    "cross_entropy": "cross_entropy_loss",
    "__matmul__": "matmul",
    "__rmatmul__": "matmul",
    "__pow__": "pow",
    "__rpow__": "pow",
    "grid_sample": "grid_sampler",
    "fractional_max_pool2d_with_indices": "fractional_max_pool2d",
    "fractional_max_pool3d_with_indices": "fractional_max_pool3d",
    "adaptive_max_pool3d_with_indices": "adaptive_max_pool3d",
    "pad": _pad_op,
    "interpolate": _interpolate_op,
    "max_pool3d": _max_pool3d_op,
    "_convolution": _convolution_op,
}

#: Why a banned op is banned, and what to use instead (by Python function name).
BANNED_MESSAGE = {
    "binary_cross_entropy": (
        "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast: "
        "the sigmoid before them saturates in low precision. Combine the two with "
        "torch.nn.functional.binary_cross_entropy_with_logits or torch.nn.BCEWithLogitsLoss, "
        "which are safe to autocast."
    ),
}
