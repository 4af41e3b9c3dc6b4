"""A layer-formats file: each named linear layer in a format of its own, the rest in the run's recipe.

``mixprec tune`` writes one; ``train``, ``bench`` and ``plan`` apply it (``--layer-formats FILE``,
:class:`mixprec.precision.Recipe` does the swapping). The file (JSON)::

    {"schema": "mixprec.layer-formats/1",
     "model": {"name": "gpt", "fingerprint": "<hex>", "linear_layers": 12},
     "target": "h100-sxm",
     "layers": {"blocks.0.attn.qkv": {"format": "fp8-rowwise", "reason": "pays 1.31x on h100-sxm, SQNR 31 dB"},
                "head": {"format": "bf16", "reason": "..."}},
     "thresholds": {...}}

A format (:data:`FORMATS`) is a dtype the layer runs in (``fp32``: autocast off for it; ``bf16``/``fp16``: the
autocast's own dtype, kept out of the recipe's FP8 conversion) or a low-precision recipe name whose linear recipe
the layer's three GEMMs run (:data:`LOWP_FORMATS`). Layers are named by their qualified module names; the model's
:func:`fingerprint` (its linear layers' names and weight shapes) tells a file made for another model. ``model``
and ``target`` describe where the file was made; ``thresholds`` is the tuner's, carried as it is.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import os
from collections.abc import Mapping
from typing import Any

from torch import nn

from ..errors import UsageError
from ..jsonio import write_json
from .convert import is_linear_layer

__all__ = ["SCHEMA", "FORMATS", "DTYPE_FORMATS", "LOWP_FORMATS", "LayerFormats", "LayerFormatsError",
           "fingerprint", "linear_layers", "load", "save"]

SCHEMA = "mixprec.layer-formats/1"

DTYPE_FORMATS = ("fp32", "bf16", "fp16")
"""Formats that are a dtype: the layer stays an ``nn.Linear`` and runs in it."""
LOWP_FORMATS = ("fp8-mixed", "fp8-rowwise", "mxfp8", "mxfp4", "nvfp4")
"""Formats that are a low-precision recipe's name: the layer runs that recipe's linear recipe (its ``fp8``)."""
FORMATS = DTYPE_FORMATS + LOWP_FORMATS


class LayerFormatsError(UsageError):
    """A layer-formats file that cannot be read, or that does not fit the model or the recipe."""


def linear_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The model's linear layers by qualified name (:func:`mixprec.lowp.convert.is_linear_layer`)."""
    return {name: m for name, m in model.named_modules() if is_linear_layer(m)}


