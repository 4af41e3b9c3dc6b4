"""The ``autocast`` context manager (and decorator): pushes a frame, enters the mode, installs hooks.

``__exit__`` restores everything -- frames, hooks, the weight-cast cache (emptied when the outermost context
exits), the mode stack -- exceptions included. One object may be entered recursively: each entry keeps its
own record.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from .policy import LOW_DTYPES, CastPolicy, default_policy

from .frame import STATE, Frame, clear_cache, frame_for
from .hooks import ForwardHooks
from .keep_fp32 import install_keep_fp32, resolve_keep_fp32
from .mode import PolicyMode

__all__ = ["autocast"]


class _Config:
    __slots__ = ("dtype", "policy", "emulate", "enabled", "cache_enabled", "keep_modules",
                 "keep_types", "kinds")

    def __init__(self, dtype: torch.dtype, policy: CastPolicy, emulate: bool, enabled: bool,
                 cache_enabled: bool, keep_modules: tuple[nn.Module, ...],
                 keep_types: tuple[type, ...]) -> None:
        self.dtype = dtype
        self.policy = policy
        self.emulate = emulate
        self.enabled = enabled
        self.cache_enabled = cache_enabled
        self.keep_modules = keep_modules
        self.keep_types = keep_types
        self.kinds = policy.table


class _Record:
    """What one ``__enter__`` did, for its ``__exit__`` to undo."""

    __slots__ = ("noop", "saved_len", "frame", "hooks", "pushed_mode")

    def __init__(self, noop: bool, saved_len: int = 0, frame: Frame | None = None) -> None:
        self.noop = noop
        self.saved_len = saved_len
        self.frame = frame
        self.hooks: list[ForwardHooks] = []
        self.pushed_mode = False


def _infer_device_type(model: nn.Module | None) -> str:
    if model is not None:
        for p in model.parameters():
            return p.device.type
    return "cuda" if torch.cuda.is_available() else "cpu"


def _resolve_policy(dtype: torch.dtype, device_type: str | torch.device | None,
                    policy: CastPolicy | None, model: nn.Module | None) -> CastPolicy:
    if dtype not in LOW_DTYPES:
        raise ValueError(
            f"autocast(dtype={dtype}): the low dtype must be torch.bfloat16 or "
            f"torch.float16 (use enabled=False to run in fp32)"
        )
    if isinstance(device_type, torch.device):
        device_type = device_type.type
    if policy is None:
        return default_policy(device_type or _infer_device_type(model), dtype)
    if not isinstance(policy, CastPolicy):
        raise TypeError(
            f"autocast(policy={policy!r}): expected a mixprec.CastPolicy, e.g. "
            f"default_policy('cpu')"
        )
    if device_type is not None and device_type != policy.device_type:
        raise ValueError(
            f"autocast(device_type={device_type!r}, policy=<{policy.device_type} policy>): "
            f"the device types disagree; drop device_type or pass "
            f"default_policy({device_type!r})"
        )
    return policy


class autocast:  # noqa: N801 -- named like torch.autocast, which it replaces
    """Run the ops inside in mixed precision per a :class:`CastPolicy` (see :mod:`mixprec.autocast`); a context
    manager or a decorator.

    Args:
        device_type: default ``policy.device_type``, else that of ``model``'s first parameter, else "cuda" if
            available, else "cpu".
        policy: default ``default_policy(device_type, dtype)``: what ``torch.autocast`` does there.
        emulate: round low-list ops' operands and results to ``dtype``, compute and store in fp32.
        keep_fp32: modules whose ops run in fp32: qualified names in ``model``, module classes or class names.
        enabled: False makes the context a no-op (an inner disabled context turns casting off).
        cache_enabled: reuse the low-precision copy of each parameter within the context.
    """

    def __init__(
        self,
        dtype: torch.dtype = torch.bfloat16,
        *,
        device_type: str | None = None,
        policy: CastPolicy | None = None,
        emulate: bool = False,
        keep_fp32: Iterable[str | type] = (),
        model: nn.Module | None = None,
        enabled: bool = True,
        cache_enabled: bool = True,
    ) -> None:
        policy = _resolve_policy(dtype, device_type, policy, model)
        keep_modules, keep_types = (
            resolve_keep_fp32(keep_fp32, model) if enabled and keep_fp32 else ((), ()))
        self._config = _Config(dtype, policy, bool(emulate), bool(enabled), bool(cache_enabled),
                               keep_modules, keep_types)
        self._records: list[_Record] = []

    # read-only views of the configuration
    dtype = property(lambda self: self._config.dtype)
    policy = property(lambda self: self._config.policy)
    device_type = property(lambda self: self._config.policy.device_type)
    emulate = property(lambda self: self._config.emulate)
    enabled = property(lambda self: self._config.enabled)

    @classmethod
    def _from_config(cls, config: _Config) -> autocast:
        self = cls.__new__(cls)
        self._config = config
        self._records = []
        return self

    def __repr__(self) -> str:
        c = self._config
        return (f"autocast({c.dtype}, device_type={c.policy.device_type!r}, "
                f"emulate={c.emulate}, enabled={c.enabled})")

    def __enter__(self) -> autocast:
        c = self._config
        frames = STATE.frames
        if not c.enabled and not frames:
            self._records.append(_Record(noop=True))  # outermost disabled: nothing to do
            return self
        frame = frame_for(c.enabled, c.policy, c.kinds, c.dtype, c.emulate, c.cache_enabled)
        record = _Record(noop=False, saved_len=len(frames), frame=frame)
        frames.append(frame)
        self._records.append(record)
        try:
            if STATE.mode is None:
                mode = PolicyMode()
                mode.__enter__()
                STATE.mode = mode
                record.pushed_mode = True
            if c.enabled and (c.keep_modules or c.keep_types):
                record.hooks = install_keep_fp32(frame, c.keep_modules, c.keep_types)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if not self._records:
            raise RuntimeError(f"{self!r}.__exit__ without a matching __enter__; use `with autocast(...):`")
        record = self._records.pop()
        if record.noop:
            return False
        for hooks in record.hooks:
            hooks.remove()
        del STATE.frames[record.saved_len:]
        if record.saved_len == 0:
            clear_cache()
        if record.pushed_mode:
            mode, STATE.mode = STATE.mode, None
            top = torch.overrides._get_current_function_mode()
            if top is not mode:
                raise RuntimeError(
                    f"mixprec autocast exit: the innermost TorchFunctionMode is {top!r}, not "
                    f"autocast's; a mode entered inside `with autocast(...)` must be exited "
                    f"inside it"
                )
            mode.__exit__(exc_type, exc, tb)
        return False

    def __call__(self, fn: Callable) -> Callable:
        config = self._config

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with autocast._from_config(config):
                return fn(*args, **kwargs)

        return wrapper
