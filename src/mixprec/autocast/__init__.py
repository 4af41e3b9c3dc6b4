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
autocast, where e.g. a gelu after a matmul runs in fp16). Real fp16 tensors -- the parameters of
an fp16 model under ``fp16-master`` -- are widened (exactly) where they meet the fp32 carriers, so
a LayerNorm with fp16 weights computes in fp32 on their values (:mod:`.widen`). An operand that
already holds low-format values (a view or relu of a low op's rounded result) is not rounded again
(:mod:`.rounded`).

Layout
------
* :mod:`.context` -- the ``autocast`` context manager / decorator: enter, exit, restore.
* :mod:`.mode` -- the ``TorchFunctionMode`` whose ``__torch_function__`` casts each call.
* :mod:`.frame` -- frames (one per configuration: the policy table and the casts), the per-thread
  frame stack, the weight-cast cache.
* :mod:`.ops` -- Python call -> ATen op name (``F.cross_entropy`` -> ``cross_entropy_loss``).
* :mod:`.casts` -- applying a cast to a call's arguments (last first, as torch does);
  :mod:`.rounded` -- emulation's rounding, and skipping it for values already rounded;
  :mod:`.widen` -- fp16/bf16 tensors meeting emulation's fp32 carriers.
* :mod:`.composites` -- running a composite's body so its inner ops meet the policy;
  :mod:`.cpp_composites` -- Python transcriptions of the C++ composites that need it.
* :mod:`.keep_fp32` -- per-module fp32 overrides; :mod:`.hooks` -- the forward pre/post hook pair
  they (and :mod:`mixprec.doctor`) install.

Arguments are cast last-first, the order in which torch's C++ autocast kernels cast them, so the
ATen ops run forward and backward (casts included) are the same, in the same order, as under
``torch.autocast`` -- the tests compare whole training steps op by op.

Differences from ``torch.autocast`` (deliberate or inherent to a function-level hook)
------------------------------------------------------------------------------------
* C++ composites are seen as one call, except those with a Python transcription
  (:mod:`.cpp_composites`: the RNN cells and ``tensordot`` on CPU, ``cross_entropy_loss`` on
  CUDA). On CPU torch lowers the gate matmuls inside ``aten::gru`` / ``rnn_tanh`` and returns fp32;
  here the GRU/vanilla RNN *layers* run in fp32 (``nn.GRUCell``/``nn.RNNCell`` match torch).
  ``einsum`` is lowered as a whole (torch lowers it only when the equation contracts through
  ``bmm``).
* Inference fast paths (``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer`` in eval under
  ``no_grad``) are never taken, so they follow the policy op by op as in training; torch.autocast
  on CPU takes them and casts their fused kernels differently (other dtypes/values than in
  training).
* fp16 LSTM on CPU runs (torch's oneDNN LSTM raises for fp16); a cast made under ``no_grad`` is
  never reused with grad enabled, and the cache is keyed by dtype, so nested contexts of different
  dtypes do not share casts.
* Promote ops run where torch raises "Unexpected floating ScalarType in at::autocast::prioritize":
  torch folds the inputs left to right from the autocast dtype and raises on meeting the other low
  dtype before any fp32 input (under bf16, ``dot(fp16, fp32)`` raises, ``dot(fp32, fp16)`` runs in
  fp32). Here inputs of different dtypes go to fp32 and inputs of one dtype stay in it, which is
  torch's answer wherever torch has one -- except that torch leaves ``bilinear``'s optional
  ``bias`` out of the choice (it casts it to the chosen dtype), which counts here.
"""

from .context import autocast
from .frame import autocast_dtype, is_autocast_active

__all__ = ["autocast", "is_autocast_active", "autocast_dtype"]
