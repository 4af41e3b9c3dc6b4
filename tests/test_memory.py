"""Exact memory accounting: counted bytes equal hand-computed bytes (rtol=0)."""

import torch
from torch import nn

from mixprec.memory import SavedTensorTracker, static_memory, storage_bytes


def test_storage_bytes_counts_views_once():
    t = torch.zeros(10, 10)
    assert storage_bytes([t, t[2:], t.t(), t.view(100)]) == 400
    assert storage_bytes([t, torch.zeros(5, dtype=torch.bfloat16)]) == 410


def test_static_memory_sgd_momentum():
    m = nn.Linear(20, 7)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    m(torch.randn(3, 20)).sum().backward()
    opt.step()
    rep = static_memory(m, opt)
    n = 20 * 7 + 7
    assert (rep.parameters, rep.gradients, rep.optimizer_state, rep.master_weights) == (4 * n, 4 * n, 4 * n, 0)


def test_static_memory_adamw_counts_moments_and_step():
    m = nn.Linear(20, 7)
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(3, 20)).sum().backward()
    opt.step()
    n = 20 * 7 + 7
    # exp_avg + exp_avg_sq (fp32) per param, plus a 0-dim fp32 `step` tensor per param (2 params)
    assert static_memory(m, opt).optimizer_state == 2 * 4 * n + 2 * 4


def test_saved_activations_fp32_linear_relu():
    m = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
    x = torch.randn(8, 16)
    with SavedTensorTracker(exclude=m.parameters()) as tr:
        m(x).sum()
    # linear saves its input (weight excluded: a parameter); relu saves its output (8x32)
    assert tr.nbytes == 4 * 8 * 16 + 4 * 8 * 32


def test_saved_activations_under_bf16_autocast_count_the_weight_copy():
    m = nn.Linear(16, 32)
    x = torch.randn(8, 16)
    with SavedTensorTracker(exclude=m.parameters()) as tr, torch.autocast("cpu", dtype=torch.bfloat16):
        m(x)
    assert tr.nbytes == 2 * 8 * 16  # the bf16 copy of the input (needed for the weight's gradient)
    x.requires_grad_(True)  # now the input's gradient needs the weight: its bf16 copy is saved too
    with SavedTensorTracker(exclude=m.parameters()) as tr, torch.autocast("cpu", dtype=torch.bfloat16):
        m(x)
    assert tr.nbytes == 2 * 8 * 16 + 2 * 16 * 32


def test_tensor_saved_twice_counts_once():
    x = torch.randn(100, requires_grad=True)
    with SavedTensorTracker() as tr:
        y = x * x  # mul saves both operands: the same storage
    assert tr.count == 1 and tr.nbytes == 400
    y.sum().backward()  # unpack still works
    torch.testing.assert_close(x.grad, 2 * x.detach(), rtol=0, atol=0)


def test_tracker_hooks_are_removed_on_exit_even_after_an_exception():
    tr = SavedTensorTracker()
    try:
        with tr:
            raise ValueError("boom")
    except ValueError:
        pass
    x = torch.randn(10, requires_grad=True)
    (x * x).sum()
    assert tr.nbytes == 0


def test_autocast_weight_copies_are_their_own_category():
    m = nn.Linear(16, 32)
    x = torch.randn(8, 16, requires_grad=True)
    for ctx in (lambda: torch.autocast("cpu", dtype=torch.bfloat16),
                lambda: __import__("mixprec").autocast(torch.bfloat16, device_type="cpu")):
        with SavedTensorTracker(exclude=m.parameters()) as tr, ctx():
            m(x)
        assert tr.by_category == {"activations": 2 * 8 * 16, "autocast_weight_copies": 2 * 16 * 32,
                                  "fp8_buffers": 0}
        assert tr.nbytes == 2 * 8 * 16 + 2 * 16 * 32


def test_fp8_layer_saves_weight_and_scales_as_fp8_buffers():
    from mixprec.lowp.fp8 import Fp8Linear

    m = Fp8Linear(32, 16)
    x = torch.randn(8, 32, requires_grad=True)
    with SavedTensorTracker(exclude=m.parameters()) as tr:
        m(x)
    # emulated on CPU: the quantized x and W are held as bf16 (2 bytes), the scales as 0-dim fp32
    assert tr.by_category == {"activations": 2 * 8 * 32, "autocast_weight_copies": 0,
                              "fp8_buffers": 2 * 16 * 32 + 2 * 4}


def test_memory_report_total_includes_the_split_categories():
    from mixprec.memory import CATEGORIES, MemoryReport

    rep = MemoryReport(parameters=1, activations=2, autocast_weight_copies=4, fp8_buffers=8)
    assert rep.total == 15 and set(CATEGORIES) <= set(rep.to_dict())


def test_the_probes_heap_plug_takes_free_heap_chunks_so_large_tensors_are_mmapped():
    """bench.measure._plug_heap: free heap chunks left by earlier allocations would serve a large tensor from
    pages already resident (VmHWM would not see it); after the plug a threshold-sized malloc is mmapped."""
    import ctypes

    import pytest

    from mixprec.bench import measure

    libc = measure._libc()
    if libc is None:
        pytest.skip("needs glibc")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    word = ctypes.sizeof(ctypes.c_size_t)

    def mmapped(p):
        return bool(ctypes.c_size_t.from_address(p - word).value & 2)

    def heap_hole_then_malloc(plug: bool) -> bool:
        libc.mallopt(measure._M_MMAP_THRESHOLD, 32 << 20)  # large chunks from the heap, as before the probe
        big = [libc.malloc(1 << 20) for _ in range(3)]
        fences = [libc.malloc(64) for _ in range(3)]  # keep the freed chunks apart from the heap's top
        for p in big:
            libc.free(p)
        libc.mallopt(measure._M_MMAP_THRESHOLD, measure.MMAP_THRESHOLD_BYTES)
        plugs = measure._plug_heap(libc) if plug else []
        try:
            assert all(not mmapped(p) for p in plugs)
            p = libc.malloc(measure.MMAP_THRESHOLD_BYTES)
            result = mmapped(p)
            libc.free(p)
            return result
        finally:
            for p in plugs + fences:
                libc.free(p)

    try:
        assert not heap_hole_then_malloc(plug=False)  # the trap the plug exists for
        assert heap_hole_then_malloc(plug=True)
    finally:
        libc.mallopt(measure._M_MMAP_THRESHOLD, 128 * 1024)  # glibc's initial threshold, for the tests after
