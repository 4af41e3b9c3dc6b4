"""C++ composites transcribed to Python, so that their inner ops meet the policy one by one.

``torch.autocast`` works at the dispatcher and sees the ops inside an ATen composite (CPU ``lstm_cell`` is on no
list, but its two ``linear`` calls are); the mode runs a transcription of the C++ path instead (same ATen ops, same
order, in-place ops included), so values, dtypes and gradients match. From torch 2.13's ``RNN.cpp``,
``Linear.cpp`` and ``LossNLL.cpp``: the non-fused (CPU) RNN cells; ``tensordot`` (dtype check, size-1 contracted
dims summed away, one ``mm``); ``cross_entropy_loss`` on the CUDA lists (``log_softmax(x, dim, dtype=x.dtype)``,
then ``nll_loss``/``nll_loss2d`` through ``nll_loss_nd``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

__all__ = ["TRANSCRIPTIONS"]

Tensor = torch.Tensor
_nn = torch._C._nn


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


_NONE, _MEAN, _SUM = 0, 1, 2  # at::Reduction


def _nll_loss_nd(input: Tensor, target: Tensor, weight: Tensor | None, reduction: int,
                 ignore_index: int) -> Tensor:
    if input.dim() < 1:
        raise ValueError(f"Expected 1 or more dimensions (got {input.dim()})")
    if input.dim() != 1 and input.size(0) != target.size(0):
        raise ValueError(f"Expected input batch_size ({input.size(0)}) to match target batch_size "
                         f"({target.size(0)}).")
    if input.dim() in (1, 2):
        return _nn.nll_loss(input, target, weight, reduction, ignore_index)
    if input.dim() == 4:
        return _nn.nll_loss2d(input, target, weight, reduction, ignore_index)
    # dim 3 or > 4: folded into nll_loss2d's (N, C, 1, -1)
    n, c = input.size(0), input.size(1)
    out_size = [n, *input.shape[2:]]
    if target.shape[1:] != input.shape[2:]:
        raise RuntimeError(f"Expected target size {out_size}, got {list(target.shape)}")
    input = input.contiguous()
    target = target.contiguous()
    input = input.view(n, c, 1, -1) if input.numel() > 0 else input.view(n, c, 0, 0)
    target = target.view(n, 1, -1) if target.numel() > 0 else target.view(n, 0, 0)
    out = _nn.nll_loss2d(input, target, weight, reduction, ignore_index)
    return out if reduction != _NONE else out.view(out_size)


def _invalid_reduction(reduction: int) -> RuntimeError:
    return RuntimeError(f"Invalid reduction type encountered in cross_entropy: {reduction}")


def _check_label_smoothing(label_smoothing: float) -> None:
    if label_smoothing > 1.0:
        raise RuntimeError(f"label_smoothing must be between 0.0 and 1.0. Got: {label_smoothing}")


def _cross_entropy_prob_target(input: Tensor, target_: Tensor, weight: Tensor | None, reduction: int,
                               label_smoothing: float) -> Tensor:
    class_dim = 0 if input.dim() == 1 else 1
    n_classes = input.size(class_dim)
    if weight is not None and not (weight.dim() == 1 and weight.numel() == n_classes):
        raise RuntimeError(f"cross_entropy: weight tensor should be defined either for all {n_classes} classes "
                           f"or no classes but got weight tensor of shape: {list(weight.shape)}")
    input = torch.log_softmax(input, class_dim, input.dtype)
    if label_smoothing > 0.0:
        _check_label_smoothing(label_smoothing)
        target = target_ * (1 - label_smoothing) + label_smoothing / n_classes
    else:
        target = target_
    if weight is not None:
        if input.dim() > 1:
            shape = [1] * input.dim()
            shape[1] = weight.size(0)
            weight = weight.view(shape)
        terms = input * target * weight
    else:
        terms = input * target
    if reduction == _MEAN:
        if input.numel() == 0:
            return -terms.sum().fill_(math.nan)
        return -terms.sum() / (input.numel() // n_classes)
    if reduction == _SUM:
        return -terms.sum()
    if reduction == _NONE:
        return -terms.sum(class_dim)
    raise _invalid_reduction(reduction)


def _cross_entropy_label_smoothing(input: Tensor, target: Tensor, weight: Tensor | None, reduction: int,
                                   ignore_index: int, label_smoothing: float) -> Tensor:
    class_dim = 0 if input.dim() == 1 else 1
    input = torch.log_softmax(input, class_dim, input.dtype)
    nllloss = _nll_loss_nd(input, target, weight, reduction, ignore_index)
    n_classes = input.size(class_dim)
    if weight is not None:
        shape = [1] * input.dim()
        shape[class_dim] = weight.size(0)
        smooth_loss = -(input * weight.view(shape)).sum(class_dim)
    else:
        smooth_loss = -input.sum(class_dim)
    ignore_mask = target == ignore_index
    smooth_loss.masked_fill_(ignore_mask, 0.0)
    if reduction == _MEAN:
        if weight is not None:
            if torch._C._dispatch_isTensorSubclassLike(weight):
                filtered_target = target.masked_fill(ignore_mask, 0)
                tgt_weights = weight.gather(0, filtered_target.flatten())
                weight_sum = tgt_weights.masked_fill_(ignore_mask.flatten(), 0).sum()
                ret = smooth_loss.sum() / weight_sum
            else:
                weight_sum = weight.gather(0, target.masked_select(~ignore_mask).flatten()).sum()
                ret = smooth_loss.sum() / weight_sum
        else:
            true_mask = ~ignore_mask
            count = true_mask.sum()  # the divisor first: C++ evaluated the right operand first
            ret = smooth_loss.sum() / count
    elif reduction == _SUM:
        ret = smooth_loss.sum()
    elif reduction == _NONE:
        ret = smooth_loss
    else:
        raise _invalid_reduction(reduction)
    return (1 - label_smoothing) * nllloss + ret * (label_smoothing / n_classes)


def cross_entropy_loss(input: Tensor, target: Tensor, weight: Tensor | None = None, reduction: int = _MEAN,
                       ignore_index: int = -100, label_smoothing: float = 0.0) -> Tensor:
    if input.shape == target.shape:  # class probabilities
        if not target.is_floating_point():
            raise RuntimeError(f"Expected floating point type for target with class probabilities, got "
                               f"{target.dtype}")
        if ignore_index >= 0:
            raise RuntimeError("ignore_index is not supported for floating point target")
        return _cross_entropy_prob_target(input, target, weight, reduction, label_smoothing)
    if label_smoothing > 0.0:
        _check_label_smoothing(label_smoothing)
        return _cross_entropy_label_smoothing(input, target, weight, reduction, ignore_index, label_smoothing)
    class_dim = 0 if input.dim() == 1 else 1
    return _nll_loss_nd(torch.log_softmax(input, class_dim, input.dtype), target, weight, reduction,
                        ignore_index)


#: ATen name -> Python transcription of its C++ code path.
TRANSCRIPTIONS: dict[str, Callable] = {
    "lstm_cell": lstm_cell,
    "gru_cell": gru_cell,
    "rnn_tanh_cell": _simple_cell("rnn_tanh_cell", torch.tanh),
    "rnn_relu_cell": _simple_cell("rnn_relu_cell", torch.relu),
    "tensordot": tensordot,
    "cross_entropy_loss": cross_entropy_loss,
}
