"""Whose code runs a low-precision linear recipe (``--fp8-impl``): mixprec's own layers, or torchao's.

An :class:`Fp8Impl` turns a model's eligible linear layers into layers that run the recipe (:mod:`.recipes`) on
one device:

- :class:`ScratchFp8` (``scratch``): :mod:`.fp8` (per tensor) and :mod:`.block` (rowwise, MX, NVFP4); every
  recipe on every device, emulated exactly where the device has no kernels (real per-tensor FP8 on CUDA 8.9+,
  real rowwise FP8 on 9.0+).
- :class:`TorchaoFp8` (``torchao``): torchao's ``Float8Linear`` for ``tensorwise`` (with power-of-two scales,
  as mixprec's recipe defines it), ``rowwise`` and ``rowwise_with_gw_hp``, and ``MXFP8Linear`` for ``mxfp8``
  (:mod:`.torchao_layers`), emulated where the GPU has no units for the format. torchao has no NVFP4 or MXFP4
  training layer, so those are refused; its layers cast under ``torch.autocast`` only (``--amp-impl native``).
  torchao is optional (``pip install mixprec[fp8]``) and imported lazily, its import-time warnings kept out of
  mixprec's output.

``--fp8-impl auto`` (:func:`auto_fp8_impl`): torchao where the GPU has units for the recipe's formats
(:meth:`mixprec.hardware.Capabilities.lowp_units`), torchao is installed and has the recipe; scratch otherwise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import logging
import warnings
from collections.abc import Collection
from typing import Any, ClassVar

from torch import nn

from .. import hardware
from ..errors import RecipeError
from .convert import Fp8Conversion, convert_to_fp8, layer_problem, make_lowp_layer, plan_fp8_conversion, swap_layers
from .recipes import LinearRecipe

__all__ = ["Fp8Impl", "ScratchFp8", "TorchaoFp8", "FP8_IMPLS", "FP8_IMPL_CHOICES", "auto_fp8_impl",
           "torchao_available", "quiet_torchao_import"]


def torchao_available() -> bool:
    """Whether torchao is installed (without importing it)."""
    return importlib.util.find_spec("torchao") is not None


@contextlib.contextmanager
def quiet_torchao_import(*, python_warnings: bool = True):
    """Import torchao modules inside this: its load-time warnings (compiled extensions it cannot load, pytree
    enum deprecations) are logged at WARNING by its own and torch's loggers; they are raised to ERROR here.
    ``python_warnings=False`` leaves Python's warnings alone (user code that may import torchao indirectly,
    as transformers does)."""
    loggers = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            if python_warnings:
                warnings.simplefilter("ignore")
            yield
    finally:
        for lg, lv in zip(loggers, levels):
            lg.setLevel(lv)


class Fp8Impl:
    """Makes a model's linear layers run ``recipe`` on ``device``.

    Args:
        recipe: the low-precision linear recipe (formats per GEMM).
        caps: what the device the run trains on can do (:class:`~mixprec.hardware.Capabilities`).
        seed: seeds stochastic rounding (NVFP4 option).
        layers: ``auto`` (where the GEMMs are real, only the layers where FP8 pays: :func:`~mixprec.lowp.convert.fp8_pays`) or ``all``.
    """

    name: ClassVar[str]
    """What ``--fp8-impl`` calls it."""
    words: ClassVar[str]
    """How :meth:`Recipe.describe` names it."""

    def __init__(self, recipe: LinearRecipe, caps: hardware.Capabilities, *, seed: int = 0,
                 layers: str = "auto") -> None:
        self.recipe = recipe
        self.caps = caps
        self.device = caps.device
        self.seed = seed
        self.layers = layers

    def refuse(self, amp_impl: str, precision: str) -> None:
        """Raise RecipeError for what this implementation cannot run (called once, at build)."""

    def real(self) -> bool:
        """Whether every GEMM of the recipe runs on real low-precision units here (else some are emulated)."""
        raise NotImplementedError

    @property
    def pays_only(self) -> str | None:
        """The recipe whose pay rule filters the layers (``layers="auto"`` where the GEMMs are real), or None."""
        return self.recipe.name if self.layers == "auto" and self.real() else None

    def plan(self, model: nn.Module, exclude: Collection[str] = ()):
        """The :class:`~mixprec.lowp.convert.Fp8Conversion` :meth:`convert` will carry out; ``exclude``: layers
        left alone (given a format of their own)."""
        return plan_fp8_conversion(model, recipe=self.recipe, pays_only=self.pays_only, exclude=exclude)

    def convert(self, model: nn.Module, exclude: Collection[str] = ()) -> tuple[nn.Module, Any]:
        """Swap the eligible linear layers but ``exclude``; returns the model and the conversion's record."""
        raise NotImplementedError

    def layer_problem(self, module: nn.Module) -> str | None:
        """Why this implementation cannot run ``module`` (a linear layer) in the recipe, or None."""
        return layer_problem(module, self.recipe)

    def convert_layers(self, model: nn.Module, names: Collection[str]) -> nn.Module:
        """Swap exactly the linear layers ``names``, whatever the layer filter and the pay rule say (a
        :meth:`layer_problem` is the caller's to refuse first); returns the model."""
        raise NotImplementedError


