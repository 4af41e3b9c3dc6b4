"""A from-scratch autocast: op-by-op casting driven by a :class:`~mixprec.policy.CastPolicy`.

Numerics, as ``torch.autocast``: ops on the policy's *low* list (matmul, linear, conv, bmm, attention) get
their floating inputs cast to bf16/fp16 and return a low-precision result (fp32 accumulation: one rounding of
each operand and of the result). Ops on the *fp32* list (losses; on CUDA also softmax, norms, exp/log/pow,
reductions) get their inputs cast up. *Promote* ops (cat, stack...) take the widest input dtype. Every other op
runs in its inputs' dtype; outputs are never cast back. Parameters stay fp32: the casts are autograd ops, so
their gradients reach the parameters in fp32. Arguments are cast last-first, as torch's C++ kernels do, so the
ATen ops run forward and backward are the same, in the same order (the tests compare whole steps op by op).

``emulate=True`` simulates the low format: a low-list op rounds its floating operands to the low format
(``x.to(low).to(float32)``, round-to-nearest-even, bit-exact), computes in fp32 and rounds its result; tensors
stay fp32, and gradients through a low op are rounded too (fp16 overflow and underflow included). Ops off the
low list run in exact fp32. Real fp16/bf16 tensors are widened exactly where they meet the fp32 carriers
(:mod:`.widen`); a value already rounded is not rounded again (:mod:`.rounded`).

Layout: :mod:`.context` (the context manager), :mod:`.mode` (the ``TorchFunctionMode``), :mod:`.frame` (one
frame per configuration, the per-thread stack, the weight-cast cache), :mod:`.ops` (Python call -> ATen name),
:mod:`.casts`, :mod:`.composites` and :mod:`.cpp_composites` (inner ops of composites meet the policy),
:mod:`.keep_fp32` and :mod:`.hooks` (per-module fp32 overrides).

Differences from ``torch.autocast``:

* C++ composites are seen as one call, except those with a Python transcription (:mod:`.cpp_composites`); on
  CPU the GRU/vanilla RNN layers run in fp32 (torch lowers their gate matmuls); ``einsum`` is lowered as a
  whole (torch only when it contracts through ``bmm``).
* Inference fast paths (``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer`` in eval under ``no_grad``)
  are never taken: they follow the policy op by op, as in training.
* fp16 LSTM on CPU runs (torch's oneDNN LSTM raises); a cast made under ``no_grad`` is never reused with grad
  enabled; the cache is keyed by dtype.
* Promote ops with inputs of two low dtypes run in fp32 where torch raises ("Unexpected floating ScalarType in
  at::autocast::prioritize"); ``bilinear``'s optional ``bias`` counts in the choice (torch leaves it out).
"""

from .context import autocast
from .frame import autocast_dtype, is_autocast_active

__all__ = ["autocast", "is_autocast_active", "autocast_dtype"]
