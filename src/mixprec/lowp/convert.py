"""Which linear layers of a model run a low-precision recipe, and the swap: :func:`convert_to_fp8`.

``nn.Linear`` layers whose in and out features are multiples of the recipe's ``multiple`` (16 for FP8: the FP8
GEMM's requirement, checked on CPU too so that a model trains alike on both; the block for MX and NVFP4: the
dimensions the forward and input-gradient GEMMs reduce over) become :class:`~mixprec.lowp.fp8.Fp8Linear`
(per tensor) or :class:`~mixprec.lowp.block.BlockLinear` (block-scaled recipes), keeping their Parameter
objects, so state_dicts load either way. By default the final classifier (``head`` or ``fc``) stays in the
surrounding precision: the logits feed the loss directly, so their error is not averaged away by later layers,
and the layer is a tiny share of the FLOPs. Subclasses of ``nn.Linear`` (``MultiheadAttention.out_proj``, whose
weight its parent uses directly) are left alone.

Linear layers that are not ``nn.Linear`` convert through an adapter (:func:`register_linear_adapter`): a
predicate that recognises the class and a view of its weight as ``(out, in)``. Built in: Hugging Face's
``Conv1D`` (GPT-2; weight stored ``(in, out)``, ``y = x @ W + b``), recognised by duck typing so transformers is
never imported; it becomes an :class:`Fp8AdaptedLinear` that keeps the stored layout and Parameter names.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Collection

import torch
from torch import nn

from .block import BlockLinear, block_linear, layer_seed
from .fp8 import GEMM_MULTIPLE, Fp8Linear, fp8_linear

__all__ = ["Fp8AdaptedLinear", "Fp8Conversion", "LinearAdapter", "SKIP_NAMES", "convert_to_fp8", "fp8_pays",
           "is_linear_layer", "layer_problem", "make_lowp_layer", "plan_fp8_conversion", "register_linear_adapter",
           "swap_layers", "unregister_linear_adapter"]

log = logging.getLogger(__name__)

SKIP_NAMES = ("head", "fc")
"""Final classifier names kept out of low precision by default (module docstring)."""


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
        """A block-scaled :class:`~mixprec.lowp.recipes.LinearRecipe`, or None for per-tensor FP8."""
        self._generator = None if recipe is None or not recipe.stochastic_rounding else (
            torch.Generator(device=module.weight.device).manual_seed(seed))
        self.train(module.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.adapter.weight_as_linear(self.weight)
        if self.recipe is None:
            return fp8_linear(x, w, self.bias, emulate=self.emulate)
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


def fp8_pays(recipe: str, n: int, k: int) -> str | None:
    """Why an ``(N out, K in)`` linear layer would run slower in FP8 than in bf16 on a Hopper-class GPU, or None
    where FP8 pays. torchao 0.18's measured rules (``torchao/float8/float8_linear_utils.py``,
    ``_auto_filter_for_tensorwise`` / ``_auto_filter_for_rowwise``, benchmarked on H100), copied rather than
    imported (they are private): tensorwise skips K <= 4096 with N <= 1024; rowwise skips N <= 2048, K <= 1024,
    and N <= 4096 with K <= 2048. No rule is known for the block-scaled recipes (None)."""
    rule = {"tensorwise": ((4096, 1024),), "rowwise": ((None, 2048), (1024, None), (2048, 4096))}.get(recipe)
    for k_max, n_max in rule or ():
        if (k_max is None or k <= k_max) and (n_max is None or n <= n_max):
            bounds = " and ".join(b for b in (f"K <= {k_max}" if k_max else "", f"N <= {n_max}" if n_max else "")
                                  if b)
            return (f"N={n}, K={k}: too small for {recipe} FP8 to pay ({bounds}: torchao's measured rule); "
                    "kept in the surrounding precision")
    return None


def is_linear_layer(m: nn.Module) -> bool:
    """Whether ``m`` is a linear layer as the conversion sees one: an ``nn.Linear`` (or subclass), an adapted class
    (:func:`register_linear_adapter`), or one already converted."""
    return isinstance(m, (nn.Linear, Fp8AdaptedLinear)) or _adapter_for(m) is not None


def layer_problem(m: nn.Module, recipe=None) -> str | None:
    """Why linear layer ``m`` cannot run ``recipe`` (a block-scaled
    :class:`~mixprec.lowp.recipes.LinearRecipe`, or None / ``tensorwise`` for per-tensor FP8), or None."""
    if recipe is not None and recipe.name == "tensorwise":
        recipe = None
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
    return None


def _skip_reason(m: nn.Module, fqn: str, module_filter_fn: Callable[[nn.Module, str], bool] | None,
                 recipe=None, pays_only: str | None = None) -> str | None:
    """Why linear layer ``m`` stays as it is, or None to convert it."""
    problem = layer_problem(m, recipe)
    if problem is not None:
        return problem
    adapter = _adapter_for(m)
    out_f, in_f = adapter.weight_as_linear(m.weight).shape if adapter else (m.out_features, m.in_features)
    if not (module_filter_fn or _default_filter)(m, fqn):
        return ("final classifier, kept out of FP8 (logits are the most sensitive layer)" if module_filter_fn is None
                else "excluded by module_filter_fn")
    if pays_only and module_filter_fn is None:  # a user's own filter wins over the default
        return fp8_pays(pays_only, out_f, in_f)
    return None


def plan_fp8_conversion(
    module: nn.Module, *, module_filter_fn: Callable[[nn.Module, str], bool] | None = None, recipe=None,
    pays_only: str | None = None, exclude: Collection[str] = (),
) -> Fp8Conversion:
    """Which linear layers :func:`convert_to_fp8` would swap, and why the others are skipped.

    ``recipe``: a block-scaled :class:`~mixprec.lowp.recipes.LinearRecipe` (its multiple), or None for
    per-tensor FP8. ``pays_only``: a recipe name (``tensorwise``, ``rowwise``) whose :func:`fp8_pays` rule also
    keeps the layers where FP8 would not pay (ignored when ``module_filter_fn`` is given). ``exclude``: names
    left out of the plan altogether, in neither list (layers given a format of their own,
    :mod:`.layer_formats`)."""
    if recipe is not None and recipe.name == "tensorwise":
        recipe = None
    converted, skipped = [], []
    for fqn, m in module.named_modules():
        converted_already = isinstance(m, (Fp8Linear, BlockLinear, Fp8AdaptedLinear))
        if converted_already or fqn in exclude or not (isinstance(m, nn.Linear) or _adapter_for(m)):
            continue
        reason = _skip_reason(m, fqn, module_filter_fn, recipe, pays_only)
        if reason is None:
            converted.append(fqn)
        else:
            skipped.append((fqn, reason))
    return Fp8Conversion(tuple(converted), tuple(skipped))


def make_lowp_layer(m: nn.Module, emulate: bool | None, recipe=None, fqn: str = "", seed: int = 0) -> nn.Module:
    """Linear layer ``m`` (named ``fqn``) as mixprec's layer running ``recipe`` (None or ``tensorwise``: per-tensor
    FP8), keeping its Parameter objects; ``seed`` as :func:`convert_to_fp8`'s."""
    if recipe is not None and recipe.name == "tensorwise":
        recipe = None
    adapter = _adapter_for(m)
    if recipe is None:
        return Fp8Linear.from_linear(m, emulate=emulate) if adapter is None else Fp8AdaptedLinear(m, adapter,
                                                                                                    emulate=emulate)
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
    pays_only: str | None = None,
    exclude: Collection[str] = (),
) -> nn.Module:
    """Swap eligible linear layers of ``module`` for FP8 ones, in place: ``nn.Linear`` for :class:`Fp8Linear`,
    a registered linear class (Hugging Face's Conv1D; :func:`register_linear_adapter`) for
    :class:`Fp8AdaptedLinear`. Returns the module (a new one when ``module`` itself is a converted linear
    layer). Skipped layers are logged at INFO; :func:`plan_fp8_conversion` returns the same decisions.

    Args:
        module_filter_fn: ``(module, qualified_name) -> bool``, True to convert; replaces the default rule
            (skip layers named ``head``/``fc``). The multiple-of-16 rule always applies.
        emulate: passed to every converted layer (None: real FP8 where the device has it).
        recipe: a block-scaled :class:`~mixprec.lowp.recipes.LinearRecipe` (layers become
            :class:`~mixprec.lowp.block.BlockLinear`; its multiple replaces 16), or None / ``tensorwise``.
        seed: seeds each layer's stochastic-rounding stream (NVFP4 option).
        pays_only, exclude: as :func:`plan_fp8_conversion`'s.
    """
    if recipe is not None and recipe.name == "tensorwise":
        recipe = None
    plan = plan_fp8_conversion(module, module_filter_fn=module_filter_fn, recipe=recipe, pays_only=pays_only,
                               exclude=exclude)
    for fqn, reason in plan.skipped:
        log.info("convert_to_fp8: kept %s in its precision: %s", fqn or "<root>", reason)
    return swap_layers(module, plan.converted, lambda m, fqn: make_lowp_layer(m, emulate, recipe, fqn, seed))


def swap_layers(module: nn.Module, names: tuple[str, ...], make: Callable[[nn.Module, str], nn.Module]) -> nn.Module:
    """Replace each named submodule ``m`` by ``make(m, name)``, in place; returns ``module`` (or what replaced it,
    when it is named itself: ``""``)."""
    for fqn in names:
        if not fqn:
            return make(module, fqn)
        parent_name, _, child = fqn.rpartition(".")
        parent = module.get_submodule(parent_name)
        setattr(parent, child, make(getattr(parent, child), fqn))
    return module
