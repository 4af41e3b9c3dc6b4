"""A from-scratch autocast: op-by-op casting driven by a :class:`~mixprec.policy.CastPolicy`.

Numerics
--------
Inside ``with autocast(torch.bfloat16):`` every op on the policy's *low* list (matmul, linear,
conv, bmm, attention) gets its floating inputs cast to bf16/fp16 and returns a low-precision
result; the kernels still accumulate in fp32, so the error is one rounding of each operand and
one of the result (unit roundoff 2^-8 for bf16, 2^-11 for fp16). Ops on the *fp32* list (losses,
and on CUDA also softmax, norms, exp/log/pow, reductions) get their inputs cast up and return
fp32, because their range (exp overflows fp16 above ~11) or accumulated error (a sum of 10^4
bf16 terms) needs it. *Promote* ops (cat, stack, ...) take the widest input dtype. Every other op
runs in whatever dtype its inputs have, so an activation that came out of a matmul in bf16
stays bf16 through relu/dropout/residual adds until an fp32 op or an fp32 operand widens it --
exactly what ``torch.autocast`` does (outputs are never cast back; doing so would cost up to
1.5x on a CNN). Parameters stay fp32 and are the master copy: the casts are ordinary autograd
ops, so the gradient that reaches a parameter is cast back to fp32.

``emulate=True`` simulates the low format instead of using it: a low-list op rounds its floating
operands to the nearest value representable in the low format (round-to-nearest-even via
``x.to(low).to(float32)``, bit-exact), computes in fp32, and rounds its result the same way;
tensors stay float32. Because the rounding casts are autograd ops, the gradients flowing through
a low op are rounded too (fp16's overflow to inf at 65504 and its underflow included), which is
what loss scaling exists for. This gives fp16 *numerics* at fp32 *speed* on CPUs without fast
fp16 kernels; ops off the low list run in exact fp32 (slightly more accurate than native fp16
autocast, where e.g. a gelu after a matmul runs in fp16).

Design
------
A :class:`torch.overrides.TorchFunctionMode` sees every call of the torch API (``torch.*``,
``torch.nn.functional.*``, ``Tensor`` methods) with its arguments. Its ``__torch_function__`` maps
the function to an ATen op name (``F.cross_entropy`` -> ``cross_entropy_loss``; ``F.pad`` in
reflect mode -> ``reflection_pad2d``), looks the name up in the policy, casts, and calls. Casting
before the call (rather than at the dispatcher level, below autograd) is what makes the casts
differentiable and lets autograd save the low-precision copies for backward.

* One mode instance is on the torch-function stack while any autocast is active in the thread;
  nested contexts push *frames* (dtype, policy, enabled, ...) and the mode obeys the top frame,
  so an inner ``autocast(enabled=False)`` or another dtype wins, as with ``torch.autocast``.
* Weight-cast cache: the low-precision copy of an fp32 leaf that requires grad (a parameter) is
  made once and reused until the outermost context exits, like ``torch.autocast``'s cache.
* Composites: inside ``__torch_function__`` the mode is popped, so a Python function such as
  ``F.multi_head_attention_forward`` would run its inner linears/softmax unseen. For the policy's
  ``composite`` names the mode re-enters itself and runs a copy of the function whose own
  ``has_torch_function`` check is disabled (the inner calls keep theirs), so every inner op
  follows the policy. The MHA / TransformerEncoderLayer inference fast paths are skipped while
  the mode is active (they refuse to run when any torch-function override is present).
* ``keep_fp32``: forward pre/post hooks on the chosen modules (by qualified name in ``model``,
  or by type) push a frame in which every listed op runs in fp32 and cast the module's floating
  inputs up; the post hook is ``always_call`` so an exception inside the module pops it too.
* ``__exit__`` restores everything -- frames, hooks, cache, the mode stack -- exceptions included.
* Arguments are cast last-first, the order in which torch's C++ autocast kernels cast them, so
  the ATen ops run forward and backward (casts included) are the same, in the same order, as
  under ``torch.autocast`` -- the tests compare whole training steps op by op.
* Cost: every torch call inside the context makes a Python round trip through the mode (a few
  microseconds; more when a large matmul has just evicted the interpreter from cache). That is
  noticeable only for models of a few large ops, e.g. an MLP step on CPU.

Differences from ``torch.autocast`` (deliberate or inherent to a function-level hook)
------------------------------------------------------------------------------------
* C++ composites are seen as one call. On CPU torch lowers the gate matmuls inside ``aten::gru``
  / ``rnn_tanh`` and returns fp32; here GRU/vanilla RNNs run in fp32. ``einsum`` is lowered as a
  whole (torch lowers it only when the equation contracts through ``bmm``).
* Inference fast paths (``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer`` in eval under
  ``no_grad``) are never taken, so they follow the policy op by op as in training; torch.autocast
  on CPU takes them and casts their fused kernels differently (other dtypes/values than in
  training).
* fp16 LSTM on CPU runs (torch's oneDNN LSTM raises for fp16); mixed fp16/bf16 inputs of a
  promote op go to fp32 (torch raises); a cast made under ``no_grad`` is never reused with grad
  enabled, and the cache is keyed by dtype, so nested contexts of different dtypes do not share
  casts.
"""

