"""User code by reference: ``--model``, ``--dataset`` and ``--loss`` may name a callable instead of a built-in.

A reference is ``package.module:callable`` or ``path/to/file.py:callable``; bench's workers import it again, so
it must not depend on the parent's run-time state. Factories get the offered keyword arguments they declare
(``input_shape``, ``num_classes``, ``vocab_size``, ``block_size``). Every failure is a :class:`UserCodeError`
(exit 2) naming the reference and the fix.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from typing import Any

from ..errors import UsageError, one_line
from ..lowp.impls import quiet_torchao_import

__all__ = ["UserCodeError", "is_reference", "load_callable", "call_declared", "reference_of", "in_process_reference"]

_IN_PROCESS: dict[str, Callable] = {}
"""Callables handed to ``fit`` in this process, by the reference its run's config records for them."""


class UserCodeError(UsageError):
    """User code named by ``--model``/``--dataset``/``--loss`` cannot be imported or called as asked."""


def is_reference(name: str) -> bool:
    """Whether ``name`` refers to user code (``module:callable`` or ``file.py:callable``)."""
    return ":" in name


def load_callable(ref: str, flag: str) -> Callable:
    """Import the callable ``ref`` names; ``flag`` (``--model``...) is quoted in errors."""
    if ref in _IN_PROCESS:
        return _IN_PROCESS[ref]
    module_part, _, attr = ref.rpartition(":")
    if not module_part or not attr:
        raise UserCodeError(f"{flag} {ref!r}: expected package.module:callable or path/to/file.py:callable")
    module = _import_file(module_part, ref, flag) if module_part.endswith(".py") else _import_module(module_part,
                                                                                                       ref, flag)
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            public = sorted(n for n in dir(module) if not n.startswith("_"))[:12]
            raise UserCodeError(f"{flag} {ref!r}: {module_part} has no attribute {attr!r} (it has: "
                                f"{', '.join(public) or 'nothing public'})")
        obj = getattr(obj, part)
    if not callable(obj):
        raise UserCodeError(f"{flag} {ref!r}: {attr} is a {type(obj).__name__}, not a callable")
    return obj


def _import_module(name: str, ref: str, flag: str):
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # `python -m mixprec` and the console script both see the current folder
    try:
        with quiet_torchao_import(python_warnings=False):  # transformers imports torchao, which logs its load
            return importlib.import_module(name)
    except ModuleNotFoundError as e:
        raise UserCodeError(f"{flag} {ref!r}: cannot import {e.name!r} (run from the folder that holds it, add "
                            "it to PYTHONPATH, or give a file path like path/to/file.py:callable)") from None
    except Exception as e:  # noqa: BLE001 -- the module's own code raised while importing
        raise UserCodeError(f"{flag} {ref!r}: importing {name} raised {one_line(e, 300)}") from None


def _import_file(path: str, ref: str, flag: str):
    full = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(full):
        raise UserCodeError(f"{flag} {ref!r}: no file {full}")
    key = "mixprec_user_" + hashlib.sha1(full.encode()).hexdigest()[:12]
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, full)
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    try:
        with quiet_torchao_import(python_warnings=False):
            spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 -- the file's own code raised while loading
        del sys.modules[key]
        raise UserCodeError(f"{flag} {ref!r}: loading {full} raised {one_line(e, 300)}") from None
    return module


def call_declared(fn: Callable, offered: dict[str, Any], *, ref: str, flag: str) -> Any:
    """Call ``fn`` with the offered keyword arguments its signature declares; its exceptions become one line."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        kwargs = dict(offered)
    else:
        kwargs = {k: v for k, v in offered.items() if k in params}
    try:
        with quiet_torchao_import(python_warnings=False):
            return fn(**kwargs)
    except Exception as e:  # noqa: BLE001 -- whatever the user's code raises is reported, not a traceback
        raise UserCodeError(f"{flag} {ref!r} raised {one_line(e, 300)} (called with "
                            f"{', '.join(f'{k}={v!r}' for k, v in kwargs.items()) or 'no arguments'})") from None


def reference_of(obj: Any, flag: str) -> str:
    """The reference string that imports ``obj`` again in another process (``compare``'s workers); a lambda, a
    nested function or one defined in ``__main__`` is refused in one line."""
    if isinstance(obj, str):
        return obj
    if not callable(obj):
        raise UserCodeError(f"{flag}: expected a callable or a 'module:callable' string, got {type(obj).__name__}")
    qual = getattr(obj, "__qualname__", "")
    if "<" in qual:
        raise UserCodeError(f"{flag}: {qual} is defined inside a function or is a lambda; another process cannot "
                            "import it — define it at the top level of a module or file")
    module = getattr(obj, "__module__", None)
    if not module or module == "__main__":
        raise UserCodeError(f"{flag}: {qual} is defined in __main__ (a script or a notebook), which a worker process "
                            f"cannot import; move it to a module on sys.path (or a file: 'path/to/file.py:{qual}'), "
                            "or train in this process with mixprec.train.fit")
    return f"{module}:{qual}"


def in_process_reference(obj: Any, flag: str) -> str:
    """A reference to ``obj`` for this process only (``fit``): recorded as ``module:qualname``;
    :func:`load_callable` returns ``obj`` itself, nothing is imported again."""
    if isinstance(obj, str):
        return obj
    if not callable(obj):
        raise UserCodeError(f"{flag}: expected a callable or a 'module:callable' string, got {type(obj).__name__}")
    ref = f"{getattr(obj, '__module__', None) or '__main__'}:{getattr(obj, '__qualname__', type(obj).__name__)}"
    _IN_PROCESS[ref] = obj
    return ref
