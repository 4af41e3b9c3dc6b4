"""Per-tensor FP8 ``nn.Linear`` (``fp8-mixed``): the layer's three GEMMs with FP8 operands, one scale per tensor.

::

    forward    y  = x  @ W^T        x, W  in e4m3
    backward   dx = dy @ W          dy in e5m2, W in e4m3
               dW = dy^T @ x        dy in e5m2, x in e4m3

All three accumulate in fp32; the bias, its gradient, activations, norms and the loss stay in the surrounding
precision, and the fp32 parameters are the master copy: only GEMM operands are quantized, afresh at every call.
e4m3 (3 mantissa bits, max 448, relative rounding error <= 2**-4) is the more precise format, for activations and
weights, whose narrow range per-tensor scaling maps onto its 18 binades. Gradients span a wide range within one
tensor, so they get e5m2 (2 mantissa bits, max 57344, 32 binades): the tail stays representable.

Each operand is scaled by ``s = 2**floor(log2(fp8_max / amax))`` of that very tensor
(:func:`~mixprec.lowp.quant.tensor_scale`), cast to FP8, and the GEMM result multiplied by ``1/s_a * 1/s_b``.
Powers of two make scaling and unscaling exact, so the cast is the only rounding, and nothing saturates. A
non-finite amax gives ``s = NaN``: the output is NaN and the recipe's non-finite check stops the run, where e4m3
would silently saturate inf to 448.

*Emulated* (every CPU; GPUs below compute capability 8.9): e4m3 and e5m2 values are exactly bf16 values, so the
GEMM is a bf16 GEMM on the FP8 values (:func:`~mixprec.lowp.quant.to_fp8_as_bf16`): exact products, fp32
accumulation, one rounding of the sum to bf16 -- the real path's one rounding for a bf16 output (``y`` under bf16
autocast, ``dx`` of bf16 activations). fp32 outputs (``dW``) carry that bf16 rounding too (relative error <=
2**-9, 25-30 dB below FP8's own noise); fp16 outputs take an fp32 GEMM. ``dW``'s unscale into fp32 is one
compiled pass where :mod:`~mixprec.lowp.quant` compiles. ``mode="reference"`` (tests, benchmarks/fp8_gemm.py):
an fp32 GEMM on the FP8 operands.

*Real* (CUDA compute capability 8.9+, chosen automatically): ``torch._scaled_mm`` with the FP8 tensors, their
fp32 inverse scales and full fp32 accumulation; a GEMM with a dimension that is not a multiple of 16 (an odd
token count) runs as an fp32 GEMM on the same FP8 operands for that call.

Dtypes: the output takes the autocast dtype when an autocast (torch's or mixprec's) is active, else the input's;
the GEMMs run with both autocasts off (:func:`no_autocast`), ``dx`` comes back in ``x``'s dtype, ``dW`` and
``db`` in the parameters'. Autograd saves the quantized x and W (FP8, or their bf16 copies when emulated) and
their scales, so backward multiplies the operands forward did. Which layers become FP8: :mod:`.convert`.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch import nn

from .. import hardware
from ..autocast import autocast, autocast_dtype, is_autocast_active
from ..memory import FP8_ROLE_ATTR
from .quant import E4M3, E5M2, layer_size, scaled_float, to_fp8, to_fp8_as_bf16

__all__ = ["E4M3", "E5M2", "GEMM_MULTIPLE", "Fp8Linear", "fp8_linear", "no_autocast", "output_dtype",
           "planned_gemm_path"]

GEMM_MULTIPLE = 16
"""``torch._scaled_mm`` needs every GEMM dimension to be a multiple of this."""


@contextlib.contextmanager
def no_autocast(device_type: str):
    """Turn off torch.autocast and mixprec's autocast, so that a low-precision GEMM's operands are not re-cast."""
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
    """A low-precision linear layer's output dtype: the active autocast's, else ``x``'s."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return autocast_dtype() or x.dtype


