"""Measurements: step/epoch timing from the trainer's history, an honest step memory peak, matmul peaks.

**Timing.** The trainer records the wall time of every step (``history[e]["step_times_s"]``) with no
``.item()`` or logging inside when ``log_every=0``; bench always runs it that way. The first
``warmup_steps`` steps of *every* epoch are dropped: the first builds the epoch's permutation and, on the
first epoch, creates kernels and caches; the second is the one the trainer samples memory on (saved-tensor
hooks make it slower). The steady epoch time is the mean timed step times the epoch's step count, i.e. the
epoch with its warm-up steps replaced by typical ones; the trainer's raw epoch time is kept beside it.
On CUDA the step clock is read without a per-step synchronize, but every recipe syncs the host once per
step (the skip decision, or the finite-loss check), so step times cannot drift ahead of the GPU by more
than one step, and the epoch clock itself is synchronised by the trainer.

**Memory.** The exact accounting (:mod:`mixprec.memory`) comes from the trainer's sampled step. Beside it,
*measured* peaks of one training step, taken after the timed run is over so they cannot disturb timing:

- CPU, the physical check: the process resident set is misleading as it is: glibc keeps freed buffers in its
  heap, so the next step reuses them without the RSS moving and a naive "RSS during the step minus RSS before" reads
  far too low. So the probe (1) switches glibc to ``mmap`` for every allocation of 64 KiB or
  more (``mallopt(M_MMAP_THRESHOLD, 65536)``, what ``MALLOC_MMAP_THRESHOLD_=65536`` does at start-up),
  so freed tensors go back to the kernel at once; (2) frees the gradients and calls ``malloc_trim(0)``,
  then *plugs the heap*: the threshold only applies to memory glibc must get from the kernel, and a large
  request is served from a free chunk of the heap first -- and the run before the probe (under glibc's own,
  dynamic threshold, which rises to 32 MiB) leaves such chunks. ``malloc_trim`` releases their pages, so a
  step's tensor placed there faults them in again, but its free keeps them: the step's RSS then only grows,
  and ``VmHWM`` reads the memory the step *touched*, not its peak (on a small step, far above it). So
  every free heap chunk of 64 KiB or more is allocated (not touched) before the baseline and freed after
  the step;
  (3) reads ``VmRSS`` as the baseline and writes ``5`` to ``/proc/self/clear_refs``, which resets the
  high-water mark ``VmHWM`` to the current RSS; (4) runs one training step; (5) reads ``VmHWM``.
  ``VmHWM - baseline`` is what one step adds at its peak: saved activations, gradients, and the
  temporaries the exact accounting does not count (activation gradients during backward, kernel
  workspace), so it reads somewhat *above* activations + gradients, never far below them
  (``tests/test_bench.py`` checks the bounds). Linux only; elsewhere it is reported as unavailable.
  Its granularity: tensors under 64 KiB still live in the heap, where they may reuse pages that are already
  resident (the probe reads less than they hold) and free chunks smaller than 64 KiB can merge into larger
  ones during the step; every mmap'd tensor costs whole 4 KiB pages; and kernels' workspace is counted only
  where it is touched. These matter on a step whose peak is a few megabytes, not on a large one.
- CPU, the figure compared with the plan: **the allocator's peak**, the CPU analogue of CUDA's
  ``max_memory_allocated``. One more step runs under ``torch.profiler`` with ``profile_memory=True``; its
  memory events are every allocation and free of PyTorch's CPU allocator (c10) in order, so their running sum
  is the bytes allocated above the step's start, exactly, and its maximum is the step's peak
  (``step_peak_bytes``). It sees every tensor, however small (VmHWM cannot: a step of a few hundred KiB of
  sub-64-KiB tensors reads 0.11-0.22 MiB there against an allocator peak of 0.28 on the tests' small CNN), and
  it is blind to what a library allocates outside c10 (oneDNN's scratchpads) and to the allocator's own
  overhead -- which the ``VmHWM`` rise keeps beside it (``rss_step_peak_bytes``), the physical check. Where the
  profiler cannot give memory events, ``step_peak_bytes`` is the ``VmHWM`` rise, and the method says so.
- CUDA: ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` over the step, minus what was
  allocated before it (``step_peak_bytes``, compared with the plan as the CPU's allocator peak is).

**Peak matmul rate.** MFU needs the machine's peak for the dtype the matmuls run in, measured here and
now rather than read from a datasheet: square matmuls of growing size, best time of a few repeats, within
a time budget per dtype (so a dtype without fast kernels on this machine costs the budget, not minutes).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import statistics
import time
from typing import Any

import torch

from ..hardware import synchronize
from ..memory import SavedTensorTracker, static_memory
from ..train.step import train_step
from .results import MemoryProbe, Timing

__all__ = ["timing_from_history", "probe_step_memory", "allocator_peak", "ALLOCATOR_METHOD"]

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
MMAP_THRESHOLD_BYTES = 65536


def timing_from_history(history: list[dict[str, Any]], *, warmup_steps: int, batch_size: int) -> Timing:
    """Step time, steady epoch time and samples/s of one run, warm-up steps of every epoch excluded."""
    timed: list[float] = []
    steady_epochs: list[float] = []
    for h in history:
        steps = h.get("step_times_s") or []
        kept = steps[warmup_steps:]
        if kept:
            timed += kept
            steady_epochs.append(sum(kept) / len(kept) * len(steps))
    raw = [h["epoch_time_s"] for h in history if h.get("epoch_time_s") is not None]
    step = statistics.median(timed) if timed else None
    return Timing(timed_steps=len(timed), warmup_steps_per_epoch=warmup_steps, step_time_s=step,
                  step_time_p10_s=_quantile(timed, 0.1), step_time_p90_s=_quantile(timed, 0.9),
                  epoch_time_s=statistics.fmean(steady_epochs) if steady_epochs else None,
                  raw_epoch_time_s=statistics.fmean(raw) if raw else None,
                  samples_per_s=batch_size / step if step else None)


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


# ------------------------------------------------------------------------------------------- memory


def _proc_status(key: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        return None
    return None


def _libc():
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt  # noqa: B018 -- glibc only
        libc.malloc_trim  # noqa: B018
        return libc
    except (OSError, AttributeError):
        return None


def _plug_heap(libc, threshold: int = MMAP_THRESHOLD_BYTES, limit: int = 4096) -> list[int]:
    """Occupy every free chunk of at least ``threshold`` bytes in this thread's malloc heap (see the module
    docstring); returns the pointers, to ``free`` after the probe. A chunk glibc serves by ``mmap`` (flag 2 in
    its size word) means no free heap chunk of that size is left: it is freed at once and the size halves."""
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    word = ctypes.sizeof(ctypes.c_size_t)
    plugs: list[int] = []
    size = 1 << 30
    while size >= threshold and len(plugs) < limit:
        p = libc.malloc(size)
        if p and not ctypes.c_size_t.from_address(p - word).value & 2:  # IS_MMAPPED clear: a heap chunk
            plugs.append(p)
            continue
        if p:
            libc.free(p)
        size //= 2
    return plugs


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


def probe_step_memory(run, *batch: Any, repeats: int = 2) -> MemoryProbe:
    """Measured peak of one training step above the resident state (see the module docstring).

    Runs ``repeats`` real optimizer steps on ``run`` (it changes the weights: call it after the run's
    results are recorded). Returns the largest measured step peak and, for comparison, the exact
    activations + gradients of the same step.
    """
    device = run.device
    cuda = device.type == "cuda"
    libc = None
    if not cuda:
        libc = _libc()
        if libc is None or _proc_status("VmHWM") is None:
            return MemoryProbe(reason="needs glibc and /proc (Linux); not available here")
        libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    best = activations = grads = None
    for _ in range(repeats):
        run.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        if cuda:
            torch.cuda.synchronize(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        else:
            libc.malloc_trim(0)
            plugs = _plug_heap(libc)
            base = _proc_status("VmRSS")
            if not _reset_hwm() or _proc_status("VmHWM") > base + MMAP_THRESHOLD_BYTES * 16:
                for p in plugs:
                    libc.free(p)
                return MemoryProbe(reason="cannot reset VmHWM (/proc/self/clear_refs not writable)")
        tracker = SavedTensorTracker(exclude=run.model.parameters())
        train_step(run.ctx, *batch, tracker=tracker)
        if cuda:
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device) - base
        else:
            peak = _proc_status("VmHWM") - base
            for p in plugs:
                libc.free(p)
        activations, grads = tracker.nbytes, static_memory(run.model, run.optimizer, run.recipe.master).gradients
        best = peak if best is None else max(best, peak)
    rss_method = f"VmHWM after clear_refs, malloc mmap threshold {MMAP_THRESHOLD_BYTES} B, malloc_trim"
    if cuda:
        return MemoryProbe(method="cuda max_memory_allocated", step_peak_bytes=best, exact_activations=activations,
                           exact_gradients=grads, repeats=repeats,
                           cuda_peak_reserved_bytes=torch.cuda.max_memory_reserved(device))
    allocated = _allocated_peak(run, batch)
    return MemoryProbe(
        method=ALLOCATOR_METHOD if allocated is not None else rss_method,
        step_peak_bytes=allocated if allocated is not None else best, rss_step_peak_bytes=best,
        rss_method=rss_method, exact_activations=activations, exact_gradients=grads, repeats=repeats)


ALLOCATOR_METHOD = "c10 allocator peak (torch.profiler memory events)"


def _allocated_peak(run, batch: tuple) -> int | None:
    """The CPU allocator's peak above the step's start over one more step (see the module docstring)."""
    run.optimizer.zero_grad(set_to_none=True)
    gc.collect()
    return allocator_peak(lambda: train_step(run.ctx, *batch))


def allocator_peak(fn) -> int | None:
    """The most bytes PyTorch's CPU allocator had handed out above what it had when ``fn()`` started, while it
    ran (torch.profiler's memory events); None when the profiler gives no memory events."""
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
        events = prof.profiler.kineto_results.events()
        cpu = torch.autograd.DeviceType.CPU
        deltas = sorted((e.start_ns(), e.nbytes()) for e in events
                        if e.name() == "[memory]" and e.device_type() == cpu)
    except (AttributeError, RuntimeError):  # a profiler without kineto's memory events
        return None
    if not deltas:
        return None
    live = peak = 0
    for _, n in deltas:
        live += n
        peak = max(peak, live)
    return peak


# ------------------------------------------------------------------------------------- matmul peak
