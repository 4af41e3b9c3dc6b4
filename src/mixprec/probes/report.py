"""The findings of the probes, and the text both reports show of them.

:class:`Findings` holds every probe's result: ``to_dict()`` gives the keys doctor.json and watch.json share,
the ``render_*`` methods the numbered sections of report.txt, :meth:`Findings.recommendations` the advice
(:mod:`.advice`). :class:`mixprec.doctor.DoctorReport` is one; the watch's report holds one.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from .advice import recommend
from .attribution import display_path
from .block_formats import SHORT, BlockFormatProfile
from .lost_updates import LostUpdates
from .precision_map import PrecisionMap
from .ranges import GradientLoss, RangeProfile
from .replay import FaultAnalysis
from .scale_history import ScaleHistory

__all__ = ["Findings", "text_table"]


def _log2(x: float) -> int:
    return int(round(math.log2(x))) if x > 0 else 0


def _pct(x: float | None) -> str:
    if x is None:
        return "-"
    if x == 0:
        return "0"
    if x < 0.0001:
        return "<0.01%"
    return f"{100 * x:.2f}%" if x < 0.1 else f"{100 * x:.1f}%"


def _binades(r) -> str:
    return "-" if not r else f"{r[0]}..{r[1]}"


def text_table(headers: list[str], rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]
    out = [indent + "  ".join(str(h).ljust(w) for h, w in zip(headers, widths)).rstrip()]
    for r in rows:
        out.append(indent + "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())
    return out


@dataclasses.dataclass
class Findings:
    """Every probe's result over the observed steps."""

    title: dict[str, Any]
    recipe_spec: dict[str, Any]
    precision_map: PrecisionMap | None
    ranges: RangeProfile
    loss_scale: float
    """The loss scale after the last step (1 without loss scaling)."""
    gradient_loss: GradientLoss
    faults: list[FaultAnalysis]
    """The first non-finite steps, classified."""
    lost_updates: LostUpdates
    history: ScaleHistory
    block_formats: BlockFormatProfile | None = None
    """The block-format what-if section (None: not measured)."""
    loop: str = "mixprec"
    """Whose terms the advice is in (:data:`~.advice.LOOPS`): ``mixprec`` (mixprec train's flags), ``torch`` (the
    user's own loop), ``transformers`` or ``lightning`` (their Trainer)."""
    json_name: str = "doctor.json"
    """The JSON file the text report points to for what it leaves out."""

    # -- derived facts --------------------------------------------------------------------------------
    @property
    def low_format(self) -> str | None:
        c = self.recipe_spec["compute"]
        return c if c in ("fp16", "bf16") else None

    @property
    def log2_scale(self) -> int:
        return _log2(self.loss_scale)

    def recommended_log2_scale(self) -> int | None:
        """Exponent of the loss scale that minimises fp16 gradient overflow + underflow (:mod:`.ranges`)."""
        return self.ranges.all_gradients().best_scale("fp16")

    def gradient_fractions(self, fmt: str = "fp16", log2_scale: int | None = None) -> dict[str, float]:
        k = self.log2_scale if log2_scale is None else log2_scale
        return self.ranges.all_gradients().fractions(fmt, k)

    def first_fault(self) -> FaultAnalysis | None:
        return next((f for f in self.faults if f.is_fault), None)

    def recommendations(self) -> list[dict[str, str]]:
        return recommend(self)

    # -- output ---------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        k_rec = self.recommended_log2_scale()
        return {
            "title": self.title,
            "recipe": self.recipe_spec,
            "precision_map": None if self.precision_map is None else self.precision_map.to_dict(),
            "ranges": {
                **self.ranges.to_dict(self.log2_scale),
                "loss_scale": self.loss_scale,
                "recommended_loss_scale": None if k_rec is None else 2.0**k_rec,
                "gradients_at_current_scale": {f: self.gradient_fractions(f) for f in self.ranges.formats},
                "gradients_without_loss_scaling": {f: self.gradient_fractions(f, 0) for f in self.ranges.formats},
                "gradients_at_recommended_scale": None if k_rec is None else {
                    f: self.gradient_fractions(f, k_rec) for f in self.ranges.formats},
                "observed_gradient_underflow": self.gradient_loss.to_dict(),
            },
            "nonfinite": {
                "first": self.faults[0].to_dict() if self.faults else None,
                "first_fault": None if self.first_fault() is None else self.first_fault().to_dict(),
                "analyzed": [f.to_dict() for f in self.faults],
            },
            "lost_updates": self.lost_updates.to_dict(),
            "loss_scale_history": self.history.to_dict(),
            "block_formats": None if self.block_formats is None else self.block_formats.to_dict(),
            "recommendations": self.recommendations(),
        }

    def render_map(self) -> list[str]:
        lines = ["1. Precision map (step 0, observed at the dispatcher: forward, backward, optimizer step)"]
        pm = self.precision_map
        if pm is None:
            return lines + ["  (not recorded)"]
        sm = pm.summary()
        low = sm["low_dtype"]
        em = f" emulated: fp32 arithmetic on operands and results rounded to {low}" if sm["emulated"] else ""
        lines.append(f"  FLOPs in low precision ({low}): {_pct(sm['low_flop_share'])} of "
                     f"{sm['total_flops'] / 1e6:.2f} MFLOP (forward + backward){';' + em if em else ''}")
        if sm["uncounted"]:
            lines.append(f"  FLOPs unknown (left out of the share) for: {', '.join(sm['uncounted'])}")
        ops = sm["ops"]
        lines.append(f"  ops: {ops.get('forward', 0)} forward, {ops.get('backward', 0)} backward, "
                     f"{ops.get('step', 0)} optimizer step; {sm['casts']} dtype casts wrote "
                     f"{sm['cast_bytes'] / 2**20:.2f} MiB")
        kept = ", ".join(f"{k} x{v}" for k, v in sorted(sm["kept_fp32"].items()))
        lines.append(f"  kept in fp32 (forward arithmetic): {kept or 'nothing'}")
        casts: dict[str, list[int]] = {}
        for r in pm.rows:
            if r.cast_bytes and r.phase != "step":
                c = casts.setdefault(f"{r.inputs}->{r.outputs}", [0, 0])
                c[0] += r.count
                c[1] += r.cast_bytes
        if casts:
            lines.append("  casts: " + ", ".join(f"{k} x{n} ({b / 2**20:.2f} MiB)" for k, (n, b) in casts.items()))
        rows = [r for r in pm.rows if r.phase != "step" and r.flops]
        shown = rows[:40]
        lines += text_table(
            ["phase", "module", "op", "inputs -> outputs", "compute", "count", "MFLOP"],
            [[r.phase, display_path(r.module), r.op, f"{r.inputs} -> {r.outputs}", r.compute, str(r.count),
              f"{r.flops / 1e6:.2f}"] for r in shown])
        if len(rows) > len(shown):
            lines.append(f"  ... {len(rows) - len(shown)} more rows with FLOPs in doctor.json")
        lines.append(f"  (all {len(pm.rows)} (phase, module, op, dtypes) rows, casts and optimizer ops included, "
                     "in doctor.json)")
        return lines

    @staticmethod
    def _fractions_text(f: dict[str, float]) -> str:
        return f"underflow {_pct(f['underflow'])}, subnormal {_pct(f['subnormal'])}, overflow {_pct(f['overflow'])}"

    def render_ranges(self, source: str | None = None) -> list[str]:
        """``source``: what the histograms were taken from (default: the doctor's fp32 pass)."""
        rp = self.ranges
        k = self.log2_scale
        source = source or f"fp32 reference pass on each of {rp.steps} steps"
        lines = [f"2. Range profile ({source}; binade e holds |x| in [2^e, 2^(e+1)); fp16 fits e <= 15, normal "
                 "from e = -14, zero below e = -26)"]
        rows = []
        for r in rp.layer_rows(k):
            a16 = r["activations"].get("fp16", {})
            g16 = r["gradients"].get("fp16", {})
            e4 = r["activations"].get("fp8_e4m3", {})
            e5 = r["gradients"].get("fp8_e5m2", {})
            rows.append([display_path(r["layer"]), r["type"], _binades(r["activation_binades"]),
                         _pct(a16.get("overflow")), _pct(e4.get("overflow")), _binades(r["gradient_binades"]),
                         _pct(g16.get("underflow")), _pct(g16.get("subnormal")), _pct(g16.get("overflow")),
                         _pct(e5.get("underflow"))])
        lines += text_table(["layer", "type", "act binades", "act>fp16", "act>e4m3", "grad binades",
                         f"fp16 zero@2^{k}", "subnormal", "overflow", f"e5m2 zero@2^{k}"], rows)
        now = self.gradient_fractions("fp16")
        lines.append(f"  all gradients at the current loss scale 2^{k} = {self.loss_scale:g}: fp16 "
                     + self._fractions_text(now))
        if k != 0:
            unscaled = self.gradient_fractions("fp16", 0)
            lines.append("  without loss scaling (2^0): fp16 " + self._fractions_text(unscaled))
        k_rec = self.recommended_log2_scale()
        if k_rec is not None:
            rec = self.gradient_fractions("fp16", k_rec)
            what = ("recommended loss scale for fp16" if self.low_format == "fp16"
                    else "if it ran in fp16, the loss scale to use")
            lines.append(f"  {what}: 2^{k_rec} = {2.0**k_rec:g}: " + self._fractions_text(rec))
        gl = self.gradient_loss
        if gl.steps:
            lines.append(f"  observed: {_pct(gl.fraction)} of parameter-gradient elements that are non-zero in fp32 "
                         f"were exactly zero after the recipe's backward ({gl.lost:,} of {gl.nonzero:,} over "
                         f"{gl.steps} steps; underflow, or rounding that flips a ReLU or cancels a sum)")
        return lines

    def render_nonfinite(self) -> list[str]:
        lines = ["3. First non-finite"]
        if not self.faults:
            lines.append(f"  none: every op of forward, backward and optimizer step was finite in all "
                         f"{len(self.history.records)} steps")
            return lines
        first = self.faults[0]
        lines.append(f"  {first.describe()}")
        for i in (first.event.inputs if first.event else []):
            lines.append(f"    input {i.short()}")
        fault = self.first_fault()
        if fault is None:
            lines.append("  no fault: every non-finite step was a loss-scale overflow that a smaller scale avoids "
                         "(the dynamic scaler skips the step and backs off)")
            return lines
        if fault is not first:
            lines.append(f"  first fault: {fault.describe()}")
            for i in (fault.event.inputs if fault.event else []):
                lines.append(f"    input {i.short()}")
        if fault.replay is not None:
            rr = fault.replay
            lines.append(f"  fp32 replay ({len(rr.trials)} replays): {rr.note}")
            for tr in rr.trials:
                fp32 = ", ".join(tr["fp32"]) or "nothing"
                lines.append(f"    fp32 = {{{fp32}}}: {tr['first_nonfinite'] or 'finite'}")
        return lines

    def render_lost(self) -> list[str]:
        lu = self.lost_updates
        if not lu.layers:
            return ["4. Lost updates (non-zero updates with low(w + d) == w)",
                    "  nothing to measure: no optimizer step was applied (every step was skipped or stopped)"]
        dtypes = sorted({layer.dtype for layer in lu.layers})
        lines = [f"4. Lost updates (non-zero updates with low(w + d) == w; the optimizer steps "
                 f"{'/'.join(dtypes)} tensors; {lu.steps} steps applied)"]
        lines += text_table(["layer", "dtype", "updated", "lost", "lost %", "median |d/w|"],
                        [[display_path(layer.name), layer.dtype, f"{layer.updated:,}", f"{layer.lost:,}",
                          _pct(layer.lost_fraction),
                          "-" if layer.median_ratio is None else f"{layer.median_ratio:.2e}"]
                         for layer in lu.layers])
        lines.append(f"  overall: {_pct(lu.lost_fraction)} of non-zero updates rounded away")
        spec = self.recipe_spec
        if spec.get("stochastic_rounding") and spec.get("params") != "fp32":
            lines.append(f"  (the optimizer steps fp32 copies; updates reach the {spec['params']} weights by "
                         "stochastic rounding, which keeps small updates in expectation rather than every step)")
        elif spec.get("master_weights"):
            lines.append(f"  (the optimizer steps the fp32 master weights; the {spec['params']} model weights are "
                         "rounded copies of them)")
        return lines

    def render_history(self) -> list[str]:
        h = self.history
        sm = h.summary()
        causes = ", ".join(f"{k} x{v}" for k, v in sm["causes"].items()) or "none"
        lines = [f"5. Loss-scale history: {sm['first_scale']:g} -> {sm['final_scale']:g} over {sm['steps']} steps; "
                 f"{sm['skipped']} skipped; non-finite causes: {causes}"]
        recs = h.records
        if recs:
            lines.append(f"  loss {recs[0].loss:.4f} at step 0 -> {recs[-1].loss:.4f} at step {recs[-1].step}")
        interesting = [r for r in recs if r.skipped or r.cause or r.next_scale != r.scale]
        shown = recs if len(recs) <= 12 else interesting[:20]
        rows = [[str(r.step), f"{r.loss:.4f}", f"{r.scale:g}", "yes" if r.skipped else "",
                 (r.cause or "")[:110]] for r in shown]
        if rows:
            lines += text_table(["step", "loss", "scale", "skipped", "cause"], rows)
        if len(recs) > 12:
            lines.append(f"  (steps without events omitted; all {len(recs)} in {self.json_name})")
        return lines

    def render_recommendations(self) -> list[str]:
        return ["Recommendations"] + [f"  - {r['text']}" for r in self.recommendations()]

    MAX_BLOCK_LAYERS = 12
    """Layers the block-format table shows (worst first); doctor.json has all."""

    def render_blocks(self) -> list[str]:
        bf = self.block_formats
        cfg, fmts = bf.config, bf.config.formats
        lines = [f"6. Block formats, what-if (fp32 pass of {bf.steps} step(s): each linear layer's GEMM operands in "
                 "each format, SQNR per dot product in dB)",
                 "  x: the worse of forward (along in_features) and grad_weight (along tokens); w: of forward and "
                 "grad_input (along out_features); dy: of grad_input and grad_weight",
                 f"  ! = more than {cfg.flag_db:g} dB below the layers' median; e4m3, e5m2: per tensor, as fp8-mixed; "
                 "the rest: blockformats, default scale rules"]
        if not bf.layers:
            return lines + ["  no linear layer ran in the observed steps"]
        flagged = {(d["layer"], d["format"], d["tensor"]) for d in bf.flagged()}
        shown = bf.worst_first()[:self.MAX_BLOCK_LAYERS]
        rows, med = [], bf.medians()
        for lr in shown:
            for i, t in enumerate(("x", "w", "dy")):
                label = [display_path(lr.name), f"{lr.in_features}x{lr.out_features}"] if i == 0 else ["", ""]
                rows.append(label + [t] + [_sqnr(lr.tensor_cell(t, f), (lr.name, f, t) in flagged) for f in fmts])
        for i, t in enumerate(("x", "w", "dy")):
            rows.append(["median" if i == 0 else "", "", t]
                        + ["-" if med[f][t] is None else f"{med[f][t]:.1f}" for f in fmts])
        lines += text_table(["layer", "in x out", "tensor"] + [SHORT[f] for f in fmts], rows)
        if len(bf.layers) > len(shown):
            lines.append(f"  ... {len(bf.layers) - len(shown)} more layers in doctor.json")
        lines += _not_applicable_lines(bf)
        totals = bf.format_totals()
        lines.append("  over every layer and operand:")
        lines += text_table(["format", "blocks clamped", "flushed to 0", "subnormal", "most flushed to 0"],
                        [[SHORT[f], _pct(v["scale_clamped"]), _pct(v["underflow"]), _pct(v["subnormal"]),
                          "-" if not (w := v["most_underflow"]) or not w["underflow"] else
                          f"{w['layer']} {w['tensor']} ({w['gemm']}) {_pct(w['underflow'])}"]
                         for f, v in totals.items()], indent="    ")
        return lines


def _sqnr(c, flag: bool) -> str:
    if c.status == "ok":
        return f"{c.sqnr_db:.1f}" + ("!" if flag else "")
    return {"exact": "exact", "n/a": "n/a"}.get(c.status, "-")


def _not_applicable_lines(bf: BlockFormatProfile) -> list[str]:
    by_layer: dict[str, dict[str, list[str]]] = {}
    for name, f, reason in bf.not_applicable():
        by_layer.setdefault(name, {}).setdefault(reason, []).append(SHORT[f])
    return [f"  n/a {display_path(name)}: " + "; ".join(f"{', '.join(fs)}: {r}" for r, fs in reasons.items())
            for name, reasons in by_layer.items()]
