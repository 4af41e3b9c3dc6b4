"""Precision map: every op of one training step, with its dtypes, module, count, FLOPs and bytes cast.

Built by :class:`PrecisionMapSink` from :class:`~.observer.OpObserver`, so it shows what ran whichever autocast
produced it: ``_to_copy fp32->bf16`` rows are the casts autocast inserted; ``fp16 (emulated)`` marks fp32
arithmetic on operands and results rounded to fp16. FLOPs come from :func:`mixprec.flops.op_flops` (the counter
bench's MFU uses; elementwise ops count zero); a layer with parameters that no formula knows is listed in
``PrecisionMap.uncounted``. "Kept in fp32" lists the forward ops inside the autocast region that did arithmetic
in fp32.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from ..flops import op_flops, unknown_layers

from .attribution import display_path
from .observer import LOW_DTYPES, OpCall, OpObserver, dtype_name, is_data_movement

__all__ = ["MapRow", "PrecisionMap", "PrecisionMapSink"]


@dataclasses.dataclass
class MapRow:
    phase: str
    module: str | None
    op: str
    inputs: str
    """Floating input dtypes, e.g. ``bf16,bf16,bf16``."""
    outputs: str
    compute: str
    """Dtype the op computed in: ``bf16``, ``fp32``, ``fp16 (emulated)``; ``cast`` for dtype conversions."""
    count: int = 0
    flops: int = 0
    cast_bytes: int = 0
    in_autocast: bool = False
    """Ran inside the recipe's autocast region."""

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["module"] = display_path(self.module)
        return d


@dataclasses.dataclass
class PrecisionMap:
    """What one forward + backward (+ optimizer step) ran, aggregated per (phase, module, op, dtypes)."""

    low_dtype: str
    rows: list[MapRow]
    uncounted: list[str] = dataclasses.field(default_factory=list)
    """Layers with parameters that ran but whose FLOPs no formula knows (``"name (Type)"``): not in the totals."""

    def _is_low(self, r: MapRow) -> bool:
        return r.compute.split(" ")[0] in {dtype_name(d) for d in LOW_DTYPES}

    @property
    def total_flops(self) -> int:
        return sum(r.flops for r in self.rows if r.phase != "step")

    @property
    def low_flops(self) -> int:
        return sum(r.flops for r in self.rows if r.phase != "step" and self._is_low(r))

    @property
    def low_flop_share(self) -> float:
        return self.low_flops / self.total_flops if self.total_flops else 0.0

    @property
    def emulated(self) -> bool:
        return any("emulated" in r.compute for r in self.rows)

    def casts(self) -> tuple[int, int]:
        """(number of dtype casts, bytes written by them) in forward + backward."""
        rows = [r for r in self.rows if r.cast_bytes and r.phase != "step"]
        return sum(r.count for r in rows), sum(r.cast_bytes for r in rows)

    def kept_fp32(self) -> dict[str, int]:
        """Forward ops inside the autocast region that did arithmetic in fp32, with how often they ran."""
        c: Counter[str] = Counter()
        for r in self.rows:
            if (r.phase == "forward" and r.in_autocast and r.compute == "fp32" and r.op not in _SKIP_KEPT
                    and r.outputs not in ("-", "")):
                c[r.op] += r.count
        return dict(c)

    def op_counts(self) -> dict[str, int]:
        c: Counter[str] = Counter()
        for r in self.rows:
            c[r.phase] += r.count
        return dict(c)

    def summary(self) -> dict[str, Any]:
        n_casts, cast_bytes = self.casts()
        return {
            "low_dtype": self.low_dtype,
            "low_flop_share": self.low_flop_share,
            "total_flops": self.total_flops,
            "low_flops": self.low_flops,
            "ops": self.op_counts(),
            "casts": n_casts,
            "cast_bytes": cast_bytes,
            "kept_fp32": self.kept_fp32(),
            "emulated": self.emulated,
            "uncounted": list(self.uncounted),
        }

    def to_dict(self) -> dict[str, Any]:
        return {"summary": self.summary(), "rows": [r.to_dict() for r in self.rows]}


# forward ops that are fp32 for lack of floating inputs or that do not compute values worth listing
_SKIP_KEPT = frozenset({"detach", "ones_like", "zeros_like", "empty_like", "nll_loss_forward_target"})


