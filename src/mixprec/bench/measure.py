"""Measurements: step/epoch timing from the trainer's history, and an honest step memory peak.

**Timing.** Every step's time, no ``.item()`` inside (``log_every=0``); the first ``warmup_steps`` of every
epoch dropped. Steady epoch time = mean timed step x the epoch's step count. A step need not wait for the GPU
(:mod:`mixprec.guard`), so on CUDA the trainer times each step with CUDA events recorded after consecutive steps
(:class:`~mixprec.train.meter.EpochMeter`), not with the host's clock.

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

**Device busy** (CUDA, after the memory probe): a few optimizer steps after warm-up steps, the loader's batches
included, under ``torch.profiler`` (CUDA activity only); the device was busy while it ran a kernel, a copy or a
memset: the union of those intervals (concurrent streams counted once), per step. The profiler slows the host,
not the device, so the busy time is compared with the timed (unprofiled) step: under
:data:`~mixprec.bench.results.HOST_BOUND_BELOW` of it, the step is host-bound.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import statistics
import time
from typing import Any

import torch

from ..guard import StepGuard
from ..hardware import synchronize
from ..memory import SavedTensorTracker, static_memory
from ..train.step import accumulate_step, train_step
from .results import DeviceBusy, MemoryProbe, Timing

__all__ = ["timing_from_history", "probe_step_memory", "allocator_peak", "ALLOCATOR_METHOD", "probe_device_busy",
           "busy_time_ns", "BUSY_METHOD"]

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


# ------------------------------------------------------------------------------------------- device busy

BUSY_METHOD = "torch.profiler: union of the device's kernel, memcpy and memset intervals"
DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
"""The profiler's activity types of work on the device (not its annotations, waits or overhead records)."""


def busy_time_ns(events, device_index: int) -> tuple[int, int]:
    """``(busy ns, kernels)`` of kineto ``events`` on CUDA device ``device_index``: the length of the union of its
    work intervals (:data:`DEVICE_WORK`), so kernels of concurrent streams count once, and its kernel count."""
    cuda = torch.autograd.DeviceType.CUDA
    spans, kernels = [], 0
    for e in events:
        if e.device_type() != cuda or e.device_index() != device_index:
            continue
        if hasattr(e, "activity_type"):
            kind = e.activity_type()
        else:  # an older torch: every device event but an annotation is work
            kind = "gpu_user_annotation" if e.is_user_annotation() else "kernel"
        if kind in DEVICE_WORK:
            spans.append((e.start_ns(), e.end_ns()))
            kernels += kind == "kernel"
    busy, end = 0, None
    for a, b in sorted(spans):
        if end is None or a >= end:
            busy, end = busy + b - a, b
        elif b > end:
            busy, end = busy + b - end, b
    return busy, kernels


def _endless(loader):
    """The loader's batches, epoch after epoch (a short epoch must not end the probe)."""
    epoch = 0
    while True:
        loader.set_epoch(epoch)
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            return
        epoch += 1


def probe_device_busy(run, *, accum: int = 1, warmup: int = 2, steps: int = 5) -> DeviceBusy:
    """The CUDA device's busy time per optimizer step of ``accum`` micro-batches, over ``steps`` profiled steps
    after ``warmup`` (see the module docstring). Real optimizer steps: call it after the run is recorded."""
    from torch.profiler import ProfilerActivity, profile

    device = run.device
    if device.type != "cuda":
        return DeviceBusy(reason=f"the run's device is {device.type}: no accelerator to keep busy")
    batches = _endless(run.train_loader)
    taken = iter(range(warmup + steps))

    def step() -> None:  # as the trainer steps: guarded (mixprec.guard), no host read where it has none
        accumulate_step(run.ctx, [next(batches) for _ in range(accum)], step=next(taken))

    saved, run.ctx.guard = run.ctx.guard, StepGuard(device)
    try:
        for _ in range(warmup):
            step()
        synchronize(device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            synchronize(device)
            wall = time.perf_counter() - t0
    finally:
        run.ctx.guard = saved
    index = device.index if device.index is not None else torch.cuda.current_device()
    busy, kernels = busy_time_ns(prof.profiler.kineto_results.events(), index)
    if not kernels:
        return DeviceBusy(reason="the profiler recorded no kernel on the device (CUPTI unavailable?)", steps=steps)
    return DeviceBusy(method=BUSY_METHOD, busy_s=busy / 1e9 / steps, kernels_per_step=kernels / steps,
                      profiled_step_s=wall / steps, steps=steps)
