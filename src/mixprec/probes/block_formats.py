"""Block-format probe, what-if: every linear layer's GEMM operands quantized in every FP8/FP4 format.

During the doctor's fp32 pass (:mod:`.ranges`) a forward hook on each linear layer (``nn.Linear`` and
subclasses, ``Fp8AdaptedLinear``, a registered linear class such as Hugging Face's ``Conv1D``, any module with
an ``(out_features, in_features)`` weight) takes ``x`` (``N x in``) and ``W``, a tensor hook the gradient ``dy``.
The three GEMMs quantize six operands, each along the dimension it reduces (:data:`OPERANDS`, :data:`AXIS`):
forward ``x @ W^T`` (x, W along in_features), grad_input ``dy @ W`` (dy, W along out_features), grad_weight
``dy^T @ x`` (dy, x along the tokens). Each is quantized in each format -- per-tensor fp8 exactly as
``fp8-mixed`` (:func:`mixprec.fp8.fp8_scale`), every :mod:`mixprec.blockformats` format with its default scale
rule -- and compared with its fp32 values:

* ``sqnr_db``: SQNR per dot product, ``-10 log10(mean_r(|x_r - q(x_r)|^2 / |x_r|^2))`` over the non-zero rows
  (what a typical output element sees); ``tensor_sqnr_db``: the whole tensor's (dominated by its largest values);
* ``scale_clamped``: the fraction of non-zero blocks whose scale hit its format's limit (:func:`scale_clamped`);
* ``underflow`` / ``subnormal``: the fractions of non-zero elements that quantize to zero / to a subnormal.

An operand whose reduced dimension is not a multiple of the block size is ``n/a``. A layer is flagged when its
SQNR is more than ``flag_db`` below the layers' median for that tensor and format. Operands of more than
``max_elements`` values are measured on whole sampled rows (:func:`.subsample.sample_rows`); everything is
accumulated in device tensors and read with one host copy in :meth:`BlockFormatProbe.result`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError
from ..formats import (
    _NVFP4_MIN_TENSOR_SCALE,
    _ROWWISE_EPS,
    BLOCK_FORMATS,
    BlockFormat,
    get_block_format,
    get_format,
    quantize_blocks_with_scales,
)
from ..lowp.convert import Fp8AdaptedLinear, _adapter_for
from ..lowp.quant import _EXP_LIMIT, fp8_scale
from ..validate import positive, positive_int
from .attribution import display_path
from .subsample import sample_rows

__all__ = ["BlockFormatConfig", "BlockFormatProbe", "BlockFormatProfile", "LayerBlockStats", "Cell",
           "WHAT_IF_FORMATS", "TENSOR_FORMATS", "OPERANDS", "operand_stats", "scale_clamped", "linear_layers"]

TENSOR_FORMATS = ("fp8_e4m3", "fp8_e5m2")
"""Per-tensor scaled FP8, as ``fp8-mixed`` quantizes (one power-of-two scale per tensor)."""
WHAT_IF_FORMATS = TENSOR_FORMATS + tuple(BLOCK_FORMATS)
"""Every format the what-if table can show, in its column order."""
OPERANDS = (("x", "forward"), ("w", "forward"), ("dy", "grad_input"), ("w", "grad_input"),
            ("dy", "grad_weight"), ("x", "grad_weight"))
"""(tensor, GEMM) of the six GEMM operands of a linear layer (see the module docstring)."""
AXIS = {("x", "forward"): "in_features", ("w", "forward"): "in_features", ("dy", "grad_input"): "out_features",
        ("w", "grad_input"): "out_features", ("dy", "grad_weight"): "tokens", ("x", "grad_weight"): "tokens"}
"""The dimension each operand is quantized along (the one its GEMM reduces)."""
SHORT = {"fp8_e4m3": "e4m3", "fp8_e5m2": "e5m2", "fp8_e4m3_rowwise": "rowwise", "fp8_e4m3_block128": "1x128",
         "mxfp8_e4m3": "mxfp8", "mxfp8_e5m2": "mxfp8_e5m2", "mxfp4": "mxfp4", "nvfp4": "nvfp4"}
"""Column headers of the text table."""
_STATS = ("signal", "noise", "nonzero", "underflow", "subnormal", "blocks", "clamped", "nonfinite", "rows",
          "row_noise")
"""What :func:`operand_stats` sums (``row_noise``: the sum over non-zero rows of noise / signal)."""
_FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def _canonical(name: str) -> str:
    key = str(name).strip().lower().replace("-", "_")
    with contextlib.suppress(ValueError):
        f = get_format(key)
        if f.name in TENSOR_FORMATS:
            return f.name
    try:
        return get_block_format(key).name
    except ValueError:
        raise ConfigError(f"--formats {name}: unknown format; use any of {', '.join(WHAT_IF_FORMATS)} "
                          "(or 'all', or 'none' to skip the block-format section)") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockFormatConfig:
    """What the block-format section measures."""

    formats: tuple[str, ...] = WHAT_IF_FORMATS
    """Formats to try, by name or alias (``"mxfp8"``, ``"e4m3"``); stored canonical, in table order."""
    steps: int = 2
    """Observed steps whose fp32 pass is measured (the first ones)."""
    max_elements: int = 2**15
    """Operands larger than this are sampled by whole rows (module docstring)."""
    flag_db: float = 6.0
    """A layer this many dB below the model's median SQNR for a format and tensor is flagged."""

    def __post_init__(self) -> None:
        names = [_canonical(f) for f in self.formats]
        if not names:
            raise ConfigError("BlockFormatConfig(formats=()): name at least one format, or pass "
                              "block_formats=None to skip the block-format section")
        object.__setattr__(self, "formats", tuple(f for f in WHAT_IF_FORMATS if f in names))
        positive_int("BlockFormatConfig.steps", self.steps)
        positive_int("BlockFormatConfig.max_elements", self.max_elements)
        positive("BlockFormatConfig.flag_db", self.flag_db)

    @classmethod
    def coerce(cls, spec: BlockFormatConfig | Sequence[str] | str | None) -> BlockFormatConfig | None:
        """A config from a config, a list of names, ``"all"``, ``"none"``/``None`` (off) or ``"a,b"``."""
        if spec is None or isinstance(spec, BlockFormatConfig):
            return spec
        if isinstance(spec, str):
            if spec.strip().lower() == "none":
                return None
            spec = WHAT_IF_FORMATS if spec.strip().lower() == "all" else [s for s in spec.split(",") if s.strip()]
        return cls(formats=tuple(spec))


