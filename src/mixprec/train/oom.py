"""Out of memory in a training step: a clean stop that says what fits.

PyTorch raises :class:`torch.OutOfMemoryError` when the device allocator cannot serve a request (a CPU
allocation failure is a ``RuntimeError`` "can't allocate memory", when the kernel does not kill the process
first). :func:`mixprec.train.step.accumulate_step` turns either into :class:`StepOutOfMemoryError` naming the
phase it happened in (forward, backward, optimizer step); the loop stops the run with one line (:func:`message`):
the step, the recipe, the batch size, and what fits —

- the largest batch the planner predicts for this model, recipe and device (:mod:`mixprec.planning.fits`: one
  step traced under fake tensors, with a time limit), where the entry point passes it down (``mixprec train`` and
  bench do; the planner sits above the trainer, so the trainer does not ask it itself);
- the ``--batch-size`` and ``--grad-accum`` that keep the effective batch (batch x accumulation) with it;
- where the last checkpoint is: nothing is written after an out-of-memory error (an optimizer step that
  failed half-way leaves the state suspect), so the last one stays as it was.

``mixprec train`` exits with :data:`EXIT_CODE`. Under torchrun a rank that ran out of memory ends at once,
with no collective (the others may be waiting in one the failed rank will never join), and leaves its line in
the process group's store (:func:`mixprec.train.distributed.stop_alone`): where every rank failed (the same
model and batch everywhere) each stops with its own line; a rank whose peer failed alone stops with the
peer's line when its collective breaks (gloo), or is ended by torchrun while it waits (NCCL).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from .. import hardware
from ..errors import one_line

if TYPE_CHECKING:
    from .build import Run

__all__ = ["StepOutOfMemoryError", "is_out_of_memory", "message", "EXIT_CODE"]

EXIT_CODE = 3
"""``mixprec train``'s exit code for a run stopped by an out-of-memory error (0 done, 1 failed, 2 usage,
130 interrupted)."""

class StepOutOfMemoryError(torch.OutOfMemoryError):
    """A training step ran out of memory. ``phase``: ``forward``, ``backward`` or ``optimizer step``.

    A :class:`torch.OutOfMemoryError`, so code that catches PyTorch's catches this too; the message is one
    line (:func:`message`) once the loop has stopped the run."""

    def __init__(self, text: str, *, phase: str) -> None:
        super().__init__(text)
        self.phase = phase


def is_out_of_memory(e: BaseException) -> bool:
    """PyTorch's out-of-memory error, or a CPU allocation that failed (``DefaultCPUAllocator: can't allocate
    memory``)."""
    return isinstance(e, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(e, RuntimeError) and "can't allocate memory" in str(e))


def message(run: Run, e: StepOutOfMemoryError, *, step: int, epoch: int, batch: int, kept: str,
            largest_batch: Callable[[Run], int | str] | None = None) -> str:
    """The stop's one line. ``kept``: what the last checkpoint is (a clause); ``largest_batch``: the planner's
    answer for the run (:func:`mixprec.planning.fits.largest_batch`, which the entry points above the trainer
    pass down), or None where it was not asked."""
    o, device = run.config.optim, run.device
    flags = f"--batch-size {o.batch_size}" + (f" --grad-accum {o.grad_accum}" if o.grad_accum > 1 else "")
    rank = f" on rank {run.rank} of {run.world_size}" if run.world_size > 1 else ""
    head = (f"step {step} (epoch {epoch}, batch {batch}) ran out of memory in its {e.phase} with {run.recipe.name} "
            f"at {flags} on {device} ({hardware.device_name(device)}){rank}")
    fits = largest_batch(run) if largest_batch is not None else "the planner was not asked"
    return f"{head}: {_what_fits(run, fits)}; {kept}"


def _what_fits(run: Run, fits: int | str) -> str:
    o = run.config.optim
    effective = o.batch_size * o.grad_accum
    keep = f"the effective batch of {effective}" + (f" per rank ({effective * run.world_size} in all)"
                                                     if run.world_size > 1 else "")
    if isinstance(fits, str):  # the planner had no answer
        return (f"the planner could not say which batch fits ({fits}); lower --batch-size and raise --grad-accum "
                f"by the same factor to keep {keep}")
    if fits == 0:
        return (f"the planner predicts that not even one sample fits with {run.recipe.name} on this device; choose "
                "a recipe that keeps less in memory (`mixprec plan --precisions ...` compares them) or a smaller "
                "model")
    if fits >= o.batch_size:
        smaller, accum = _keeping(effective, max(o.batch_size // 2, 1))
        return (f"the planner predicts that batch {o.batch_size} fits, so other allocations hold the memory "
                f"(another process, fragmentation); try --batch-size {smaller} --grad-accum {accum}, which keeps "
                f"{keep}")
    smaller, accum = _keeping(effective, fits)
    return (f"the planner predicts that at most batch {fits} fits: --batch-size {smaller} --grad-accum {accum} keeps "
            f"{keep}")


def _keeping(effective: int, at_most: int) -> tuple[int, int]:
    """The largest batch size <= ``at_most`` that divides ``effective``, and the accumulation that restores it."""
    b = max(d for d in range(1, min(at_most, effective) + 1) if effective % d == 0)
    return b, effective // b
