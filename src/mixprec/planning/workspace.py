"""Kernel workspace: bytes a CPU kernel allocates inside an op and frees before it returns.

The traced step (:class:`.recorder.StepRecorder`) sees each op's outputs only; a real kernel may allocate
temporaries of its own while it runs, which count towards the step's real peak but never appear under
``FakeTensorMode`` (the fake kernel allocates the outputs and nothing else). For the ``cpu`` target the
recorder adds, at each op, the workspace :func:`cpu_workspace` names for it to the live bytes when it looks
for the peak; the bytes belong to the **temporary** category (:mod:`mixprec.memory`: alive at the peak, in
no exact category), never to activations.

What is modelled was measured op by op on a real step (glibc in mmap mode, every malloc counted during the
op minus what is alive after it) with PyTorch's CPU kernels, and it is written in terms of the op's own
operands, not fitted to any model:

- ``native_batch_norm_backward``: one temporary the size of the input, in the input's dtype (seen for
  contiguous and channels-last inputs, fp32 and bf16);
- ``max_pool2d_with_indices_backward`` on a non-contiguous (channels-last) input: contiguous copies of the
  indices and of the input gradient (a contiguous input needs neither).

Not modelled: oneDNN's scratchpads and weight reorders in convolutions and in bf16/fp16 GEMMs (a
roughly fixed size per op that does not follow the operands' sizes, and a repacked copy of a GEMM's
second operand that oneDNN makes for some shapes and not others), and MKL's fp32 GEMM packing buffers (kept
by MKL between calls, so they are resident before a step). GPU targets get no workspace term: cuBLAS keeps
its workspace per handle (allocated once, resident), and cuDNN's per-call workspace depends on the algorithm
it picks on the device, which a plan made without that device cannot know.
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
