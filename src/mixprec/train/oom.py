"""Out of memory in a training step: a clean stop that says what fits.

:func:`mixprec.train.step.accumulate_step` turns a device or CPU allocation failure into
:class:`StepOutOfMemoryError` naming the phase; the loop stops with one line (:func:`message`): the step, the
recipe, the batch size, the largest batch the planner predicts (passed down by the entry points), the
``--batch-size``/``--grad-accum`` that keep the effective batch, and the last checkpoint (nothing is written after
the error). ``mixprec train`` exits with :data:`EXIT_CODE`. Under torchrun the rank stops alone
(:func:`mixprec.train.distributed.stop_alone`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import hardware

__all__ = ["StepOutOfMemoryError", "is_out_of_memory", "message", "EXIT_CODE"]

EXIT_CODE = 3
"""``mixprec train``'s exit code for a run stopped by an out-of-memory error (0 done, 1 failed, 2 usage,
130 interrupted)."""

class StepOutOfMemoryError(torch.OutOfMemoryError):
    """A training step ran out of memory in ``phase``; a :class:`torch.OutOfMemoryError` subclass."""

    def __init__(self, text: str, *, phase: str) -> None:
        super().__init__(text)
        self.phase = phase


def is_out_of_memory(e: BaseException) -> bool:
    """PyTorch's out-of-memory error, or a CPU allocation that failed (``DefaultCPUAllocator: can't allocate
    memory``)."""
    return isinstance(e, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(e, RuntimeError) and "can't allocate memory" in str(e))


def message(run: Any, e: StepOutOfMemoryError, *, step: int, epoch: int, batch: int, kept: str,
            largest_batch: Callable[[Any], int | str] | None = None) -> str:
    """The stop's one line. ``kept``: a clause on the last checkpoint; ``largest_batch``: the planner's answer,
    or None."""
    o, device = run.config.optim, run.device
    flags = f"--batch-size {o.batch_size}" + (f" --grad-accum {o.grad_accum}" if o.grad_accum > 1 else "")
    rank = f" on rank {run.rank} of {run.world_size}" if run.world_size > 1 else ""
    head = (f"step {step} (epoch {epoch}, batch {batch}) ran out of memory in its {e.phase} with {run.recipe.name} "
            f"at {flags} on {device} ({hardware.device_name(device)}){rank}")
    fits = largest_batch(run) if largest_batch is not None else "the planner was not asked"
    return f"{head}: {_what_fits(run, fits)}; {kept}"


def _what_fits(run: Any, fits: int | str) -> str:
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
