"""The IDX file format of MNIST-style datasets: one reader, nothing dataset-specific.

A 4-byte big-endian magic (low byte: number of dimensions), one 4-byte size per dimension, then ``prod(sizes)``
bytes row-major; gzip is detected from the first bytes. Which files make a dataset: :mod:`.builtin`.
"""

from __future__ import annotations

import gzip
import math
import os
import zlib

import torch

from .protocol import DataError

__all__ = ["IdxFormatError", "read_idx"]

_IDX_MAGIC = {0x00000801: "labels", 0x00000803: "images"}  # uint8 vectors and uint8 3-D arrays


class IdxFormatError(DataError):
    """A file that was read but is not well-formed IDX (an unreadable file is a plain :class:`DataError`)."""


def read_idx(path) -> torch.Tensor:
    """Read an IDX file (magic ``0x00000803`` images or ``0x00000801`` labels, raw or gzip) into a uint8 tensor.

    Raises DataError when the file cannot be read, IdxFormatError when it is not exactly well-formed.
    """
    path = os.fspath(path)
    data = _read_bytes(path)
    if data[:2] == b"\x1f\x8b":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as e:
            raise IdxFormatError(f"{path}: corrupt gzip data ({e})") from None
    if len(data) < 4:
        raise IdxFormatError(f"{path}: too short to be an IDX file ({len(data)} bytes)")
    magic = int.from_bytes(data[:4], "big")
    if magic not in _IDX_MAGIC:
        raise IdxFormatError(
            f"{path}: not an IDX file of uint8 images or labels (magic 0x{magic:08x}; "
            "expected 0x00000803 for images or 0x00000801 for labels)"
        )
    ndim = magic & 0xFF
    header = 4 + 4 * ndim
    if len(data) < header:
        raise IdxFormatError(f"{path}: IDX header truncated ({len(data)} bytes, header needs {header})")
    dims = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    expected = header + math.prod(dims)
    if len(data) != expected:
        what = "truncated" if len(data) < expected else "has trailing bytes"
        raise IdxFormatError(
            f"{path}: IDX payload {what}: header says {_IDX_MAGIC[magic]} of shape {dims}, "
            f"so the file should be {expected} bytes, but it is {len(data)}"
        )
    if expected == header:  # a well-formed file of no samples (torch.frombuffer refuses count=0)
        return torch.empty(dims, dtype=torch.uint8)
    # bytearray makes the buffer writable (torch.frombuffer warns on read-only bytes); one memcpy.
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8, offset=header, count=expected - header)
    return flat.reshape(dims)


def _read_bytes(path: str) -> bytes:
    """The file's bytes; a DataError that says why not (missing, permission denied, a folder)."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except PermissionError:
        raise DataError(f"{path}: permission denied: this user cannot read the file; fix its permissions "
                        f"(e.g. chmod a+r {path}) or copy the files to a folder you can read") from None
    except IsADirectoryError:
        raise DataError(f"{path}: is a folder, not an IDX file") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read: {e.strerror or e}") from None
