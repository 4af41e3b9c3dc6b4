"""Turn a doctor report into recommendations, each with a machine-readable ``kind`` and a sentence.

Kinds: ``keep-fp32`` (named modules overflow the low format: run them in fp32), ``switch-bf16`` (fp16's
range cannot hold the values at any scale), ``init-scale`` (a different loss scale loses fewer gradients or
avoids skipped steps), ``master-weights`` (updates are rounded away in low-precision weights), ``not-precision``
(non-finite even in fp32: learning rate, data, model), ``keep-recipe`` (nothing wrong found).
"""

from __future__ import annotations

from typing import Any

from .attribution import display_path

__all__ = ["recommend", "THRESHOLDS"]

THRESHOLDS = {
    "underflow": 0.01,  # gradient underflow fraction worth changing the loss scale for...
    "underflow_gain": 0.005,  # ...if the recommended scale lowers overflow + underflow by this much
    "unfixable": 0.01,  # overflow + underflow left at the best fp16 scale that calls for bf16
    "lost_updates": 0.05,  # lost-update fraction that calls for master weights
}


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%" if x >= 0.001 else f"{100 * x:.3f}%"


def recommend(report: Any) -> list[dict[str, str]]:
    recs: list[dict[str, str]] = []
    spec, low = report.recipe_spec, report.low_format

    def add(kind: str, text: str) -> None:
        recs.append({"kind": kind, "text": text})

    # 3. non-finite values: the most urgent
    fault = report.first_fault()
    if fault is not None and fault.replay is not None:
        mods = fault.replay.modules
        if mods:
            names = ",".join(mods)
            shown = ", ".join(display_path(m) for m in mods)
            add("keep-fp32", f"keep {shown} in fp32: the step is finite when only {'it runs' if len(mods) == 1 else 'they run'}"
                             f" in fp32 (mixprec train --keep-fp32 {names} --amp-impl scratch, or "
                             f"diagnose(..., keep_fp32=({', '.join(repr(m) for m in mods)},)))"
                + ("; or switch to bf16-mixed, whose range is fp32's" if low == "fp16" else ""))
        elif "not a precision problem" in fault.replay.note or "outside the model" in fault.replay.note:
            add("not-precision", f"non-finite values that fp32 does not fix ({fault.replay.note}): lower --lr, add "
                                 "--clip-grad-norm 1.0, or check the data and the loss")
    elif fault is not None and fault.classification == "optimizer step":
        add("not-precision", "the optimizer step produced non-finite weights: lower --lr or add --clip-grad-norm 1.0")

    # 2. ranges
    k_now, k_rec = report.log2_scale, report.recommended_log2_scale()
    if low == "fp16":
        over = [r["layer"] for r in report.ranges.layer_rows(0) if r["activations"]["fp16"]["overflow"] > 0]
        if over and not any(r["kind"] == "keep-fp32" for r in recs):
            add("keep-fp32", f"activations of {', '.join(display_path(n) for n in over)} exceed fp16's 65504: keep "
                             f"{'it' if len(over) == 1 else 'them'} in fp32 (--keep-fp32 {','.join(over)} --amp-impl "
                             "scratch) or switch to bf16-mixed")
        if k_rec is not None:
            now, rec = report.gradient_fractions("fp16"), report.gradient_fractions("fp16", k_rec)
            lost_now, lost_rec = now["underflow"] + now["overflow"], rec["underflow"] + rec["overflow"]
            skipped_by_scale = sum(1 for f in report.faults if f.classification == "scale overflow")
            if spec["loss_scaling"] and ((now["underflow"] > THRESHOLDS["underflow"]
                                          and lost_now - lost_rec > THRESHOLDS["underflow_gain"])
                                         or (now["overflow"] > 0 and rec["overflow"] == 0) or skipped_by_scale):
                add("init-scale", f"start the loss scale at 2^{k_rec} = {2.0**k_rec:g} (--init-scale {2.0**k_rec:g}) "
                                  f"instead of 2^{k_now}: fp16 gradient underflow {_pct(now['underflow'])} -> "
                                  f"{_pct(rec['underflow'])}, overflow {_pct(now['overflow'])} -> {_pct(rec['overflow'])}"
                    + (f"; {skipped_by_scale} step(s) were skipped while the scaler backed off" if skipped_by_scale else ""))
            elif not spec["loss_scaling"] and now["underflow"] > THRESHOLDS["underflow"]:
                add("init-scale", f"{_pct(now['underflow'])} of gradients underflow fp16 without loss scaling: use a "
                                  f"loss scale of 2^{k_rec} = {2.0**k_rec:g} (fp16-mixed's dynamic scaler)")
            if lost_rec > THRESHOLDS["unfixable"]:
                add("switch-bf16", f"even at the best loss scale {_pct(lost_rec)} of gradients over- or underflow fp16: "
                                   "its range is too narrow for this model; switch to bf16-mixed")
    elif low == "bf16":
        bad = [r["layer"] for r in report.ranges.layer_rows(0)
               if r["activations"]["bf16"]["overflow"] > 0 or r["gradients"]["bf16"]["overflow"] > 0]
        if bad and not any(r["kind"] == "keep-fp32" for r in recs):
            add("keep-fp32", f"values of {', '.join(display_path(n) for n in bad)} exceed even bf16's range: "
                             "check these layers (this is not a precision problem)")

    # 4. lost updates
    lu = report.lost_updates
    low_stored = [layer for layer in lu.layers if layer.dtype in ("bf16", "fp16")]
    frac_low = (sum(x.lost for x in low_stored) / max(1, sum(x.updated for x in low_stored))) if low_stored else 0.0
    if low_stored and frac_low > THRESHOLDS["lost_updates"]:
        master = "bf16-master" if low_stored[0].dtype == "bf16" else "fp16-master"
        add("master-weights", f"{_pct(frac_low)} of non-zero updates to {low_stored[0].dtype} weights are rounded away "
                              f"(low(w + d) == w): use {master} (fp32 master weights) or --stochastic-rounding")
    elif lu.lost_fraction > THRESHOLDS["lost_updates"]:
        add("master-weights", f"{_pct(lu.lost_fraction)} of updates are below even fp32's resolution: the learning "
                              "rate is too small to change the weights")

    if not recs:
        sm = report.history.summary()
        extra = ""
        if low == "fp16" and k_rec is not None:
            extra = f"; fp16 gradient underflow at the current scale {_pct(report.gradient_fractions('fp16')['underflow'])}"
        add("keep-recipe", f"keep {report.title.get('recipe')}: no overflow, lost updates or non-finite values in "
                           f"{sm['steps']} steps ({sm['skipped']} skipped){extra}")
    return recs