class PrecisionMapSink:
    """Aggregates :class:`OpCall` s into a :class:`PrecisionMap` (a sink of :class:`OpObserver`).

    Emulated low precision is recognised after the fact: an fp32 matmul, convolution or attention whose
    floating inputs all hold fp16 values *and whose result is then rounded to fp16* computed what an fp16
    op computes, so its row moves to ``fp16 (emulated)`` when that rounding cast is seen. Other fp32 ops on
    low-precision values (relu between two emulated linears, a loss after autocast's upcast) really do
    their arithmetic in fp32 and keep ``fp32``.
    """

    def __init__(self, low_dtype: torch.dtype | None) -> None:
        self.low_dtype = low_dtype
        self._rows: dict[tuple, MapRow] = {}
        self._pending: WeakIdKeyDictionary = WeakIdKeyDictionary()  # fp32 result -> [row key, flops, dtype, done]

    def _row(self, key: tuple, call: OpCall) -> MapRow:
        row = self._rows.get(key)
        if row is None:
            phase, module, op, ins, outs, compute, in_autocast = key
            row = self._rows[key] = MapRow(phase, module, op, ins, outs, compute, in_autocast=in_autocast)
        return row

    def on_op(self, call: OpCall, observer: OpObserver) -> None:
        pend = self._pending
        if is_data_movement(call.func) and call.name != "_to_copy":
            if call.in_tensors and call.out_tensors and call.in_tensors[0] in pend:
                pend[call.out_tensors[0]] = pend[call.in_tensors[0]]  # views keep the mark
            return
        ins = ",".join(dtype_name(d) for d in call.in_dtypes) or "-"
        outs = ",".join(dtype_name(d) for d in call.out_dtypes) or "-"
        flops = _flops(call)
        compute = "cast" if call.name == "_to_copy" else dtype_name(_compute_dtype(call, flops))
        key = (call.phase, call.module, call.name, ins, outs, compute, call.in_autocast)
        row = self._row(key, call)
        row.count += 1
        row.flops += flops
        if call.name == "_to_copy" and call.in_tensors and call.out_tensors:
            src, dst = call.in_tensors[0], call.out_tensors[0]
            if src.dtype != dst.dtype and src.is_floating_point() and dst.is_floating_point():
                row.cast_bytes += dst.numel() * dst.element_size()
            for entry in pend.get(src, ()):
                if entry[2] == dst.dtype and not entry[3] and entry[0][0] == call.phase:
                    entry[3] = True  # once per op, however many views of its result get rounded
                    self._relabel(entry[0], entry[1], entry[2], call)
            return
        # a matmul/conv/attention in fp32 whose floating inputs all hold low-precision values is emulated if
        # its result gets rounded to that dtype later, in the same phase; ops in between (the bias add of a
        # decomposed linear) pass the pending mark on
        floats = [t for t in call.in_tensors if t.is_floating_point()]
        outs32 = [t for t in call.out_tensors if t.dtype == torch.float32]
        if not floats or not outs32 or any(t.dtype != torch.float32 for t in floats):
            return
        lows, chain = set(), []
        for t in floats:
            low = observer.carries(t)
            if low is None and t in pend:
                chain += [e for e in pend[t] if not e[3]]
                low = pend[t][0][2] if pend[t] else None
            if low is None:
                return
            lows.add(low)
        if len(lows) == 1 and (flops or chain):
            entries = chain + ([[key, flops, lows.pop(), False]] if flops else [])
            for o in outs32:
                pend[o] = entries

    def _relabel(self, key: tuple, flops: int, low: torch.dtype, call: OpCall) -> None:
        old = self._rows.get(key)
        if old is None:
            return
        old.count -= 1
        old.flops -= flops
        if old.count == 0:
            del self._rows[key]
        new = self._row(key[:5] + (f"{dtype_name(low)} (emulated)",) + key[6:], call)
        new.count += 1
        new.flops += flops

    def result(self, model: nn.Module | None = None) -> PrecisionMap:
        """The map; given the observed ``model``, also the layers that ran whose FLOPs are unknown."""
        rows = list(self._rows.values())
        uncounted: list[str] = []
        if model is not None:
            forward = [r for r in rows if r.phase == "forward" and r.module]
            uncounted = unknown_layers(model, {r.module for r in forward if r.flops}, {r.module for r in forward})
        return PrecisionMap(low_dtype=dtype_name(self.low_dtype), rows=rows, uncounted=uncounted)


def _compute_dtype(call: OpCall, flops: int) -> torch.dtype | None:
    """The op's compute dtype; a matmul-like op (one with FLOPs) whose floating operands are all one
    low-precision dtype multiplies in it even where it writes fp32 results (oneDNN's bf16 LSTM backward
    returns fp32 gradients from bf16 operands), so it is that dtype's work."""
    ins = set(call.in_dtypes)
    if flops and call.compute_dtype == torch.float32 and len(ins) == 1 and next(iter(ins)) in LOW_DTYPES:
        return next(iter(ins))
    return call.compute_dtype


def _flops(call: OpCall) -> int:
    return op_flops(call.func, call.args, call.kwargs, call.out)
