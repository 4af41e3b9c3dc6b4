"""FP8 linear layers: the three GEMMs of ``nn.Linear`` with FP8 operands and per-tensor scaling.

Which GEMMs
-----------
A linear layer ``y = x @ W^T + b`` runs one matmul forward and two backward::

    forward    y  = x  @ W^T        x, W  in e4m3
    backward   dx = dy @ W          dy in e5m2, W in e4m3
               dW = dy^T @ x        dy in e5m2, x in e4m3

All three take FP8 operands and accumulate in fp32; everything else (bias add, bias gradient
``db = sum(dy)``, activations, norms, the loss) stays in the surrounding precision (bf16 under the
``fp8-mixed`` recipe's autocast). Parameters stay fp32 and are the master copy: only the GEMM
operands are quantized, afresh at every call.

Why e4m3 forward and e5m2 for gradients
---------------------------------------
e4m3 (3 mantissa bits, max 448) is the more *precise* format: its relative rounding error is at
most 2^-4, so a GEMM operand keeps ~25-30 dB of signal over quantization noise. Activations and
weights have a narrow, well-behaved range that per-tensor scaling maps onto e4m3's 18 binades.
Gradients have a wide dynamic range within one tensor (a few large entries, a long tail of tiny
ones), so they get e5m2 (2 mantissa bits, max 57344, 32 binades): one bit less precision buys
twice the exponent range, and the tail stays representable instead of flushing to zero.

How the scales are computed, and why in float64 and as powers of two
--------------------------------------------------------------------
Dynamic per-tensor ("current") scaling: each operand is scaled just before the GEMM by
``s = fp8_max / amax(|t|)`` of that very tensor, rounded *down* to a power of two:
``s = 2**floor(log2(fp8_max / amax))``. Then ``t * s`` lies within ``[-fp8_max, fp8_max]`` (nothing
saturates; the largest entry lands in ``[fp8_max/2, fp8_max]``), is cast to FP8, and the GEMM result
is multiplied by ``1/s_a * 1/s_b``. Because the scale is a power of two, scaling and unscaling are
exact in binary floating point: the cast to FP8 is the *only* rounding, and ``1/s`` is exact. The cost
is at most one binade of the FP8 range (the smallest subnormals). The ratio is computed in float64
because an fp32 ``448 / amax`` overflows to inf for amax below ~1e-36 (gradients get that small), and
the exponent is read with ``frexp``, which is exact, where ``floor(log2(r))`` can round up across a
power of two. The exponent is clamped to [-126, 126] so ``s`` and ``1/s`` are both normal fp32 values
(``_scaled_mm`` takes fp32 scales). An all-zero tensor gets ``s = 2**126`` (any scale is exact for 0).
A non-finite amax (an inf or NaN anywhere in the tensor) gives ``s = NaN``, so the GEMM result is NaN
and the recipe's non-finite-loss check stops the run, instead of the e4m3 cast silently saturating
inf to 448. amax is ``max(t.amax(), -t.amin())``: two read-only passes, no ``|t|`` temporary. On CPU the
exponent is then computed on the host (reading a CPU scalar is free, a dozen 0-dim tensor ops are not); on
GPUs it stays on the device: no host sync.

Emulated and real paths
-----------------------
*Emulated* (every CPU, and GPUs below compute capability 8.9): every e4m3 and e5m2 value is exactly a
bf16 value (3 or 2 mantissa bits in bf16's 7; their exponents, -9..8 and -16..15, inside bf16's fp32
range), and the *scaled* operands are FP8 values, so the emulated GEMM is a **bf16 GEMM** on them: the
products of two bf16 numbers are exact in fp32 and oneDNN (cuBLAS on GPUs) accumulates them in fp32 --
what FP8 tensor cores do -- at bf16 speed, where the former emulation ran an fp32 GEMM on the same values
(tests and benchmarks/fp8_gemm.py keep that one as the "reference" path; benchmarks/README.md has the figures).

The operands are rounded to the FP8 grid without the FP8 dtype (on CPU its casts are slow, slower than the
GEMM they feed): with ``v = t * scale`` (exact) and
``M = 1.5 * 2**(max(e, emin) + 23 - m)`` for ``e`` v's exponent, ``m`` the format's mantissa bits and
``emin`` its smallest normal exponent, fp32's spacing around ``M`` is exactly v's FP8 spacing and
``|v| < M / 3``, so the fp32 addition ``v + M`` rounds v to the FP8 grid (ties to even: fp32's RNE,
and ``M``'s last mantissa bit is even) and ``(v + M) - M`` is exact. ``M`` is built from v's exponent
bits. Nothing saturates because the scale keeps ``|v| <= fp8 max``; a NaN scale gives NaN. The result
equals ``v.to(fp8).to(bf16)`` for every input (tests: all FP8 values, all ties, random and subnormal
inputs), signed zeros aside. Autograd saves these bf16 operands (2 bytes per element; the real path
saves 1-byte FP8). Where it pays (large CPU operands; :mod:`mixprec.quant_kernels`) the amax, the scale and
the rounding run as one ``torch.compile``'d call giving the same values bit for bit, and ``dW``'s cast to
fp32 and unscale as one pass.

The bf16 GEMM rounds its fp32 sum once, to bf16, and the power-of-two unscale is exact. For a bf16
output (``y`` under the recipe's autocast, ``dx`` of bf16 activations) that is exactly the one rounding
the real path does. fp32 outputs (``dW`` always; ``y``/``dx`` outside bf16 autocast) carry that bf16
rounding too: relative error <= 2**-9, ~55 dB below the signal and 25-30 dB below FP8's own noise, so
the SQNR of y, dx and dW against fp32 barely moves (the tests allow 0.1 dB) -- the rounding bf16-mixed
applies to all its GEMM results, dW included. CPU PyTorch has no bf16 GEMM with an fp32 output at bf16
speed (``torch.mm(..., out_dtype=)`` is CUDA-only; ``torch._scaled_mm`` on CPU takes FP8 inputs and is
exact, but far slower; oneDNN's fp32 matmul with ``torch.backends.mkldnn.matmul.fp32_precision = "bf16"``
is exact on these operands but slower than the bf16 GEMM, and is a process-wide flag). fp16 outputs (3 more mantissa bits than bf16) take
the exact fp32 GEMM.

*Real* (CUDA, compute capability >= 8.9, chosen automatically): ``torch._scaled_mm`` with the FP8
tensors, their fp32 inverse scales and ``use_fast_accum=False`` (full fp32 accumulation in all three
GEMMs). It needs every GEMM dimension divisible by 16; a GEMM whose token count (batch x sequence)
is not falls back to an fp32 GEMM on the same FP8 operands for that call. The real path is not exercised
on CPU.

Dtypes: the output dtype is the autocast dtype when an autocast (``torch.autocast`` or mixprec's) is
active, else the input's dtype. The GEMMs run with every autocast disabled, so neither autocast re-casts
the FP8 operands: the autograd Function handles its dtypes explicitly. ``dx`` comes back in ``x``'s
dtype, ``dW`` and ``db`` in the parameters' dtype (fp32). The quantized x and W (FP8, or their bf16
copies when emulated) and their scales are what autograd saves for backward, so backward uses the same
operands as forward.

Which layers
------------
:func:`convert_to_fp8` swaps ``nn.Linear`` modules whose in/out features are divisible by 16 (the FP8
GEMM's requirement; the same layers are converted on CPU and GPU so a model trains alike on both)
and, by default, keeps the final classifier (named ``head`` or ``fc``) in the surrounding precision:
the logits feed the softmax/loss directly, so their error is not averaged away by later layers and
is the most sensitive to quantization, while the layer is a tiny share of the FLOPs. Subclasses of
``nn.Linear`` (e.g. ``MultiheadAttention.out_proj``, whose weight its parent uses directly) are left
alone. :class:`Fp8Linear` keeps ``nn.Linear``'s parameters, so state_dicts load either way.

Block-scaled recipes (rowwise, MXFP8, MXFP4, NVFP4: :mod:`mixprec.gemm_recipes`) convert through the same
functions with ``recipe=``: layers become :class:`~mixprec.blocklinear.BlockLinear`, and the shape rule uses
the recipe's multiple (32 for MX, 16 for NVFP4 and FP8) for in and out features, the dimensions the forward
and input-gradient GEMMs reduce over.

Linear layers that are not ``nn.Linear`` are converted through a small adapter registry
(:func:`register_linear_adapter`): a predicate that recognises the class and a view of its weight as
``(out, in)``. Built in: Hugging Face's ``Conv1D`` (GPT, GPT-2), a linear layer whose weight is stored
transposed, ``(in, out)``, with ``y = x @ W + b``; recognised by duck typing (class name, ``nf``, weight
shape) so transformers is never imported. It becomes an :class:`Fp8AdaptedLinear` that keeps the stored
layout and Parameter names (state_dicts and optimizers unaffected) and runs ``fp8_linear(x, W.T, b)``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import threading
from collections.abc import Callable

import torch
from torch import nn

from .. import hardware
from . import quant as quant_kernels
from .gemm_context import no_autocast as _no_autocast
from .gemm_context import output_dtype as _output_dtype
from ..memory import FP8_ROLE_ATTR

__all__ = [
    "E4M3",
    "E5M2",
    "Fp8AdaptedLinear",
    "Fp8Conversion",
    "Fp8Linear",
    "LinearAdapter",
    "convert_to_fp8",
    "fp8_linear",
    "fp8_scale",
    "plan_fp8_conversion",
    "planned_gemm_path",
    "register_linear_adapter",
    "to_fp8",
    "to_fp8_as_bf16",
    "unregister_linear_adapter",
]

log = logging.getLogger(__name__)

E4M3 = torch.float8_e4m3fn
"""Forward operands (x, W): 3 mantissa bits, max 448."""
E5M2 = torch.float8_e5m2
"""Gradient operand (dy): 2 mantissa bits, max 57344."""
GEMM_MULTIPLE = 16
"""``torch._scaled_mm`` needs every GEMM dimension to be a multiple of this."""
SKIP_NAMES = ("head", "fc")
"""Final classifier names kept out of FP8 by default (see the module docstring)."""
_EXP_LIMIT = 126  # |log2 scale| <= 126: the scale and its inverse are both normal fp32
_FP8_MAX = {E4M3: torch.finfo(E4M3).max, E5M2: torch.finfo(E5M2).max}


def fp8_scale(amax: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """Power-of-two scale ``2**floor(log2(fp8_max / amax))`` as a 0-dim fp32 tensor; NaN if amax isn't finite.

    On CPU the exponent is computed on the host (reading a CPU scalar costs nothing, where the dozen 0-dim
    tensor ops of :func:`_device_scale` each pay an op's overhead, a GEMM's worth on small layers); elsewhere
    on the device (no host sync). Both compute the same float64 ratio and read its exponent exactly.
    """
    if amax.device.type == "cpu" and not _is_fake(amax):
        return torch.tensor(_host_scale(float(amax), fp8_dtype), dtype=torch.float32)
    return _device_scale(amax, fp8_dtype)  # also fake tensors (mixprec plan): they cannot be read on the host


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _host_scale(amax: float, fp8_dtype: torch.dtype) -> float:
    if not math.isfinite(amax):
        return math.nan
    _, e = math.frexp(_FP8_MAX[fp8_dtype] / max(amax, 2.0**-1000))  # float64; ratio = m * 2**e, 0.5 <= m < 1
    return 2.0 ** min(max(e - 1, -_EXP_LIMIT), _EXP_LIMIT)


def _device_scale(amax: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    ratio = _FP8_MAX[fp8_dtype] / amax.double().clamp(min=2.0**-1000)
    _, e = torch.frexp(ratio)  # ratio = m * 2**e, 0.5 <= m < 1, so floor(log2(ratio)) = e - 1 exactly
    scale = (((e - 1).clamp(-_EXP_LIMIT, _EXP_LIMIT).to(torch.int64) + 1023) << 52).view(torch.float64)  # exact 2**k
    return torch.where(torch.isfinite(amax), scale, torch.nan).float()


def to_fp8(t: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``t`` with dynamic per-tensor scaling: returns (fp8 tensor, fp32 inverse scale).

    ``fp8.float() * inv_scale`` dequantizes; the only rounding is the cast to FP8 (RNE).
    """
    t32 = t.detach().float()
    scale = fp8_scale(_amax(t32), fp8_dtype)
    return (t32 * scale).to(fp8_dtype), scale.reciprocal()


