"""CastPolicy: the default lists agree with the installed torch's autocast registrations and
behaviour; the dataclass validates, derives and describes."""

import dataclasses
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mixprec.autocast.policy import CastKind, CastPolicy, default_policy


def _registered(dispatch_key: str, *, overloads: bool = False) -> set[str]:
    """Op names with a kernel registered for an autocast dispatch key (``name.overload`` or ``name``)."""
    regs = torch._C._dispatch_get_registrations_for_dispatch_key(dispatch_key)
    names = {r.split("::", 1)[1] for r in regs if r.startswith("aten::")}
    return names if overloads else {n.split(".")[0] for n in names}


# Listed on purpose although torch registers no AutocastCPU kernel under that name (the reasons are in autocast/policy.py).
CPU_EXTRAS = {"einsum", "inner", "linalg_multi_dot", "chain_matmul", "lstm"}


def _listed(policy: CastPolicy) -> set[str]:
    """Listed op names, overloads dropped (composites are entered, not cast)."""
    return {op.split(".")[0] for op in set(policy.table) - set(policy.composite)}


def test_cpu_lists_are_exactly_torchs_autocast_cpu_registrations():
    listed = _listed(default_policy("cpu"))
    registered = _registered("AutocastCPU")
    assert registered - listed == set(), "torch casts these on CPU but the policy does not"
    assert listed - registered == CPU_EXTRAS


# What AutocastCUDA registers, by cast policy: the AT_FORALL_LOWER_PRECISION_FP, AT_FORALL_FP32,
# AT_FORALL_FP32_SET_OPT_DTYPE, AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE (fp32_append_dtype) and AT_FORALL_PROMOTE
# macros of aten/src/ATen/autocast_mode.h, plus the KERNEL_CUDA lines and the banned binary_cross_entropy of
# TORCH_LIBRARY_IMPL(aten, Autocast, m) in aten/src/ATen/autocast_mode.cpp, torch 2.13 (the two tests below check it
# against the installed torch's registrations and header).
# Nothing else: in particular no cross_entropy_loss (AutocastCPU has one; CUDA runs the C++ composite).
AUTOCAST_CUDA = {
    "lower_precision_fp": {
        "_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc",
        "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "prelu", "addmm",
        "addmv", "addr", "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm",
        "chain_matmul", "linalg_multi_dot", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell",
        "gru_cell", "rnn_tanh_cell", "rnn_relu_cell", "_scaled_dot_product_flash_attention",
        "scaled_dot_product_attention",
        "cudnn_convolution", "cudnn_convolution_transpose",  # KERNEL_CUDA in autocast_mode.cpp
    },
    "fp32": {
        "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
        "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm",
        "native_layer_norm", "rms_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim",
        "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
        "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
        "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
        "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
        "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d", "_upsample_nearest_exact2d",
        "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
        "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
    },
    "fp32_set_opt_dtype": {
        "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum", "linalg_vector_norm",
        "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList",
    },
    "fp32_append_dtype": {"norm.Scalar", "norm.ScalarOpt_dim"},
    "promote": {
        "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put", "tensordot",
        "scatter_add",
    },
    "banned": {"binary_cross_entropy"},
}
# torch's cast policy -> the policy's kind (fp32_set_opt_dtype and fp32_append_dtype both add dtype=float32)
KIND_OF_CATEGORY = {
    "lower_precision_fp": CastKind.LOW, "fp32": CastKind.FP32, "fp32_set_opt_dtype": CastKind.FP32_OUT,
    "fp32_append_dtype": CastKind.FP32_OUT, "promote": CastKind.PROMOTE, "banned": CastKind.BANNED,
}
# What the CUDA policy lists beyond AutocastCUDA's kernels, and why (autocast/policy.py has the details)
CUDA_POLICY_EXTRAS = {
    # nn.LSTM/GRU/RNN reach _cudnn_rnn, which cudnn/AutocastRNN.cpp registers under the same key
    "lstm": CastKind.LOW, "gru": CastKind.LOW, "rnn_tanh": CastKind.LOW, "rnn_relu": CastKind.LOW,
    "linalg_norm": CastKind.FP32_OUT,  # runs linalg_vector_norm / linalg_matrix_norm
    # entered: their inner ops meet the lists (a Python body, or cross_entropy_loss's C++ composite transcribed)
    "multi_head_attention_forward": CastKind.COMPOSITE, "normalize": CastKind.COMPOSITE,
    "softmin": CastKind.COMPOSITE, "cross_entropy_loss": CastKind.COMPOSITE,
}


def test_autocast_cuda_table_is_what_the_installed_torch_registers():
    # The CPU build of torch registers the AutocastCUDA kernels too, so this runs without a GPU.
    listed = set().union(*AUTOCAST_CUDA.values())
    assert listed == _registered("AutocastCUDA", overloads=True)


