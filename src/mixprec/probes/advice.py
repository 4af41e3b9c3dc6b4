"""Recommendations from the findings (:class:`~.report.Findings`), each a ``kind`` and a sentence.

Kinds, most urgent first:

* ``keep-fp32`` -- named modules overflow the low format: the fp32 replay (or the range profile) names them;
* ``not-precision`` -- a batch that holds inf/nan, non-finite even in fp32, or updates larger than the weights
  (learning rate, data, model): precision is not the cause; the update-to-weight check names the layers that
  show it and is only judged on tensors with a scale of their own (zero-initialised ones are left out, see
  ``lost_updates``);
* ``init-scale`` -- another loss scale loses fewer gradients to underflow, or avoids skipped steps;
* ``switch-bf16`` -- fp16's range cannot hold these gradients at any loss scale;
* ``master-weights`` -- updates are rounded away in low-precision weights;
* ``keep-recipe`` -- nothing wrong found.

After these, what-if advice on the block formats (:mod:`.block_formats`), which holds whatever the recipe:

* ``block-format-filter`` -- layers whose SQNR in a format is far below the model's median: keep them out of
  that format (its recipe's layer filter);
* ``block-format-range`` -- blocks whose scale clamps at its format's limit (their values lose range).

Each fix is said in the terms of the loop the findings came from (``Findings.loop``, :data:`LOOPS`): mixprec
train's flags for the doctor and ``mixprec train --watch``; in the user's own loop, what its code can change
(``clip_grad_norm_``, the optimizer's learning rate, a module run with autocast off); under the Hugging Face or
Lightning Trainer, their settings.
"""

from __future__ import annotations

import math
from typing import Any

from .attribution import display_path
from .block_formats import SHORT

__all__ = ["recommend", "THRESHOLDS", "LOOPS"]

THRESHOLDS = {
    "underflow": 0.01,  # gradient underflow fraction worth changing the loss scale for...
    "underflow_gain": 0.005,  # ...if the recommended scale lowers overflow + underflow by this much
    "unfixable": 0.01,  # overflow + underflow left at the best fp16 scale that calls for bf16
    "lost_updates": 0.05,  # lost-update fraction that calls for master weights
    "clamped_blocks": 0.001,  # fraction of a block format's blocks with a clamped scale worth a word
}


MAX_NAMED = 5
"""Layers named in one recommendation, worst first."""

_KEEP_IN_CODE = ("run {shown} with autocast off and fp32 inputs (in its parent's forward: with torch.autocast("
                 "\"{device}\", enabled=False): h = module(h.float())), or use mixprec.autocast(dtype, model=model, "
                 "keep_fp32={mods!r}) in place of torch.autocast")
