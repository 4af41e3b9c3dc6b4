"""``mixprec tune``: each linear layer in the cheapest format that pays on a target GPU and keeps the loss.

Two measurements per layer and candidate format, put together:

- **pays**: the planner's time for the layer's forward and backward (its three GEMMs and the casts of their
  operands) on the target, one linear layer of the model's shape traced alone under fake tensors, against the same
  layer in bf16 (``pays = t_bf16 / t_format``). The layer's share of a real step is what it saves there.
- **safe**: the probes' what-if measurement (:mod:`mixprec.probes.block_formats`) of the layer's six GEMM operands
  on real batches: the operands quantised in the format, against their fp32 values. A format is safe for a layer
  when every operand's SQNR per dot product is within :data:`SQNR_MARGIN_DB` of the format's ideal (round to
  nearest of its element's mantissa) and at most :data:`MAX_UNDERFLOW` of its non-zero elements flush to zero.

Each layer takes the fastest candidate that is safe and pays (by more than :data:`MIN_GAIN`); else bf16. bf16
itself is not measured (its exponent range is fp32's); fp32 is chosen only where bf16 is not a candidate.
What it cannot see: layers are tuned one at a time (an error one layer lets through may grow in the next), on a few
batches of the run's data at its start (outliers that appear later in training are not seen).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from ..errors import UsageError
from ..precision import resolve_recipe
from ..probes.block_formats import BlockFormatConfig, BlockFormatProbe, LayerBlockStats
from ..probes.ranges import RangeProfiler

__all__ = ["tune", "Tuning", "LayerChoice", "TuneError", "SQNR_MARGIN_DB", "MAX_UNDERFLOW", "MIN_GAIN",
           "default_candidates", "ideal_sqnr_db"]

SQNR_MARGIN_DB = 6.0
"""How far (dB) below its format's ideal SQNR an operand may be and still be safe."""
MAX_UNDERFLOW = 0.01
"""The largest fraction of an operand's non-zero elements that may flush to zero."""
MIN_GAIN = 1.05
"""A low-precision format must make the layer at least this much faster than bf16 to be chosen."""

_OPERAND_FORMATS: dict[str, dict[str, str]] = {
    "fp8-mixed": {"x": "fp8_e4m3", "w": "fp8_e4m3", "dy": "fp8_e5m2"},
    "fp8-rowwise": {"x": "fp8_e4m3_rowwise", "w": "fp8_e4m3_rowwise", "dy": "fp8_e4m3_rowwise"},
    "mxfp8": {"x": "mxfp8_e4m3", "w": "mxfp8_e4m3", "dy": "mxfp8_e4m3"},
    "mxfp4": {"x": "mxfp4", "w": "mxfp4", "dy": "mxfp4"},
    "nvfp4": {"x": "nvfp4", "w": "nvfp4", "dy": "nvfp4"},
}
"""The what-if format (:data:`mixprec.probes.block_formats.WHAT_IF_FORMATS`) each recipe quantises x, W, dy in."""
_MANTISSA = {"fp8_e4m3": 3, "fp8_e5m2": 2, "fp8_e4m3_rowwise": 3, "mxfp8_e4m3": 3, "mxfp4": 1, "nvfp4": 1}
_HIGH = ("bf16-mixed", "fp32")


class TuneError(UsageError):
    """A tune request that cannot work (an unknown candidate, a target without the units)."""


def ideal_sqnr_db(fmt: str) -> float:
    """SQNR of round-to-nearest onto ``m`` mantissa bits over uniformly spread mantissas: 6.02 (m + 1) + 4.77 dB."""
    return 6.02 * (_MANTISSA[fmt] + 1) + 4.77


def default_candidates(target) -> tuple[str, ...]:
    """The FP8/FP4 recipes the target has units for, bf16-mixed and fp32."""
    low = (("fp8-mixed",) if target.fp8_matmul else ()) + (("fp8-rowwise",) if target.rowwise_fp8 else ()) \
        + (("mxfp8", "mxfp4", "nvfp4") if target.mx_matmul else ())
    return low + _HIGH


