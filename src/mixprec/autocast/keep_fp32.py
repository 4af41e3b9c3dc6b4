"""``autocast(keep_fp32=...)``: chosen modules run every listed op in fp32.

While a kept module runs, its pre hook pushes the context's ``forced_fp32`` frame and casts the module's floating
inputs up; the always-called post hook pops it (:mod:`.hooks`). Modules are chosen by qualified name in
``model``, by class, or by class name (a class used in ``model``, else one in ``torch.nn``); with a model,
classes resolve to its instances, hooked one by one rather than by a global hook.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

from .casts import map_tensors
from .frame import STATE, Frame
from .hooks import ForwardHooks

__all__ = ["KeepFp32Hooks", "resolve_keep_fp32", "install_keep_fp32"]


class KeepFp32Hooks:
    """Forward pre/post hooks that run the hooked modules' ops in fp32 while ``owner`` is active."""

    def __init__(self, owner: Frame, types_: tuple[type, ...] = ()) -> None:
        self.owner = owner
        self.types = types_  # for global hooks: which modules to act on

    def _active(self, module: nn.Module) -> bool:
        if self.types and not isinstance(module, self.types):
            return False
        return any(f is self.owner for f in STATE.frames)

    def pre(self, module: nn.Module, args: tuple, kwargs: dict):
        if not self._active(module):
            return None
        top = STATE.frames[-1]
        STATE.frames.append(top.forced_fp32())
        if not top.enabled:
            return None
        return map_tensors(args, kwargs, top.to_fp32)

    def post(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self._active(module) and len(STATE.frames) > 1:
            STATE.frames.pop()
        return None


def install_keep_fp32(owner: Frame, modules: tuple[nn.Module, ...], types_: tuple[type, ...]
                      ) -> list[ForwardHooks]:
    """Hook ``modules`` one by one and ``types_`` globally; the caller removes the hooks."""
    installed = []
    if modules:
        hooks = KeepFp32Hooks(owner)
        installed.append(ForwardHooks(hooks.pre, hooks.post).install(modules))
    if types_:
        hooks = KeepFp32Hooks(owner, types_)
        installed.append(ForwardHooks(hooks.pre, hooks.post).install_global())
    return installed


def _module_type_named(name: str, model: nn.Module | None) -> type | None:
    if model is not None:
        for mod in model.modules():
            if type(mod).__name__ == name:
                return type(mod)
    candidate = getattr(nn, name, None)
    if isinstance(candidate, type) and issubclass(candidate, nn.Module):
        return candidate
    return None


def _resolve_name(entry: str, model: nn.Module | None) -> nn.Module | type:
    if model is not None:
        try:
            return model.get_submodule(entry)
        except AttributeError:
            pass
    typ = _module_type_named(entry, model)
    if typ is not None:
        return typ
    if model is None:
        raise ValueError(
            f"autocast(keep_fp32=[{entry!r}, ...]): {entry!r} is not a torch.nn module "
            f"class, and a module name needs the model to resolve it against; pass "
            f"model=<your nn.Module>"
        )
    names = [n for n, _ in model.named_modules() if n][:12]
    raise ValueError(
        f"autocast(keep_fp32=[{entry!r}, ...]): the model has no submodule or module "
        f"class {entry!r}; qualified names look like {names}"
    )


def resolve_keep_fp32(keep_fp32: Iterable[str | type], model: nn.Module | None
                      ) -> tuple[tuple[nn.Module, ...], tuple[type, ...]]:
    """Split keep_fp32 into module instances (hooked one by one) and types (global hooks)."""
    if isinstance(keep_fp32, (str, type)):
        keep_fp32 = [keep_fp32]
    modules: dict[int, nn.Module] = {}
    module_types: list[type] = []
    for entry in keep_fp32:
        if isinstance(entry, type) and issubclass(entry, nn.Module):
            module_types.append(entry)
            continue
        if not isinstance(entry, str):
            raise TypeError(
                f"autocast(keep_fp32=[{entry!r}, ...]): entries must be qualified module names, "
                f"module class names (str) or nn.Module subclasses, got {type(entry).__name__}"
            )
        resolved = _resolve_name(entry, model)
        if isinstance(resolved, nn.Module):
            modules[id(resolved)] = resolved
        else:
            module_types.append(resolved)
    if model is not None and module_types:
        wanted = tuple(module_types)
        for mod in model.modules():
            if isinstance(mod, wanted):
                modules[id(mod)] = mod
        module_types = []
    return tuple(modules.values()), tuple(module_types)
