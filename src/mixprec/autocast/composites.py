"""Composites: functions whose inner ops must meet the policy one by one.

Inside ``__torch_function__`` the mode is popped, so a Python function such as ``F.multi_head_attention_forward``
would run its inner ops unseen. For the policy's ``composite`` names the mode re-enters itself and runs a copy of
the function whose own ``has_torch_function`` checks are off (inner calls keep theirs). C++ composites have no
Python body; those in :mod:`.cpp_composites` have a Python transcription.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

from .casts import iter_tensors
from .cpp_composites import TRANSCRIPTIONS

__all__ = ["body"]


def _never(*args: Any, **kwargs: Any) -> bool:
    return False


_CHECKS = frozenset({"has_torch_function", "has_torch_function_unary", "has_torch_function_variadic"})
_NO_CHECKS = dict.fromkeys(_CHECKS, _never)


def _unchecked(func: Any) -> Callable | None:
    """A copy of ``func`` whose top-level has_torch_function* checks are off (a fresh snapshot of its globals
    with the checks bound to False; the functions it calls keep theirs). Built per call: never stale."""
    code = getattr(func, "__code__", None)
    if code is None or _CHECKS.isdisjoint(code.co_names):
        return None
    g = dict(func.__globals__)
    g.update(_NO_CHECKS)
    copy = types.FunctionType(code, g, func.__name__, func.__defaults__, func.__closure__)
    copy.__kwdefaults__ = func.__kwdefaults__
    return copy


def body(func: Any, args: tuple, kwargs: dict, eligible: Callable[[Any], bool]) -> Callable | None:
    """What to run, with the mode re-entered, for the composite ``func``; None: call ``func`` itself. A
    transcription is used only when some tensor argument is ``eligible``."""
    python_body = _unchecked(func)
    if python_body is not None:
        return python_body
    transcription = TRANSCRIPTIONS.get(getattr(func, "__name__", None))
    if transcription is not None and any(eligible(t) for t in iter_tensors(args, kwargs)):
        return transcription
    return None
