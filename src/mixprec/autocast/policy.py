"""Cast policy: which ops run in the low dtype, which are forced to fp32, which promote.

A :class:`CastPolicy` is plain data -- frozen sets of ATen op names per cast kind (``linear``, ``conv2d``,
``cross_entropy_loss``...), the level at which ``torch.autocast`` decides -- that :func:`mixprec.autocast.autocast`
consumes; the autocast maps Python calls onto those names (``F.cross_entropy`` -> ``cross_entropy_loss``, ``x @ y``
-> ``matmul``). The kinds are those of ``aten/src/ATen/autocast_mode.{h,cpp}``:

* ``LOW`` -- every floating input (never fp64) cast to the low dtype: matmuls, convolutions, linear, attention,
  whose kernels accumulate in fp32.
* ``FP32`` -- floating inputs cast up to fp32: losses, ``exp``/``log``/``pow``, norms on CUDA, linear algebra, FFTs.
* ``FP32_OUT`` -- ops with an output ``dtype`` (``softmax``, ``log_softmax``, ``sum``, ``cumsum``, ``norm``...):
  when the first input is eligible and no dtype was given, run with ``dtype=torch.float32`` (torch's
  ``fp32_set_opt_dtype`` / ``fp32_append_dtype``).
* ``PROMOTE`` -- every floating input cast to the widest floating input dtype (``cat``, ``stack``, ``index_put``,
  ``addcmul``...); inputs of both low dtypes go to fp32 (see :mod:`mixprec.autocast`).
* ``BANNED`` -- refused with an explanation (``binary_cross_entropy`` on CUDA).
* ``COMPOSITE`` -- one call to a function-level hook whose inner ops must meet the policy: a Python function
  (``F.multi_head_attention_forward``) whose body runs with the policy active, or a C++ composite run as a Python
  transcription (``lstm_cell``, ``tensordot`` on CPU, ``cross_entropy_loss`` on CUDA;
  :mod:`mixprec.autocast.cpp_composites`).

Everything else runs untouched (``relu``, ``add``, ``view``...), with PyTorch's type promotion.

:func:`default_policy` reproduces ``torch.autocast``'s lists (the ``AutocastCPU``/``AutocastCUDA`` registrations
of torch 2.13; tests/test_policy.py checks them). On CPU ``softmax``, ``layer_norm``, ``exp``/``log`` and ``sum``
are not forced to fp32 (bf16 has fp32's range; CPU kernels accumulate in fp32) while pooling/padding ops without
fast bf16 kernels are; ops torch lowers inside a C++ composite (``einsum`` through ``bmm``, ``lstm`` through
``mkldnn_rnn_layer``) are listed as low, and where that would differ from torch the composite is transcribed
(the RNN cells, ``tensordot``). On CUDA ``cross_entropy_loss`` is a composite (no CUDA kernel): its
``log_softmax`` runs in the logits' dtype, its ``nll_loss`` in fp32. ``name.overload`` names one overload (CPU
autocast lowers only ``_convolution.deprecated``). To keep softmax in fp32 on CPU too:
``default_policy("cpu").with_ops(CastKind.FP32_OUT, ["softmax", "log_softmax"])``.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from functools import cached_property

import torch

__all__ = ["CastKind", "CastPolicy", "default_policy", "LOW_DTYPES"]

#: dtypes an autocast may use as its low precision.
LOW_DTYPES = (torch.float16, torch.bfloat16)


class CastKind(str, enum.Enum):
    """What the autocast does to an op's floating inputs."""

    LOW = "low"
    FP32 = "fp32"
    FP32_OUT = "fp32_out"
    PROMOTE = "promote"
    BANNED = "banned"
    COMPOSITE = "composite"


_FIELD = {kind: kind.value for kind in CastKind}  # the CastPolicy field that holds each kind


def _names(values: Iterable[str]) -> frozenset[str]:
    if isinstance(values, str):  # a lone name, not its characters
        return frozenset([values])
    return frozenset(values)


