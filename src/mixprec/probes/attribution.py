"""Which module and which phase (forward, backward, optimizer step) an op belongs to.

Forward ops run inside the innermost module on a stack kept by forward pre/post hooks. Backward ops are
attributed through the autograd graph: a module's post hook claims every ``grad_fn`` node between its outputs
and its inputs (inner modules claim first), and during backward the node the engine runs
(``torch._C._current_autograd_node()``) names the module; ``AccumulateGrad`` belongs to the parameter's owner.
The phase is ``backward`` while the engine runs a node, ``step`` after the first backward op, ``forward``
before it. One tracker observes one step; call :meth:`ModuleTracker.new_step` between steps.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from ..autocast.hooks import ForwardHooks

__all__ = ["ModuleTracker", "OUTSIDE", "display_path"]

OUTSIDE = None
"""Module path of ops that ran outside the model (the loss function, loss scaling, the optimizer)."""


def display_path(path: str | None) -> str:
    """A module path as the report prints it."""
    if path is None:
        return "(outside model)"
    return path or "(model)"


class ModuleTracker:
    """Attributes ops to modules and phases while active (``with tracker:``); hooks are removed on exit."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._names = {id(m): name for name, m in model.named_modules()}
        self._param_owner: dict[int, str] = {}
        for name, m in model.named_modules():
            for p in m.parameters(recurse=False):
                self._param_owner.setdefault(id(p), name)
        self._stack: list[tuple[str, set[Any]]] = []
        self._node_owner: dict[Any, str] = {}
        self._hooks = ForwardHooks(self._pre, self._post)
        self.after_backward = False

    # -- context -------------------------------------------------------------------------------------
    def __enter__(self) -> ModuleTracker:
        self._hooks.install(self.model.modules())
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.remove()
        self._stack.clear()

    def new_step(self) -> None:
        """Forget the previous step's graph and phase."""
        self._node_owner.clear()
        self._stack.clear()
        self.after_backward = False

    # -- hooks ---------------------------------------------------------------------------------------
    def _pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        frontier = {t.grad_fn for t in tree_leaves((args, kwargs))
                    if isinstance(t, torch.Tensor) and t.grad_fn is not None}
        self._stack.append((self._names.get(id(module), type(module).__name__), frontier))

    def _post(self, module: nn.Module, args: tuple, output: Any) -> None:
        if not self._stack:
            return
        path, frontier = self._stack.pop()
        todo = [t.grad_fn for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        owner = self._node_owner
        while todo:
            node = todo.pop()
            if node is None or node in owner or node in frontier:
                continue
            owner[node] = path
            todo.extend(n for n, _ in node.next_functions if n is not None)

    # -- queries -------------------------------------------------------------------------------------
    def where(self) -> tuple[str, str | None, str | None]:
        """``(phase, module path, autograd node name)`` of the op being dispatched now."""
        node = torch._C._current_autograd_node()
        if node is not None:
            self.after_backward = True
            path = self._node_owner.get(node)
            if path is None:
                var = getattr(node, "variable", None)  # AccumulateGrad
                if var is not None:
                    path = self._param_owner.get(id(var))
            return "backward", path, node.name()
        if self.after_backward:
            return "step", OUTSIDE, None
        return "forward", (self._stack[-1][0] if self._stack else OUTSIDE), None

    def upstream(self) -> str | None:
        """In backward: the module owning the node that receives the current node's gradient.

        For a cast at the border of a module kept in fp32, that is the module whose output the cast
        converted: the gradient overflowed on its way *into* that module's (low-precision) region.
        """
        node = torch._C._current_autograd_node()
        if node is None:
            return None
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            path = self._node_owner.get(nxt)
            if path is None:
                var = getattr(nxt, "variable", None)
                path = self._param_owner.get(id(var)) if var is not None else None
            return path
        return None
