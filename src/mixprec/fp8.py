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
inf to 448. Computing amax reads the whole tensor once but keeps it on the device: no host sync.

Emulated and real paths
-----------------------
*Emulated* (every CPU, and GPUs below compute capability 8.9): operands are cast to the FP8 dtype
and back to fp32 (bit-exact RNE, the same rounding :func:`mixprec.formats.quantize` gives), the GEMM
runs in **fp32** on the scaled values and its result is multiplied by the two inverse scales -- what
``torch._scaled_mm`` does in hardware. fp32 rather than bf16 because (1) FP8 tensor cores accumulate
in fp32, so fp32 is the faithful model; (2) FP8 values are exact in both, so bf16 would add nothing
but a rounding of the output before the scales are applied; (3) on CPUs without AVX512-BF16/AMX a
bf16 GEMM is slower than fp32. The output is then rounded once to the output dtype.

*Real* (CUDA, compute capability >= 8.9, chosen automatically): ``torch._scaled_mm`` with the FP8
tensors, their fp32 inverse scales and ``use_fast_accum=False`` (full fp32 accumulation in all three
GEMMs). It needs every GEMM dimension divisible by 16; a GEMM whose token count (batch x sequence)
is not falls back to the emulated GEMM for that call. The real path is not exercised on CPU.

