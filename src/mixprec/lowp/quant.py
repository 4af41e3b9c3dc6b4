"""Fused quantisation of the emulated low-precision GEMM operands (:mod:`mixprec.fp8`, :mod:`mixprec.blocklinear`).

An emulated FP8/FP4 operand is ``round(clamp(t * m, -max, max)) * s`` in bf16, with ``m`` and ``s`` powers of two
(or NVFP4's block factors) per tensor, row or block. Eagerly that is about ten elementwise passes over the
operand, each a kernel launch and a trip through memory; on a CPU with fast bf16 GEMMs they cost more than
the GEMM. Here each is one ``torch.compile``'d call where that pays: :func:`fp8_tensorwise` (per-tensor FP8:
amax, scale and rounding) and :func:`mx_values` (MX: block amax, e8m0 scales and rounding) in one call,
rowwise FP8 and NVFP4 as :func:`block_amax` then :func:`apply_scaled` with the caller's scale rule between
them, and :func:`scaled_float` (a bf16 GEMM result unscaled into fp32). Each returns None where it does not
compile, and the caller runs its eager path.

Same values, bit for bit
------------------------
The compiled chain rounds with Veltkamp's split instead of the eager path's exponent-bit "magic number"
(bit casts are slow in Inductor's vectorised CPU code): for ``|v| >= 2**emin`` (the element format's
normal range) and ``p`` its significant bits, ``c = v * (2**(24 - p) + 1)``, ``hi = c - (c - v)`` is ``v``
rounded to ``p`` bits, ties to even; below ``2**emin`` (the format's subnormals, a fixed spacing
``2**(emin - mbits)``) ``(v + C) - C`` with ``C = 1.5 * 2**(emin - mbits + 23)`` rounds to that spacing.
Both equal the magic-number rounding on every fp32 input (tests: every fp32 value of a binade, both
signs, each element format, and the subnormal range); a value that rounds to zero gives +0, as before.
Only correctly rounded IEEE operations are used (multiply, divide, add, subtract, compare, min/max) and
integer bit operations, which Inductor's C++ code keeps as written (it compiles without unsafe math or
floating-point contraction). The per-tensor and MX scales in the graph repeat :func:`mixprec.fp8.fp8_scale`
and :func:`mixprec.blockformats.mx_scale_exponent` with bit operations; rowwise scales (``log2``/``exp2``)
and NVFP4's (an e4m3 cast) stay with the caller, eager. Tests compare every path with the eager one on
random, zero, tiny, huge, subnormal, inf and NaN inputs.

When it compiles
----------------
``MIXPREC_FUSED_QUANT`` (environment, read at first use) or :func:`set_fused_quant` picks ``auto`` (the
default), ``on`` or ``off``. ``auto`` runs compiled on CPU only, for the operands of linear layers of at
least :data:`MIN_COMPILE_NUMEL` weights (:mod:`mixprec.fp8` and :mod:`mixprec.blocklinear` say which layer
through :func:`layer_size`): each kernel (per-tensor FP8, MX along rows or columns, ...; fp32 or bf16
input) compiles once and takes any shape. A compile takes seconds -- tens for the first in a process on a
small busy machine, far less when Inductor's on-disk cache already holds the kernel -- which a few hundred
steps of a layer that large repay; tests and small models stay eager and never compile. ``on`` compiles
every operand on any device; ``off`` never compiles. Inside a ``torch.compile``'d model (traced anyway), on
fake tensors (``mixprec plan``), and after a compile fails (no C compiler, no Inductor) the eager path
runs; a failure is logged once at INFO.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading

import torch

from ..errors import ConfigError

__all__ = ["MIN_COMPILE_NUMEL", "MIN_OPERAND_NUMEL", "apply_scaled", "block_amax", "fp8_tensorwise",
           "fused_quant_mode", "layer_size", "mx_values", "scaled_float", "set_fused_quant"]

log = logging.getLogger(__name__)

MIN_COMPILE_NUMEL = 1 << 19
"""``auto`` fuses the operands of linear layers with at least this many weights (1024 x 512)."""
MIN_OPERAND_NUMEL = 1 << 12
"""... and of those, operands of at least this many elements (smaller ones cost more in the call than eagerly)."""
_MODES = ("auto", "on", "off")
_ENV = "MIXPREC_FUSED_QUANT"
_state = {"mode": None, "env": None, "broken": False, "fns": {}, "grids": {}}
_LOCAL = threading.local()


def fused_quant_mode() -> str:
    """The current mode: :func:`set_fused_quant`'s, else ``$MIXPREC_FUSED_QUANT`` (read at first use), else
    ``auto``."""
    mode = _state["mode"] or _state.get("env")
    if mode is None:
        mode = os.environ.get(_ENV, "auto").strip().lower() or "auto"
        if mode not in _MODES:
            raise ConfigError(f"{_ENV}={mode!r}: choose one of {', '.join(_MODES)} (or unset it: auto)")
        _state["env"] = mode
    return mode


@contextlib.contextmanager
def layer_size(numel: int):
    """Operands quantised in this block belong to a linear layer of ``numel`` weights (``auto``'s criterion: the
    layer's size, not the operand's, so every operand of a large layer is fused and none of a small one)."""
    prev = getattr(_LOCAL, "size", None)
    _LOCAL.size = numel
    try:
        yield
    finally:
        _LOCAL.size = prev


@contextlib.contextmanager
def set_fused_quant(mode: str | None):
    """Use ``mode`` (``auto``, ``on``, ``off``; None: the environment's) in this process until the block exits."""
    if mode is not None and mode not in _MODES:
        raise ConfigError(f"set_fused_quant({mode!r}): choose one of {', '.join(_MODES)}, or None")
    prev = _state["mode"]
    _state["mode"] = mode
    try:
        yield
    finally:
        _state["mode"] = prev


def _wanted(t: torch.Tensor, kind: str) -> bool:
    """Whether to run kernel ``kind`` compiled on ``t``. ``auto``: on CPU, inside a layer of at least
    :data:`MIN_COMPILE_NUMEL` weights (:func:`layer_size`; outside one, ``t`` itself), for operands of at
    least :data:`MIN_OPERAND_NUMEL` elements."""
    if _state["broken"] or torch.compiler.is_compiling():
        return False
    mode = fused_quant_mode()
    if mode == "off":
        return False
    if mode == "auto":
        n = t.numel()
        size = getattr(_LOCAL, "size", None)
        if t.device.type != "cpu" or n < MIN_OPERAND_NUMEL or (n if size is None else size) < MIN_COMPILE_NUMEL:
            return False
    from torch._subclasses.fake_tensor import FakeTensor

    return not isinstance(t, FakeTensor)


def _scaled_round(x: torch.Tensor, m: torch.Tensor, s: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``round(clamp(x * m, -vmax, vmax)) * s`` in bf16 on the element grid ``k`` describes (:func:`_grid`).

    The format's constants are a tensor, not Python numbers, so every format shares one compiled graph per
    input dtype (Dynamo recompiles for each new Python constant, and stops compiling a function after a
    handful of variants); the three layouts are three functions (:data:`_KERNELS`) for the same reason."""
    v = torch.clamp(x.float() * m, -k[0], k[0])
    c = v * k[1]
    hi = c - (c - v)
    lo = (v + k[2]) - k[2]
    q = torch.where(torch.abs(v) < k[3], lo, hi)
    return (q * s).to(torch.bfloat16)


def _round_tensor(x, m, s, k):  # x (N,), m and s 0-dim: one scale per tensor
    return _scaled_round(x, m, s, k)


def _round_rows(x, m, s, k):  # x (A, B), m and s (A, 1): blocks along the last, contiguous dimension
    return _scaled_round(x, m, s, k)


def _round_cols(x, m, s, k):  # x (A, B, C), m and s (A, 1, C): blocks along a strided dimension
    return _scaled_round(x, m, s, k)


def _amax_along(b: torch.Tensor, dim: int) -> torch.Tensor:
    b = b.float()
    return torch.maximum(b.amax(dim), b.amin(dim).neg())


def _amax_tensor(b):  # (N,) -> 0-dim
    return _amax_along(b, 0)


def _amax_rows(b):  # (A, B) -> (A,)
    return _amax_along(b, 1)


def _amax_cols(b):  # (A, B, C) -> (A, C)
    return _amax_along(b, 1)


def _tensor_scale(amax: torch.Tensor, fp8_max: torch.Tensor) -> torch.Tensor:
    """:func:`mixprec.fp8.fp8_scale` in the graph: ``2**floor(log2(fp8_max / amax))``, exponent clamped to
    [-126, 126], NaN for a non-finite amax. The float64 ratio's exponent field is its exact floor(log2) (the
    ratio is a normal float64, or inf for amax 0, which the clamp turns into 2**126 as the host rule does)."""
    ratio = fp8_max.double() / amax.double()
    e = torch.clamp(((ratio.view(torch.int64) >> 52) & 0x7FF) - 1023, -126, 126)
    scale = ((e + 127) << 23).to(torch.int32).view(torch.float32)
    return torch.where(torch.isfinite(amax), scale, torch.nan)


def _fp8_tensor(x, k):  # x (N,): per-tensor FP8, the scale computed in the graph -> (bf16 values, scale)
    a = x.float()
    scale = _tensor_scale(torch.maximum(a.amax(), a.amin().neg()), k[0])
    return _scaled_round(a, scale, torch.ones_like(scale), k), scale  # scale an output: stored once (_mx)


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """Exact float32 ``2**k`` for integer ``k`` in [-127, 127] (:func:`mixprec.blocklinear._pow2`)."""
    k = k.to(torch.int32)
    return torch.where(k >= -126, (k + 127) << 23, torch.full_like(k, 1 << 22)).view(torch.float32)


def _mx_exponent(amax: torch.Tensor, el_max: torch.Tensor, emax: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
    """:func:`mixprec.blockformats.mx_scale_exponent` with the element format and rule as tensors."""
    k_floor = ((amax.view(torch.int32) >> 23) & 0xFF) - 127 - emax
    d = amax / el_max
    bits = d.view(torch.int32)
    k_rceil = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    k_rceil = torch.where(bits < (1 << 23), torch.where(bits > (1 << 22), -126, -127), k_rceil)
    return torch.clamp(torch.where(floor, k_floor, k_rceil), -127, 127)


def _mx(x: torch.Tensor, k: torch.Tensor, kint: torch.Tensor) -> torch.Tensor:
    """MX values along dim 1 of ``x`` (one block): amax, the e8m0 scale, scale-round-unscale -> (bf16 values, m, s).

    ``m`` and ``s`` are returned so that Inductor stores them once per block: a graph output is realized,
    where an intermediate is recomputed inline for every element that reads it (a dozen integer ops per
    element instead of per block)."""
    a = x.float()
    amax = torch.maximum(a.amax(1, keepdim=True), a.amin(1, keepdim=True).neg())
    e = _mx_exponent(amax, k[0], kint[0], kint[1] != 0)
    nan = torch.isnan(amax)
    m = torch.where(nan, torch.nan, _pow2(-e))
    s = torch.where(nan, torch.nan, _pow2(e))
    return _scaled_round(a, m, s, k), m, s


def _mx_rows(x, k, kint):  # x (A, 32): blocks along the last, contiguous dimension
    return _mx(x, k, kint)


def _mx_cols(x, k, kint):  # x (A, 32, C): blocks along a strided dimension
    return _mx(x, k, kint)


def _scaled_float(x, s):  # x (N,), s 0-dim -> float32 x * s
    return x.float() * s


_KERNELS = {f.__name__: f for f in (_round_tensor, _round_rows, _round_cols, _amax_tensor, _amax_rows, _amax_cols,
                                    _fp8_tensor, _mx_rows, _mx_cols, _scaled_float)}



def _grid(vmax: float | None, sig: int, emin: int, mbits: int, device: torch.device) -> torch.Tensor:
    """float32 ``[vmax, 2**(24 - sig) + 1, 1.5 * 2**(emin - mbits + 23), 2**emin]`` (module docstring), cached."""
    key = (vmax, sig, emin, mbits, device)
    got = _state["grids"].get(key)
    if got is None:
        got = _state["grids"][key] = torch.tensor(
            [math.inf if vmax is None else vmax, 2.0 ** (24 - sig) + 1, 1.5 * 2.0 ** (emin - mbits + 23), 2.0**emin],
            dtype=torch.float32, device=device)
    return got


def _layout(t: torch.Tensor, dim: int) -> tuple[str, tuple[int, ...]]:
    """Which kernel family a contiguous ``t`` blocked along ``dim`` takes, and the shape it is viewed as."""
    a, b, c = math.prod(t.shape[:dim]), t.shape[dim], math.prod(t.shape[dim + 1:])
    if a == 1 and c == 1:
        return "tensor", (b,)
    if c == 1:
        return "rows", (a, b)
    return "cols", (a, b, c)


def _run(name: str, *args):
    try:
        fn = _state["fns"].get(name)
        if fn is None:
            fn = _state["fns"][name] = torch.compile(_KERNELS[name], dynamic=True)
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - any compile failure (no compiler, no Inductor): eager from now on
        _state["broken"] = True
        log.info("mixprec: fused quantisation unavailable (%s: %s); using the eager path",
                 type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return None


def apply_scaled(x: torch.Tensor, m: torch.Tensor, s: torch.Tensor | None, vmax: float | None, *, sig: int,
                 emin: int, mbits: int, dim: int) -> torch.Tensor | None:
    """The bf16 operand ``round(clamp(x * m, -vmax, vmax)) * s`` (``vmax`` None: no clamp) on the grid of an
    element format with ``sig`` significant bits, ``mbits`` mantissa bits and smallest normal exponent
    ``emin``, in one compiled pass -- or None where it is not compiled (the caller's eager path then runs).
    ``x`` is contiguous; ``m`` and ``s`` are 0-dim or shaped like ``x`` with ``dim`` (the block's elements)
    of size 1. ``x * m`` is one fp32 product per element, as in the eager paths."""
    kind, shape = _layout(x, dim)
    if not _wanted(x, "round_" + kind):
        return None
    k = _grid(vmax, sig, emin, mbits, x.device)
    ms = () if kind == "tensor" else (shape[0], 1, *shape[2:])
    s = torch.ones((), device=x.device) if s is None else s
    q = _run(f"_round_{kind}", x.view(shape), m.reshape(ms), s.reshape(ms), k)
    return None if q is None else q.view(x.shape)


def block_amax(b: torch.Tensor, dim: int) -> torch.Tensor | None:
    """float32 ``max |b|`` along ``dim`` of a contiguous ``b`` in one compiled pass (NaN where any is NaN; the
    result has ``b``'s shape without ``dim``), or None where it is not compiled."""
    kind, shape = _layout(b, dim)
    if not _wanted(b, "amax_" + kind):
        return None
    amax = _run(f"_amax_{kind}", b.view(shape))
    return None if amax is None else amax.view((*b.shape[:dim], *b.shape[dim + 1:]))


def fp8_tensorwise(t: torch.Tensor, *, fp8_max: float, sig: int, emin: int, mbits: int
                   ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`mixprec.fp8.to_fp8_as_bf16` of a contiguous ``t`` (the format given by its largest value,
    significant bits, smallest normal exponent and mantissa bits) as one compiled call: ``(bf16 values,
    fp32 inverse scale)``, or None where it is not compiled."""
    if not _wanted(t, "fp8_tensor"):
        return None
    got = _run("_fp8_tensor", t.view(-1), _grid(fp8_max, sig, emin, mbits, t.device))
    return None if got is None else (got[0].view(t.shape), torch.reciprocal(got[1]))


def mx_values(t: torch.Tensor, dim: int, *, block: int, el_max: float, emax: int, sig: int, emin: int, mbits: int,
              floor: bool) -> torch.Tensor | None:
    """An MX operand (:func:`mixprec.blocklinear.quantize_operand`: bf16 values, the e8m0 scales folded in) of
    a contiguous ``t`` with blocks of ``block`` along ``dim``, as one compiled call (amax, scales and rounding
    in the graph; ``floor``: the FLOOR rule, else RCEIL), or None where it is not compiled."""
    b = t.view(*t.shape[:dim], t.shape[dim] // block, block, *t.shape[dim + 1:])
    kind, shape = _layout(b, dim + 1)
    if kind == "tensor":
        kind, shape = "rows", (1, block)
    if not _wanted(t, "mx_" + kind):
        return None
    k = _grid(el_max, sig, emin, mbits, t.device)
    kint = torch.tensor([emax, int(floor)], dtype=torch.int32, device=t.device)
    got = _run(f"_mx_{kind}", b.view(shape), k, kint)
    return None if got is None else got[0].view(t.shape)


def scaled_float(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor | None:
    """float32 ``x * s`` of a contiguous ``x`` and a 0-dim float32 ``s`` in one compiled pass (the eager
    ``x.float().mul_(s)`` is two), or None where it is not compiled."""
    if not _wanted(x, "scaled_float"):
        return None
    got = _run("_scaled_float", x.view(-1), s.reshape(()))
    return None if got is None else got.view(x.shape)