# ------------------------------------------------------------------------------------------------------
# one operand in one format
# ------------------------------------------------------------------------------------------------------

def scale_clamped(fmt: BlockFormat | str, amax: torch.Tensor, tensor_amax: torch.Tensor) -> torch.Tensor:
    """Which blocks (their ``amax``; ``tensor_amax`` for NVFP4) get a scale clamped at its format's limit."""
    if fmt in _FP8_DTYPES:
        _, e = torch.frexp(torch.finfo(_FP8_DTYPES[fmt]).max / amax.double().clamp(min=2.0**-1000))
        return (e - 1 < -_EXP_LIMIT) | (e - 1 > _EXP_LIMIT)
    f = get_block_format(fmt)
    el, sf = f.element, f.scale
    if sf.name == "e8m0":
        k = torch.frexp(amax).exponent - 1 - el.emax  # FLOOR's log2 scale; frexp is exact for subnormals too
        return (k < -127) | (k > 127)
    if f.tensor_scale:
        t = torch.clamp(tensor_amax / (sf.max * el.max), min=_NVFP4_MIN_TENSOR_SCALE)
        return amax / el.max / t < sf.min
    if f.block_size is None:
        return amax < _ROWWISE_EPS
    return torch.isinf(torch.full_like(amax, el.max) / amax)