@dataclass(frozen=True)
class CastPolicy:
    """Which ops the autocast casts, and to what. Op names are ATen names (see module docstring)."""

    device_type: str
    """Device whose tensors are eligible for casting ("cpu", "cuda", ...); others are left alone."""
    low: frozenset[str] = field(default_factory=frozenset)
    """Ops whose floating inputs are cast to the low dtype."""
    fp32: frozenset[str] = field(default_factory=frozenset)
    """Ops whose floating inputs are cast to float32."""
    fp32_out: frozenset[str] = field(default_factory=frozenset)
    """Ops run with ``dtype=torch.float32`` when their first input is eligible and no dtype is given."""
    promote: frozenset[str] = field(default_factory=frozenset)
    """Ops whose floating inputs are cast to the widest floating input dtype."""
    banned: frozenset[str] = field(default_factory=frozenset)
    """Ops that raise inside the autocast (unsafe in low precision)."""
    composite: frozenset[str] = field(default_factory=frozenset)
    """Python functions whose bodies run with the policy active (their inner ops are cast)."""

    def __post_init__(self) -> None:
        if not isinstance(self.device_type, str) or not self.device_type:
            raise ValueError(
                f"CastPolicy(device_type={self.device_type!r}): device_type must be a device "
                f"type string such as 'cpu' or 'cuda'"
            )
        for name in _FIELD.values():
            object.__setattr__(self, name, _names(getattr(self, name)))
        seen: dict[str, str] = {}
        for name in _FIELD.values():
            for op in getattr(self, name):
                if op in seen:
                    raise ValueError(
                        f"CastPolicy: op {op!r} is listed in both {seen[op]!r} and {name!r}; "
                        f"an op has one cast kind -- use policy.with_ops(kind, [{op!r}]) to move it"
                    )
                seen[op] = name

    @cached_property
    def table(self) -> Mapping[str, CastKind]:
        """``{op name: CastKind}`` for every listed op (computed once per policy)."""
        return {op: kind for kind, name in _FIELD.items() for op in getattr(self, name)}

    def kind(self, op: str) -> CastKind | None:
        """The cast kind of ``op``, or None if the autocast leaves it alone."""
        return self.table.get(op)

    def with_ops(self, kind: CastKind | str, ops: Iterable[str]) -> CastPolicy:
        """A copy with ``ops`` moved to ``kind`` (removed from whatever list held them)."""
        kind = CastKind(kind)
        ops = _names(ops)
        changes = {name: getattr(self, name) - ops for name in _FIELD.values()}
        changes[_FIELD[kind]] = changes[_FIELD[kind]] | ops
        return replace(self, **changes)

    def without_ops(self, ops: Iterable[str]) -> CastPolicy:
        """A copy in which ``ops`` are left alone (removed from every list)."""
        ops = _names(ops)
        return replace(self, **{name: getattr(self, name) - ops for name in _FIELD.values()})

    def describe(self) -> str:
        """One line per kind, for logs."""
        lines = [f"CastPolicy({self.device_type})"]
        for f in fields(self):
            if f.name != "device_type":
                ops = sorted(getattr(self, f.name))
                lines.append(f"  {f.name:9s} ({len(ops):3d}): {' '.join(ops)}")
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# torch.autocast's lists (aten/src/ATen/autocast_mode.{h,cpp}, torch 2.13)
# ---------------------------------------------------------------------------------------------

# Python composites entered on every device: F.multi_head_attention_forward (nn.MultiheadAttention,
# nn.Transformer*) is one torch-function call whose in-projections, bmm/sdpa and out-projection
# native autocast sees one by one.
_COMPOSITE_ALL = frozenset({"multi_head_attention_forward"})

_CPU_LOW = frozenset({
    "conv1d", "conv2d", "conv3d", "bmm", "mm", "linalg_vecdot", "baddbmm", "addmm",
    "_addmm_activation", "addbmm", "linear", "_convolution.deprecated", "matmul", "conv_tbc",
    "mkldnn_rnn_layer", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "prelu",
    "scaled_dot_product_attention", "_native_multi_head_attention",
    # C++ composites that native CPU autocast lowers through their inner bmm/mm/mkldnn_rnn_layer
    # (torch lowers einsum only when the equation contracts, e.g. not "ij,ij->ij").
    "einsum", "inner", "linalg_multi_dot", "chain_matmul", "lstm",
})

# C++ composites run as Python transcriptions on CPU (mixprec.autocast.cpp_composites)
_CPU_COMPOSITE = _COMPOSITE_ALL | {
    "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell", "tensordot",
}

_CPU_FP32 = frozenset({
    "avg_pool3d", "binary_cross_entropy", "grid_sampler", "polar", "prod", "quantile",
    "nanquantile", "stft", "cdist", "grid_sampler_2d", "_grid_sampler_2d_cpu_fallback",
    "grid_sampler_3d", "trace", "view_as_complex", "cholesky", "cholesky_inverse",
    "cholesky_solve", "inverse", "lu_solve", "orgqr", "ormqr", "pinverse", "max_pool3d",
    "max_unpool2d", "max_unpool3d", "adaptive_avg_pool3d", "reflection_pad1d",
    "reflection_pad2d", "replication_pad1d", "replication_pad2d", "replication_pad3d",
    "mse_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss",
    "poisson_nll_loss", "smooth_l1_loss", "cross_entropy_loss", "l1_loss", "huber_loss",
    "margin_ranking_loss", "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
    "ctc_loss", "kl_div", "multilabel_margin_loss", "binary_cross_entropy_with_logits",
    "fft_fft", "fft_ifft", "fft_fft2", "fft_ifft2", "fft_fftn", "fft_ifftn", "fft_rfft",
    "fft_irfft", "fft_rfft2", "fft_irfft2", "fft_rfftn", "fft_irfftn", "fft_hfft", "fft_ihfft",
    "linalg_cond", "linalg_matrix_rank", "linalg_solve", "linalg_cholesky", "linalg_svdvals",
    "linalg_eigvals", "linalg_eigvalsh", "linalg_inv", "linalg_householder_product",
    "linalg_tensorinv", "linalg_tensorsolve", "fake_quantize_per_tensor_affine", "geqrf",
    "_lu_with_info", "qr", "svd", "triangular_solve", "fractional_max_pool2d",
    "fractional_max_pool3d", "adaptive_max_pool3d", "multilabel_margin_loss_forward",
    "linalg_qr", "linalg_cholesky_ex", "linalg_svd", "linalg_eig", "linalg_eigh",
    "linalg_lstsq", "linalg_inv_ex",
})

