"""C++ composites transcribed to Python, so that their inner ops meet the policy one by one.

``torch.autocast`` works at the dispatcher, so it sees the ops *inside* an ATen composite: on CPU
``aten::lstm_cell`` is not on any list, but the two ``aten::linear`` calls it makes are, and the
cell returns fp32 computed from low-precision gates. A function-level autocast sees one
``lstm_cell`` call. For the composites listed here the mode instead runs a Python transcription of
the C++ CPU code path (same ATen ops, same order, in-place ops included) with itself re-entered,
so the inner ops are cast exactly as torch casts them -- values, dtypes and gradients identical.

Transcribed (from ``aten/src/ATen/native/RNN.cpp`` and ``Linear.cpp`` of torch 2.13):

* ``lstm_cell``, ``gru_cell``, ``rnn_tanh_cell``, ``rnn_relu_cell``: the non-fused cell bodies
  (``LSTMCell``, ``GRUCell``, ``SimpleCell``), i.e. the CPU path. ``nn.LSTMCell``/``GRUCell``/
  ``RNNCell`` call these.
* ``tensordot``: ``at::tensordot`` checks that both inputs share a dtype, sums size-1 contracted
  dims away, then contracts through one ``mm`` -- the op CPU autocast lowers. Casting the inputs
  up front instead would hide the dtype error torch raises for mixed inputs and would run those
  sums in the low dtype.

The mode uses a transcription only when a tensor argument is eligible (on the autocast's device);
otherwise the C++ op runs as is.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

__all__ = ["TRANSCRIPTIONS"]

Tensor = torch.Tensor


def _check_cell(input: Tensor, hx: Sequence[Tensor], w_ih: Tensor, w_hh: Tensor,
                gates: int) -> None:
    """The shape checks of RNN.cpp's check_rnn_cell_forward_* (same messages)."""
    hidden_size = w_hh.size(1)
    if input.size(1) != w_ih.size(1):
        raise RuntimeError(
            f"input has inconsistent input_size: got {input.size(1)} expected {w_ih.size(1)}")
    for label, w in (("weight_ih", w_ih), ("weight_hh", w_hh)):
        if w.size(0) != gates * hidden_size:
            raise RuntimeError(f"{label} first dim must be {gates} * hidden_size = "
                               f"{gates * hidden_size}, but got {w.size(0)}")
    for label, h in enumerate(hx):
        if input.size(0) != h.size(0):
            raise RuntimeError(f"Input batch size {input.size(0)} doesn't match hidden{label} "
                               f"batch size {h.size(0)}")
        if h.size(1) != hidden_size:
            raise RuntimeError(f"hidden{label} has inconsistent hidden_size: got {h.size(1)}, "
                               f"expected {hidden_size}")


def lstm_cell(input: Tensor, hx: Sequence[Tensor], w_ih: Tensor, w_hh: Tensor,
              b_ih: Tensor | None = None, b_hh: Tensor | None = None) -> tuple[Tensor, Tensor]:
    if len(hx) != 2:
        raise RuntimeError("lstm_cell expects two hidden states")
    _check_cell(input, hx, w_ih, w_hh, 4)
    h, c = hx
    gates = F.linear(h, w_hh, b_hh).add_(F.linear(input, w_ih, b_ih))
    ingate, forgetgate, cellgate, outgate = gates.unsafe_chunk(4, 1)
    ingate = ingate.sigmoid_()
    forgetgate = forgetgate.sigmoid_()
    cellgate = cellgate.tanh_()
    outgate = outgate.sigmoid_()
    cy = (forgetgate * c).add_(ingate * cellgate)
    hy = outgate * cy.tanh()
    return hy, cy


def gru_cell(input: Tensor, hx: Tensor, w_ih: Tensor, w_hh: Tensor,
             b_ih: Tensor | None = None, b_hh: Tensor | None = None) -> Tensor:
    _check_cell(input, (hx,), w_ih, w_hh, 3)
    i_r, i_i, i_n = F.linear(input, w_ih, b_ih).unsafe_chunk(3, 1)
    h_r, h_i, h_n = F.linear(hx, w_hh, b_hh).unsafe_chunk(3, 1)
    reset_gate = h_r.add_(i_r).sigmoid_()
    input_gate = h_i.add_(i_i).sigmoid_()
    new_gate = i_n.add(h_n.mul_(reset_gate)).tanh_()
    return (hx - new_gate).mul_(input_gate).add_(new_gate)


def _simple_cell(name: str, nonlinearity: Callable[[Tensor], Tensor]) -> Callable[..., Tensor]:
    def cell(input: Tensor, hx: Tensor, w_ih: Tensor, w_hh: Tensor,
             b_ih: Tensor | None = None, b_hh: Tensor | None = None) -> Tensor:
        _check_cell(input, (hx,), w_ih, w_hh, 1)
        return nonlinearity(F.linear(hx, w_hh, b_hh).add_(F.linear(input, w_ih, b_ih)))

    cell.__name__ = cell.__qualname__ = name
    return cell


def tensordot(a: Tensor, b: Tensor, dims_a: Sequence[int], dims_b: Sequence[int]) -> Tensor:
    if len(dims_a) != len(dims_b):
        raise RuntimeError("both dimension lists should have same length")
    if a.dtype != b.dtype:
        raise RuntimeError("both inputs should have same dtype")
    t1, t2, csize = a, b, 1
    for d1, d2 in zip(dims_a, dims_b):
        s1, s2 = a.size(d1), b.size(d2)
        if s2 == 1:  # broadcast dimensions can be summed right away
            t1 = t1.sum(d1, keepdim=True, dtype=t1.dtype)
        elif s1 == 1:
            t2 = t2.sum(d2, keepdim=True, dtype=t2.dtype)
        elif s1 != s2:
            raise RuntimeError(f"contracted dimensions need to match, but first has size {s1} in "
                               f"dim {d1} and second has size {s2} in dim {d2}")
        else:
            csize *= s1
    contracted_a = {d % a.dim() for d in dims_a}
    contracted_b = {d % b.dim() for d in dims_b}
    free_a = [i for i in range(a.dim()) if i not in contracted_a]
    free_b = [i for i in range(b.dim()) if i not in contracted_b]
    sizes_a = [t1.size(i) for i in free_a]
    sizes_b = [t2.size(i) for i in free_b]
    t1 = t1.permute([*free_a, *dims_a]).reshape(math.prod(sizes_a), csize)
    t2 = t2.permute([*dims_b, *free_b]).reshape(csize, math.prod(sizes_b))
    return torch.mm(t1, t2).reshape(sizes_a + sizes_b)


#: ATen name -> Python transcription of its C++ CPU code path.
TRANSCRIPTIONS: dict[str, Callable] = {
    "lstm_cell": lstm_cell,
    "gru_cell": gru_cell,
    "rnn_tanh_cell": _simple_cell("rnn_tanh_cell", torch.tanh),
    "rnn_relu_cell": _simple_cell("rnn_relu_cell", torch.relu),
    "tensordot": tensordot,
}