from __future__ import annotations

import functools
import threading
import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from mixprec.policy import LOW_DTYPES, CastKind, CastPolicy, default_policy

__all__ = ["autocast", "is_autocast_active", "autocast_dtype"]

_F32 = torch.float32
_F64 = torch.float64
_LOW, _FP32, _FP32_OUT, _PROMOTE, _BANNED, _COMPOSITE = (
    CastKind.LOW, CastKind.FP32, CastKind.FP32_OUT, CastKind.PROMOTE, CastKind.BANNED,
    CastKind.COMPOSITE,
)

_BANNED_MESSAGE = {
    "binary_cross_entropy": (
        "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast: "
        "the sigmoid before them saturates in low precision. Combine the two with "
        "torch.nn.functional.binary_cross_entropy_with_logits or torch.nn.BCEWithLogitsLoss, "
        "which are safe to autocast."
    ),
}


# ---------------------------------------------------------------------------------------------
# Python call -> ATen op name
# ---------------------------------------------------------------------------------------------

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


# Python function __name__ -> ATen name (a str), or a function of the call's arguments.
_RENAME: dict[str, str | Callable[[tuple, Mapping], str]] = {
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
}


# ---------------------------------------------------------------------------------------------
# Per-thread state
# ---------------------------------------------------------------------------------------------

