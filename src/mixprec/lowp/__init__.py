"""Low-precision linear layers: FP8 and FP4 GEMMs, emulated exactly where the device has no kernels.

- :mod:`.recipes` -- :class:`~.recipes.LinearRecipe`: which operand of which GEMM in which format, per recipe;
- :mod:`.quant` -- every operand quantiser (per-tensor FP8, rowwise, MX, NVFP4), eager or ``torch.compile``'d
  from the same functions, on the rules of :mod:`mixprec.formats`;
- :mod:`.fp8` -- :class:`~.fp8.Fp8Linear`, per-tensor FP8 (``fp8-mixed``); :mod:`.block` --
  :class:`~.block.BlockLinear`, the block-scaled recipes;
- :mod:`.convert` -- which layers of a model convert, and :func:`~.convert.convert_to_fp8`;
- :mod:`.impls` -- ``--fp8-impl``: mixprec's layers or torchao's (:mod:`.torchao_layers`).
"""
