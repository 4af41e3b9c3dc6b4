"""Model FLOPs: one counter for bench's MFU and doctor's precision map.

:data:`CUSTOM_FORMULAS` adds to ``torch.utils.flop_counter`` CPU attention (with PyTorch's own
``sdpa_flop_count``) and fused recurrent layers (``mkldnn_rnn_layer``, ``_cudnn_rnn``): ``2 * T * B *
(numel(W_ih) + numel(W_hh))`` forward, twice that backward. Elementwise work is not counted, by convention. The
formulas reach ``FlopCounterMode`` through ``custom_mapping`` (nothing registered globally); what is still not
counted is listed (:func:`uncounted_modules`), never silently zero.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils import flop_counter as _fc
from torch.utils.flop_counter import FlopCounterMode

__all__ = ["CUSTOM_FORMULAS", "flop_counter", "op_flops", "uncounted_modules", "unknown_layers", "StepFlops",
           "count_flops"]

aten = torch.ops.aten


def _prod(shape: Any) -> int:
    return math.prod(shape) if shape is not None else 0


def _cpu_sdpa(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return int(_fc.sdpa_flop_count(query, key, value))


def _cpu_sdpa_backward(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    return int(_fc.sdpa_backward_flop_count(grad_out, query, key, value))


def _rnn_gemms(input_shape, weight_shapes) -> int:
    """``2 * T * B * sum(numel(W))`` over a layer's 2-D weights (biases are added, not multiplied)."""
    in_features = weight_shapes[0][1] if weight_shapes and len(weight_shapes[0]) == 2 else input_shape[-1]
    steps_times_batch = _prod(input_shape) // max(in_features, 1)
    return 2 * steps_times_batch * sum(_prod(w) for w in weight_shapes if w is not None and len(w) == 2)


def _mkldnn_rnn_layer(input, w_ih, w_hh, *args, out_shape=None, **kwargs) -> int:
    return _rnn_gemms(input, [w_ih, w_hh])


def _mkldnn_rnn_layer_backward(input, w_ih, w_hh, *args, out_shape=None, **kwargs) -> int:
    return 2 * _rnn_gemms(input, [w_ih, w_hh])


def _cudnn_rnn_all_layers(input, weights) -> int:
    mats = [w for w in weights if w is not None and len(w) == 2]
    if not mats:
        return 0
    tb = _prod(input) // max(input[-1], 1)
    return 2 * tb * sum(_prod(w) for w in mats)


def _cudnn_rnn(input, weight, *args, out_shape=None, **kwargs) -> int:
    return _cudnn_rnn_all_layers(input, weight)


def _cudnn_rnn_backward(input, weight, *args, out_shape=None, **kwargs) -> int:
    return 2 * _cudnn_rnn_all_layers(input, weight)


def _optional(name: str) -> Any:
    try:
        return getattr(aten, name)
    except (AttributeError, RuntimeError):
        return None


CUSTOM_FORMULAS: dict[Any, Callable[..., int]] = {
    op: f for op, f in [
        (_optional("_scaled_dot_product_flash_attention_for_cpu"), _cpu_sdpa),
        (_optional("_scaled_dot_product_flash_attention_for_cpu_backward"), _cpu_sdpa_backward),
        (_optional("mkldnn_rnn_layer"), _mkldnn_rnn_layer),
        (_optional("mkldnn_rnn_layer_backward"), _mkldnn_rnn_layer_backward),
        (_optional("_cudnn_rnn"), _cudnn_rnn),
        (_optional("_cudnn_rnn_backward"), _cudnn_rnn_backward),
    ] if op is not None
}
"""Our formulas, keyed by aten overload packet; they take shapes (``FlopCounterMode``'s ``shape_wrapper``)."""


def flop_counter(**kwargs: Any) -> FlopCounterMode:
    """A ``FlopCounterMode`` (``display=False`` unless given) that also counts :data:`CUSTOM_FORMULAS`."""
    kwargs.setdefault("display", False)
    mapping = {**CUSTOM_FORMULAS, **kwargs.pop("custom_mapping", {})}
    return FlopCounterMode(custom_mapping=mapping, **kwargs)