_CPU_PROMOTE = frozenset({"stack", "cat", "index_copy"})

# AT_FORALL_LOWER_PRECISION_FP plus the cuDNN kernels; used for CUDA and every other device
# (XPU registers the same lists).
_CUDA_LOW = frozenset({
    "_convolution", "_convolution.deprecated", "convolution", "conv1d", "conv2d", "conv3d", "conv_tbc",
    "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "prelu", "addmm", "addmv",
    "addr", "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm",
    "bmm", "chain_matmul", "linalg_multi_dot", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell",
    "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
    "cudnn_convolution", "cudnn_convolution_transpose",
    # nn.LSTM/GRU/RNN reach _cudnn_rnn (autocast low) through one Python-visible call
    "lstm", "gru", "rnn_tanh", "rnn_relu",
})

_CUDA_FP32 = frozenset({
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
    "reciprocal", "rsqrt", "sinh", "tan", "pow", "softplus", "layer_norm", "native_layer_norm",
    "group_norm", "rms_norm", "frobenius_norm", "nuclear_norm", "cosine_similarity",
    "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
    "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
    "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
    "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm",
    "logsumexp", "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d",
    "_upsample_nearest_exact2d", "upsample_nearest3d", "_upsample_nearest_exact3d",
    "upsample_linear1d", "upsample_bilinear2d", "_upsample_bilinear2d_aa",
    "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
})

_CUDA_FP32_OUT = frozenset({
    "prod", "softmax", "log_softmax", "cumprod", "cumsum", "linalg_vector_norm",
    "linalg_matrix_norm", "sum",
    "norm",  # fp32_append_dtype: the dtype-less overloads get dtype=float32 appended
    "linalg_norm",  # composite of linalg_vector_norm/linalg_matrix_norm
})

_CUDA_PROMOTE = frozenset({
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler",
    "index_put", "tensordot", "scatter_add",
})

# Python composites whose inner ops are on the CUDA fp32 lists (F.normalize -> norm,
# F.softmin -> softmax), and cross_entropy_loss: AutocastCUDA has no kernel for it (unlike
# AutocastCPU, which runs it all in fp32), so its C++ composite runs under autocast --
# log_softmax(x, dtype=x.dtype) in the logits' dtype, then nll_loss in fp32 -- and is transcribed
# (mixprec.autocast.cpp_composites). To run the whole loss in fp32 instead:
# policy.with_ops(CastKind.FP32, ["cross_entropy_loss"]), or keep_fp32 on the loss module.
_CUDA_COMPOSITE = _COMPOSITE_ALL | {"normalize", "softmin", "cross_entropy_loss"}


POLICY_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps")
"""Device types with a built-in policy: the CPU lists, or the CUDA lists (which XPU and MPS share)."""


def default_policy(device_type: str = "cpu", dtype: torch.dtype = torch.bfloat16) -> CastPolicy:
    """The policy ``torch.autocast(device_type, dtype)`` applies (one shared object per pair).

    ``"cpu"`` gets the AutocastCPU lists; every other device the AutocastCUDA lists (which XPU
    also uses; MPS registers a subset of them). In torch the lists do not depend on ``dtype``;
    it is validated here so that a wrong dtype fails where the policy is made.
    """
    if isinstance(device_type, torch.device):
        device_type = device_type.type
    if device_type not in POLICY_DEVICE_TYPES:
        raise ValueError(
            f"default_policy({device_type!r}): mixprec has cast lists for {', '.join(POLICY_DEVICE_TYPES)}; "
            "for another device pass policy=CastPolicy(...) with its lists"
        )
    if dtype not in LOW_DTYPES:
        raise ValueError(
            f"default_policy({device_type!r}, dtype={dtype}): the low dtype must be one of "
            f"{[str(d) for d in LOW_DTYPES]}"
        )
    return _default_policy(device_type)


@functools.lru_cache(maxsize=None)
def _default_policy(device_type: str) -> CastPolicy:
    if device_type == "cpu":
        return CastPolicy(
            device_type="cpu",
            low=_CPU_LOW,
            fp32=_CPU_FP32,
            promote=_CPU_PROMOTE,
            composite=_CPU_COMPOSITE,
        )
    return CastPolicy(
        device_type=device_type,
        low=_CUDA_LOW,
        fp32=_CUDA_FP32,
        fp32_out=_CUDA_FP32_OUT,
        promote=_CUDA_PROMOTE,
        banned=frozenset({"binary_cross_entropy"}),
        composite=_CUDA_COMPOSITE,
    )
