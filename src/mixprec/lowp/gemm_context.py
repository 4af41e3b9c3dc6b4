"""What the low-precision GEMM layers (:mod:`mixprec.fp8`, :mod:`mixprec.blocklinear`) share about autocast: the
dtype their output takes, and a context in which neither autocast re-casts their operands."""

from __future__ import annotations

import contextlib

import torch

from ..autocast import autocast, autocast_dtype, is_autocast_active

__all__ = ["no_autocast", "output_dtype"]


@contextlib.contextmanager
def no_autocast(device_type: str):
    """Turn off torch.autocast and mixprec's autocast, so the FP8 GEMMs' operands are not re-cast."""
    if not (torch.is_autocast_enabled(device_type) or is_autocast_active()):  # backward: nothing to turn off
        yield
        return
    with contextlib.ExitStack() as stack:
        if torch.is_autocast_enabled(device_type):
            stack.enter_context(torch.autocast(device_type, enabled=False))
        if is_autocast_active():
            stack.enter_context(autocast(device_type=device_type, enabled=False))
        yield


def output_dtype(x: torch.Tensor) -> torch.dtype:
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return autocast_dtype() or x.dtype