@dataclasses.dataclass(frozen=True)
class LayerChoice:
    """One layer's decision and the figures behind it."""

    name: str
    shape: tuple[int, int]
    """(out_features, in_features)."""
    tokens: int
    format: str
    """``fp32``, ``bf16`` or a low-precision recipe name."""
    reason: str
    pays: dict[str, float]
    """Candidate -> t_bf16 / t_candidate on the target."""
    sqnr_db: dict[str, float | None]
    """Candidate -> the worst operand's SQNR per dot product (None: not measured or not applicable)."""
    unsafe: dict[str, str]
    """Candidate -> why it is not safe (absent when it is)."""


@dataclasses.dataclass(frozen=True)
class Tuning:
    """What :func:`tune` decided: one :class:`LayerChoice` per linear layer, and where it wrote the file."""

    target: str
    candidates: tuple[str, ...]
    layers: tuple[LayerChoice, ...]
    path: str | None
    thresholds: dict[str, Any]

    def formats(self) -> dict[str, str]:
        return {c.name: c.format for c in self.layers}

    def table(self) -> str:
        low = [c for c in self.candidates if c not in _HIGH]
        head = ["layer", "out x in", "tokens"] + [f"{c}: pays / SQNR" for c in low] + ["chosen", "why"]
        rows = []
        for c in self.layers:
            cells = []
            for f in low:
                s = c.sqnr_db.get(f)
                sq = "n/a" if s is None else ("exact" if math.isinf(s) else f"{s:.1f} dB")
                cells.append(f"{c.pays[f]:.2f}x / {sq}" + (" (unsafe)" if f in c.unsafe else "")
                             if f in c.pays else "n/a")
            rows.append([c.name, f"{c.shape[0]} x {c.shape[1]}", str(c.tokens), *cells, c.format, c.reason])
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)


def _check_candidates(candidates: Iterable[str]) -> tuple[str, ...]:
    out = []
    for c in candidates:
        try:
            name = resolve_recipe(c).name
        except UsageError:
            raise TuneError(f"--candidates {c}: unknown recipe; choose among fp32, bf16-mixed and "
                            f"{', '.join(_OPERAND_FORMATS)}") from None
        if name not in _OPERAND_FORMATS and name not in _HIGH:
            raise TuneError(f"--candidates {c}: a layer can run fp32, bf16-mixed or an FP8/FP4 recipe "
                            f"({', '.join(_OPERAND_FORMATS)}), not {name}")
        if name not in out:
            out.append(name)
    if not out:
        raise TuneError("--candidates: name at least one recipe, e.g. fp8-mixed,bf16-mixed")
    return tuple(out)


def _no_update(params) -> torch.optim.Optimizer:
    """The one-layer plans' optimizer: one scalar, so the layer's forward and backward are the step."""
    return torch.optim.SGD([torch.zeros((), requires_grad=True)], lr=0.0)


def _layer_times(shapes: Iterable[tuple[int, int, int]], candidates: Sequence[str], target, *,
                 compile_fp8: bool) -> dict[tuple[int, int, int], dict[str, float]]:
    """``(out, in, tokens) -> candidate -> seconds`` of one linear layer's forward and backward on the target."""
    from ..planning.api import Planner
    from ..train.config import TrainConfig

    times: dict[tuple[int, int, int], dict[str, float]] = {}
    for n, k, m in shapes:
        batch = (torch.zeros(m, k), torch.zeros(m, n))

        def make(n=n, k=k) -> nn.Module:
            return nn.Sequential(nn.Linear(k, n))

        config = TrainConfig.from_flags(model="mlp", dataset="synthetic", fp8_layers="all", fp8_impl="scratch",
                                        compile="on" if compile_fp8 else "off")
        planner = Planner(config=config, target=target, model=make, batch=batch,
                          loss_fn=lambda out, y: (out.float() - y).square().mean(), make_optimizer=_no_update)
        times[(n, k, m)] = {}
        for c in candidates:
            tr, notes, tf32 = planner.trace(c)
            times[(n, k, m)][c] = planner.recipe_plan(tr, tf32=tf32, notes=notes).step_time_s
    return times