def _amax(t: torch.Tensor) -> torch.Tensor:
    """``max |t|`` in two read-only passes and no temporary (``t.abs().amax()`` writes ``|t|`` first); NaN if any."""
    return torch.maximum(t.amax(), t.amin().neg())


_MANTISSA_BITS = {E4M3: 3, E5M2: 2}
_MIN_NORMAL_EXP = {E4M3: -6, E5M2: -14}


def to_fp8_as_bf16(t: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`to_fp8` with the FP8 values returned as bf16 (exact): ``(q, inv_scale)`` with
    ``q == to_fp8(t)[0].to(torch.bfloat16)``, equal as values (a negative number that rounds to zero gives +0,
    not -0). The emulated GEMMs' operands, computed without the FP8 dtype (see "Emulated path").
    """
    t = t.detach()
    m, emin = _MANTISSA_BITS[fp8_dtype], _MIN_NORMAL_EXP[fp8_dtype]
    fused = quant_kernels.fp8_tensorwise(t.contiguous(), fp8_max=_FP8_MAX[fp8_dtype], sig=m + 1, emin=emin, mbits=m)
    if fused is not None:  # one compiled call where it pays (mixprec.quant_kernels), the same values
        return fused
    v, v_bits, magic, magic_f = _work_buffers(t)
    if t.dtype != torch.float32:  # bf16 reductions are slower than fp32 ones on CPU: convert first
        t = v.copy_(t)
    scale = fp8_scale(_amax(t), fp8_dtype)
    torch.mul(t, scale, out=v)  # exact: a power of two, |v| <= fp8 max
    # M = 1.5 * 2**(max(e, emin) + 23 - m), e = v's exponent: fp32's ulp at M is v's FP8 ulp and |v| < M / 3,
    # so (v + M) - M is v rounded to the FP8 grid, ties to even (module docstring)
    torch.bitwise_and(v_bits, 0x7F800000, out=magic)
    magic.clamp_(min=(127 + emin) << 23)  # FP8 subnormals: the spacing stops shrinking at 2**(emin - m)
    magic += ((23 - m) << 23) | 0x400000
    v += magic_f
    return v.sub_(magic_f).to(torch.bfloat16), scale.reciprocal()


_WORK = threading.local()


def _work_buffers(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 ``v`` and int32 ``magic`` work tensors shaped like ``t``, each also viewed as the other dtype.

    On CPU they are views of two per-thread buffers reused across calls: glibc returns freed blocks this
    large to the OS, so fresh ones page-fault on first touch, which can cost more than the arithmetic. They
    hold 2 x 4 bytes per element of the largest operand seen.
    Other devices have caching allocators.
    """
    if t.device.type != "cpu" or _is_fake(t):  # fake tensors (mixprec plan): the real buffers cannot take them
        v, magic = torch.empty(t.shape, device=t.device), torch.empty(t.shape, dtype=torch.int32, device=t.device)
        return v, v.view(torch.int32), magic, magic.view(torch.float32)
    views = _WORK.__dict__.setdefault("views", {})
    got = views.get(t.shape)
    if got is None:
        n = t.numel()
        store = _WORK.__dict__.get("store")
        if store is None or store.shape[1] < n:
            store = _WORK.store = torch.empty(2, n, dtype=torch.int32)
            views.clear()
        if len(views) > 64:  # many shapes (variable lengths): keep the cache small
            views.clear()
        v_bits, magic = store[0, :n].view(t.shape), store[1, :n].view(t.shape)
        got = views[t.shape] = (v_bits.view(torch.float32), v_bits, magic, magic.view(torch.float32))
    return got


def _emulated_gemm(a: torch.Tensor, a_inv: torch.Tensor, b: torch.Tensor, b_inv: torch.Tensor,
                   out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``(a @ b) * a_inv * b_inv (+ bias)`` for bf16 ``a`` (M, K), ``b`` (K, N) holding FP8 values (exact in bf16).

    A bf16 GEMM: exact products, fp32 accumulation, the sum rounded once to bf16; the power-of-two unscale is
    exact, so fusing it with the bias add rounds as ``y * s + bias`` would. fp16 outputs (3 more mantissa bits
    than bf16) take the fp32 GEMM instead (module docstring).
    """
    if out_dtype == torch.float16:
        out = (torch.mm(a.float(), b.float()) * (a_inv * b_inv)).to(out_dtype)
    else:
        out = torch.mm(a, b)
        if out_dtype == torch.float32 and bias is None:
            fused = quant_kernels.scaled_float(out, a_inv * b_inv)  # dW: the cast and the unscale in one pass
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
    :func:`to_fp8_as_bf16`) or ``"reference"`` (FP8 ``a``, ``b``, fp32 GEMM: the former emulation, kept as the
    checked reference).
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
        with _no_autocast(x.device.type), quant_kernels.layer_size(weight.numel()):
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
        with _no_autocast(dy.device.type), quant_kernels.layer_size(wq.numel()):
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
    out = _Fp8Matmul.apply(x.reshape(-1, x.shape[-1]), weight, bias, _output_dtype(x), mode)
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


@dataclasses.dataclass(frozen=True)
class LinearAdapter:
    """How to run a module that is a linear layer but not an ``nn.Linear`` with FP8 GEMMs.

    The module must hold ``weight`` (a 2-D Parameter) and ``bias`` (a Parameter of ``out_features``, or None)
    and compute ``x @ weight_as_linear(weight).T + bias`` over the last dimension of ``x``.
    """

    name: str
    matches: Callable[[nn.Module], bool]
    weight_as_linear: Callable[[torch.Tensor], torch.Tensor]
    """The stored weight as an ``(out_features, in_features)`` tensor: a differentiable view (``torch.t``)."""


def _is_hf_conv1d(m: nn.Module) -> bool:
    """Hugging Face's ``transformers.pytorch_utils.Conv1D`` (GPT, GPT-2, ...), recognised without importing
    transformers: a class named Conv1D with an int ``nf`` and a 2-D weight stored ``(in, out) = (nx, nf)``."""
    w, b, nf = getattr(m, "weight", None), getattr(m, "bias", None), getattr(m, "nf", None)
    return (type(m).__name__ == "Conv1D" and isinstance(nf, int) and isinstance(w, nn.Parameter) and w.dim() == 2
            and w.shape[1] == nf and (b is None or (isinstance(b, nn.Parameter) and tuple(b.shape) == (nf,))))


_ADAPTERS: list[LinearAdapter] = [LinearAdapter("Conv1D (Hugging Face; weight stored (in, out))", _is_hf_conv1d,
                                                torch.t)]


def register_linear_adapter(cls_or_match: type | Callable[[nn.Module], bool],
                            weight_as_linear: Callable[[torch.Tensor], torch.Tensor], *,
                            name: str | None = None) -> LinearAdapter:
    """Teach :func:`convert_to_fp8` another linear layer class; returns the adapter (for
    :func:`unregister_linear_adapter`). Checked before the built-in ones.

    Args:
        cls_or_match: a class (matched exactly, not its subclasses) or a predicate ``module -> bool``.
        weight_as_linear: the stored weight as ``(out_features, in_features)``, e.g. ``torch.t`` for a
            weight stored ``(in, out)`` like Hugging Face's Conv1D (which is built in).
    """
    if isinstance(cls_or_match, type):
        cls = cls_or_match
        adapter = LinearAdapter(name or cls.__name__, lambda m: type(m) is cls, weight_as_linear)
    else:
        adapter = LinearAdapter(name or getattr(cls_or_match, "__name__", "adapter"), cls_or_match,
                                weight_as_linear)
    _ADAPTERS.insert(0, adapter)
    return adapter


def unregister_linear_adapter(adapter: LinearAdapter) -> None:
    _ADAPTERS.remove(adapter)


def _adapter_for(m: nn.Module) -> LinearAdapter | None:
    if isinstance(m, (nn.Linear, Fp8AdaptedLinear)):
        return None
    return next((a for a in _ADAPTERS if a.matches(m)), None)


class Fp8AdaptedLinear(nn.Module):
    """A linear layer of a registered class (:func:`register_linear_adapter`; Hugging Face's Conv1D built in)
    with FP8 GEMMs: ``y = x @ weight_as_linear(weight).T + bias`` through :func:`fp8_linear`.

    It keeps the original module's Parameter objects under the same names, in their stored layout (Conv1D's
    weight stays ``(in, out)``), so state_dicts load both ways -- a Hugging Face checkpoint into a converted
    model, a converted model's into a plain one -- and an optimizer built before keeps stepping them. The
    layout costs nothing: the FP8 scale (amax) ignores it and the quantized copy is laid out afresh anyway.
    Plain attributes of the original (Conv1D's ``nf``, ``nx``) are carried over for code that reads them.
    """

    def __init__(self, module: nn.Module, adapter: LinearAdapter, *, emulate: bool | None = None,
                 recipe=None, seed: int = 0) -> None:
        super().__init__()
        for k, v in vars(module).items():
            if not k.startswith("_") and k != "training" and isinstance(v, (bool, int, float, str)):
                setattr(self, k, v)
        self.weight = module.weight
        self.bias = module.bias
        self.adapter = adapter
        self.out_features, self.in_features = adapter.weight_as_linear(module.weight).shape
        self.emulate = emulate
        self.recipe = recipe
        """A block-scaled :class:`~mixprec.gemm_recipes.LinearRecipe`, or None for per-tensor FP8."""
        self._generator = None if recipe is None or not recipe.stochastic_rounding else (
            torch.Generator(device=module.weight.device).manual_seed(seed))
        self.train(module.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.adapter.weight_as_linear(self.weight)
        if self.recipe is None:
            return fp8_linear(x, w, self.bias, emulate=self.emulate)
        from .block import block_linear

        return block_linear(x, w, self.bias, self.recipe, emulate=self.emulate, generator=self._generator)

    def extra_repr(self) -> str:
        return (f"{self.adapter.name}: in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, emulate={self.emulate}")


@dataclasses.dataclass(frozen=True)
class Fp8Conversion:
    """What :func:`convert_to_fp8` does to a model."""

    converted: tuple[str, ...]
    """Qualified names of the linear layers swapped for :class:`Fp8Linear` (``nn.Linear``) or
    :class:`Fp8AdaptedLinear` (a registered linear class, e.g. Hugging Face's Conv1D)."""
    skipped: tuple[tuple[str, str], ...]
    """``(qualified name, reason)`` of every linear layer (``nn.Linear``, a subclass, or an adapted class) left
    as it was."""


def _default_filter(module: nn.Module, fqn: str) -> bool:
    return fqn.rsplit(".", 1)[-1] not in SKIP_NAMES


def _skip_reason(m: nn.Module, fqn: str, module_filter_fn: Callable[[nn.Module, str], bool] | None,
                 recipe=None) -> str | None:
    """Why linear layer ``m`` stays as it is, or None to convert it."""
    adapter = _adapter_for(m)
    if adapter is None and type(m) is not nn.Linear:
        return (f"{type(m).__name__} is a subclass of nn.Linear (its parent may use the weight directly, e.g. "
                "MultiheadAttention.out_proj)")
    out_f, in_f = adapter.weight_as_linear(m.weight).shape if adapter else (m.out_features, m.in_features)
    multiple = GEMM_MULTIPLE if recipe is None else recipe.multiple
    if in_f % multiple or out_f % multiple:
        what = ("FP8 GEMMs need" if recipe is None or recipe.token_block is None
                else f"{recipe.name}'s blocks along the reduced dimensions need")
        return f"in_features={in_f}, out_features={out_f}: {what} multiples of {multiple}"
    if not (module_filter_fn or _default_filter)(m, fqn):
        return ("final classifier, kept out of FP8 (logits are the most sensitive layer)" if module_filter_fn is None
                else "excluded by module_filter_fn")
    return None


def _converted_types() -> tuple[type, ...]:
    from .block import BlockLinear

    return Fp8Linear, Fp8AdaptedLinear, BlockLinear


def plan_fp8_conversion(
    module: nn.Module, *, module_filter_fn: Callable[[nn.Module, str], bool] | None = None, recipe=None
) -> Fp8Conversion:
    """Which linear layers :func:`convert_to_fp8` would swap, and why the others are skipped.

    ``recipe``: a block-scaled :class:`~mixprec.gemm_recipes.LinearRecipe` (its multiple), or None for
    per-tensor FP8."""
    if recipe is not None and recipe.name == "tensorwise":
        recipe = None
    converted, skipped = [], []
    for fqn, m in module.named_modules():
        if isinstance(m, _converted_types()) or not (isinstance(m, nn.Linear) or _adapter_for(m)):
            continue
        reason = _skip_reason(m, fqn, module_filter_fn, recipe)
        if reason is None:
            converted.append(fqn)
        else:
            skipped.append((fqn, reason))
    return Fp8Conversion(tuple(converted), tuple(skipped))


def _to_fp8_module(m: nn.Module, emulate: bool | None, recipe=None, fqn: str = "", seed: int = 0) -> nn.Module:
    adapter = _adapter_for(m)
    if recipe is None:
        return Fp8Linear.from_linear(m, emulate=emulate) if adapter is None else Fp8AdaptedLinear(m, adapter,
                                                                                                    emulate=emulate)
    from .block import BlockLinear, layer_seed

    seed = layer_seed(seed, fqn)
    if adapter is None:
        return BlockLinear.from_linear(m, recipe=recipe, emulate=emulate, seed=seed)
    return Fp8AdaptedLinear(m, adapter, emulate=emulate, recipe=recipe, seed=seed)


def convert_to_fp8(
    module: nn.Module,
    *,
    module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
    emulate: bool | None = None,
    recipe=None,
    seed: int = 0,
) -> nn.Module:
    """Swap eligible linear layers of ``module`` for FP8 ones, in place: ``nn.Linear`` for :class:`Fp8Linear`,
    a registered linear class (Hugging Face's Conv1D; :func:`register_linear_adapter`) for
    :class:`Fp8AdaptedLinear`. Returns the module (a new one when ``module`` itself is a converted linear
    layer). Skipped layers are logged at INFO; :func:`plan_fp8_conversion` returns the same decisions.

    Args:
        module_filter_fn: ``(module, qualified_name) -> bool``, True to convert; replaces the default rule
            (skip layers named ``head``/``fc``). The multiple-of-16 rule always applies.
        emulate: passed to every converted layer (None: real FP8 where the device has it).
        recipe: a block-scaled :class:`~mixprec.gemm_recipes.LinearRecipe` (layers become
            :class:`~mixprec.blocklinear.BlockLinear`; its multiple replaces 16), or None / ``tensorwise``.
        seed: seeds each layer's stochastic-rounding stream (NVFP4 option).
    """
    if recipe is not None and recipe.name == "tensorwise":
        recipe = None
    plan = plan_fp8_conversion(module, module_filter_fn=module_filter_fn, recipe=recipe)
    for fqn, reason in plan.skipped:
        log.info("convert_to_fp8: kept %s in its precision: %s", fqn or "<root>", reason)
    for fqn in plan.converted:
        if not fqn:
            return _to_fp8_module(module, emulate, recipe, fqn, seed)
        parent_name, _, child = fqn.rpartition(".")
        parent = module.get_submodule(parent_name)
        setattr(parent, child, _to_fp8_module(getattr(parent, child), emulate, recipe, fqn, seed))
    return module