def _emulated_gemm(a: torch.Tensor, a_inv: torch.Tensor, b: torch.Tensor, b_inv: torch.Tensor,
                   out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``(a @ b) * a_inv * b_inv (+ bias)`` for bf16 ``a`` (M, K), ``b`` (K, N) holding FP8 values (exact in bf16).

    A bf16 GEMM: exact products, fp32 accumulation, the sum rounded once to bf16; the power-of-two unscale is
    exact, so fusing it with the bias add rounds as ``y * s + bias`` would. fp16 outputs (3 more mantissa bits
    than bf16) take the fp32 GEMM instead.
    """
    if out_dtype == torch.float16:
        out = (torch.mm(a.float(), b.float()) * (a_inv * b_inv)).to(out_dtype)
    else:
        out = torch.mm(a, b)
        if out_dtype == torch.float32 and bias is None:
            fused = scaled_float(out, a_inv * b_inv)  # dW: the cast and the unscale in one pass
            if fused is not None:
                return fused
        if out_dtype != torch.bfloat16:
            out = out.to(out_dtype)
        if bias is not None:
            return torch.addcmul(bias.to(out_dtype), out, a_inv * b_inv)
        out = out.mul_(a_inv * b_inv)
    return out if bias is None else out + bias.to(out_dtype)


def _gemm(a: torch.Tensor, a_inv: torch.Tensor, b: torch.Tensor, b_inv: torch.Tensor,
          out_dtype: torch.dtype, mode: str, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``(a @ b) * a_inv * b_inv (+ bias)`` for 2-D ``a`` (M, K) and ``b`` (K, N), returned in ``out_dtype``.

    ``mode``: ``"real"`` (FP8 ``a``, ``b``: ``torch._scaled_mm``), ``"emulated"`` (bf16 ``a``, ``b`` from
    :func:`~mixprec.lowp.quant.to_fp8_as_bf16`) or ``"reference"`` (FP8 ``a``, ``b``, an fp32 GEMM).
    """
    if mode == "emulated":
        return _emulated_gemm(a, a_inv, b, b_inv, out_dtype, bias)
    if mode == "real" and all(d % GEMM_MULTIPLE == 0 for d in (*a.shape, b.shape[1])):
        # cuBLAS layout: a row-major, b column-major
        out = torch._scaled_mm(a.contiguous(), b.t().contiguous().t(), scale_a=a_inv, scale_b=b_inv,
                               out_dtype=out_dtype, use_fast_accum=False)
    else:
        out = (torch.mm(a.float(), b.float()) * (a_inv * b_inv)).to(out_dtype)
    return out if bias is None else out + bias.to(out_dtype)


def _quantize(t: torch.Tensor, fp8_dtype: torch.dtype, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    return to_fp8_as_bf16(t, fp8_dtype) if mode == "emulated" else to_fp8(t, fp8_dtype)


class _Fp8Matmul(torch.autograd.Function):
    """``x @ W^T`` (+ bias) with the three GEMMs in FP8; x is 2-D (tokens, in_features)."""

    @staticmethod
    def forward(ctx, x, weight, bias, out_dtype, mode):
        with no_autocast(x.device.type), layer_size(weight.numel()):
            xq, x_inv = _quantize(x, E4M3, mode)
            wq, w_inv = _quantize(weight, E4M3, mode)
            y = _gemm(xq, x_inv, wq.t(), w_inv, out_dtype, mode, bias)
        for t, role in ((xq, "activation"), (x_inv, "scale"), (wq, "weight"), (w_inv, "scale")):
            setattr(t, FP8_ROLE_ATTR, role)  # how mixprec.memory tells FP8 buffers from activations
        ctx.save_for_backward(xq, x_inv, wq, w_inv)
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.mode = mode
        return y

    @staticmethod
    def backward(ctx, dy):
        xq, x_inv, wq, w_inv = ctx.saved_tensors
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        dx = dw = db = None
        with no_autocast(dy.device.type), layer_size(wq.numel()):
            dyq, dy_inv = _quantize(dy, E5M2, ctx.mode)
            if ctx.needs_input_grad[0]:
                dx = _gemm(dyq, dy_inv, wq, w_inv, x_dtype, ctx.mode)
            if ctx.needs_input_grad[1]:
                dw = _gemm(dyq.t(), dy_inv, xq, x_inv, w_dtype, ctx.mode)
            if b_dtype is not None and ctx.needs_input_grad[2]:
                db = dy.sum(0, dtype=torch.float32).to(b_dtype)
        return dx, dw, db, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
               emulate: bool | None = None) -> torch.Tensor:
    """``F.linear`` with FP8 GEMMs. ``emulate``: None = real where the device has FP8 matmuls, else emulated;
    True = always emulate; False = require real FP8 (raises where the device lacks it)."""
    planned = getattr(_PLANNED, "mode", None)
    if planned is not None:
        return _linear(x, weight, bias, planned)
    real = hardware.has_fp8_matmul(x.device)
    if emulate is False and not real:
        raise RuntimeError(
            f"fp8_linear(..., emulate=False) needs FP8 matmuls (CUDA compute capability 8.9+), but {x.device} has "
            "none; use emulate=None (auto) or emulate=True"
        )
    return _linear(x, weight, bias, "real" if real and not emulate else "emulated")


_PLANNED = threading.local()


def planned_mode() -> str | None:
    """The GEMM path :func:`planned_gemm_path` set in this thread, or None (the device decides)."""
    return getattr(_PLANNED, "mode", None)


@contextlib.contextmanager
def planned_gemm_path(mode: str | None):
    """Run every FP8 layer's GEMMs on the path ``mode`` (``"real"`` or ``"emulated"``) in this thread, whatever
    the tensors' device: ``mixprec plan`` traces, on fake CPU tensors, the path a GPU target would take (None:
    the device decides, as always). Restored on exit."""
    if mode not in (None, "real", "emulated"):
        raise ValueError(f"planned_gemm_path({mode!r}): choose 'real', 'emulated' or None")
    prev = getattr(_PLANNED, "mode", None)
    _PLANNED.mode = mode
    try:
        yield
    finally:
        _PLANNED.mode = prev


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, mode: str) -> torch.Tensor:
    """:func:`fp8_linear` with the GEMM path chosen (``mode`` as in :func:`_gemm`; tests and benchmarks)."""
    out = _Fp8Matmul.apply(x.reshape(-1, x.shape[-1]), weight, bias, output_dtype(x), mode)
    return out.reshape(*x.shape[:-1], out.shape[-1])


class Fp8Linear(nn.Linear):
    """``nn.Linear`` whose three GEMMs run in FP8 (see the module docstring). Same parameters and
    state_dict keys as ``nn.Linear``; ``emulate`` as in :func:`fp8_linear`."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None, *,
                 emulate: bool | None = None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.emulate = emulate

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, emulate: bool | None = None) -> Fp8Linear:
        """Wrap ``linear``'s own Parameter objects (no copy; an optimizer built before still steps them)."""
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=False, emulate=emulate)
        new.weight = linear.weight
        new.bias = linear.bias
        new.train(linear.training)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.bias, emulate=self.emulate)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, emulate={self.emulate}"