def _shape(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.shape
    if isinstance(x, (list, tuple)):
        return type(x)(_shape(v) for v in x)
    return x


def op_flops(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """FLOPs of one dispatched aten call ``func(*args, **kwargs) -> out``, by PyTorch's formulas or ours;
    0 for ops no formula covers (elementwise ops, by convention)."""
    packet = getattr(func, "overloadpacket", func)
    custom = CUSTOM_FORMULAS.get(packet)
    try:
        if custom is not None:
            return int(custom(*_shape(args), out_shape=_shape(out), **_shape(kwargs)))
        formula = _fc.flop_registry.get(packet)
        return 0 if formula is None else int(formula(*args, **kwargs, out_val=out))
    except Exception:  # noqa: BLE001 -- a formula that does not know this overload: count nothing, never fail
        return 0


FLOP_FREE: tuple[type[nn.Module], ...] = (
    nn.Embedding, nn.EmbeddingBag, nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm,
    nn.modules.batchnorm._NormBase, *([nn.RMSNorm] if hasattr(nn, "RMSNorm") else []), nn.PReLU,
)
"""Leaf modules whose work is elementwise or a lookup: not counted, by convention, and not 'unknown'."""


def uncounted_modules(model: nn.Module, counter: FlopCounterMode, ran: set[str] | None = None) -> list[str]:
    """Leaf modules with parameters that ``counter`` gave no FLOPs (see :func:`unknown_layers`)."""
    counted = {k.split(".", 1)[1] for k, v in counter.get_flop_counts().items() if "." in k and sum(v.values())}
    return unknown_layers(model, counted, ran)


def unknown_layers(model: nn.Module, counted: set[str], ran: set[str] | None = None) -> list[str]:
    """Leaf modules with parameters not in ``counted``, as ``"name (Type)"``, except :data:`FLOP_FREE` kinds and
    (when ``ran`` is given) modules that did not run."""
    out = []
    for name, mod in model.named_modules():
        if not name or any(True for _ in mod.children()) or isinstance(mod, FLOP_FREE):
            continue
        if not any(True for _ in mod.parameters(recurse=False)):
            continue
        if ran is not None and name not in ran:
            continue
        if name not in counted:
            out.append(f"{name} ({type(mod).__name__})")
    return out


@dataclasses.dataclass(frozen=True)
class StepFlops:
    """FLOPs of one training step (forward and backward), by op, and what could not be counted."""

    forward: int
    backward: int
    by_op: dict[str, int]
    """Forward + backward FLOPs per aten op (``mm``, ``addmm``, ``convolution``, ``mkldnn_rnn_layer``...)."""
    uncounted: tuple[str, ...] = ()
    """Leaf modules with parameters whose FLOPs no formula knows."""

    @property
    def total(self) -> int:
        return self.forward + self.backward

    def to_dict(self) -> dict[str, Any]:
        return {"forward": self.forward, "backward": self.backward, "total": self.total, "by_op": self.by_op,
                "uncounted": list(self.uncounted)}


def _by_op(counter: FlopCounterMode) -> dict[str, int]:
    out: dict[str, int] = {}
    for op, n in counter.get_flop_counts().get("Global", {}).items():
        name = str(op).split(".")[-1]
        out[name] = out.get(name, 0) + int(n)
    return out


def count_flops(model: nn.Module, forward: Callable[[], torch.Tensor]) -> StepFlops:
    """FLOPs of ``loss = forward()`` and ``loss.backward()``; leaves ``.grad`` None (it runs the model: use a copy
    when BatchNorm statistics or RNG state matter)."""
    ran: set[str] = set()
    handles = [m.register_forward_pre_hook(lambda mod, _a, _n=n: ran.add(_n)) for n, m in model.named_modules() if n]
    try:
        with flop_counter() as fwd:
            loss = forward()
        with flop_counter() as bwd:
            loss.backward()
    finally:
        for h in handles:
            h.remove()
    for p in model.parameters():
        p.grad = None
    ops = _by_op(fwd)
    for k, v in _by_op(bwd).items():
        ops[k] = ops.get(k, 0) + v
    missing = set(uncounted_modules(model, fwd, ran))
    return StepFlops(forward=int(fwd.get_total_flops()), backward=int(bwd.get_total_flops()), by_op=ops,
                     uncounted=tuple(sorted(missing)))

