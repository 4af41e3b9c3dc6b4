"""Low-precision linear recipes: which tensor is quantised in which format in each of a linear layer's GEMMs.

A linear layer ``y = x @ W^T + b`` (``x``: tokens x in_features, ``W``: out_features x in_features) runs
three GEMMs; each names its two operands and the dimension it reduces over, which is the dimension a
block format cuts into blocks::

    GEMM          product          reduced over       operands
    output        y  = x  @ W^T    in_features  (K)   x along K, W along K
    grad_input    dx = dy @ W      out_features (N)   dy along N, W along N
    grad_weight   dW = dy^T @ x    tokens       (M)   dy along M, x along M

So a block-scaled recipe quantises ``W`` twice (along K forward, along N for ``dx``) and ``x`` and ``dy``
twice each: the same tensor has different scales in the two GEMMs it feeds. The table below is the one
place that says which formats each recipe uses; :mod:`.fp8` and :mod:`.block` run it (scratch) and
:mod:`.impls` maps it to torchao's layers.

============================ =============== ==================== ===================== ==================
recipe (``--precision``)     output: x, W    grad_input: dy, W    grad_weight: dy, x    defined by
============================ =============== ==================== ===================== ==================
``fp8-mixed`` (tensorwise)   e4m3, e4m3      e5m2, e4m3           e5m2, e4m3            torchao "tensorwise"
                             per tensor      per tensor           per tensor            (power-of-two scales)
``fp8-rowwise``              e4m3 rows of x, e4m3 rows of dy,     e4m3 columns of dy    torchao "rowwise"
                             rows of W       columns of W         and of x
``fp8-rowwise --wgrad-hp``   as rowwise      e4m3 rows of dy,     bf16, bf16            torchao
                                             W per tensor                               "rowwise_with_gw_hp"
``mxfp8``                    MXFP8 e4m3, 32  MXFP8 e4m3, 32       MXFP8 e4m3, 32        torchao MXFP8Linear
                             along K         along N              along M               (RCEIL); TE MXFP8
``mxfp4``                    MXFP4 e2m1, 32  MXFP4, 32 along N    MXFP4, 32 along M     OCP MX (no torchao
                             along K                                                    training recipe)
``nvfp4``                    NVFP4 1x16      NVFP4 1x16 along N   NVFP4 1x16 along M    NVIDIA NVFP4 (TE
                             along K                              (+ optional RHT)      NVFP4BlockScaling)
============================ =============== ==================== ===================== ==================

Every recipe keeps the bias add, the bias gradient, activations, norms and the loss in the surrounding
precision (bf16 under autocast), and the fp32 parameters are the master copy: only GEMM operands are
quantised, afresh at every call. rowwise scales are powers of two (torchao's
``round_scales_to_power_of_2=True``); per-tensor scales of ``fp8-mixed`` are too (mixprec's rule; torchao's
"tensorwise" default is an unrounded fp32 scale, :mod:`.impls` asks torchao for power-of-two scales so the
recipe means the same under both). Gradients are e4m3 in rowwise and MX recipes (torchao's
choice: the per-row/per-block scale supplies the range e5m2 bought per tensor).

Options (``RecipeConfig``/train flags; refused where a recipe has no such variant):

* ``--wgrad-hp``: the weight-gradient GEMM in bf16 on the unquantised ``dy`` and ``x`` (torchao's
  ``rowwise_with_gw_hp``, which also makes ``W`` per-tensor in ``grad_input``; MXFP8's
  ``wgrad_with_hp``): the most accurate ``dW``, at the cost of the fast kernel for a third of the FLOPs.
* ``--mx-scale-rule floor|rceil`` (MX recipes): RCEIL (the default; NVIDIA hardware and torchao's MXFP8
  training) or the OCP spec's FLOOR (can saturate a block's largest element).
* ``--fp4-hadamard`` (``nvfp4``): a random Hadamard transform (RHT) of the weight-gradient GEMM's inputs, as
  TransformerEngine does: ``dy`` and ``x`` are multiplied along the token dimension, in blocks of 16, by the
  same orthonormal ``H = hadamard(16) / 4 @ diag(signs)`` (fixed random signs), so ``dW = (H dy)^T (H x) =
  dy^T x`` in exact arithmetic while an outlier's energy is spread over its 16-token block before
  quantisation: the block's scale then serves its other 15 values better.
* ``--fp4-stochastic-rounding`` (``nvfp4``): ``dy`` rounds stochastically to e2m1 (probability proportional
  to the distance to each neighbour; unbiased: E[q] = x) in both backward GEMMs, as TE does for gradients;
  ``x`` and ``W`` keep round-to-nearest-even.

Where this departs from TransformerEngine's NVFP4 recipe: TE scales weights in 16x16 tiles (the same
quantised ``W`` in both GEMMs) and keeps a model's last layers in bf16; mixprec scales ``W`` 1x16 along
each GEMM's reduced dimension, as torchao's NVFP4 tensor does, and keeps only the classifier out by default.

The layer filter: every dimension a GEMM reduces must be a multiple of the recipe's ``multiple`` (the
block: 32 for MX, 16 for NVFP4; 16 for FP8 per-tensor and rowwise, the FP8 kernels' requirement), so
in_features and out_features are checked when the model is converted (a layer that does not fit is
skipped with its reason). The token count is only known per call: for the block recipes, whose
weight-gradient GEMM cuts tokens into blocks, it is padded with zero rows to a multiple of the block
(exact: zero rows change no block's scale and add nothing to ``dW``).
"""