LOOPS: dict[str, dict[str, str]] = {
    "mixprec": {
        "lr_clip": "lower --lr, add --clip-grad-norm 1.0",
        "lr": "lower --lr",
        "keep": "mixprec train --keep-fp32 {flag} --amp-impl scratch, or keep_fp32={mods!r} in the API",
        "keep_short": "--keep-fp32 {flag} --amp-impl scratch",
        "bf16": "switch to bf16-mixed",
        "init_scale": "--init-scale {scale:g}",
        "scaler": "use fp16-mixed's dynamic scaler",
        "master": "use {dt}-master (fp32 master weights) or --stochastic-rounding",
    },
    "torch": {
        "lr_clip": "lower the optimizer's learning rate (lr), clip the gradients before opt.step() "
                   "(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))",
        "lr": "lower the optimizer's learning rate (lr)",
        "keep": _KEEP_IN_CODE,
        "bf16": "autocast to torch.bfloat16",
        "init_scale": "torch.amp.GradScaler(init_scale={scale:g})",
        "scaler": "scale the loss with torch.amp.GradScaler",
        "master": "keep the weights in fp32 (autocast runs the math in {dt}), or let the optimizer step fp32 "
                  "copies (mixprec.MasterWeights)",
    },
    "transformers": {
        "lr_clip": "lower learning_rate, keep max_grad_norm=1.0 (TrainingArguments)",
        "lr": "lower learning_rate (TrainingArguments)",
        "keep": _KEEP_IN_CODE,
        "bf16": "bf16=True in place of fp16=True (TrainingArguments)",
        "init_scale": "a GradScaler with init_scale={scale:g} (accelerate's GradScalerKwargs)",
        "scaler": "train with fp16=True (TrainingArguments), whose GradScaler scales the loss",
        "master": "load the model's weights in fp32 and train with bf16=True or fp16=True (autocast runs the math "
                  "in {dt})",
    },
    "lightning": {
        "lr_clip": "lower the learning rate in configure_optimizers, clip with Trainer(gradient_clip_val=1.0)",
        "lr": "lower the learning rate in configure_optimizers",
        "keep": _KEEP_IN_CODE,
        "bf16": "Trainer(precision=\"bf16-mixed\")",
        "init_scale": "plugins=[MixedPrecision(\"16-mixed\", device, scaler=torch.amp.GradScaler(init_scale="
                      "{scale:g}))]",
        "scaler": "Trainer(precision=\"16-mixed\")",
        "master": "a -mixed precision (\"bf16-mixed\" or \"16-mixed\": fp32 weights, autocast) in place of a -true "
                  "one",
    },
}
"""What each fix is called in each loop: mixprec train's flags, the user's own PyTorch code, the Hugging Face
Trainer's arguments, the Lightning Trainer's."""


def _say(report: Any, what: str, **values: Any) -> str:
    """The fix ``what`` in the terms of the report's loop (``Findings.loop``)."""
    loop = getattr(report, "loop", "mixprec")
    device = str(report.title.get("device") or "cuda").split(":")[0]
    return LOOPS.get(loop, LOOPS["mixprec"])[what].format(device=device, **values)


def _pct(x: float) -> str:
    if x == 0:
        return "0%"
    if x < 1e-5:
        return "<0.001%"
    return f"{100 * x:.1f}%" if x >= 0.001 else f"{100 * x:.3f}%"


def _names(mods: list[str]) -> tuple[str, str]:
    """(for people, for --keep-fp32)."""
    return ", ".join(display_path(m) for m in mods), ",".join(mods)


def _faults(report: Any, low: str | None) -> list[dict[str, str]]:
    fault = report.first_fault()
    if fault is None:
        return []
    if fault.data:
        return [{"kind": "not-precision", "text": f"the batch of step {fault.step} holds inf/nan "
                 f"({'; '.join(fault.data)}): the data is at fault, not the model or the precision — fix or filter "
                 "those samples (a corrupt record, or a division by zero in preprocessing?)"}]
    replay = fault.replay
    if replay is not None and replay.modules:
        shown, flag = _names(replay.modules)
        verb = "it runs" if len(replay.modules) == 1 else "they run"
        keep = _say(report, "keep", shown=shown, flag=flag, mods=tuple(replay.modules))
        text = f"keep {shown} in fp32: the step is finite when {verb} in fp32 ({keep})"
        if low == "fp16":
            text += f"; or {_say(report, 'bf16')}, whose range is fp32's"
        h = report.history.summary()
        if fault.event is not None and fault.event.phase == "forward" and report.recipe_spec["loss_scaling"]:
            text += (f". The loss scaler cannot fix a forward overflow (it only scales gradients): it skipped "
                     f"{h['skipped']} of {h['steps']} steps")
        return [{"kind": "keep-fp32", "text": text}]
    if replay is not None:
        ev = fault.event
        what = replay.note if "outside the model" in replay.note else \
            f"{ev.phase} aten.{ev.op} in {display_path(ev.module)} is non-finite even in fp32"
        return [{"kind": "not-precision", "text": f"{what}: not a precision problem; {_say(report, 'lr_clip')}, "
                                                  "or check the data and the loss"}]
    if fault.classification == "optimizer step":
        return [{"kind": "not-precision",
                 "text": f"the optimizer step made the weights non-finite: {_say(report, 'lr_clip')}"}]
    return []