def _fits(layer: LayerBlockStats, candidate: str) -> str | None:
    """Why ``candidate`` cannot run the layer (its GEMMs' dimension multiples), or None."""
    from ..lowp.fp8 import GEMM_MULTIPLE
    from ..lowp.recipes import linear_recipe

    spec = resolve_recipe(candidate)
    multiple = GEMM_MULTIPLE if spec.fp8 == "tensorwise" else linear_recipe(spec.fp8).multiple
    if layer.in_features % multiple or layer.out_features % multiple:
        return f"{layer.out_features} x {layer.in_features} is not a multiple of {multiple}"
    return None


def _safety(layer: LayerBlockStats, candidate: str) -> tuple[float | None, str | None]:
    """(worst SQNR per dot product over the layer's operands, why unsafe or None)."""
    misfit = _fits(layer, candidate)
    if misfit:
        return None, misfit
    worst, why = math.inf, None
    for (tensor, gemm), cells in layer.operands.items():
        fmt = _OPERAND_FORMATS[candidate][tensor]
        cell = cells.get(fmt)
        if cell is None or cell.status == "not observed":
            return None, f"{tensor} of {gemm} not observed"
        if cell.status == "n/a":
            return None, f"{tensor} of {gemm} does not fit {fmt}'s blocks"
        if cell.status in ("zero", "exact"):
            continue
        floor = ideal_sqnr_db(fmt) - SQNR_MARGIN_DB
        if cell.sqnr_db is not None and cell.sqnr_db < worst:
            worst = cell.sqnr_db
        if why is None and cell.sqnr_db is not None and cell.sqnr_db < floor:
            why = f"{tensor} of {gemm}: SQNR {cell.sqnr_db:.1f} dB < {floor:.1f}"
        if why is None and (cell.underflow or 0) > MAX_UNDERFLOW:
            why = f"{tensor} of {gemm}: {100 * cell.underflow:.1f}% of values flush to zero in {fmt}"
        if why is None and cell.nonfinite:
            why = f"{tensor} of {gemm}: {cell.nonfinite} values overflow {fmt}"
    return worst, why


def _choose(layer: LayerBlockStats, tokens: int, times: dict[str, float], candidates: Sequence[str],
            target_name: str, min_gain: float = MIN_GAIN) -> LayerChoice:
    base = "bf16-mixed" if "bf16-mixed" in candidates else "fp32"
    high = "bf16" if base == "bf16-mixed" else "fp32"
    pays = {c: times[base] / times[c] for c in candidates if c in _OPERAND_FORMATS and not _fits(layer, c)}
    sqnr, unsafe = {}, {}
    for c in pays:
        sqnr[c], why = _safety(layer, c)
        if why:
            unsafe[c] = why
    ok = sorted((c for c in pays if c not in unsafe and pays[c] >= min_gain), key=lambda c: times[c])
    shape = (layer.out_features, layer.in_features)
    if ok:
        c = ok[0]
        s = sqnr[c]
        speed = (f"pays {pays[c]:.2f}x on {target_name}" if pays[c] >= MIN_GAIN else
                 f"{pays[c]:.2f}x bf16's speed on {target_name}, chosen for --min-gain {min_gain:g}")
        reason = f"{c}: {speed}, " + ("exact" if s is None or math.isinf(s) else f"SQNR {s:.1f} dB")
        return LayerChoice(layer.name, shape, tokens, c, reason, pays, sqnr, unsafe)
    if not pays:
        misfits = [f"{c} ({_fits(layer, c)})" for c in candidates if c in _OPERAND_FORMATS]
        reason = f"{high}: " + ("; ".join(misfits) if misfits else "no low-precision candidate")
    elif all(c in unsafe for c in pays):
        reason = f"{high}: " + "; ".join(f"{c} unsafe ({unsafe[c]})" for c in pays)
    else:
        best = max((c for c in pays if c not in unsafe), key=lambda c: pays[c])
        reason = (f"{high}: {best} would not pay on {target_name} ({pays[best]:.2f}x at "
                  f"{shape[0]} x {shape[1]}, {tokens} tokens)")
    return LayerChoice(layer.name, shape, tokens, high, reason, pays, sqnr, unsafe)