from __future__ import annotations

import dataclasses

from ..errors import RecipeError

__all__ = ["OPERAND_FORMATS", "LinearRecipe", "LINEAR_RECIPES", "linear_recipe"]

OPERAND_FORMATS: dict[str, str] = {
    "e4m3-tensor": "FP8 e4m3, one power-of-two scale per tensor",
    "e5m2-tensor": "FP8 e5m2, one power-of-two scale per tensor",
    "e4m3-row": "FP8 e4m3, one power-of-two scale per row along the reduced dimension (torchao rowwise)",
    "mxfp8": "MXFP8: e4m3 elements, an e8m0 scale per 32 along the reduced dimension",
    "mxfp4": "MXFP4: e2m1 elements, an e8m0 scale per 32 along the reduced dimension",
    "nvfp4": "NVFP4: e2m1 elements, an e4m3 scale per 16 along the reduced dimension, an fp32 scale per tensor",
    "bf16": "not quantised: the operand as autocast gives it (bf16), a bf16 GEMM",
}
"""How one GEMM operand can be quantised (the names the table uses)."""

_BLOCK = {"mxfp8": 32, "mxfp4": 32, "nvfp4": 16}


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinearRecipe:
    """Which format each operand of a linear layer's three GEMMs is quantised to (module docstring)."""

    name: str
    """The recipe's name here (``tensorwise``, ``rowwise``, ``mxfp8``, ``mxfp4``, ``nvfp4``)."""
    output: tuple[str, str]
    """Formats of ``(x, W)`` in ``y = x @ W^T`` (reduced over in_features); keys of :data:`OPERAND_FORMATS`."""
    grad_input: tuple[str, str]
    """Formats of ``(dy, W)`` in ``dx = dy @ W`` (reduced over out_features)."""
    grad_weight: tuple[str, str]
    """Formats of ``(dy, x)`` in ``dW = dy^T @ x`` (reduced over tokens)."""
    multiple: int
    """in_features and out_features must be multiples of this (the block size, or the FP8 kernels' 16)."""
    scale_rule: str | None = None
    """MX scale rule (``rceil`` or ``floor``); None for the others."""
    hadamard: bool = False
    """Random Hadamard transform of the weight-gradient GEMM's inputs (NVFP4 option)."""
    stochastic_rounding: bool = False
    """Round ``dy`` stochastically in the backward GEMMs (NVFP4 option)."""
    defined_by: str
    """The definition followed."""

    def __post_init__(self) -> None:
        for gemm in ("output", "grad_input", "grad_weight"):
            for f in getattr(self, gemm):
                if f not in OPERAND_FORMATS:
                    raise RecipeError(f"LinearRecipe(name={self.name!r}): {gemm} operand format {f!r} is not one of "
                                      f"{', '.join(OPERAND_FORMATS)}")
        for f in self.formats():
            if f in _BLOCK and self.multiple % _BLOCK[f]:
                raise RecipeError(f"LinearRecipe(name={self.name!r}): multiple={self.multiple} is not a multiple of "
                                  f"{f}'s block of {_BLOCK[f]}")

    def formats(self) -> set[str]:
        """Every operand format the recipe uses."""
        return {*self.output, *self.grad_input, *self.grad_weight}

    @property
    def token_block(self) -> int | None:
        """The block the weight-gradient GEMM cuts tokens into (tokens are zero-padded to it), or None."""
        return max((_BLOCK.get(f, 0) for f in self.grad_weight), default=0) or None

    @property
    def wgrad_hp(self) -> bool:
        """Whether the weight-gradient GEMM runs unquantised (bf16)."""
        return self.grad_weight == ("bf16", "bf16")

    def describe(self) -> str:
        """One clause: the formats of the three GEMMs."""
        def pair(p):
            return p[0] if p[0] == p[1] else f"{p[0]} x {p[1]}"

        extras = [w for w, on in (("RHT on the wgrad inputs", self.hadamard),
                                  ("stochastic rounding of dy", self.stochastic_rounding)) if on]
        rule = f", {self.scale_rule.upper()} scales" if self.scale_rule else ""
        return (f"y {pair(self.output)}, dx {pair(self.grad_input)}, dW {pair(self.grad_weight)}{rule}"
                + (f" + {', '.join(extras)}" if extras else ""))


