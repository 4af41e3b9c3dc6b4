"""Measurements: step/epoch timing from the trainer's history, and an honest step memory peak.

**Timing.** Every step's wall time, no ``.item()`` inside (``log_every=0``); the first ``warmup_steps`` of every
epoch dropped. Steady epoch time = mean timed step x the epoch's step count. On CUDA every recipe syncs once per
step, so step times cannot run ahead of the GPU by more than one step.

**Memory**, measured after the timed run (beside the exact accounting of :mod:`mixprec.memory`):

- CPU, ``step_peak_bytes``: the c10 allocator's peak over one step (``torch.profiler`` memory events: every
  allocation and free in order, their running sum's maximum), the CPU analogue of ``max_memory_allocated``;
  blind to memory allocated outside c10 (oneDNN scratchpads).
- CPU, ``rss_step_peak_bytes``, the physical check (Linux/glibc): the rise of ``VmHWM`` (reset through
  ``/proc/self/clear_refs``) over one step above ``VmRSS``. glibc keeps freed buffers in its heap, so first
  every allocation of 64 KiB or more is sent to ``mmap`` (``mallopt(M_MMAP_THRESHOLD)``), ``malloc_trim(0)``
  runs, and every free heap chunk of 64 KiB or more is occupied (:func:`_plug_heap`) so that a step's large
  tensors are mmapped and counted, not placed in trimmed chunks. It reads somewhat above activations +
  gradients (temporaries, workspace), never far below; smaller tensors may reuse resident heap pages.
- CUDA: ``max_memory_allocated`` / ``max_memory_reserved`` over the step, minus what was allocated before.
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
    """Occupy every free chunk of at least ``threshold`` bytes in this thread's malloc heap; returns the pointers,
    to ``free`` after the probe. A chunk served by ``mmap`` (flag 2 in its size word) means none of that size is
    left: it is freed at once and the size halves."""
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
    """Measured peak of one training step above the resident state, with the exact activations + gradients of the
    same step. Runs ``repeats`` real optimizer steps (it changes the weights: call it after the run is recorded)."""
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
    run.optimizer.zero_grad(set_to_none=True)
    gc.collect()
    return allocator_peak(lambda: train_step(run.ctx, *batch))


def allocator_peak(fn) -> int | None:
    """The most bytes PyTorch's CPU allocator had handed out above its start while ``fn()`` ran; None when the
    profiler gives no memory events."""
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
