"""torchao's training layers as :class:`mixprec.lowp.impls.TorchaoFp8` uses them (imports torchao: import this
module lazily, inside :func:`mixprec.lowp.impls.quiet_torchao_import`)."""

from __future__ import annotations

import torch
from torch import nn
from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear, _to_mxfp8_then_scaled_mm
from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

__all__ = ["PaddedMXFP8Linear", "padded_mxfp8_linear"]


class PaddedMXFP8Linear(MXFP8Linear):
    """torchao's ``MXFP8Linear`` with the tokens zero-padded to a multiple of 32 and the output sliced back.

    Its weight-gradient GEMM cuts the token dimension into blocks of 32 and asserts a multiple; zero rows change
    no block's scale, give zero outputs and zero output gradients, and add nothing to ``dW``, so padding is
    exact (mixprec's scratch layers pad the same way).

    Emulated (``KernelPreference.EMULATED``), torchao dequantises each operand to its own dtype and multiplies
    them with ``torch.mm``, which needs one dtype: a bf16 activation times the fp32 master weight fails, and
    the CPU autocast does not step in. So the input is given in the weight's dtype (bf16 -> fp32 is exact;
    the quantisation sees the same values) and the output is cast to the autocast dtype: an fp32 GEMM on
    the exact MXFP8 values, rounded once, as :mod:`mixprec.lowp.block`'s ``reference`` mode; the bias is added
after that cast, in the output dtype (as ``MXFP8Linear`` and mixprec's layers add it).
    """

    emulated: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.emulated:
            x2 = x2.to(self.weight.dtype)
        n = x2.shape[0]
        if n % 32:
            x2 = torch.cat([x2, x2.new_zeros(32 - n % 32, shape[-1])])
        out = _to_mxfp8_then_scaled_mm(x2, self.weight, kernel_preference=self.kernel_preference,
                                       scale_calculation_mode=self.scale_calculation_mode,
                                       wgrad_with_hp=self.wgrad_with_hp)[:n].reshape(*shape[:-1], -1)
        device = x.device.type
        if self.emulated and torch.is_autocast_enabled(device):
            out = out.to(torch.get_autocast_dtype(device))
        return out if self.bias is None else out + self.bias.to(out.dtype)  # as MXFP8Linear, after the cast


def padded_mxfp8_linear(linear: nn.Linear, *, real: bool, wgrad_hp: bool) -> PaddedMXFP8Linear:
    """``linear`` (its own Parameter objects) as a :class:`PaddedMXFP8Linear`: RCEIL scales, e4m3 everywhere;
    ``real``: torchao's sm100 kernels (``KernelPreference.AUTO``), else its emulation."""
    with torch.device("meta"):
        new = PaddedMXFP8Linear(linear.in_features, linear.out_features, bias=False,
                                kernel_preference=KernelPreference.AUTO if real else KernelPreference.EMULATED,
                                wgrad_with_hp=wgrad_hp)
    new.weight, new.bias = linear.weight, linear.bias
    new.emulated = not real
    new.train(linear.training)
    return new