LINEAR_RECIPES: dict[str, LinearRecipe] = {
    r.name: r
    for r in (
        LinearRecipe(name="tensorwise", output=("e4m3-tensor", "e4m3-tensor"),
                     grad_input=("e5m2-tensor", "e4m3-tensor"), grad_weight=("e5m2-tensor", "e4m3-tensor"),
                     multiple=16, defined_by="torchao Float8LinearConfig 'tensorwise' with power-of-two scales"),
        LinearRecipe(name="rowwise", output=("e4m3-row", "e4m3-row"), grad_input=("e4m3-row", "e4m3-row"),
                     grad_weight=("e4m3-row", "e4m3-row"), multiple=16,
                     defined_by="torchao Float8LinearConfig.from_recipe_name('rowwise')"),
        LinearRecipe(name="mxfp8", output=("mxfp8", "mxfp8"), grad_input=("mxfp8", "mxfp8"),
                     grad_weight=("mxfp8", "mxfp8"), multiple=32, scale_rule="rceil",
                     defined_by="torchao MXFP8Linear (MXFP8TrainingRecipe.MXFP8_RCEIL); TE MXFP8BlockScaling(E4M3)"),
        LinearRecipe(name="mxfp4", output=("mxfp4", "mxfp4"), grad_input=("mxfp4", "mxfp4"),
                     grad_weight=("mxfp4", "mxfp4"), multiple=32, scale_rule="rceil",
                     defined_by="OCP MX v1.0 MXFP4 in every GEMM (mxfp8's layout with e2m1 elements)"),
        LinearRecipe(name="nvfp4", output=("nvfp4", "nvfp4"), grad_input=("nvfp4", "nvfp4"),
                     grad_weight=("nvfp4", "nvfp4"), multiple=16,
                     defined_by="NVIDIA NVFP4 (TE NVFP4BlockScaling) with 1x16 blocks everywhere, RHT and SR off"),
    )
}
"""Every low-precision linear recipe by name (the ``fp8`` field of a :class:`~mixprec.recipes.RecipeSpec`)."""


def linear_recipe(name: str, *, wgrad_hp: bool = False, mx_scale_rule: str | None = None,
                  hadamard: bool = False, stochastic_rounding: bool = False) -> LinearRecipe:
    """The recipe ``name`` with the options asked for; an option the recipe has no variant for is a RecipeError.

    ``wgrad_hp`` on ``rowwise`` is torchao's ``rowwise_with_gw_hp`` (W per tensor in ``grad_input`` too).
    """
    r = LINEAR_RECIPES[name]
    changes: dict = {}
    if wgrad_hp:
        if name == "tensorwise":
            raise RecipeError("--wgrad-hp: fp8-mixed (per-tensor FP8) has no high-precision weight-gradient variant; "
                              "use --precision fp8-rowwise --wgrad-hp (torchao's rowwise_with_gw_hp) or mxfp8")
        changes["grad_weight"] = ("bf16", "bf16")
        if name == "rowwise":
            changes.update(grad_input=("e4m3-row", "e4m3-tensor"),
                           defined_by="torchao Float8LinearConfig.from_recipe_name('rowwise_with_gw_hp')")
    if mx_scale_rule is not None:
        if r.scale_rule is None:
            raise RecipeError(f"--mx-scale-rule {mx_scale_rule}: only the MX recipes (mxfp8, mxfp4) have e8m0 scales")
        if mx_scale_rule not in ("rceil", "floor"):
            raise RecipeError(f"--mx-scale-rule {mx_scale_rule!r}: choose rceil or floor")
        changes["scale_rule"] = mx_scale_rule
    for flag, on, field in (("--fp4-hadamard", hadamard, "hadamard"),
                            ("--fp4-stochastic-rounding", stochastic_rounding, "stochastic_rounding")):
        if on:
            if name != "nvfp4":
                raise RecipeError(f"{flag} is an option of the nvfp4 recipe (TransformerEngine's NVFP4); "
                                  "drop it or use --precision nvfp4")
            changes[field] = True
    if changes.get("hadamard") and changes.get("grad_weight") == ("bf16", "bf16"):
        raise RecipeError("--fp4-hadamard with --wgrad-hp: the Hadamard transform is for the weight-gradient GEMM's "
                          "FP4 inputs, which --wgrad-hp keeps in bf16; drop one")
    return dataclasses.replace(r, **changes) if changes else r