def test_cuda_policy_kinds_are_autocast_cuda_categories():
    # the policy names an op without its overload, except _convolution's two (CPU autocast tells them apart)
    want = {op if op == "_convolution.deprecated" else op.split(".")[0]: KIND_OF_CATEGORY[category]
            for category, ops in AUTOCAST_CUDA.items() for op in ops}
    want.update(CUDA_POLICY_EXTRAS)
    for dtype in (torch.bfloat16, torch.float16):
        assert dict(default_policy("cuda", dtype).table) == want


def _header_macro(text: str, name: str) -> set[str]:
    """The entries of ``#define AT_FORALL_<name>(_)`` in autocast_mode.h, as ``op`` or ``op.overload``."""
    body = re.search(rf"#define AT_FORALL_{name}\(_\)((?:.*\\\n)*.*)", text).group(1)
    if name == "DIFFERENT_REDISPATCH_SIGNATURE":
        return set(re.findall(r'"([\w.]+)"', body))
    return {".".join(part.strip() for part in entry.split(",")) for entry in re.findall(r"_\(([^()]*)\)", body)}


def test_autocast_cuda_table_follows_the_installed_autocast_mode_h():
    header = Path(torch.__file__).parent / "include" / "ATen" / "autocast_mode.h"
    if not header.exists():
        pytest.skip(f"this torch ships no C++ headers ({header} is missing)")
    text = header.read_text()
    assert _header_macro(text, "LOWER_PRECISION_FP") == AUTOCAST_CUDA["lower_precision_fp"] - {
        "cudnn_convolution", "cudnn_convolution_transpose"}
    assert _header_macro(text, "FP32") == AUTOCAST_CUDA["fp32"]
    assert _header_macro(text, "FP32_SET_OPT_DTYPE") == AUTOCAST_CUDA["fp32_set_opt_dtype"]
    assert _header_macro(text, "DIFFERENT_REDISPATCH_SIGNATURE") == AUTOCAST_CUDA["fp32_append_dtype"]
    assert _header_macro(text, "PROMOTE") == AUTOCAST_CUDA["promote"]


def test_cross_entropy_loss_is_fp32_on_cpu_and_its_composite_on_cuda():
    # AutocastCPU runs cross_entropy_loss in fp32 as a whole; AutocastCUDA has no kernel for it, so there its
    # C++ composite runs: log_softmax in the logits' dtype (an explicit dtype), then nll_loss in fp32.
    assert "cross_entropy_loss" in _registered("AutocastCPU")
    assert "cross_entropy_loss" not in _registered("AutocastCUDA")
    assert default_policy("cpu").kind("cross_entropy_loss") is CastKind.FP32
    assert default_policy("cuda").kind("cross_entropy_loss") is CastKind.COMPOSITE
    assert default_policy("cuda").kind("nll_loss") is CastKind.FP32
    assert default_policy("cuda").kind("log_softmax") is CastKind.FP32_OUT


@pytest.mark.parametrize("device_type, key", [("cpu", "AutocastCPU"), ("cuda", "AutocastCUDA")])
def test_overload_entries_name_registered_overloads(device_type, key):
    entries = {op for op in default_policy(device_type).table if "." in op}
    assert "_convolution.deprecated" in entries
    assert entries <= _registered(key, overloads=True)


def test_cpu_lowers_only_the_deprecated_convolution_overload():
    # aten::_convolution (13 args, with allow_tf32) has no AutocastCPU kernel; .deprecated (12) has
    assert "_convolution" not in _registered("AutocastCPU", overloads=True)
    assert default_policy("cpu").kind("_convolution") is None
    assert default_policy("cpu").kind("_convolution.deprecated") is CastKind.LOW
    assert default_policy("cuda").kind("_convolution") is CastKind.LOW


# One op per kind that can be called with a single floating tensor: under torch.autocast("cpu")
# a low op turns fp32 into the low dtype and an fp32 op turns the low dtype into fp32.
CPU_LOW_PROBES = {
    "mm": lambda t: torch.mm(t, t),
    "matmul": lambda t: t @ t,
    "bmm": lambda t: torch.bmm(t[None], t[None]),
    "linear": lambda t: F.linear(t, t),
    "addmm": lambda t: torch.addmm(t, t, t),
    "einsum": lambda t: torch.einsum("ij,jk->ik", t, t),
}
# C++ composites that CPU autocast lowers inside (their inner linear/mm), which the policy
# transcribes instead of casting their inputs
CPU_COMPOSITE_PROBES = {
    "tensordot": lambda t: torch.tensordot(t, t, dims=1),
    "rnn_tanh_cell": lambda t: torch.rnn_tanh_cell(t, t, t, t),
    "rnn_relu_cell": lambda t: torch.rnn_relu_cell(t, t, t, t),
}
CPU_FP32_PROBES = {
    "mse_loss": lambda t: F.mse_loss(t, t),
    "l1_loss": lambda t: F.l1_loss(t, t),
    "cdist": lambda t: torch.cdist(t, t),
    "prod": lambda t: t.prod(),
    "trace": lambda t: t.trace(),
    "max_pool3d": lambda t: F.max_pool3d(t[None, None, None], 1),
    "replication_pad1d": lambda t: F.pad(t[None], (1, 1), mode="replicate"),
    "binary_cross_entropy_with_logits": lambda t: F.binary_cross_entropy_with_logits(t, t.sigmoid()),
}


