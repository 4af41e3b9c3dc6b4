"""A forward pre-hook and an always-called forward hook, installed on modules and removed together.

The post hook is registered with ``always_call=True``, so state a pre hook pushed is popped even when the
forward raises. ``pre(module, args, kwargs)`` returns None (inputs unchanged) or ``(args, kwargs)``; a global
pre hook (:meth:`ForwardHooks.install_global`) cannot replace keyword arguments: it gets ``kwargs={}`` and only
its new ``args`` are used.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

__all__ = ["ForwardHooks"]

PreHook = Callable[[nn.Module, tuple, dict], "tuple[tuple, dict] | None"]
PostHook = Callable[[nn.Module, tuple, Any], None]


class ForwardHooks:
    """``pre`` before and ``post`` after the forward of the modules it is installed on."""

    def __init__(self, pre: PreHook, post: PostHook) -> None:
        self.pre = pre
        self.post = post
        self._handles: list[Any] = []

    def install(self, modules: Iterable[nn.Module]) -> ForwardHooks:
        for module in modules:
            self._handles.append(module.register_forward_pre_hook(self.pre, with_kwargs=True))
            self._handles.append(module.register_forward_hook(self.post, always_call=True))
        return self

    def install_global(self) -> ForwardHooks:
        """Hook every module's forward in this process."""
        pre = self.pre

        def pre_args_only(module: nn.Module, args: tuple):
            replaced = pre(module, args, {})
            return None if replaced is None else replaced[0]

        self._handles.append(nn.modules.module.register_module_forward_pre_hook(pre_args_only))
        self._handles.append(
            nn.modules.module.register_module_forward_hook(self.post, always_call=True))
        return self

    def remove(self) -> None:
        """Idempotent."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
