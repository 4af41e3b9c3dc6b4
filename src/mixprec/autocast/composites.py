"""Composites: functions whose inner ops must meet the policy one by one.

Inside ``__torch_function__`` the mode is popped, so a Python function such as
``F.multi_head_attention_forward`` would run its inner linears/softmax unseen. For the policy's
``composite`` names the mode re-enters itself and runs :func:`body` of the function: a copy whose
own ``has_torch_function`` check is disabled (the inner calls keep theirs), so every inner op follows
the policy. A C++ composite (``lstm_cell``, ``tensordot`` on CPU) has no Python body; for those
listed in :mod:`.cpp_composites` the body is a Python transcription of the C++ code.
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
    """A copy of the Python function ``func`` whose top-level has_torch_function* checks are off.

    The copy gets a fresh snapshot of ``func``'s module globals with the check names bound to a
    function returning False; functions it calls keep their own (real) globals, so their checks
    still route them through the mode. Built per call (~2 us), so it never goes stale.
    """
    code = getattr(func, "__code__", None)
    if code is None or _CHECKS.isdisjoint(code.co_names):
        return None
    g = dict(func.__globals__)
    g.update(_NO_CHECKS)
    copy = types.FunctionType(code, g, func.__name__, func.__defaults__, func.__closure__)
    copy.__kwdefaults__ = func.__kwdefaults__
    return copy


def body(func: Any, args: tuple, kwargs: dict, eligible: Callable[[Any], bool]) -> Callable | None:
    """What to run, with the mode re-entered, for the composite ``func``; None: call ``func`` itself.

    A transcription is used only when some tensor argument is ``eligible`` (on the autocast's device).
    """
    python_body = _unchecked(func)
    if python_body is not None:
        return python_body
    transcription = TRANSCRIPTIONS.get(getattr(func, "__name__", None))
    if transcription is not None and any(eligible(t) for t in iter_tensors(args, kwargs)):
        return transcription
    return None
