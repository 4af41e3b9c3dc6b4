"""Run chosen modules' forwards in fp32 under whichever autocast is on (torch's or mixprec's): both autocasts
off and floating inputs cast to fp32 inside the forward, back on when it returns or raises. The modules'
parameters are the caller's business."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from .context import autocast as scratch_autocast
from .hooks import ForwardHooks

__all__ = ["Fp32Forward"]


def _up(t: Any) -> Any:
    if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float32:
        return t.float()
    return t


class Fp32Forward:
    """Forward hooks that run the hooked modules with autocast off on ``device_type`` and fp32 inputs."""

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self._stacks: list[contextlib.ExitStack] = []
        self._hooks = ForwardHooks(self._pre, self._post)

    def _pre(self, module: nn.Module, args: tuple, kwargs: dict):
        stack = contextlib.ExitStack()
        stack.enter_context(torch.autocast(self.device_type, enabled=False))
        stack.enter_context(scratch_autocast(torch.bfloat16, enabled=False))
        self._stacks.append(stack)
        return tree_map(_up, args), tree_map(_up, kwargs)

    def _post(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self._stacks:
            self._stacks.pop().close()

    def install(self, modules: Iterable[nn.Module]) -> Fp32Forward:
        self._hooks.install(modules)
        return self

    def remove(self) -> None:
        """Remove the hooks and turn back on an autocast a forward left off (idempotent)."""
        self._hooks.remove()
        while self._stacks:
            self._stacks.pop().close()