def _whole_step(config, assignment: dict[str, str], *, base: str, target, model: nn.Module, folder: str) -> float:
    """The planner's step time of the whole model with ``assignment`` (layer -> format), as the run would go."""
    import os

    from ..lowp.layer_formats import save
    from ..planning.api import Planner

    path = os.path.join(folder, f"candidate-{len(os.listdir(folder))}.json")
    save(path, assignment, model=model, model_name=config.model.name, target=target.name)
    planner = Planner(config=config.with_flags(layer_formats=path, precision=base), target=target)
    tr, notes, tf32 = planner.trace(base + "+layers")
    return planner.recipe_plan(tr, tf32=tf32, notes=notes).step_time_s


def _refine(choices: list[LayerChoice], options: dict[str, list[str]], step: Callable[[dict[str, str]], float],
            starts: Iterable[dict[str, str]], say: Callable[[str], None]) -> tuple[dict[str, str], float]:
    """Per-layer choices priced alone do not add up exactly (a compiled step fuses across layers): start from the
    fastest of ``starts`` (the per-layer choices, each uniform candidate on the layers it is safe for) and move one
    group of same-shaped layers at a time to another safe option while the whole step gets faster."""
    best, best_t = None, math.inf
    for a in starts:
        t = step(a)
        if t < best_t:
            best, best_t = dict(a), t
    groups: dict[tuple, list[str]] = {}
    for c in choices:
        groups.setdefault((c.shape, c.tokens, tuple(options[c.name])), []).append(c.name)
    for (_, _, opts), names in groups.items():
        for o in opts:
            if all(best[n] == o for n in names):
                continue
            trial = {**best, **{n: o for n in names}}
            t = step(trial)
            if t < best_t:
                best, best_t = trial, t
    say(f"tune: whole-step plan {best_t * 1e3:.3f} ms")
    return best, best_t


def _whole_model(choices: list[LayerChoice], low: Sequence[str], base: str, target, model: nn.Module, config,
                 plan_batch_size: int | None, say: Callable[[str], None]) -> list[LayerChoice]:
    """:func:`_refine` on the whole model's plan; layers it moved say so in their reason."""
    import tempfile

    high = "bf16" if base == "bf16-mixed" else "fp32"
    options = {c.name: [f for f in low if f in c.pays and f not in c.unsafe] + [high] for c in choices}
    starts = [{c.name: c.format for c in choices}]
    starts += [{c.name: (f if f in options[c.name] else high) for c in choices} for f in low]
    plan_config = config.with_flags(batch_size=plan_batch_size or config.optim.batch_size, compile="auto")
    with tempfile.TemporaryDirectory() as folder:
        def step(a: dict[str, str]) -> float:
            return _whole_step(plan_config, a, base=base, target=target, model=model, folder=folder)

        alone = step(starts[0])
        best, best_t = _refine(choices, options, step, starts, say)
    out = []
    for c in choices:
        if best[c.name] != c.format:
            c = dataclasses.replace(c, format=best[c.name], reason=(
                f"{best[c.name]}: the whole step plans faster so ({best_t * 1e3:.3f} ms against "
                f"{alone * 1e3:.3f} ms with each layer's own choice); alone: {c.reason}"))
        out.append(c)
    return out


def _measure(run, whatif: Sequence[str], steps: int, say: Callable[[str], None]) -> list[LayerBlockStats]:
    """Every linear layer's GEMM operands in each ``whatif`` format on ``steps`` of the run's batches (trained as
    the run's recipe between them); without formats, the layers' shapes only."""
    from ..probes.block_formats import linear_layers
    from ..train.contract import as_batch
    from ..train.step import train_step

    if not whatif:
        return [LayerBlockStats(n, type(m).__name__, m.in_features, m.out_features, None, {})
                for n, m in linear_layers(run.model)]
    probe = BlockFormatProbe(run.model, BlockFormatConfig(formats=whatif, steps=steps))
    profiler = RangeProfiler(run.model, ())
    run.model.train()
    with run.recipe.run_context():
        loader = iter(run.train_loader)
        for step in range(steps):
            raw = next(loader, None)
            if raw is None:  # fewer batches than steps: the next pass
                loader = iter(run.train_loader)
                raw = next(loader)
            batch = as_batch(raw).to(run.device)
            with probe.watching():
                profiler.observe(run.objective, batch)
            train_step(run.ctx, batch, step=step)
            say(f"tune: measured batch {step + 1}/{steps}")
    return probe.result().layers


