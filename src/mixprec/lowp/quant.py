"""Every quantiser of the low-precision GEMM operands, eager and compiled from the same functions.

An emulated operand is ``round(clamp(t * m, -max, max)) * s`` in **bf16**, with ``m`` and ``s`` a scale rule's
multiplier and decode scale per tensor, row or block: :func:`~mixprec.formats.abs_max`, the rule
(:func:`tensor_scale` per tensor, :mod:`mixprec.formats`' block rules), :func:`~mixprec.formats.round_to_grid`,
then ``s`` multiplied in on the way to bf16. The values equal the formats' own (:func:`to_fp8` casts,
:func:`~mixprec.formats.quantize_blocks`) wherever bf16 holds ``q * s`` (module docstring of :mod:`.block`), a
value rounding to zero aside (+0 here). Entry points: :func:`to_fp8` / :func:`to_fp8_as_bf16` (per-tensor FP8,
:mod:`.fp8`), :func:`quantize_operand` (the block recipes' operands, :mod:`.block`), :func:`scaled_float`.

Compiled
--------
``MIXPREC_FUSED_QUANT`` (environment, read at first use) or :func:`set_fused_quant`: ``auto`` (default), ``on``
or ``off``. Where it applies, the kernels below -- :func:`torch.compile` of the functions the eager path calls,
the format's constants passed as tensors so that one graph serves every format -- replace about ten elementwise
passes by one or two: per-tensor FP8 and MX in one call (amax, scale and rounding), rowwise and NVFP4 as the
block amax, their scale rule run eagerly (its ``log2``/e4m3 cast stay out of the graph), then the rounding.
``auto`` compiles on CPU only, for operands of at least :data:`MIN_OPERAND_NUMEL` elements of linear layers of
at least :data:`MIN_COMPILE_NUMEL` weights (:func:`layer_size`), so tests and small models never compile;
``on`` compiles every operand on any device; ``off`` never. Inside a ``torch.compile``'d model, on fake tensors
(``mixprec plan``) and after a failed compile (logged once at INFO) the eager path runs.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import types

import torch
from torch._subclasses.fake_tensor import FakeTensor

from ..errors import ConfigError
from ..formats import (
    ELEMENT_FORMATS,
    ElementFormat,
    abs_max,
    mx_scales,
    nvfp4_scales,
    pow2,
    quantize_blocks,
    round_to_grid,
    rowwise_scales,
)

__all__ = ["E4M3", "E5M2", "MIN_COMPILE_NUMEL", "MIN_OPERAND_NUMEL", "fp8_scale", "fused_quant_mode", "layer_size",
           "quantize_operand", "scaled_float", "set_fused_quant", "tensor_scale", "to_fp8", "to_fp8_as_bf16"]

log = logging.getLogger(__name__)

E4M3 = torch.float8_e4m3fn
"""Forward operands (x, W): 3 mantissa bits, max 448."""
E5M2 = torch.float8_e5m2
"""Gradient operand (dy): 2 mantissa bits, max 57344."""
_FP8 = {E4M3: ELEMENT_FORMATS["e4m3"], E5M2: ELEMENT_FORMATS["e5m2"]}
_EXP_LIMIT = 126  # |log2 scale| <= 126: the scale and its inverse are both normal fp32
_BF16 = torch.bfloat16

MIN_COMPILE_NUMEL = 1 << 19
"""``auto`` fuses the operands of linear layers with at least this many weights (1024 x 512)."""
MIN_OPERAND_NUMEL = 1 << 12
"""... and of those, operands of at least this many elements (smaller ones cost more in the call than eagerly)."""
_MODES = ("auto", "on", "off")
_ENV = "MIXPREC_FUSED_QUANT"
_state = {"mode": None, "env": None, "broken": False, "fns": {}, "consts": {}}
_LOCAL = threading.local()


# -------------------------------------------------------------------------------------- per-tensor FP8 scale


def tensor_scale(amax: torch.Tensor, fp8_max) -> torch.Tensor:
    """fp8-mixed's per-tensor scale: ``2**floor(log2(fp8_max / amax))``, the exponent clamped to [-126, 126] (the
    scale and its inverse are normal fp32), as float32; NaN for a non-finite amax, ``2**126`` for 0. The ratio is
    float64 (an fp32 ``448 / amax`` overflows below amax ~1e-36) and ``frexp`` reads its exponent exactly."""
    ratio = fp8_max / amax.double().clamp(min=2.0**-1000)
    _, e = torch.frexp(ratio)  # ratio = m * 2**e, 0.5 <= m < 1, so floor(log2(ratio)) = e - 1 exactly
    scale = pow2((e - 1).clamp(-_EXP_LIMIT, _EXP_LIMIT), torch.float64)
    return torch.where(torch.isfinite(amax), scale, torch.nan).float()


def fp8_scale(amax: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """:func:`tensor_scale` as a 0-dim fp32 tensor. On CPU the exponent is computed on the host (reading a CPU
    scalar costs nothing; a dozen 0-dim ops cost a small layer's GEMM), elsewhere on the device (no host sync)."""
    if amax.device.type == "cpu" and not _is_fake(amax):
        a = float(amax)
        if not math.isfinite(a):
            return torch.tensor(math.nan)
        _, e = math.frexp(_FP8[fp8_dtype].max / max(a, 2.0**-1000))
        return torch.tensor(2.0 ** min(max(e - 1, -_EXP_LIMIT), _EXP_LIMIT), dtype=torch.float32)
    return _device_scale(amax, fp8_dtype)  # also fake tensors (mixprec plan): they cannot be read on the host


def _device_scale(amax: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    return tensor_scale(amax, _FP8[fp8_dtype].max)  # a function of its own: mixprec plan replays its ops


def _is_fake(t: torch.Tensor) -> bool:
    return isinstance(t, FakeTensor)  # mixprec plan's tensors


# ------------------------------------------------------------------------------------------- the quantisers


def to_fp8(t: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-tensor scaling: ``(fp8 tensor, fp32 inverse scale)``; ``fp8.float() * inv_scale``
    dequantizes, and the cast to FP8 (RNE) is the only rounding."""
    t32 = t.detach().float()
    scale = fp8_scale(abs_max(t32), fp8_dtype)
    return (t32 * scale).to(fp8_dtype), scale.reciprocal()


def to_fp8_as_bf16(t: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`to_fp8` with the FP8 values as bf16 (exact), computed without the FP8 dtype (on CPU its casts are
    slower than the GEMM they feed): ``q == to_fp8(t)[0].to(torch.bfloat16)`` as values (+0 for -0)."""
    def scales(amax):
        scale = fp8_scale(amax, fp8_dtype)
        return scale, None, scale.reciprocal()

    return _quantise(t.detach(), None, _FP8[fp8_dtype], scales, "_k_tensorwise", clamp=False)


def quantize_operand(t: torch.Tensor, fmt: str, axis: int, *, scale_rule: str | None = None,
                     stochastic: bool = False, generator: torch.Generator | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A GEMM operand in ``fmt`` (a key of :data:`mixprec.lowp.recipes.OPERAND_FORMATS`) quantised along
    ``axis`` (the reduced dimension): ``(bf16 values with the block scales folded in, the scale the GEMM's
    output is multiplied by, or None)`` -- the second is NVFP4's per-tensor scale. ``stochastic``: NVFP4 with
    stochastically rounded elements."""
    t = t.detach()
    if fmt == "bf16":
        return t.to(_BF16), None
    if fmt == "e5m2-tensor":
        raise ValueError("per-tensor e5m2 operands are mixprec.lowp.fp8's (the tensorwise recipe), not a block format")
    if fmt == "e4m3-tensor":  # torchao's tensorwise rule with power-of-two scales: its rowwise rule, one row
        return quantize_blocks(t.reshape(1, -1), "fp8_e4m3_rowwise", axis=1).reshape(t.shape).to(_BF16), None
    if fmt == "nvfp4" and stochastic:
        return _nvfp4_stochastic(t, axis, generator)
    if t.dim() == 2 and not t.is_contiguous() and t.t().is_contiguous():  # a transposed view: quantise the
        q, ts = quantize_operand(t.t(), fmt, 1 - axis, scale_rule=scale_rule)  # stored tensor along the other axis
        return q.t(), ts
    ax = axis % t.dim()
    el = ELEMENT_FORMATS["e2m1" if fmt in ("mxfp4", "nvfp4") else "e4m3"]
    block = {"mxfp8": 32, "mxfp4": 32, "nvfp4": 16}.get(fmt, t.shape[ax])  # e4m3-row: the whole axis
    shape = (math.prod(t.shape[:ax]) * (t.shape[ax] // block), block, math.prod(t.shape[ax + 1:]))
    if fmt == "nvfp4":
        return _quantise(t, shape, el, nvfp4_scales)
    if fmt == "e4m3-row":
        return _quantise(t, shape, el, lambda amax: rowwise_scales(amax, el.max))
    floor = scale_rule == "floor"
    return _quantise(t, shape, el, lambda amax: mx_scales(amax, el.max, el.emax, floor), "_k_mx", floor=floor)


def _round_e2m1_stochastic(y: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """``y`` (within +-6) rounded to e2m1 stochastically: up with probability (y - lo) / (hi - lo)."""
    a = y.abs()
    _, e = torch.frexp(a)
    k = torch.clamp(e - 1, min=0, max=2) - 1  # log2 of e2m1's spacing at a: 0.5 below 2, then 1, then 2
    step = torch.ldexp(torch.ones_like(a), k)
    u = torch.rand(a.shape, generator=generator, device=a.device)
    q = torch.clamp(torch.floor(a / step + u) * step, max=6.0)
    return torch.copysign(q, y)


def _nvfp4_stochastic(t: torch.Tensor, axis: int, generator: torch.Generator | None):
    """NVFP4 along ``axis`` with stochastically rounded elements: (block values ``q * s`` in bf16, tensor scale)."""
    rows = t.float().movedim(axis, -1)
    blocks = rows.reshape(*rows.shape[:-1], rows.shape[-1] // 16, 16)
    m, s, ts = nvfp4_scales(abs_max(blocks, -1))
    q = _round_e2m1_stochastic(torch.clamp(blocks * m.unsqueeze(-1), -6.0, 6.0), generator)
    return (q * s.unsqueeze(-1)).reshape(rows.shape).movedim(-1, axis).to(_BF16), ts


# ------------------------------------------------------------- one path, eager or compiled (the same functions)


def _values(x: torch.Tensor, m: torch.Tensor, s: torch.Tensor | None, vmax, grid, v=None, magic=None) -> torch.Tensor:
    """bf16 ``round(clamp(x * m, -vmax, vmax)) * s`` for fp32 ``x`` (``vmax`` None: no clamp; ``s`` None: 1) on
    ``grid`` (:func:`~mixprec.formats.round_to_grid`). ``v``, ``magic``: fp32 and int32 work tensors shaped like
    ``x`` (None: new ones)."""
    v = torch.mul(x, m, out=v)
    if vmax is not None:
        v.clamp_(-vmax, vmax)
    q = round_to_grid(v, grid, magic)
    if s is None:
        return q.to(_BF16)
    return torch.mul(q, s, out=torch.empty(q.shape, dtype=_BF16, device=q.device))  # one pass to bf16


def _quantise(t: torch.Tensor, shape: tuple[int, int, int] | None, el: ElementFormat, scales,
              kernel: str | None = None, *, floor: bool = False, clamp: bool = True
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``t`` quantised: ``(bf16 values, the GEMM output's scale or None)``. ``shape``: ``t`` viewed as (A, B, C)
    with blocks of B along dim 1, or None for one scale per tensor. ``scales``: the amax, (A, 1, C) or one, ->
    ``(m, s or None, the output's scale or None)``, run eagerly -- between the compiled amax and rounding unless
    ``kernel`` computes it in the graph."""
    if t.is_contiguous() and _wanted(t):
        x, (fk, ik) = t.view(shape or -1), _consts(el, t.device, floor)
        if kernel is not None:
            got = _run(kernel, x, fk, ik)
            if got is not None:
                return got[0].view(t.shape), (got[1].reciprocal() if shape is None else None)
        else:
            amax = _run("_k_amax", x)
            m, s, out = scales(amax) if amax is not None else (None, None, None)
            q = None if amax is None else _run("_k_round", x, m, s, fk, ik)
            if q is not None:
                return q.view(t.shape), out
    v, magic = _work_buffers(shape or t.shape, t.device, _is_fake(t))
    if shape is None:  # one block: the tensor in its own shape, no views
        x = t if t.dtype == torch.float32 and t.is_contiguous() else v.copy_(t)
    else:
        x = t.view(shape) if t.dtype == torch.float32 and t.is_contiguous() else v.view(t.shape).copy_(t).view(shape)
    m, s, out = scales(abs_max(x, () if shape is None else 1, keepdim=shape is not None))
    q = _values(x, m, s, el.max if clamp else None, el, v, magic)
    return q if shape is None else q.view(t.shape), out


# The compiled kernels: x (A, B, C) with blocks along dim 1 (_k_tensorwise: x flat); fk = the element format's
# [max, *split] (fp32), ik = [emax, FLOOR?] (int32). m and s are outputs of _k_mx so that Inductor stores them
# once per block instead of recomputing them for every element.


def _k_amax(x):
    return abs_max(x.float(), 1, keepdim=True)


def _k_round(x, m, s, fk, ik):
    return _values(x.float(), m, s, fk[0], fk[1:])


def _k_mx(x, fk, ik):
    a = x.float()
    m, s, _ = mx_scales(abs_max(a, 1, keepdim=True), fk[0], ik[0], ik[1] != 0)
    return _values(a, m, s, fk[0], fk[1:]), m, s


def _k_tensorwise(x, fk, ik):  # returns the scale, not its reciprocal: that, in the graph, doubles its time
    a = x.float()
    scale = tensor_scale(abs_max(a), fk[0])
    return _values(a, scale, None, None, fk[1:]), scale


def _k_scaled_float(x, s):
    return x.float() * s


_KERNELS = {f.__name__: f for f in (_k_amax, _k_round, _k_mx, _k_tensorwise, _k_scaled_float)}


def scaled_float(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor | None:
    """float32 ``x * s`` of a contiguous ``x`` and a 0-dim float32 ``s`` in one compiled pass (the eager
    ``x.float().mul_(s)`` is two), or None where it is not compiled."""
    if not _wanted(x):
        return None
    got = _run("_k_scaled_float", x.view(-1), s.reshape(()))
    return None if got is None else got.view(x.shape)


# ------------------------------------------------------------------------------------------ when to compile


def fused_quant_mode() -> str:
    """:func:`set_fused_quant`'s mode, else ``$MIXPREC_FUSED_QUANT`` (read at first use), else ``auto``."""
    mode = _state["mode"] or _state.get("env")
    if mode is None:
        mode = os.environ.get(_ENV, "auto").strip().lower() or "auto"
        if mode not in _MODES:
            raise ConfigError(f"{_ENV}={mode!r}: choose one of {', '.join(_MODES)} (or unset it: auto)")
        _state["env"] = mode
    return mode


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


@contextlib.contextmanager
def layer_size(numel: int):
    """Operands quantised in this block belong to a linear layer of ``numel`` weights (``auto`` decides by the
    layer's size, so every operand of a large layer is fused and none of a small one)."""
    prev = getattr(_LOCAL, "size", None)
    _LOCAL.size = numel
    try:
        yield
    finally:
        _LOCAL.size = prev


def _wanted(t: torch.Tensor) -> bool:
    """Whether to run compiled on ``t`` (module docstring)."""
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
    return not _is_fake(t)


def _consts(el: ElementFormat, device: torch.device, floor: bool) -> tuple[torch.Tensor, torch.Tensor]:
    key = (el.name, floor, device)
    got = _state["consts"].get(key)
    if got is None:
        got = _state["consts"][key] = (torch.tensor([el.max, *el.split], device=device),
                                       torch.tensor([el.emax, int(floor)], dtype=torch.int32, device=device))
    return got


def _run(name: str, *args):
    x = args[0]
    key = name if x.dim() != 3 else f"{name}_{int(x.shape[0] == 1)}{int(x.shape[2] == 1)}"
    try:
        fn = _state["fns"].get(key)
        if fn is None:  # each layout (blocks along rows, along columns, the whole tensor) compiles a copy with a
            k = _KERNELS[name]  # code object of its own: Dynamo's limit on recompiles is per code object
            fn = types.FunctionType(k.__code__.replace(co_name=key), k.__globals__, key)
            fn = _state["fns"][key] = torch.compile(fn, dynamic=True)
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - any compile failure (no compiler, no Inductor): eager from now on
        _state["broken"] = True
        log.info("mixprec: fused quantisation unavailable (%s: %s); using the eager path",
                 type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return None


_WORK = threading.local()


def _work_buffers(shape: tuple[int, ...], device: torch.device, fake: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 and int32 work tensors of ``shape``. On CPU, views of one per-thread buffer reused across calls
    (glibc returns freed blocks this large to the OS, and fresh ones page-fault on first touch, which can cost
    more than the arithmetic): 8 bytes per element of the largest operand seen. Other devices have caching
    allocators."""
    if device.type != "cpu" or fake:  # fake tensors (mixprec plan): the real buffers cannot take them
        return torch.empty(shape, device=device), torch.empty(shape, dtype=torch.int32, device=device)
    views = _WORK.__dict__.setdefault("views", {})
    got = views.get(shape)
    if got is None:
        n = math.prod(shape)
        store = _WORK.__dict__.get("store")
        if store is None or store.shape[1] < n:
            store = _WORK.store = torch.empty(2, n, dtype=torch.int32)
            views.clear()
        if len(views) > 64:  # many shapes (variable lengths): keep the cache small
            views.clear()
        got = views[shape] = (store[0, :n].view(torch.float32).view(shape), store[1, :n].view(shape))
    return got