@pytest.mark.parametrize("op", sorted(CPU_LOW_PROBES))
def test_cpu_low_ops_are_lowered_by_torch_autocast(op):
    assert default_policy("cpu").kind(op) is CastKind.LOW
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert CPU_LOW_PROBES[op](torch.randn(4, 4)).dtype == torch.bfloat16


@pytest.mark.parametrize("op", sorted(CPU_COMPOSITE_PROBES))
def test_cpu_composites_are_lowered_inside_by_torch_autocast(op):
    assert default_policy("cpu").kind(op) is CastKind.COMPOSITE
    assert op not in _registered("AutocastCPU")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert CPU_COMPOSITE_PROBES[op](torch.randn(4, 4)).dtype == torch.bfloat16


@pytest.mark.parametrize("op", sorted(CPU_FP32_PROBES))
def test_cpu_fp32_ops_are_widened_by_torch_autocast(op):
    assert default_policy("cpu").kind(op) is CastKind.FP32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert CPU_FP32_PROBES[op](torch.rand(4, 4).bfloat16()).dtype == torch.float32


@pytest.mark.parametrize("op", ["softmax", "log_softmax", "layer_norm", "group_norm", "exp", "sum"])
def test_cpu_leaves_alone_what_torch_autocast_cpu_leaves_alone(op):
    # On CUDA these are forced to fp32; on CPU torch.autocast does not touch them.
    assert default_policy("cpu").kind(op) is None
    assert default_policy("cuda").kind(op) in (CastKind.FP32, CastKind.FP32_OUT)


def test_cuda_kinds_follow_autocast_mode_h():
    p = default_policy("cuda", torch.float16)
    assert {op: p.kind(op) for op in ("linear", "softmax", "layer_norm", "cat", "index_put",
                                      "binary_cross_entropy", "multi_head_attention_forward")} == {
        "linear": CastKind.LOW,
        "softmax": CastKind.FP32_OUT,
        "layer_norm": CastKind.FP32,
        "cat": None,  # cat/stack promote only on CPU; on CUDA type promotion handles them
        "index_put": CastKind.PROMOTE,
        "binary_cross_entropy": CastKind.BANNED,
        "multi_head_attention_forward": CastKind.COMPOSITE,
    }


def test_other_devices_get_the_generic_lists():
    assert default_policy("xpu").low == default_policy("cuda").low
    assert default_policy("xpu").device_type == "xpu"
    assert default_policy(torch.device("cpu")) is default_policy("cpu", torch.float16)


def test_default_policy_rejects_a_dtype_that_is_not_low():
    with pytest.raises(ValueError, match=r"default_policy\('cpu', dtype=torch.float32\)"):
        default_policy("cpu", torch.float32)


def test_policy_is_frozen_data():
    p = default_policy("cpu")
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.low = frozenset()
    assert isinstance(p.low, frozenset)
    assert hash(p) == hash(dataclasses.replace(p))


def test_an_op_has_one_kind():
    with pytest.raises(ValueError, match="'mm' is listed in both 'low' and 'fp32'"):
        CastPolicy("cpu", low={"mm"}, fp32={"mm", "exp"})


def test_names_are_coerced_to_frozensets_and_a_lone_string_is_one_name():
    p = CastPolicy("cpu", low=["mm", "bmm"], fp32="softmax")
    assert p.low == frozenset({"mm", "bmm"}) and p.fp32 == frozenset({"softmax"})


def test_with_ops_moves_and_without_ops_removes():
    p = default_policy("cpu")
    q = p.with_ops(CastKind.FP32_OUT, ["softmax", "log_softmax"]).with_ops("fp32", "linear")
    assert q.kind("softmax") is CastKind.FP32_OUT
    assert q.kind("linear") is CastKind.FP32 and "linear" not in q.low
    assert p.kind("linear") is CastKind.LOW  # the original is untouched
    r = q.without_ops(["linear"])
    assert r.kind("linear") is None and r.kind("mm") is CastKind.LOW


def test_describe_lists_every_kind():
    text = CastPolicy("cpu", low={"mm"}, fp32={"exp"}).describe()
    assert text.splitlines()[0] == "CastPolicy(cpu)"
    assert "low       (  1): mm" in text and "fp32      (  1): exp" in text


def test_device_type_must_be_named():
    with pytest.raises(ValueError, match="device_type must be"):
        CastPolicy("", low={"mm"})