def fingerprint(model: nn.Module) -> str:
    """A short hash of the sorted (qualified name, weight shape) of the model's linear layers (16 hex digits);
    the same model class with the same sizes has the same one, on any device, converted or not."""
    layers = sorted((name, list(m.weight.shape)) for name, m in linear_layers(model).items())
    return hashlib.sha256(json.dumps(layers).encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class LayerFormats:
    """A loaded layer-formats file (module docstring)."""

    path: str
    layers: dict[str, tuple[str, str]]
    """Qualified module name -> (format, reason)."""
    model: dict[str, Any]
    """Where it was made: ``name``, ``fingerprint`` (None: not checked), ``linear_layers``."""
    target: str | None
    raw: dict[str, Any]
    """The file as read."""

    def by_format(self) -> dict[str, list[str]]:
        """Format -> the layers in it, in :data:`FORMATS` order."""
        out: dict[str, list[str]] = {}
        for name, (fmt, _) in self.layers.items():
            out.setdefault(fmt, []).append(name)
        return {f: out[f] for f in FORMATS if f in out}

    def formats(self) -> set[str]:
        return {fmt for fmt, _ in self.layers.values()}

    def _error(self, what: str) -> LayerFormatsError:
        return LayerFormatsError(f"--layer-formats {self.path}: {what}")

    def check_model(self, model: nn.Module) -> dict[str, nn.Module]:
        """The file's layers in ``model`` by name; LayerFormatsError (one line) for a name the model lacks or that
        is not a linear layer, and for a file made for another model (its fingerprint differs)."""
        mine = fingerprint(model)
        theirs = self.model.get("fingerprint")
        other = theirs is not None and theirs != mine
        made_for = (f"the file was made for another model ({self.model.get('name') or 'unnamed'}, fingerprint "
                    f"{theirs}; this one's is {mine})")
        modules = dict(model.named_modules())
        linear = linear_layers(model)
        for name in self.layers:
            if name not in modules:
                close = difflib.get_close_matches(name, list(linear), n=1, cutoff=0.6)
                hint = f" (did you mean {close[0]}?)" if close else ""
                raise self._error(f"the model has no module {name!r}{hint}; "
                                  + (made_for + ": make one for this model with mixprec tune" if other
                                     else "name its linear layers by their qualified names (model.named_modules())"))
            if name not in linear:
                raise self._error(f"{name!r} is a {type(modules[name]).__name__}, not a linear layer; a layer-formats "
                                  "file names linear layers (nn.Linear or a registered linear class)")
        if other:
            raise self._error(made_for + "; make one for this model with mixprec tune (or drop the file's "
                              "model.fingerprint to apply it anyway)")
        return {name: linear[name] for name in self.layers}

    def to_dict(self) -> dict[str, Any]:
        return self.raw


def _fail(path: str, what: str) -> LayerFormatsError:
    return LayerFormatsError(f"--layer-formats {path}: {what}")


def load(path: str | os.PathLike) -> LayerFormats:
    """Read and check a layer-formats file; LayerFormatsError (one line naming the file and the fix) when it is
    missing, not JSON, of another schema, or names an unknown format."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise _fail(path, "no such file; give the path of a file mixprec tune wrote") from None
    except (OSError, UnicodeDecodeError) as e:
        raise _fail(path, f"cannot be read ({getattr(e, 'strerror', None) or e}); give a readable JSON file") from None
    try:
        raw = json.loads(text)
    except ValueError as e:
        raise _fail(path, f"not JSON ({str(e).splitlines()[0]}); give a file mixprec tune wrote") from None
    if not isinstance(raw, dict) or raw.get("schema") != SCHEMA:
        got = raw.get("schema") if isinstance(raw, dict) else type(raw).__name__
        raise _fail(path, f"schema is {got!r}, not {SCHEMA!r}; give a file mixprec tune wrote")
    layers_raw = raw.get("layers")
    if not isinstance(layers_raw, dict):
        raise _fail(path, 'no "layers" object; it maps module names to {"format": ..., "reason": ...}')
    layers = {}
    for name, entry in layers_raw.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("format"), str):
            raise _fail(path, f'layer {name!r}: expected {{"format": ..., "reason": ...}}, got {json.dumps(entry)}')
        fmt, reason = entry["format"], entry.get("reason", "")
        if fmt not in FORMATS:
            raise _fail(path, f"layer {name!r}: unknown format {fmt!r}; choose one of: {', '.join(FORMATS)}")
        layers[name] = (fmt, reason if isinstance(reason, str) else json.dumps(reason))
    model = raw.get("model", {})
    if not isinstance(model, dict):
        raise _fail(path, '"model" must be an object {"name": ..., "fingerprint": ..., "linear_layers": ...}')
    target = raw.get("target")
    if target is not None and not isinstance(target, str):
        raise _fail(path, f'"target" must be a target name like "h100-sxm" or null, got {json.dumps(target)}')
    return LayerFormats(path=path, layers=layers, model=dict(model), target=target, raw=raw)


def save(path: str | os.PathLike, layers: Mapping[str, tuple[str, str] | str], *, model: nn.Module,
         model_name: str, target: str | None, thresholds: Mapping[str, Any] | None = None) -> LayerFormats:
    """Write a layer-formats file for ``model`` (atomically) and return it as :func:`load` reads it.

    ``layers``: name -> ``(format, reason)`` or just the format; every name must be a linear layer of ``model``
    and every format one of :data:`FORMATS` (LayerFormatsError otherwise, nothing written)."""
    path = os.fspath(path)
    entries = {}
    for name, value in layers.items():
        fmt, reason = (value, "") if isinstance(value, str) else value
        if fmt not in FORMATS:
            raise _fail(path, f"layer {name!r}: unknown format {fmt!r}; choose one of: {', '.join(FORMATS)}")
        entries[name] = {"format": fmt, "reason": reason}
    doc = {"schema": SCHEMA,
           "model": {"name": model_name, "fingerprint": fingerprint(model), "linear_layers": len(linear_layers(model))},
           "target": target, "layers": entries, "thresholds": dict(thresholds or {})}
    LayerFormats(path=path, layers={n: (e["format"], e["reason"]) for n, e in entries.items()}, model=doc["model"],
                 target=target, raw=doc).check_model(model)
    write_json(path, doc)
    return load(path)
