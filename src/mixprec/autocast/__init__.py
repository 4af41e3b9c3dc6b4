"""A from-scratch autocast: op-by-op casting driven by a :class:`~.policy.CastPolicy`, as ``torch.autocast``.

Ops on the policy's *low* list (matmul, linear, conv, bmm, attention) get their floating inputs cast to bf16/fp16
(fp32 accumulation: one rounding of each operand and of the result); *fp32*-list ops (losses; on CUDA also
softmax, norms, exp/log/pow, reductions) get them cast up; *promote* ops take the widest input dtype; every other
op runs in its inputs' dtype, and outputs are never cast back. The casts are autograd ops, so fp32 parameters get
fp32 gradients. Arguments are cast last-first, as torch's C++ kernels do, so the ATen ops run forward and backward
are the same, in the same order (the tests compare whole steps op by op).

``emulate=True`` simulates the low format: a low-list op rounds its floating operands and its result to the low
format (``x.to(low).to(float32)``, bit-exact RNE) and computes in fp32; tensors stay fp32 and gradients through a
low op are rounded too (fp16 overflow and underflow included). Real fp16/bf16 tensors are widened exactly where
they meet fp32 carriers (:mod:`.widen`); a value already rounded is not rounded again (:mod:`.rounded`).

Layout: :mod:`.context` (the context manager), :mod:`.mode` (the ``TorchFunctionMode``), :mod:`.frame` (per
configuration and thread; the weight-cast cache), :mod:`.ops`, :mod:`.casts`, :mod:`.composites` and
:mod:`.cpp_composites`, :mod:`.keep_fp32` and :mod:`.hooks`.

Differences from ``torch.autocast``: C++ composites are one call, except those transcribed in
:mod:`.cpp_composites` (on CPU GRU/vanilla RNN layers run in fp32; ``einsum`` is lowered as a whole); inference
fast paths are never taken (they follow the policy op by op); fp16 LSTM on CPU runs; a cast made under
``no_grad`` is never reused with grad; promote ops mixing two low dtypes run in fp32 where torch raises, and
``bilinear``'s optional ``bias`` counts in the choice.
"""

from .context import autocast
from .frame import autocast_dtype, is_autocast_active

__all__ = ["autocast", "is_autocast_active", "autocast_dtype"]