def _initial_log2_scale(report: Any) -> int:
    """Exponent of the loss scale the run *started* at: what ``--init-scale`` sets, so what the advice replaces.

    ``report.loss_scale`` is the scale after the last step, which the dynamic scaler may have backed off
    (or grown) from it; the first step's record holds the initial one.
    """
    recs = report.history.records
    scale = recs[0].scale if recs else report.loss_scale
    return round(math.log2(scale)) if scale > 0 else 0


def _fp16_ranges(report: Any, have_keep: bool) -> list[dict[str, str]]:
    recs = []
    over = [r["layer"] for r in report.ranges.layer_rows(0) if r["activations"]["fp16"]["overflow"] > 0]
    if over and not have_keep:
        shown, flag = _names(over)
        short = "keep_short" if getattr(report, "loop", "mixprec") == "mixprec" else "keep"
        keep = _say(report, short, shown=shown, flag=flag, mods=tuple(over))
        recs.append({"kind": "keep-fp32", "text": f"activations of {shown} exceed fp16's 65504: keep them in fp32 "
                                                  f"({keep}) or {_say(report, 'bf16')}"})
    k_now, k_rec = _initial_log2_scale(report), report.recommended_log2_scale()
    if k_rec is None:
        return recs
    now, rec = report.gradient_fractions("fp16", k_now), report.gradient_fractions("fp16", k_rec)
    lost_now, lost_rec = now["underflow"] + now["overflow"], rec["underflow"] + rec["overflow"]
    skipped = sum(1 for f in report.faults if f.classification == "scale overflow")
    change = (f"fp16 gradient underflow {_pct(now['underflow'])} -> {_pct(rec['underflow'])}, "
              f"overflow {_pct(now['overflow'])} -> {_pct(rec['overflow'])}")
    if report.recipe_spec["loss_scaling"]:
        worth = (now["underflow"] > THRESHOLDS["underflow"] and lost_now - lost_rec > THRESHOLDS["underflow_gain"]) \
            or (now["overflow"] > 0 and rec["overflow"] == 0) or skipped
        if worth:
            text = f"start the loss scale at 2^{k_rec} = {2.0**k_rec:g} " \
                   f"({_say(report, 'init_scale', scale=2.0**k_rec)}) instead of 2^{k_now}: {change}"
            if skipped:
                text += f"; {skipped} step(s) were skipped while the scaler backed off"
            recs.append({"kind": "init-scale", "text": text})
    elif now["underflow"] > THRESHOLDS["underflow"]:
        recs.append({"kind": "init-scale", "text": f"{_pct(now['underflow'])} of gradients underflow fp16 without "
                                                   f"loss scaling: {_say(report, 'scaler')} (2^{k_rec} suits)"})
    if lost_rec > THRESHOLDS["unfixable"]:
        recs.append({"kind": "switch-bf16", "text": f"even at the best loss scale {_pct(lost_rec)} of gradients over- "
                                                    "or underflow fp16, whose range is too narrow for this model: "
                                                    f"{_say(report, 'bf16')}"})
    return recs


def _bf16_ranges(report: Any, have_keep: bool) -> list[dict[str, str]]:
    bad = [r["layer"] for r in report.ranges.layer_rows(0)
           if r["activations"]["bf16"]["overflow"] > 0 or r["gradients"]["bf16"]["overflow"] > 0]
    if not bad or have_keep:
        return []
    return [{"kind": "not-precision", "text": f"values of {_names(bad)[0]} exceed even bf16's (= fp32's) range: "
                                              "check these layers, this is not a precision problem"}]


