"""CastPolicy: the default lists agree with the installed torch's autocast registrations and
behaviour; the dataclass validates, derives and describes."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from mixprec.policy import CastKind, CastPolicy, default_policy


def _registered(dispatch_key: str, *, overloads: bool = False) -> set[str]:
    """Op names with a kernel registered for an autocast dispatch key (``name.overload`` or ``name``)."""
    regs = torch._C._dispatch_get_registrations_for_dispatch_key(dispatch_key)
    names = {r.split("::", 1)[1] for r in regs if r.startswith("aten::")}
    return names if overloads else {n.split(".")[0] for n in names}


# Listed on purpose although torch registers no kernel under that name on that device
# (the reasons are in policy.py).
CPU_EXTRAS = {"einsum", "inner", "linalg_multi_dot", "chain_matmul", "lstm"}
CUDA_EXTRAS = {"lstm", "gru", "rnn_tanh", "rnn_relu", "cross_entropy_loss", "linalg_norm"}


def _listed(policy: CastPolicy) -> set[str]:
    """Listed op names, overloads dropped (composites are entered, not cast)."""
    return {op.split(".")[0] for op in set(policy.table) - set(policy.composite)}


def test_cpu_lists_are_exactly_torchs_autocast_cpu_registrations():
    listed = _listed(default_policy("cpu"))
    registered = _registered("AutocastCPU")
    assert registered - listed == set(), "torch casts these on CPU but the policy does not"
    assert listed - registered == CPU_EXTRAS


def test_cuda_lists_cover_torchs_autocast_cuda_registrations():
    # The CPU build of torch still registers the AutocastCUDA kernels, so this runs without a GPU.
    listed = _listed(default_policy("cuda"))
    registered = _registered("AutocastCUDA")
    assert registered - listed == set(), "torch casts these on CUDA but the policy does not"
    assert listed - registered == CUDA_EXTRAS


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
