"""Skips and faults kept on the device between host reads: :class:`StepGuard`.

A step that reads a value on the host waits for every kernel queued before it, so a GPU idles between steps. With
a guard, :meth:`Recipe.backward <mixprec.precision.Recipe.backward>` and :meth:`Recipe.step
<mixprec.precision.Recipe.step>` keep their decisions on the device where the optimizer can skip there (PyTorch's
fused optimizers take ``found_inf``), and the caller reads the guard (:meth:`StepGuard.read`, one read) where it
reads anyway: ``mixprec train`` at a log line, an evaluation, a checkpoint and the epoch's end.

Per step, on the device:

- without loss scaling a non-finite loss or gradient is a *fault*: the step is skipped and the run *halts*;
- with loss scaling an inf/NaN gradient is the scaler's skip (counted); ``max_consecutive_skips`` of them in a row
  halt the run after that step.

A halted run skips every later step whole — weights, optimizer state and loss scale stay as they were — so what
the next read finds is the last good state, with the step where the run halted and why. Under torchrun the flags
are agreed across ranks before they count, so every rank reads the same.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch

from .memory import local_tensor

__all__ = ["StepGuard", "GuardReading", "nonfinite_grads"]

_LOSS, _GRADIENT, _SKIPS = 1, 2, 3
_WHAT = {_LOSS: "loss", _GRADIENT: "gradient", _SKIPS: "skips"}


@dataclasses.dataclass(frozen=True)
class GuardReading:
    """What a :class:`StepGuard` held at one host read."""

    halted: bool
    step: int | None
    """The step where the run halted (None when it did not)."""
    what: str | None
    """Why: ``loss`` or ``gradient`` (non-finite, no loss scaling), ``skips`` (the consecutive-skip limit)."""
    skipped: int
    """Steps the loss scaler skipped since the guard was made (a halted run's steps not counted)."""
    consecutive: int
    """Skipped steps in a row up to the last step (at the halt, when halted)."""


class StepGuard:
    """The device-side flags and counters of one run's steps; read them with :meth:`read`.

    ``max_consecutive_skips``: loss-scaled runs halt after this many skipped steps in a row (None: never);
    ``consecutive_skips``: the row a resumed run continues.
    """

    def __init__(self, device: torch.device, *, max_consecutive_skips: int | None = None,
                 consecutive_skips: int = 0) -> None:
        self.device = torch.device(device)
        self.max_consecutive_skips = max_consecutive_skips
        self.halted = torch.zeros((), dtype=torch.float32, device=self.device)
        """0-dim float32, 1.0 once the run halted: every later step is skipped whole."""
        self._step = torch.full((), -1, dtype=torch.int64, device=self.device)
        self._what = torch.zeros((), dtype=torch.int64, device=self.device)
        self._skipped = torch.zeros((), dtype=torch.int64, device=self.device)
        self._consecutive = torch.full((), consecutive_skips, dtype=torch.int64, device=self.device)
        self._loss_flag: torch.Tensor | None = None
        self._stepped: set[int] = set()
        self.last = GuardReading(False, None, None, 0, consecutive_skips)
        """The latest :meth:`read`."""

    # -- what the recipe tells it ---------------------------------------------------------------------
    def note_loss(self, loss: torch.Tensor) -> None:
        """A micro-batch's loss (recipes without loss scaling): remember whether it is finite (no read)."""
        bad = torch.where(torch.isfinite(loss.detach()), 0.0, 2.0)
        self._loss_flag = bad if self._loss_flag is None else torch.maximum(self._loss_flag, bad)

    def take_loss_flag(self) -> torch.Tensor | None:
        """The step's loss flag (0-dim float32: 2.0 where a loss was non-finite), reset for the next step."""
        flag, self._loss_flag = self._loss_flag, None
        return flag

    def fault(self, code: torch.Tensor, step: int) -> torch.Tensor:
        """Fold a step's fault in (no loss scaling); ``code``: 0-dim, 2 for a non-finite loss, 1 for a non-finite
        gradient only, 0 when finite, agreed across ranks. Returns the step's skip flag (0-dim float32, 0 or 1:
        the fault, or an earlier halt)."""
        pre = self.halted
        hit = code > 0
        new = hit & (pre == 0)
        self._step = torch.where(new, step, self._step)
        self._what = torch.where(new, torch.where(code >= 2, _LOSS, _GRADIENT), self._what)
        self.halted = torch.maximum(pre, hit.float())
        return self.halted

    def skip(self, found_inf: torch.Tensor, step: int) -> None:
        """Fold a loss-scaled step's skip in (``found_inf`` > 0: the scaler skipped it), after the step: count it
        and halt the run from the next step on at the consecutive-skip limit."""
        live = self.halted == 0
        found = found_inf.reshape(()).to(self.device, non_blocking=True) > 0
        self._skipped = self._skipped + (found & live)
        self._consecutive = torch.where(live, torch.where(found, self._consecutive + 1, 0), self._consecutive)
        if self.max_consecutive_skips is None:
            return
        new = live & (self._consecutive >= self.max_consecutive_skips)
        self._step = torch.where(new, step, self._step)
        self._what = torch.where(new, _SKIPS, self._what)
        self.halted = torch.maximum(self.halted, new.float())

    def skips_on_device(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` can skip a step on the device: it takes ``found_inf`` (PyTorch's fused optimizers,
        ``_step_supports_amp_scaling``) and has made its state (a step it skipped would make it, unlike a step
        never taken: fused SGD's first momentum buffers would be left uninitialised)."""
        return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and (
            len(optimizer.state) > 0 or id(optimizer) in self._stepped)

    def stepped(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer`` applied a step (read on the host): from now on it may skip on the device."""
        self._stepped.add(id(optimizer))

    # -- what the caller reads --------------------------------------------------------------------------
    def read(self) -> GuardReading:
        """The flags and counters on the host: one read (it waits for the device)."""
        halted, step, what, skipped, consecutive = torch.stack(
            [self.halted.to(torch.int64), self._step, self._what, self._skipped, self._consecutive]).tolist()
        self.last = GuardReading(bool(halted), step if halted else None, _WHAT.get(what) if halted else None,
                                 skipped, consecutive)
        return self.last


def nonfinite_grads(params: Iterable[torch.Tensor], found: torch.Tensor) -> None:
    """Set ``found`` (0-dim float32) to 1.0 where a gradient of ``params`` holds inf/NaN: one foreach pass per
    (device, dtype) group (``torch._amp_foreach_non_finite_check_and_unscale_`` with a scale of 1, which leaves
    the values as they are), no read."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for p in params:
        g = p.grad
        if g is None:
            continue
        g = local_tensor(g)
        if g.is_sparse:
            g = g._values()
        groups.setdefault((g.device, g.dtype), []).append(g)
    ones: dict[torch.device, torch.Tensor] = {}
    with torch.no_grad():
        for (device, _), grads in groups.items():
            if device not in ones:
                ones[device] = torch.ones((), dtype=torch.float32, device=device)
            dev_found = found if device == found.device else torch.zeros((), dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, dev_found, ones[device])
            if dev_found is not found:
                found.copy_(torch.maximum(found, dev_found.to(found.device, non_blocking=True)))
