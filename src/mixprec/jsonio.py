"""The one way to write output files: atomic (temp file + rename) and, for JSON, strict (NaN and inf become
null, so every parser reads it)."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import os
import tempfile
from typing import Any

from .errors import OutputError

__all__ = ["write_json", "write_text", "write_bytes", "write_figure", "to_jsonable", "file_mode_mask"]


def to_jsonable(o: Any) -> Any:
    """``o`` as plain JSON data: non-finite floats become None, tuples lists, dataclasses (and objects
    with ``to_dict()``) dicts, dict keys strings; anything else unknown becomes its ``str``."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if o is None or isinstance(o, (bool, int, str)):
        return o
    if isinstance(o, dict):
        return {str(k): to_jsonable(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [to_jsonable(v) for v in o]
    if hasattr(o, "to_dict"):
        return to_jsonable(o.to_dict())
    if dataclasses.is_dataclass(o) and not isinstance(o, type):
        return to_jsonable(dataclasses.asdict(o))
    if hasattr(o, "item") and callable(o.item):  # 0-dim tensors, numpy scalars
        try:
            return to_jsonable(o.item())
        except (TypeError, ValueError, RuntimeError):
            pass
    return str(o)


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` atomically; a failed write raises OutputError naming the path, leaving any old file intact."""
    write_bytes(path, text.encode("utf-8"))


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` atomically, as :func:`write_text` does."""
    path = os.fspath(path)
    d = os.path.dirname(os.path.abspath(path))
    tmp = None
    try:
        os.makedirs(d, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=os.path.splitext(path)[1] or ".tmp", dir=d)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o666 & ~file_mode_mask())  # mkstemp makes 0600; a report is as readable as any file written
        os.replace(tmp, path)
        tmp = None
    except OSError as e:
        raise OutputError(f"could not write {path} ({e.strerror or e})") from None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def write_figure(fig: Any, path: str | os.PathLike, **savefig: Any) -> None:
    """Render a matplotlib figure to PNG in memory, then write it with :func:`write_bytes`."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", **savefig)
    write_bytes(path, buf.getvalue())


def file_mode_mask() -> int:
    """This process's umask."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_json(path: str | os.PathLike, obj: Any, *, indent: int = 2) -> None:
    """Write ``obj`` as strict JSON (see :func:`to_jsonable`), atomically, as :func:`write_text` does."""
    write_text(path, json.dumps(to_jsonable(obj), indent=indent, allow_nan=False) + "\n")