def _quantize(rows: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(values, elements, smallest normal element) of ``rows`` (float32) quantized along its last dim."""
    if fmt in _FP8_DTYPES:
        dt = _FP8_DTYPES[fmt]
        amax = torch.maximum(rows.amax(), rows.amin().neg())
        s = fp8_scale(amax, dt).to(rows.device)
        el = (rows * s).to(dt).float()
        return el / s, el, get_format(fmt).smallest_normal
    bq = quantize_blocks_with_scales(rows, fmt, axis=-1)
    return bq.dequantize(), bq.elements, 2.0 ** bq.format.element.emin


def block_size(fmt: str, length: int) -> int:
    """Elements per scale of ``fmt`` along a dimension of ``length``."""
    return length if fmt in _FP8_DTYPES else (get_block_format(fmt).block_size or length)


def operand_stats(m: torch.Tensor, fmt: str, *, max_elements: int = 2**15) -> torch.Tensor:
    """Float64 sums named by ``_STATS`` (signal, noise, nonzero, underflow, subnormal, blocks, clamped,
    nonfinite, rows, row_noise) of the 2-D operand ``m`` in ``fmt``, quantized along ``m``'s last dimension
    (which must fit the block size), ``m`` sampled as the module docstring says."""
    return _stats(*sample_rows(m.detach().float(), max_elements), fmt)


@torch.no_grad()
def _stats(rows: torch.Tensor, n: int, fmt: str) -> torch.Tensor:
    q, el, smallest_normal = _quantize(rows, fmt)
    tensor_amax = rows.abs().amax()
    x, q, el = rows[:n], q[:n], el[:n]
    finite = torch.isfinite(x)
    ok = finite & torch.isfinite(q)
    nz = finite & (x != 0)
    x64 = torch.where(finite, x, 0).double()
    err = torch.where(ok, x.double() - q.double(), 0)
    signal_r, noise_r = x64.square().sum(dim=1), err.square().sum(dim=1)
    rows_live = signal_r > 0
    bs = block_size(fmt, x.shape[-1])
    amax = x.reshape(n, -1, bs).abs().amax(dim=-1)
    live = torch.isfinite(amax) & (amax > 0)
    clamped = live & scale_clamped(fmt, amax, tensor_amax)
    row_noise = torch.where(rows_live, noise_r / torch.where(rows_live, signal_r, 1), 0)
    return torch.stack([signal_r.sum(), noise_r.sum(), nz.sum(), (nz & (q == 0)).sum(),
                        (nz & (el != 0) & (el.abs() < smallest_normal)).sum(), live.sum(), clamped.sum(),
                        (finite & ~ok).sum(), rows_live.sum(), row_noise.sum()]).double()


# ------------------------------------------------------------------------------------------------------
# results
# ------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Cell:
    """One operand (or one tensor's worse GEMM) in one format."""

    status: str
    """``ok``, ``exact`` (no error), ``zero`` (all-zero operand), ``n/a`` (does not fit the block size),
    ``not observed``."""
    sqnr_db: float | None = None
    """SQNR per dot product (module docstring), dB."""
    tensor_sqnr_db: float | None = None
    """SQNR of the whole operand, dB."""
    scale_clamped: float | None = None
    """Fraction of non-zero blocks whose scale hit its format's limit."""
    underflow: float | None = None
    """Fraction of non-zero elements quantized to zero."""
    subnormal: float | None = None
    """Fraction of non-zero elements on a subnormal of the element format."""
    blocks: int = 0
    elements: int = 0
    """Non-zero finite elements measured."""
    nonfinite: int = 0
    """Finite elements whose quantized value is not (a NaN block, or a value rounded past float32)."""
    reason: str | None = None
    gemm: str | None = None
    """For a tensor's cell: the GEMM whose operand is the worse."""

    @classmethod
    def from_stats(cls, s: list[float]) -> Cell:
        signal, noise, nz, under, sub, blocks, clamped, bad, rows, row_noise = s
        status = "zero" if signal == 0 else "exact" if noise == 0 else "ok"
        ok = status == "ok"
        return cls(status=status, sqnr_db=-10 * math.log10(row_noise / rows) if ok and row_noise else None,
                   tensor_sqnr_db=10 * math.log10(signal / noise) if ok else None,
                   scale_clamped=clamped / blocks if blocks else 0.0, underflow=under / nz if nz else 0.0,
                   subnormal=sub / nz if nz else 0.0, blocks=int(blocks), elements=int(nz), nonfinite=int(bad))

    @property
    def value(self) -> float | None:
        """SQNR for ordering: ``inf`` when exact, None when there is nothing to compare."""
        return math.inf if self.status == "exact" else self.sqnr_db

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclasses.dataclass
class LayerBlockStats:
    """One linear layer: its six operands, each in every format."""

    name: str
    kind: str
    in_features: int
    out_features: int
    tokens: tuple[int, int] | None
    """(fewest, most) tokens per step seen."""
    operands: dict[tuple[str, str], dict[str, Cell]]
    """(tensor, GEMM) -> format -> cell."""

    def tensor_cell(self, tensor: str, fmt: str) -> Cell:
        """The worse of the tensor's two GEMM operands; ``n/a`` if either does not fit the format."""
        cells = [(g, self.operands[(t, g)][fmt]) for t, g in OPERANDS if t == tensor]
        bad = [c for _, c in cells if c.status in ("n/a", "not observed")]
        if bad:
            return dataclasses.replace(bad[0])
        worst_g, worst = min(cells, key=lambda gc: math.inf if gc[1].value is None else gc[1].value)
        if worst.value is None:  # an all-zero tensor
            return dataclasses.replace(worst, gemm=worst_g)
        return dataclasses.replace(worst, gemm=worst_g,
                                   underflow=max(c.underflow for _, c in cells),
                                   subnormal=max(c.subnormal for _, c in cells),
                                   scale_clamped=max(c.scale_clamped for _, c in cells))

    def to_dict(self) -> dict[str, Any]:
        return {"layer": display_path(self.name), "type": self.kind, "in_features": self.in_features,
                "out_features": self.out_features, "tokens": list(self.tokens) if self.tokens else None,
                "operands": [{"tensor": t, "gemm": g, "axis": AXIS[(t, g)],
                              "formats": {f: c.to_dict() for f, c in cells.items()}}
                             for (t, g), cells in self.operands.items()]}


@dataclasses.dataclass
class BlockFormatProfile:
    """The block-format section of a doctor report."""

    config: BlockFormatConfig
    steps: int
    layers: list[LayerBlockStats]

    def medians(self) -> dict[str, dict[str, float | None]]:
        """format -> tensor -> median over the layers of the tensor's SQNR; only lossy cells count (an input
        the format holds exactly, such as integer pixels, says nothing about what is typical), None for none."""
        out: dict[str, dict[str, float | None]] = {}
        for f in self.config.formats:
            for t in ("x", "w", "dy"):
                vals = [c.sqnr_db for lr in self.layers if (c := lr.tensor_cell(t, f)).status == "ok"]
                out.setdefault(f, {})[t] = statistics.median(vals) if vals else None
        return out

    def _gaps(self) -> Iterator[tuple[LayerBlockStats, str, str, Cell, float]]:
        """(layer, format, tensor, cell, median) of every lossy cell whose format and tensor have a median."""
        med = self.medians()
        for lr in self.layers:
            for f in self.config.formats:
                for t in ("x", "w", "dy"):
                    c = lr.tensor_cell(t, f)
                    if c.status == "ok" and med[f][t] is not None:
                        yield lr, f, t, c, med[f][t]

    def flagged(self) -> list[dict[str, Any]]:
        """Cells more than ``flag_db`` below the model's median for their format and tensor, worst first."""
        out = [{"layer": lr.name, "format": f, "tensor": t, "gemm": c.gemm, "sqnr_db": c.sqnr_db, "median_db": m,
                "below_db": m - c.sqnr_db} for lr, f, t, c, m in self._gaps() if c.sqnr_db < m - self.config.flag_db]
        return sorted(out, key=lambda d: -d["below_db"])

    def worst_first(self) -> list[LayerBlockStats]:
        """Layers by how far their worst cell falls below the median (most first), then widest first."""
        deficit: dict[int, float] = {}
        for lr, _, _, c, m in self._gaps():
            deficit[id(lr)] = max(deficit.get(id(lr), -math.inf), m - c.sqnr_db)
        return sorted(self.layers, key=lambda lr: (-deficit.get(id(lr), -math.inf), -lr.in_features * lr.out_features))

    def not_applicable(self) -> list[tuple[str, str, str]]:
        """(layer, format, reason) of every layer a format does not fit, each once."""
        out = []
        for lr in self.layers:
            for f in self.config.formats:
                dims = dict.fromkeys(c[f].reason.split(" is not")[0] for c in lr.operands.values()
                                     if c[f].status == "n/a")
                if dims:
                    bs = block_size(f, 0)
                    verb = "is not a multiple" if len(dims) == 1 else "are not multiples"
                    out.append((lr.name, f, f"{', '.join(dims)} {verb} of {bs}"))
        return out

    def format_totals(self) -> dict[str, dict[str, Any]]:
        """Per format, over every layer and operand: clamped / underflow / subnormal fractions and the worst."""
        out = {}
        for f in self.config.formats:
            cells = [(lr.name, t, g, cells[f]) for lr in self.layers for (t, g), cells in lr.operands.items()
                     if cells[f].status in ("ok", "exact", "zero")]
            nz, blocks = sum(c.elements for *_, c in cells), sum(c.blocks for *_, c in cells)
            worst = max(cells, key=lambda x: x[3].underflow, default=None)
            out[f] = {"scale_clamped": sum(c.scale_clamped * c.blocks for *_, c in cells) / blocks if blocks else 0.0,
                      "underflow": sum(c.underflow * c.elements for *_, c in cells) / nz if nz else 0.0,
                      "subnormal": sum(c.subnormal * c.elements for *_, c in cells) / nz if nz else 0.0,
                      "most_underflow": None if worst is None else
                      {"layer": display_path(worst[0]), "tensor": worst[1], "gemm": worst[2],
                       "underflow": worst[3].underflow},
                      "most_clamped": _most_clamped(cells)}
        return out

    def to_dict(self) -> dict[str, Any]:
        med = self.medians()
        return {"steps": self.steps, "formats": list(self.config.formats), "max_elements": self.config.max_elements,
                "flag_db": self.config.flag_db, "scale_rules": "each format's default: MX FLOOR, rowwise and 1x128 "
                "power-of-two, nvfp4 nearest e4m3 block scale times an fp32 tensor scale; fp8_e4m3/fp8_e5m2 are "
                "per-tensor as fp8-mixed",
                "axes": {f"{t}/{g}": AXIS[(t, g)] for t, g in OPERANDS},
                "layers": [lr.to_dict() for lr in self.layers],
                "tensors": {display_path(lr.name): {f: {t: lr.tensor_cell(t, f).to_dict()
                                                                    for t in ("x", "w", "dy")}
                                                                for f in self.config.formats}
                            for lr in self.layers},
                "median_sqnr_db": med,
                "flagged": [{**d, "layer": display_path(d["layer"])} for d in self.flagged()],
                "not_applicable": [{"layer": display_path(n), "format": f, "reason": r}
                                   for n, f, r in self.not_applicable()],
                "totals": self.format_totals()}


def _most_clamped(cells: list) -> dict[str, Any] | None:
    hit = [x for x in cells if x[3].scale_clamped]
    if not hit:
        return None
    name, t, g, c = max(hit, key=lambda x: x[3].scale_clamped)
    return {"layer": display_path(name), "tensor": t, "gemm": g, "scale_clamped": c.scale_clamped}


# ------------------------------------------------------------------------------------------------------
# the probe
# ------------------------------------------------------------------------------------------------------

def _weight_getter(m: nn.Module):
    """A function returning ``m``'s weight as ``(out, in)`` when ``m`` is a linear layer, else None.

    It reads the weight at call time, so under ``functional_call`` it sees the substituted fp32 copy."""
    if isinstance(m, Fp8AdaptedLinear):
        return lambda: m.adapter.weight_as_linear(m.weight)
    adapter = _adapter_for(m)
    if adapter is not None:
        return lambda: adapter.weight_as_linear(m.weight)
    w = getattr(m, "weight", None)
    shape = (getattr(m, "out_features", None), getattr(m, "in_features", None))
    if isinstance(w, torch.Tensor) and w.dim() == 2 and tuple(w.shape) == shape:
        return lambda: m.weight
    return None


def linear_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every linear layer of ``model`` (see the module docstring), by qualified name."""
    return [(n, m) for n, m in model.named_modules() if _weight_getter(m) is not None]


class _Layer:
    def __init__(self, name: str, m: nn.Module) -> None:
        self.name, self.module, self.weight = name, m, _weight_getter(m)
        self.out_features, self.in_features = self.weight().shape
        self.acc: dict[tuple[str, str, str], torch.Tensor] = {}
        self.na: dict[tuple[str, str, str], str] = {}
        self.tokens: tuple[int, int] | None = None


class BlockFormatProbe:
    """Hooks on a model's linear layers that measure :class:`BlockFormatProfile` during the fp32 pass.

    ``with probe.watching(): ...`` around the doctor's fp32 pass measures it (the first ``config.steps``
    times); ``result()`` reads the totals back. With ``config=None`` it does nothing and returns None.
    """

    def __init__(self, model: nn.Module, config: BlockFormatConfig | None = BlockFormatConfig()) -> None:
        self.config = config
        self.steps = 0
        self._layers = [_Layer(n, m) for n, m in linear_layers(model)] if config is not None else []

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        if self.config is None or self.steps >= self.config.steps or not self._layers:
            yield
            return
        handles = [lay.module.register_forward_hook(self._forward_hook(lay)) for lay in self._layers]
        try:
            yield
        finally:
            for h in handles:
                h.remove()
        self.steps += 1

    def _forward_hook(self, lay: _Layer):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            x = args[0] if args else None
            if not (isinstance(x, torch.Tensor) and x.is_floating_point() and x.shape[-1:] == (lay.in_features,)):
                return
            x2 = x.detach().reshape(-1, lay.in_features)
            n = x2.shape[0]
            lay.tokens = (n, n) if lay.tokens is None else (min(lay.tokens[0], n), max(lay.tokens[1], n))
            w = lay.weight().detach()
            self._measure(lay, "x", "forward", x2)
            self._measure(lay, "w", "forward", w)
            self._measure(lay, "w", "grad_input", w.t())
            self._measure(lay, "x", "grad_weight", x2.t())
            if isinstance(output, torch.Tensor) and output.requires_grad and output.shape[-1:] == (lay.out_features,):
                output.register_hook(lambda g: self._grad_hook(lay, g))
        return hook

    def _grad_hook(self, lay: _Layer, g: torch.Tensor) -> None:
        g2 = g.detach().reshape(-1, lay.out_features)
        self._measure(lay, "dy", "grad_input", g2)
        self._measure(lay, "dy", "grad_weight", g2.t())

    def _measure(self, lay: _Layer, tensor: str, gemm: str, m: torch.Tensor) -> None:
        k, rows, n = m.shape[-1], None, 0
        for f in self.config.formats:
            key = (tensor, gemm, f)
            bs = block_size(f, k)
            if k % bs:
                axis = AXIS[(tensor, gemm)]
                lay.na.setdefault(key, f"{axis} {k} is not a multiple of {bs}")
                continue
            if rows is None:
                rows, n = sample_rows(m.detach().float(), self.config.max_elements)
            s = _stats(rows, n, f)
            lay.acc[key] = s if key not in lay.acc else lay.acc[key] + s

    def result(self) -> BlockFormatProfile | None:
        """The totals so far (one host copy of every accumulator); None when off."""
        if self.config is None:
            return None
        keys = [(lay, key) for lay in self._layers for key in lay.acc]
        host = torch.stack([lay.acc[key].cpu() for lay, key in keys]).tolist() if keys else []
        values = {(id(lay), key): v for (lay, key), v in zip(keys, host)}
        layers = [self._layer_result(lay, values) for lay in self._layers if lay.tokens is not None]
        return BlockFormatProfile(config=self.config, steps=self.steps, layers=layers)

    def _layer_result(self, lay: _Layer, values: dict) -> LayerBlockStats:
        ops: dict[tuple[str, str], dict[str, Cell]] = {}
        for t, g in OPERANDS:
            for f in self.config.formats:
                key = (t, g, f)
                if (id(lay), key) in values:
                    cell = Cell.from_stats(values[(id(lay), key)])
                elif key in lay.na:
                    cell = Cell(status="n/a", reason=lay.na[key])
                else:
                    cell = Cell(status="not observed", reason="no gradient reached this layer's output")
                ops.setdefault((t, g), {})[f] = cell
        return LayerBlockStats(name=lay.name, kind=type(lay.module).__name__, in_features=lay.in_features,
                               out_features=lay.out_features, tokens=lay.tokens, operands=ops)