Dtypes: the output dtype is the autocast dtype when an autocast (``torch.autocast`` or mixprec's) is
active, else the input's dtype. The GEMMs run with every autocast disabled, so neither autocast re-casts
the FP8 operands: the autograd Function handles its dtypes explicitly. ``dx`` comes back in ``x``'s
dtype, ``dW`` and ``db`` in the parameters' dtype (fp32). The quantized x and W (1 byte per element)
and their scales are what autograd saves for backward, so backward uses the same operands as forward.

Which layers
------------
:func:`convert_to_fp8` swaps ``nn.Linear`` modules whose in/out features are divisible by 16 (the FP8
GEMM's requirement; the same layers are converted on CPU and GPU so a model trains alike on both)
and, by default, keeps the final classifier (named ``head`` or ``fc``) in the surrounding precision:
the logits feed the softmax/loss directly, so their error is not averaged away by later layers and
is the most sensitive to quantization, while the layer is a tiny share of the FLOPs. Subclasses of
``nn.Linear`` (e.g. ``MultiheadAttention.out_proj``, whose weight its parent uses directly) are left
alone. :class:`Fp8Linear` keeps ``nn.Linear``'s parameters, so state_dicts load either way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable

import torch
from torch import nn

from . import hardware
from .autocast import autocast, autocast_dtype, is_autocast_active

__all__ = [
    "E4M3",
    "E5M2",
    "Fp8Conversion",
    "Fp8Linear",
    "convert_to_fp8",
    "fp8_linear",
    "fp8_scale",
    "plan_fp8_conversion",
    "to_fp8",
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


def fp8_scale(amax: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """Power-of-two scale ``2**floor(log2(fp8_max / amax))`` as a 0-dim fp32 tensor; NaN if amax isn't finite."""
    ratio = torch.finfo(fp8_dtype).max / amax.double().clamp(min=2.0**-1000)
    _, e = torch.frexp(ratio)  # ratio = m * 2**e, 0.5 <= m < 1, so floor(log2(ratio)) = e - 1 exactly
    scale = (((e - 1).clamp(-_EXP_LIMIT, _EXP_LIMIT).to(torch.int64) + 1023) << 52).view(torch.float64)  # exact 2**k
    return torch.where(torch.isfinite(amax), scale, torch.nan).float()


def to_fp8(t: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``t`` with dynamic per-tensor scaling: returns (fp8 tensor, fp32 inverse scale).

    ``fp8.float() * inv_scale`` dequantizes; the only rounding is the cast to FP8 (RNE).
    """
    t32 = t.detach().float()
    scale = fp8_scale(t32.abs().amax(), fp8_dtype)
    return (t32 * scale).to(fp8_dtype), scale.reciprocal()


def _gemm(a: torch.Tensor, a_inv: torch.Tensor, b: torch.Tensor, b_inv: torch.Tensor,
          out_dtype: torch.dtype, real: bool) -> torch.Tensor:
    """``(a @ b) * a_inv * b_inv`` for 2-D FP8 ``a`` (M, K) and ``b`` (K, N), returned in ``out_dtype``."""
    if real and all(d % GEMM_MULTIPLE == 0 for d in (*a.shape, b.shape[1])):
        # cuBLAS layout: a row-major, b column-major
        return torch._scaled_mm(a.contiguous(), b.t().contiguous().t(), scale_a=a_inv, scale_b=b_inv,
                                out_dtype=out_dtype, use_fast_accum=False)
    return (torch.mm(a.float(), b.float()) * (a_inv * b_inv)).to(out_dtype)


@contextlib.contextmanager
def _no_autocast(device_type: str):
    """Turn off torch.autocast and mixprec's autocast, so the FP8 GEMMs' operands are not re-cast."""
    with contextlib.ExitStack() as stack:
        if torch.is_autocast_enabled(device_type):
            stack.enter_context(torch.autocast(device_type, enabled=False))
        if is_autocast_active():
            stack.enter_context(autocast(device_type=device_type, enabled=False))
        yield


class _Fp8Matmul(torch.autograd.Function):
    """``x @ W^T`` (+ bias) with the three GEMMs in FP8; x is 2-D (tokens, in_features)."""

    @staticmethod
    def forward(ctx, x, weight, bias, out_dtype, real):
        with _no_autocast(x.device.type):
            x8, x_inv = to_fp8(x, E4M3)
            w8, w_inv = to_fp8(weight, E4M3)
            y = _gemm(x8, x_inv, w8.t(), w_inv, out_dtype, real)
            if bias is not None:
                y = y + bias.to(out_dtype)
        ctx.save_for_backward(x8, x_inv, w8, w_inv)
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.real = real
        return y

    @staticmethod
    def backward(ctx, dy):
        x8, x_inv, w8, w_inv = ctx.saved_tensors
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        dx = dw = db = None
        with _no_autocast(dy.device.type):
            dy8, dy_inv = to_fp8(dy, E5M2)
            if ctx.needs_input_grad[0]:
                dx = _gemm(dy8, dy_inv, w8, w_inv, x_dtype, ctx.real)
            if ctx.needs_input_grad[1]:
                dw = _gemm(dy8.t(), dy_inv, x8, x_inv, w_dtype, ctx.real)
            if b_dtype is not None and ctx.needs_input_grad[2]:
                db = dy.float().sum(0).to(b_dtype)
        return dx, dw, db, None, None


def _output_dtype(x: torch.Tensor) -> torch.dtype:
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return autocast_dtype() or x.dtype


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
               emulate: bool | None = None) -> torch.Tensor:
    """``F.linear`` with FP8 GEMMs. ``emulate``: None = real where the device has FP8 matmuls, else emulated;
    True = always emulate; False = require real FP8 (raises where the device lacks it)."""
    real = hardware.has_fp8_matmul(x.device)
    if emulate is False and not real:
        raise RuntimeError(
            f"fp8_linear(..., emulate=False) needs FP8 matmuls (CUDA compute capability 8.9+), but {x.device} has "
            "none; use emulate=None (auto) or emulate=True"
        )
    real = real and not emulate
    out = _Fp8Matmul.apply(x.reshape(-1, x.shape[-1]), weight, bias, _output_dtype(x), real)
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
class Fp8Conversion:
    """What :func:`convert_to_fp8` does to a model."""

    converted: tuple[str, ...]
    """Qualified names of the ``nn.Linear`` modules swapped for :class:`Fp8Linear`."""
    skipped: tuple[tuple[str, str], ...]
    """``(qualified name, reason)`` of every ``nn.Linear`` (or subclass) left as it was."""


def _default_filter(module: nn.Module, fqn: str) -> bool:
    return fqn.rsplit(".", 1)[-1] not in SKIP_NAMES


def plan_fp8_conversion(
    module: nn.Module, *, module_filter_fn: Callable[[nn.Module, str], bool] | None = None
) -> Fp8Conversion:
    """Which linear layers :func:`convert_to_fp8` would swap, and why the others are skipped."""
    keep = module_filter_fn or _default_filter
    converted, skipped = [], []
    for fqn, m in module.named_modules():
        if not isinstance(m, nn.Linear) or isinstance(m, Fp8Linear):
            continue
        if type(m) is not nn.Linear:
            skipped.append((fqn, f"{type(m).__name__} is a subclass of nn.Linear (its parent may use the weight "
                                 "directly, e.g. MultiheadAttention.out_proj)"))
        elif m.in_features % GEMM_MULTIPLE or m.out_features % GEMM_MULTIPLE:
            skipped.append((fqn, f"in_features={m.in_features}, out_features={m.out_features}: FP8 GEMMs need "
                                 f"multiples of {GEMM_MULTIPLE}"))
        elif not keep(m, fqn):
            skipped.append((fqn, "final classifier, kept out of FP8 (logits are the most sensitive layer)"
                            if module_filter_fn is None else "excluded by module_filter_fn"))
        else:
            converted.append(fqn)
    return Fp8Conversion(tuple(converted), tuple(skipped))


def convert_to_fp8(
    module: nn.Module,
    *,
    module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
    emulate: bool | None = None,
) -> nn.Module:
    """Swap eligible ``nn.Linear`` layers of ``module`` for :class:`Fp8Linear`, in place; returns the module
    (a new one when ``module`` itself is a converted linear layer). Skipped layers are logged at INFO;
    :func:`plan_fp8_conversion` returns the same decisions.

    Args:
        module_filter_fn: ``(module, qualified_name) -> bool``, True to convert; replaces the default rule
            (skip layers named ``head``/``fc``). The multiple-of-16 rule always applies.
        emulate: passed to every :class:`Fp8Linear` (None: real FP8 where the device has it).
    """
    plan = plan_fp8_conversion(module, module_filter_fn=module_filter_fn)
    for fqn, reason in plan.skipped:
        log.info("convert_to_fp8: kept %s in its precision: %s", fqn or "<root>", reason)
    for fqn in plan.converted:
        if not fqn:
            return Fp8Linear.from_linear(module, emulate=emulate)
        parent_name, _, child = fqn.rpartition(".")
        parent = module.get_submodule(parent_name)
        setattr(parent, child, Fp8Linear.from_linear(getattr(parent, child), emulate=emulate))
    return module