class ScratchFp8(Fp8Impl):
    """mixprec's layers: :class:`~mixprec.lowp.fp8.Fp8Linear` (per tensor), :class:`~mixprec.lowp.block.BlockLinear`."""

    name = "scratch"
    words = "mixprec's scratch layers"

    def real(self) -> bool:
        r = self.recipe
        if r.name == "tensorwise":
            return self.caps.fp8_matmul
        return r.name == "rowwise" and not r.wgrad_hp and self.caps.rowwise_fp8

    def convert(self, model: nn.Module, exclude: Collection[str] = ()) -> tuple[nn.Module, Any]:
        plan = self.plan(model, exclude)
        return convert_to_fp8(model, recipe=self.recipe, seed=self.seed, pays_only=self.pays_only,
                              exclude=exclude), plan

    def convert_layers(self, model: nn.Module, names: Collection[str]) -> nn.Module:
        return swap_layers(model, tuple(names), lambda m, fqn: make_lowp_layer(m, None, self.recipe, fqn, self.seed))


_NN_LINEAR_ONLY = "torchao converts nn.Linear only (use --fp8-impl scratch for other linear classes)"

_TORCHAO_RECIPES = ("tensorwise", "rowwise", "mxfp8")
"""Recipes torchao 0.18 has a training layer for (``rowwise`` also as ``rowwise_with_gw_hp``; ``mxfp8`` also
with ``wgrad_with_hp``)."""


class TorchaoFp8(Fp8Impl):
    """torchao's ``Float8Linear`` / ``MXFP8Linear``, emulated where the GPU lacks the units (module docstring)."""

    name = "torchao"
    words = "torchao's training layers"

    def refuse(self, amp_impl: str, precision: str) -> None:
        if self.recipe.name not in _TORCHAO_RECIPES:
            raise RecipeError(
                f"--fp8-impl torchao with {precision}: torchao has no training layer for {self.recipe.name} "
                "(its NVFP4 training is Triton-only, it has no MXFP4 training); use --fp8-impl scratch or auto")
        if self.recipe.scale_rule == "floor":
            raise RecipeError(f"--fp8-impl torchao with {precision} --mx-scale-rule floor: torchao's MXFP8 training "
                              "uses RCEIL scales; drop --mx-scale-rule or use --fp8-impl scratch")
        if not torchao_available():
            raise RecipeError(f"--fp8-impl torchao with {precision}: torchao is not installed; "
                              "pip install 'mixprec[fp8]' (or use --fp8-impl scratch)")
        if amp_impl == "scratch":
            raise RecipeError(f"--fp8-impl torchao with {precision} --amp-impl scratch: torchao's layers cast under "
                              "torch.autocast only; use --amp-impl native (or auto), or --fp8-impl scratch")

    def real(self) -> bool:
        return self.caps.lowp_units(self.recipe.name)

    def plan(self, model: nn.Module, exclude: Collection[str] = ()):
        plan = super().plan(model, exclude)  # torchao swaps nn.Linear only: adapted classes (HF Conv1D) stay
        keep = tuple(n for n in plan.converted if type(model.get_submodule(n)) is nn.Linear)
        left = tuple((n, _NN_LINEAR_ONLY) for n in plan.converted if n not in keep)
        return Fp8Conversion(keep, plan.skipped + left)

    def convert(self, model: nn.Module, exclude: Collection[str] = ()) -> tuple[nn.Module, Any]:
        plan = self.plan(model, exclude)
        return self.convert_layers(model, plan.converted), plan

    def layer_problem(self, module: nn.Module) -> str | None:
        problem = super().layer_problem(module)
        return problem if problem or type(module) is nn.Linear else f"{type(module).__name__}: {_NN_LINEAR_ONLY}"

    def convert_layers(self, model: nn.Module, names: Collection[str]) -> nn.Module:
        with quiet_torchao_import():
            make = self._mxfp8_layer() if self.recipe.name == "mxfp8" else self._float8_layer()
        return swap_layers(model, tuple(names), lambda linear, _: make(linear))

    def _float8_layer(self):
        from torchao.float8.config import Float8LinearConfig
        from torchao.float8.float8_linear import Float8Linear

        r = self.recipe
        name = {"tensorwise": "tensorwise", "rowwise": "rowwise_with_gw_hp" if r.wgrad_hp else "rowwise"}[r.name]
        config = dataclasses.replace(Float8LinearConfig.from_recipe_name(name), emulate=not self.real(),
                                     round_scales_to_power_of_2=True)
        return lambda linear: Float8Linear.from_float(linear, config=config)

    def _mxfp8_layer(self):
        from .torchao_layers import padded_mxfp8_linear

        real, wgrad_hp = self.real(), self.recipe.wgrad_hp
        return lambda linear: padded_mxfp8_linear(linear, real=real, wgrad_hp=wgrad_hp)


FP8_IMPLS: dict[str, type[Fp8Impl]] = {m.name: m for m in (ScratchFp8, TorchaoFp8)}
"""Every low-precision linear implementation by its ``--fp8-impl`` name."""

FP8_IMPL_CHOICES: tuple[str, ...] = ("auto", *FP8_IMPLS)
"""What ``--fp8-impl`` accepts."""


def auto_fp8_impl(recipe: LinearRecipe, caps: hardware.Capabilities) -> str:
    """``--fp8-impl auto``: torchao where the GPU has units for the recipe's formats, torchao is installed and
    has the recipe; scratch otherwise."""
    if (recipe.name in _TORCHAO_RECIPES and recipe.scale_rule != "floor"
            and caps.lowp_units(recipe.name) and torchao_available()):
        return TorchaoFp8.name
    return ScratchFp8.name