def _lost_updates(report: Any) -> list[dict[str, str]]:
    lu = report.lost_updates
    huge = sorted((x for x in lu.layers if x.median_ratio is not None and x.median_ratio > 1.0),
                  key=lambda x: -x.median_ratio)
    if huge:
        shown = ", ".join(f"{display_path(x.name)} ({x.median_ratio:.3g})" for x in huge[:MAX_NAMED])
        more = f" and {len(huge) - MAX_NAMED} more" if len(huge) > MAX_NAMED else ""
        return [{"kind": "not-precision", "text": f"a typical update is larger than the weight it changes (median "
                                                  f"|d/w| > 1 in {shown}{more}): the learning rate is far too "
                                                  f"large; {_say(report, 'lr')}"}]
    low = [layer for layer in lu.layers if layer.dtype in ("bf16", "fp16")]
    frac = sum(x.lost for x in low) / max(1, sum(x.updated for x in low)) if low else 0.0
    if low and frac > THRESHOLDS["lost_updates"]:
        dt = low[0].dtype
        return [{"kind": "master-weights", "text": f"{_pct(frac)} of non-zero updates to {dt} weights are rounded "
                                                   f"away (low(w + d) == w): {_say(report, 'master', dt=dt)}"}]
    if lu.lost_fraction > THRESHOLDS["lost_updates"]:
        return [{"kind": "master-weights", "text": f"{_pct(lu.lost_fraction)} of updates are below even fp32's "
                                                   "resolution: the learning rate is too small to move the weights"}]
    return []


def recommend(report: Any) -> list[dict[str, str]]:
    """Recommendations for a :class:`~.report.Findings`, most urgent first."""
    low = report.low_format
    recs = _faults(report, low)
    have_keep = any(r["kind"] == "keep-fp32" for r in recs)
    if low == "fp16":
        recs += _fp16_ranges(report, have_keep)
    elif low == "bf16":
        recs += _bf16_ranges(report, have_keep)
    recs += _lost_updates(report)
    if not recs:
        sm = report.history.summary()
        text = (f"keep {report.title.get('recipe')}: no overflow, lost updates or non-finite values in "
                f"{sm['steps']} steps ({sm['skipped']} skipped)")
        if low == "fp16":
            text += f"; fp16 gradient underflow at the current scale {_pct(report.gradient_fractions()['underflow'])}"
        recs.append({"kind": "keep-recipe", "text": text})
    return recs + _block_formats(report)


def _block_formats(report: Any) -> list[dict[str, str]]:
    bf = getattr(report, "block_formats", None)
    if bf is None:
        return []
    recs, by_format = [], {}
    for d in bf.flagged():
        by_format.setdefault(d["format"], {}).setdefault(d["layer"], d)  # worst cell per layer, flagged() sorts
    for f, worst in by_format.items():
        layers = list(worst.values())[:MAX_NAMED]
        more = f" and {len(worst) - MAX_NAMED} more" if len(worst) > MAX_NAMED else ""
        why = "; ".join(f"{display_path(d['layer'])} {d['tensor']} ({d['gemm']}) SQNR {d['sqnr_db']:.1f} dB vs "
                        f"median {d['median_db']:.1f} dB" for d in layers)
        recs.append({"kind": "block-format-filter",
                     "text": f"keep {_names([d['layer'] for d in layers])[0]}{more} in bf16 for {SHORT[f]} (its "
                             f"recipe's layer filter): {why}"})
    for f, v in bf.format_totals().items():
        w = v["most_clamped"]
        if v["scale_clamped"] > THRESHOLDS["clamped_blocks"] and w is not None:
            recs.append({"kind": "block-format-range",
                         "text": f"{SHORT[f]}: {_pct(v['scale_clamped'])} of non-zero blocks need a scale beyond "
                                 f"its scale format's range (most in {w['layer']} {w['tensor']} ({w['gemm']}): "
                                 f"{_pct(w['scale_clamped'])}); their values lose range or flush to zero"})
    return recs
