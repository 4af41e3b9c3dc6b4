"""Kernel workspace: bytes a CPU kernel allocates inside an op and frees before it returns.

A fake kernel allocates its outputs only, so for the ``cpu`` target the recorder adds the workspace
:func:`cpu_workspace` names for an op to the live bytes when it looks for the peak (as **temporary** memory).
Modelled in terms of the op's operands, as measured on PyTorch's CPU kernels:

- ``native_batch_norm_backward``: one temporary the size of the input, in its dtype;
- ``max_pool2d_with_indices_backward`` on a non-contiguous (channels-last) input: contiguous copies of the
  indices and of the input gradient.

Not modelled: oneDNN scratchpads and weight reorders, MKL's packing buffers (resident between calls), and GPU
targets (cuBLAS's workspace is resident; cuDNN's depends on the algorithm picked on the device).
"""

from __future__ import annotations

import torch

__all__ = ["cpu_workspace", "WORKSPACE_OPS"]


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _batch_norm_backward(args: list, outputs: list) -> int:
    return _nbytes(args[1]) if len(args) > 1 else 0  # (grad_out, input, ...)


def _max_pool2d_backward(args: list, outputs: list) -> int:
    # (grad_output, self, kernel_size..., indices): the last tensor argument is the indices
    if len(args) < 2 or not isinstance(args[1], torch.Tensor) or args[1].is_contiguous():
        return 0
    indices = [a for a in args[2:] if isinstance(a, torch.Tensor)]
    return (_nbytes(indices[-1]) if indices else 0) + _nbytes(args[1])


WORKSPACE_OPS = {
    "native_batch_norm_backward": _batch_norm_backward,
    "max_pool2d_with_indices_backward": _max_pool2d_backward,
}
"""Op name (overload packet) -> ``(positional args, outputs) -> workspace bytes`` on the cpu target."""


def cpu_workspace(name: str, args: list, outputs: list) -> int:
    """Bytes op ``name`` allocates and frees inside its CPU kernel (0 when none is modelled)."""
    fn = WORKSPACE_OPS.get(name)
    return fn(args, outputs) if fn is not None else 0