class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.frames: list[_Frame] = []
        # weight-cast cache: {(low dtype, emulate, grad enabled): {id(param): (param, cast)}};
        # the inner dicts are emptied when the outermost context exits
        self.cache: dict[tuple, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.mode: _PolicyMode | None = None  # the mode, while it is on the torch-function stack
        self.frame_cache: dict[tuple, _Frame] = {}  # frames are reused across context entries


_state = _ThreadState()


def _frame(enabled: bool, policy: CastPolicy, kinds: Mapping[str, CastKind], dtype: torch.dtype,
           emulate: bool, cache_enabled: bool) -> _Frame:
    """The thread's frame for this configuration (built once: its closures are the hot path)."""
    key = (enabled, id(policy), id(kinds), dtype, emulate, cache_enabled)
    frames = _state.frame_cache
    frame = frames.get(key)
    if frame is None or frame.kinds is not kinds or frame.policy is not policy:
        if len(frames) >= _MAX_MEMO:  # e.g. a new policy object per step: do not grow forever
            frames.clear()
        frame = frames[key] = _Frame(enabled, policy, kinds, dtype, emulate, cache_enabled)
    return frame


def _clear_cache() -> None:
    for entries in _state.cache.values():
        if entries:
            entries.clear()


def is_autocast_active() -> bool:
    """True inside an enabled mixprec autocast in this thread."""
    frames = _state.frames
    return bool(frames) and frames[-1].enabled


def autocast_dtype() -> torch.dtype | None:
    """The low dtype of the innermost enabled mixprec autocast in this thread, else None."""
    return _state.frames[-1].dtype if is_autocast_active() else None


# ---------------------------------------------------------------------------------------------
# Casting
# ---------------------------------------------------------------------------------------------

# like at::autocast::is_eligible: floating but not fp64 (and on the autocast's device type)
_ELIGIBLE_DTYPES = frozenset(
    d for d in vars(torch).values()
    if isinstance(d, torch.dtype) and d.is_floating_point and d is not _F64
)


def _to(t: torch.Tensor, low: torch.dtype) -> torch.Tensor:
    # .bfloat16()/.half()/.float() run the same aten::_to_copy as .to(dtype) but skip the
    # overload resolution of Tensor.to in the Python binding (about 3 us less per cast)
    return t.bfloat16() if low is torch.bfloat16 else t.half()


def _round(t: torch.Tensor, low: torch.dtype) -> torch.Tensor:
    """Round to the nearest value of the ``low`` format (RNE), returned as float32."""
    if t.dtype is low:
        return t.float()
    return _to(t, low).float()


def _round_result(out: Any, low: torch.dtype) -> Any:
    if isinstance(out, torch.Tensor):
        return _round(out, low) if out.dtype is _F32 else out
    if type(out) in (list, tuple):
        return type(out)(_round_result(o, low) for o in out)
    return out


class _Frame:
    """What the mode does while this frame is on top of the thread's frame stack.

    A frame's settings never change, so it is built once per configuration and thread (see
    ``_frame``): the per-tensor casts are closures over its settings, and ``by_func`` memoizes
    the cast kind of each torch function seen, because they run for every call in the context.
    """

    __slots__ = ("enabled", "kinds", "dtype", "device_type", "emulate", "cache_enabled", "policy",
                 "eligible", "to_low", "to_fp32", "by_func", "_forced")

    def __init__(self, enabled: bool, policy: CastPolicy, kinds: Mapping[str, CastKind],
                 dtype: torch.dtype, emulate: bool, cache_enabled: bool) -> None:
        self.enabled = enabled
        self.policy = policy
        self.kinds = kinds
        self.dtype = dtype
        self.device_type = dev = policy.device_type
        self.emulate = emulate
        self.cache_enabled = cache_enabled
        self.by_func: dict[Any, Any] = {}
        self._forced: _Frame | None = None
        eligible_dtypes = _ELIGIBLE_DTYPES
        on_cpu = dev == "cpu"

        def eligible(t: torch.Tensor) -> bool:
            return t.dtype in eligible_dtypes and (t.is_cpu if on_cpu else t.device.type == dev)

        def to_fp32(t: torch.Tensor) -> torch.Tensor:
            dt = t.dtype
            if dt is _F32 or dt not in eligible_dtypes or not (
                    t.is_cpu if on_cpu else t.device.type == dev):
                return t
            return t.float()

        low = dtype
        bf16 = low is torch.bfloat16
        if cache_enabled:
            cache = _state.cache
            with_grad = cache.setdefault((low, emulate, True), {})
            without_grad = cache.setdefault((low, emulate, False), {})
        is_grad_enabled = torch.is_grad_enabled

        def to_low(t: torch.Tensor) -> torch.Tensor:
            """``t`` in the low dtype (emulating: rounded to it, kept fp32), via the weight cache."""
            dt = t.dtype
            if dt is _F32:  # the common case first: fp32 is always eligible
                if not (t.is_cpu if on_cpu else t.device.type == dev):
                    return t
                # like torch.autocast, cache the casts of fp32 leaves that require grad (parameters)
                if cache_enabled and t.requires_grad and t.is_leaf and not t._is_view():
                    entries = with_grad if is_grad_enabled() else without_grad
                    hit = entries.get(id(t))
                    if hit is not None and hit[0] is t:
                        return hit[1]
                    out = t.bfloat16() if bf16 else t.half()
                    if emulate:
                        out = out.float()
                    entries[id(t)] = (t, out)  # holding t keeps id(t) unique while cached
                    return out
                out = t.bfloat16() if bf16 else t.half()
                return out.float() if emulate else out
            if (dt is low and not emulate) or dt not in eligible_dtypes or not (
                    t.is_cpu if on_cpu else t.device.type == dev):
                return t
            if emulate:
                return t.float() if dt is low else (t.bfloat16() if bf16 else t.half()).float()
            return t.bfloat16() if bf16 else t.half()

        self.eligible = eligible
        self.to_fp32 = to_fp32
        self.to_low = to_low

    def forced_fp32(self) -> _Frame:
        """This frame with every listed op run in fp32 (for keep_fp32 modules)."""
        if not self.enabled:
            return self
        if self._forced is None:
            self._forced = _Frame(True, self.policy, _fp32_table(self.policy), self.dtype, False,
                                  False)
        return self._forced

    def kind_of(self, func: Any) -> Any:
        """func's CastKind, None (leave alone), or _RESOLVE (depends on the call's arguments)."""
        name = getattr(func, "__name__", None)
        rename = _RENAME.get(name)
        if not self.enabled:  # a disabled frame leaves every function alone
            kind = None
        elif rename is None:
            kind = self.kinds.get(name)
        elif isinstance(rename, str):
            kind = self.kinds.get(rename)
        else:
            kind = _RESOLVE
        if type(func) in _STABLE_FUNCTION_TYPES:  # not e.g. the fresh method-wrapper of a getter
            if len(self.by_func) >= _MAX_MEMO:
                self.by_func.clear()
            self.by_func[func] = kind
        return kind


_MAX_MEMO = 4096
_RESOLVE = object()  # sentinel: the op name depends on the arguments (see _RENAME)
_UNSEEN = object()
_STABLE_FUNCTION_TYPES = (
    types.BuiltinFunctionType, types.FunctionType, types.MethodDescriptorType,
    types.WrapperDescriptorType,
)


@functools.lru_cache(maxsize=16)
def _fp32_table(policy: CastPolicy) -> Mapping[str, CastKind]:
    keep = (_FP32_OUT, _COMPOSITE)
    return {op: (kind if kind in keep else _FP32) for op, kind in policy.table.items()}


_Tensor = torch.Tensor
_SEQUENCES = (list, tuple)


def _map_seq(seq: list | tuple, fn: Callable[[torch.Tensor], torch.Tensor]) -> list | tuple:
    return type(seq)([fn(x) if isinstance(x, _Tensor) else x for x in seq])


def _map_args(args: tuple, fn: Callable[[torch.Tensor], torch.Tensor]) -> tuple:
    """``args`` with ``fn`` applied to every tensor, last first (see ``_map_tensors``)."""
    new_args = None
    i = len(args)
    while i:
        i -= 1
        a = args[i]
        if isinstance(a, _Tensor):
            b = fn(a)
        elif type(a) in _SEQUENCES and a:
            b = _map_seq(a, fn)
        else:
            continue
        if b is not a:
            if new_args is None:
                new_args = list(args)
            new_args[i] = b
    return args if new_args is None else tuple(new_args)


def _map_tensors(args: tuple, kwargs: dict, fn: Callable[[torch.Tensor], torch.Tensor]
                 ) -> tuple[tuple, dict]:
    """Apply ``fn`` to every tensor in args/kwargs, looking one level into lists and tuples.

    Last argument first: torch's autocast kernels cast their arguments in a C++ parameter-pack
    expansion, which GCC evaluates right to left. Matching that order makes the cast ops (and so
    the autograd graph's node order and the backward op sequence) identical to torch's. The
    inputs are never modified; a new dict is made only when a keyword argument changed.
    """
    if kwargs:
        new_kwargs = None
        for k in reversed(kwargs):
            v = kwargs[k]
            if isinstance(v, _Tensor):
                w = fn(v)
            elif type(v) in _SEQUENCES and v:
                w = _map_seq(v, fn)
            else:
                continue
            if w is not v:
                if new_kwargs is None:
                    new_kwargs = dict(kwargs)  # same keys, same order
                new_kwargs[k] = w
        if new_kwargs is not None:
            kwargs = new_kwargs
    return _map_args(args, fn), kwargs


def _iter_tensors(args: tuple, kwargs: dict) -> Iterable[torch.Tensor]:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif type(a) in (list, tuple):
            for x in a:
                if isinstance(x, torch.Tensor):
                    yield x


# ---------------------------------------------------------------------------------------------
# Composites: run a Python function's body with its own torch-function check disabled
# ---------------------------------------------------------------------------------------------

def _never(*args: Any, **kwargs: Any) -> bool:
    return False


_CHECKS = frozenset({"has_torch_function", "has_torch_function_unary", "has_torch_function_variadic"})
_NO_CHECKS = dict.fromkeys(_CHECKS, _never)


def _unchecked(func: Any) -> Callable | None:
    """A copy of the Python function ``func`` whose top-level has_torch_function* checks are off.

    The copy gets a fresh snapshot of ``func``'s module globals with the check names bound to a
    function returning False; functions it calls keep their own (real) globals, so their checks
    still route them through the mode. Built per call (~2 us), so it never goes stale.
    """
    code = getattr(func, "__code__", None)
    if code is None or _CHECKS.isdisjoint(code.co_names):
        return None
    g = dict(func.__globals__)
    g.update(_NO_CHECKS)
    body = types.FunctionType(code, g, func.__name__, func.__defaults__, func.__closure__)
    body.__kwdefaults__ = func.__kwdefaults__
    return body


# ---------------------------------------------------------------------------------------------
# The mode
# ---------------------------------------------------------------------------------------------

class _PolicyMode(TorchFunctionMode):
    """Applies the top frame of the thread's frame stack to every torch-API call."""

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        # The hot path: every torch call in the context comes through here, so the common cases
        # (an op left alone; a low-list op called without keywords, e.g. F.linear) come first
        # and build no dicts.
        frames = _state.frames
        if not frames:
            return func(*args, **kwargs) if kwargs else func(*args)
        frame = frames[-1]
        kind = frame.by_func.get(func, _UNSEEN)
        if kind is _UNSEEN:
            kind = frame.kind_of(func)  # None for every function while the frame is disabled
        if kind is None:
            return func(*args, **kwargs) if kwargs else func(*args)
        if not kwargs:
            if kind is _LOW:
                args = _map_args(args, frame.to_low)
                if frame.emulate:
                    return _round_result(func(*args), frame.dtype)
                return func(*args)
            kwargs = {}
        elif kwargs.get("out") is not None:  # out= overloads: not autocast, as in torch
            return func(*args, **kwargs)
        if kind is _RESOLVE:
            kind = frame.kinds.get(_RENAME[func.__name__](args, kwargs))
            if kind is None:
                return func(*args, **kwargs)

        if kind is _LOW:
            args, kwargs = _map_tensors(args, kwargs, frame.to_low)
            if frame.emulate:
                return _round_result(func(*args, **kwargs), frame.dtype)
            return func(*args, **kwargs)

        if kind is _FP32:
            args, kwargs = _map_tensors(args, kwargs, frame.to_fp32)
            return func(*args, **kwargs)

        if kind is _FP32_OUT:
            first = args[0] if args else kwargs.get("input")
            if (isinstance(first, torch.Tensor) and first.dtype is not _F32
                    and frame.eligible(first) and kwargs.get("dtype") is None
                    and not any(isinstance(a, torch.dtype) for a in args)):
                kwargs = {**kwargs, "dtype": _F32}
            return func(*args, **kwargs)

        if kind is _PROMOTE:
            widest = None
            for t in _iter_tensors(args, kwargs):
                if frame.eligible(t):
                    if widest is None:
                        widest = t.dtype
                    elif t.dtype is not widest:
                        widest = _F32  # fp32 wins; fp16 mixed with bf16 also goes to fp32
            if widest is not None:
                eligible = frame.eligible
                args, kwargs = _map_tensors(
                    args, kwargs,
                    lambda t: t.to(widest) if t.dtype is not widest and eligible(t) else t)
            return func(*args, **kwargs)

        if kind is _COMPOSITE:
            body = _unchecked(func)
            if body is None:
                return func(*args, **kwargs)
            with self:  # re-enter: the body's inner calls come back through this mode
                return body(*args, **kwargs)

        if kind is _BANNED and any(frame.eligible(t) for t in _iter_tensors(args, kwargs)):
            raise RuntimeError(
                f"{func.__name__} is banned inside mixprec autocast({frame.dtype}, device_type="
                f"{frame.device_type!r}): "
                + _BANNED_MESSAGE.get(func.__name__, "the policy lists it as unsafe.")
            )
        return func(*args, **kwargs)


# ---------------------------------------------------------------------------------------------
# keep_fp32 hooks
# ---------------------------------------------------------------------------------------------

class _KeepFp32Hooks:
    """Forward pre/post hooks that run the hooked modules' ops in fp32 while ``owner`` is active."""

    def __init__(self, owner: _Frame, types_: tuple[type, ...] = ()) -> None:
        self.owner = owner
        self.types = types_  # for global hooks: which modules to act on

    def _active(self, module: nn.Module) -> bool:
        if self.types and not isinstance(module, self.types):
            return False
        return any(f is self.owner for f in _state.frames)

    def pre(self, module: nn.Module, args: tuple, kwargs: dict | None = None):
        if not self._active(module):
            return None
        top = _state.frames[-1]
        _state.frames.append(top.forced_fp32())
        if not top.enabled:
            return None
        new_args, new_kwargs = _map_tensors(args, kwargs or {}, top.to_fp32)
        return new_args if kwargs is None else (new_args, new_kwargs)

    def pre_with_kwargs(self, module: nn.Module, args: tuple, kwargs: dict):
        return self.pre(module, args, kwargs)

    def post(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self._active(module) and len(_state.frames) > 1:
            _state.frames.pop()
        return None


# ---------------------------------------------------------------------------------------------
# The context manager
# ---------------------------------------------------------------------------------------------

class _Config:
    __slots__ = ("dtype", "policy", "emulate", "enabled", "cache_enabled", "keep_modules",
                 "keep_types", "kinds")

    def __init__(self, dtype: torch.dtype, policy: CastPolicy, emulate: bool, enabled: bool,
                 cache_enabled: bool, keep_modules: tuple[nn.Module, ...],
                 keep_types: tuple[type, ...]) -> None:
        self.dtype = dtype
        self.policy = policy
        self.emulate = emulate
        self.enabled = enabled
        self.cache_enabled = cache_enabled
        self.keep_modules = keep_modules
        self.keep_types = keep_types
        self.kinds = policy.table


class _Record:
    __slots__ = ("noop", "saved_len", "frame", "handles", "pushed_mode")

    def __init__(self, noop: bool, saved_len: int = 0, frame: _Frame | None = None,
                 pushed_mode: bool = False) -> None:
        self.noop = noop
        self.saved_len = saved_len
        self.frame = frame
        self.handles: list[Any] = []
        self.pushed_mode = pushed_mode


def _infer_device_type(model: nn.Module | None) -> str:
    if model is not None:
        for p in model.parameters():
            return p.device.type
    return "cuda" if torch.cuda.is_available() else "cpu"


def _module_type_named(name: str, model: nn.Module | None) -> type | None:
    """The nn.Module subclass called ``name``: a class used in ``model``, else one in torch.nn."""
    if model is not None:
        for mod in model.modules():
            if type(mod).__name__ == name:
                return type(mod)
    candidate = getattr(nn, name, None)
    if isinstance(candidate, type) and issubclass(candidate, nn.Module):
        return candidate
    return None


def _resolve_keep_fp32(keep_fp32: Iterable[str | type], model: nn.Module | None
                       ) -> tuple[tuple[nn.Module, ...], tuple[type, ...]]:
    """Split keep_fp32 into module instances (hooked one by one) and types (global hooks).

    A string is a qualified submodule name of ``model`` ("head", "blocks.0.ln1"), else a module
    class name ("LayerNorm": a class used in ``model`` or in torch.nn). With a model, types are
    resolved to its instances, which is cheaper than a global hook on every module call.
    """
    if isinstance(keep_fp32, (str, type)):
        keep_fp32 = [keep_fp32]
    modules: dict[int, nn.Module] = {}
    module_types: list[type] = []
    for entry in keep_fp32:
        if isinstance(entry, type) and issubclass(entry, nn.Module):
            module_types.append(entry)
        elif isinstance(entry, str):
            mod = None
            if model is not None:
                try:
                    mod = model.get_submodule(entry)
                except AttributeError:
                    mod = None
            if mod is not None:
                modules[id(mod)] = mod
                continue
            typ = _module_type_named(entry, model)
            if typ is not None:
                module_types.append(typ)
                continue
            if model is None:
                raise ValueError(
                    f"autocast(keep_fp32=[{entry!r}, ...]): {entry!r} is not a torch.nn module "
                    f"class, and a module name needs the model to resolve it against; pass "
                    f"model=<your nn.Module>"
                )
            names = [n for n, _ in model.named_modules() if n][:12]
            raise ValueError(
                f"autocast(keep_fp32=[{entry!r}, ...]): the model has no submodule or module "
                f"class {entry!r}; qualified names look like {names}"
            )
        else:
            raise TypeError(
                f"autocast(keep_fp32=[{entry!r}, ...]): entries must be qualified module names, "
                f"module class names (str) or nn.Module subclasses, got {type(entry).__name__}"
            )
    if model is not None and module_types:
        wanted = tuple(module_types)
        for mod in model.modules():
            if isinstance(mod, wanted):
                modules[id(mod)] = mod
        module_types = []
    return tuple(modules.values()), tuple(module_types)


class autocast:  # noqa: N801 -- named like torch.autocast, which it replaces
    """Run the ops inside in mixed precision per a :class:`CastPolicy` (see the module docstring).

    Args:
        dtype: the low dtype, torch.bfloat16 (default) or torch.float16.
        device_type: tensors on this device type are cast; default: ``policy.device_type``, else
            the device of ``model``'s first parameter, else "cuda" if available, else "cpu".
        policy: the cast policy; default ``default_policy(device_type, dtype)``, i.e. what
            ``torch.autocast`` does on that device.
        emulate: round low-list ops' operands and results to ``dtype`` but compute and store in
            fp32 (low-precision numerics at fp32 speed; for fp16 on CPUs without fast fp16).
        keep_fp32: modules whose ops run in fp32: qualified names in ``model`` ("head"),
            module classes (``nn.LayerNorm``) or class names ("LayerNorm").
        model: the module that ``keep_fp32`` names refer to.
        enabled: False makes the context a no-op (an inner disabled context turns casting off).
        cache_enabled: reuse the low-precision copy of each parameter within the context.

    Usable as ``with autocast(...):`` or as a decorator ``@autocast(...)``.
    """

    def __init__(
        self,
        dtype: torch.dtype = torch.bfloat16,
        *,
        device_type: str | None = None,
        policy: CastPolicy | None = None,
        emulate: bool = False,
        keep_fp32: Iterable[str | type] = (),
        model: nn.Module | None = None,
        enabled: bool = True,
        cache_enabled: bool = True,
    ) -> None:
        if dtype not in LOW_DTYPES:
            raise ValueError(
                f"autocast(dtype={dtype}): the low dtype must be torch.bfloat16 or "
                f"torch.float16 (use enabled=False to run in fp32)"
            )
        if isinstance(device_type, torch.device):
            device_type = device_type.type
        if policy is not None:
            if not isinstance(policy, CastPolicy):
                raise TypeError(
                    f"autocast(policy={policy!r}): expected a mixprec.policy.CastPolicy, e.g. "
                    f"default_policy('cpu')"
                )
            if device_type is not None and device_type != policy.device_type:
                raise ValueError(
                    f"autocast(device_type={device_type!r}, policy=<{policy.device_type} policy>): "
                    f"the device types disagree; drop device_type or pass "
                    f"default_policy({device_type!r})"
                )
        else:
            device_type = device_type or _infer_device_type(model)
            policy = default_policy(device_type, dtype)
        keep_modules, keep_types = (
            _resolve_keep_fp32(keep_fp32, model) if enabled and keep_fp32 else ((), ()))
        self._config = _Config(dtype, policy, bool(emulate), bool(enabled), bool(cache_enabled),
                               keep_modules, keep_types)
        self._records: list[_Record] = []

    # read-only views of the configuration
    dtype = property(lambda self: self._config.dtype)
    policy = property(lambda self: self._config.policy)
    device_type = property(lambda self: self._config.policy.device_type)
    emulate = property(lambda self: self._config.emulate)
    enabled = property(lambda self: self._config.enabled)

    @classmethod
    def _from_config(cls, config: _Config) -> autocast:
        self = cls.__new__(cls)
        self._config = config
        self._records = []
        return self

    def __repr__(self) -> str:
        c = self._config
        return (f"autocast({c.dtype}, device_type={c.policy.device_type!r}, "
                f"emulate={c.emulate}, enabled={c.enabled})")

    def __enter__(self) -> autocast:
        c = self._config
        frames = _state.frames
        if not c.enabled and not frames:
            self._records.append(_Record(noop=True))  # outermost disabled: nothing to do
            return self
        frame = _frame(c.enabled, c.policy, c.kinds, c.dtype, c.emulate, c.cache_enabled)
        record = _Record(noop=False, saved_len=len(frames), frame=frame)
        frames.append(frame)
        self._records.append(record)
        try:
            if _state.mode is None:
                mode = _PolicyMode()
                mode.__enter__()
                _state.mode = mode
                record.pushed_mode = True
            if c.enabled and (c.keep_modules or c.keep_types):
                self._install_hooks(record)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _install_hooks(self, record: _Record) -> None:
        c = self._config
        if c.keep_modules:
            hooks = _KeepFp32Hooks(record.frame)
            for mod in c.keep_modules:
                record.handles.append(
                    mod.register_forward_pre_hook(hooks.pre_with_kwargs, with_kwargs=True))
                record.handles.append(mod.register_forward_hook(hooks.post, always_call=True))
        if c.keep_types:
            hooks = _KeepFp32Hooks(record.frame, c.keep_types)
            record.handles.append(nn.modules.module.register_module_forward_pre_hook(hooks.pre))
            record.handles.append(
                nn.modules.module.register_module_forward_hook(hooks.post, always_call=True))

    def __exit__(self, exc_type, exc, tb) -> bool:
        record = self._records.pop()
        if record.noop:
            return False
        for handle in record.handles:
            handle.remove()
        del _state.frames[record.saved_len:]
        if record.saved_len == 0:
            _clear_cache()
        if record.pushed_mode:
            mode, _state.mode = _state.mode, None
            top = torch.overrides._get_current_function_mode()
            if top is not mode:
                raise RuntimeError(
                    f"mixprec autocast exit: the innermost TorchFunctionMode is {top!r}, not "
                    f"autocast's; a mode entered inside `with autocast(...)` must be exited "
                    f"inside it"
                )
            mode.__exit__(exc_type, exc, tb)
        return False

    def __call__(self, fn: Callable) -> Callable:
        config = self._config

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with autocast._from_config(config):
                return fn(*args, **kwargs)

        return wrapper
