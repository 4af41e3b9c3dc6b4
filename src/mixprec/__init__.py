"""mixprec: mixed-precision training for PyTorch, implemented from scratch and measured.

The engine is usable on its own, without the trainer::

    from mixprec import autocast, DynamicLossScaler

    scaler = DynamicLossScaler()                        # dynamic loss scaling, GradScaler semantics
    with autocast(torch.float16, model=model):          # ops run in fp16 per the cast policy
        loss = loss_fn(model(x), y)
    scaler.scale(loss).backward()                       # loss x S keeps small gradients above fp16's underflow
    scaler.unscale_(opt)                                # grads / S in fp32 math, inf/nan check fused (foreach)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # clip the *true* gradients
    scaler.step(opt)                                    # skipped when any gradient overflowed
    scaler.update()                                     # back off x0.5 on overflow, grow x2 after N clean steps

Pieces:

- :mod:`mixprec.formats` — fp32, tf32, bf16, fp16, fp8 e4m3/e5m2: range, precision, and ``quantize`` with
  round-to-nearest-even (bit-identical to PyTorch's casts) or unbiased stochastic rounding.
- :mod:`mixprec.autocast` (:mod:`~mixprec.autocast.policy`: which ops run low, which stay fp32, which promote) — a
  from-scratch autocast (a ``TorchFunctionMode``) whose per-op dtypes match ``torch.autocast``, with
  per-module fp32 overrides and fp16 emulation for CPUs.
- :mod:`mixprec.scaler` — :class:`DynamicLossScaler`: GradScaler-exact by default, plus hysteresis,
  bounds, and a found_inf all-reduce across ranks; :class:`ScalerConfig`, the settings and their defaults.
- :mod:`mixprec.scaler_view` — :class:`ScalerView`: the state of any of the three loss scalers
  (GradScaler, ShardedGradScaler, DynamicLossScaler) as device tensors, without host syncs.
- :mod:`mixprec.master` — :class:`MasterWeights`: fp32 copies for the optimizer when the model's params are
  fp16/bf16, so updates smaller than half an ulp of the weight are not rounded away.
- :mod:`mixprec.memory` — exact bytes by category (params, grads, optimizer state, masters, activations).
- :func:`mixprec.plan` (:mod:`mixprec.planning`) — memory by category, peak, largest batch and step time of
  each recipe on a target GPU or this CPU, from one step traced under fake tensors (nothing runs).
- :mod:`mixprec.watching` — ``mixprec.watch(model, optimizer, scaler=...)``: the doctor's checks inside the
  user's own loop (hooks only); callbacks for Hugging Face and Lightning in :mod:`mixprec.integrations`.
- :mod:`mixprec.precision` — the recipes (``fp32``, ``amp``, ``bf16-mixed``, ``bf16-master``...; the table
  in :mod:`mixprec.recipes`) built from these pieces or from PyTorch's own (:mod:`mixprec.mechanisms`),
  behind one interface the trainer uses.
"""

from .autocast import autocast, autocast_dtype, is_autocast_active
from .formats import FORMATS, Format, get_format, quantize
from .master import MasterWeights
from .memory import MemoryReport, SavedTensorTracker, static_memory
from .autocast.policy import CastKind, CastPolicy, default_policy
from .precision import RECIPES, Recipe, RecipeConfig, ScalerConfig, StepResult, build_recipe, resolve_recipe
from .scaler import DynamicLossScaler
from .scaler_view import ScalerView

__version__ = "0.1.0"

_LAZY = {"plan": ("planning", "plan"), "watch": ("watching", "watch")}


def __getattr__(name: str):
    """``mixprec.plan`` and ``mixprec.watch`` load their packages (and the trainer under them) on first use, so
    that ``import mixprec`` is the engine alone."""
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(f"{__name__}.{module}"), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_LAZY))

__all__ = [
    "autocast",
    "autocast_dtype",
    "is_autocast_active",
    "CastKind",
    "CastPolicy",
    "default_policy",
    "DynamicLossScaler",
    "plan",
    "Format",
    "FORMATS",
    "get_format",
    "quantize",
    "MasterWeights",
    "MemoryReport",
    "SavedTensorTracker",
    "static_memory",
    "RECIPES",
    "Recipe",
    "RecipeConfig",
    "ScalerConfig",
    "ScalerView",
    "StepResult",
    "build_recipe",
    "resolve_recipe",
    "watch",
    "__version__",
]