def _check_settings(steps: int, plan_batch_size: int | None, min_gain: float) -> None:
    if steps < 1:
        raise TuneError(f"--steps must be >= 1, got {steps}")
    if plan_batch_size is not None and plan_batch_size < 1:
        raise TuneError(f"--plan-batch-size must be >= 1, got {plan_batch_size}")
    if not min_gain >= 0:
        raise TuneError(f"--min-gain must be >= 0, got {min_gain}")


def tune(config=None, *, target: str = "h100-sxm", candidates: Sequence[str] | str | None = None, steps: int = 4,
         min_gain: float = MIN_GAIN, plan_batch_size: int | None = None, out: str | None = None,
         log: Callable[[str], None] | None = None, **flags: Any) -> Tuning:
    """Choose each linear layer's format for ``target`` (module docstring); writes ``out`` (a layer-formats
    file, :mod:`mixprec.lowp.layer_formats`) when given.

    Args:
        config: a :class:`~mixprec.train.config.TrainConfig`; else one from ``flags`` (train's flag names).
        candidates: recipe names (or one comma-separated string); default :func:`default_candidates`.
        steps: batches of the run's data the safety measurement sees (training as the base recipe between them).
        min_gain: how much faster than bf16 a format must make a layer (0: the fastest safe format, paying or not:
            a study of the numerics alone).
        plan_batch_size: the batch the target will train on, where it differs from the one measured here (the
            layers are priced at its tokens; default the run's batch size).
    """
    from ..planning.targets import get_target
    from ..train.build import build_run
    from ..train.config import TrainConfig

    _check_settings(steps, plan_batch_size, min_gain)
    tgt = get_target(target)
    if isinstance(candidates, str):
        candidates = [c for c in candidates.split(",") if c.strip()]
    cands = _check_candidates(candidates or default_candidates(tgt))
    low = [c for c in cands if c in _OPERAND_FORMATS]
    config = config if config is not None else TrainConfig.from_flags(**flags)
    if config.recipe.layer_formats is not None:
        raise TuneError(f"--layer-formats {config.recipe.layer_formats}: tune writes a layer-formats file (--out), it "
                        "does not read one; drop --layer-formats")
    base = "bf16-mixed" if "bf16-mixed" in cands else "fp32"
    config = config.with_flags(precision=base, out=None, metrics_json=None, resume=None, watch=None,
                               max_steps=None, layer_formats=None)
    say = log or (lambda line: None)
    run = build_run(config)
    whatif = sorted({_OPERAND_FORMATS[c][t] for c in low for t in ("x", "w", "dy")})
    layers = _measure(run, whatif, steps, say)
    scale = (plan_batch_size or config.optim.batch_size) / config.optim.batch_size
    tokens = {lay.name: round((lay.tokens[1] if lay.tokens else config.optim.batch_size) * scale) for lay in layers}
    shapes = {(lay.out_features, lay.in_features, tokens[lay.name]) for lay in layers}
    say(f"tune: pricing {len(shapes)} layer shape(s) x {len(cands)} candidate(s) on {tgt.name}")
    compile_fp8 = bool(low) and tgt.kind == "cuda" and tgt.fp8_matmul  # --compile auto there
    times = _layer_times(sorted(shapes), cands, tgt, compile_fp8=compile_fp8)
    choices = [_choose(lay, tokens[lay.name], times[(lay.out_features, lay.in_features, tokens[lay.name])],
                       cands, tgt.name, min_gain) for lay in layers]
    if low and min_gain > 0 and choices:
        choices = _whole_model(choices, low, base, tgt, run.model, config, plan_batch_size, say)
    thresholds = {"sqnr_margin_db": SQNR_MARGIN_DB, "max_underflow": MAX_UNDERFLOW, "min_gain": min_gain,
                  "ideal_sqnr_db": {f: round(ideal_sqnr_db(f), 2) for f in whatif}, "steps": steps,
                  "compiled": compile_fp8}
    result = Tuning(target=tgt.name, candidates=cands, layers=tuple(choices), path=out, thresholds=thresholds)
    if out is not None:
        from ..lowp.layer_formats import save

        save(out, {c.name: (c.format, c.reason) for c in choices}, model=run.model, model_name=config.model.name,
             target=tgt.name, thresholds=thresholds)
    return result

