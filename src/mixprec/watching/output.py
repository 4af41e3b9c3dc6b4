"""Where the watch's findings go: watch.json, report.txt, steps.csv, PNG plots, TensorBoard scalars.

Everything is written by rank 0 (captures by the rank that faulted), into ``out`` if one was given:

* ``watch.json`` and ``report.txt``: rewritten at every sample, trigger and at close, atomically
  (:mod:`mixprec.jsonio`: a crash leaves the previous complete file, never half of one);
* ``steps.csv``: one row per step, appended as the steps are read (at samples), so it is complete up to the
  last sample after a crash;
* PNGs (with matplotlib): at close, at a trigger, and at samples at most every ``plot_seconds`` (drawing
  costs far more than a sampled step), each written to a temporary file and renamed;
* TensorBoard scalars under ``out/tensorboard`` (when the ``tensorboard`` package is installed).

Under ``torch.distributed`` each rank watches its own shard; at samples and at close the ranks' range
histograms, lost-update counts, triggers, fault analyses and counters are gathered (one ``all_gather_object``)
and rank 0 writes their sum (the analyses in step order, so the first fault of any rank is the report's first
fault; the counters are the ranks' maximum, with each rank's non-finite count in ``ranks_nonfinite``). Triggers
between samples are written by rank 0 from its own view.
"""

from __future__ import annotations

import csv
import importlib.util
import io
import math
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from ..jsonio import write_json, write_text
from ..probes.lost_updates import LayerUpdates, LostUpdates
from ..probes.observer import dtype_name
from ..probes.ranges import GradientLoss, LayerRanges, RangeProfile
from ..probes.report import Findings
from ..probes.scale_history import ScaleHistory, StepRecord
from .plots import write_plots
from .report import WatchReport

__all__ = ["Output", "CSV_FIELDS"]

CSV_FIELDS = ("step", "loss", "loss_scale", "next_scale", "skipped", "nonfinite", "grad_l2", "grad_norm",
              "sampled", "cause")


class Output:
    def __init__(self, watch: Any) -> None:
        self.watch = watch
        cfg = watch.config
        self.out = None if cfg.out is None else os.path.abspath(os.fspath(cfg.out))
        self.writes = watch.rank == 0 and self.out is not None
        self.history = ScaleHistory(sparse=True)
        self.series: list[dict[str, Any]] = []
        self._csv_new = True
        self._tb = None
        tb = cfg.tensorboard if cfg.tensorboard is not None else importlib.util.find_spec("tensorboard") is not None
        self._want_tb = self.writes and tb
        self._last_plot = time.monotonic()  # the first PNGs at a trigger, at close or after plot_seconds

    def path(self, name: str) -> str:
        os.makedirs(self.out, exist_ok=True)
        return os.path.join(self.out, name)

    # -- per step -----------------------------------------------------------------------------------
    def add_steps(self, records: list[Any]) -> None:
        rows = []
        for v in records:
            loss = math.nan if v.loss is None else float(v.loss)
            rec = StepRecord(step=v.step, loss=loss, scale=float(v.scale), next_scale=float(v.next_scale),
                             skipped=bool(v.skipped), cause=v.cause)
            self.history.add(rec, v.sampled)
            rows.append([v.step, loss, rec.scale, rec.next_scale, int(v.skipped),
                         "" if v.nonfinite is None else int(v.nonfinite), _num(v.grad_l2), _num(v.grad_norm),
                         int(v.sampled), v.cause or ""])
            self._scalars(v, loss)
        if self.writes and rows:
            buf = io.StringIO()
            w = csv.writer(buf)
            if self._csv_new:
                w.writerow(CSV_FIELDS)
            w.writerows(rows)
            with open(self.path("steps.csv"), "w" if self._csv_new else "a", encoding="utf-8") as f:
                f.write(buf.getvalue())
            self._csv_new = False

    def _scalars(self, v: Any, loss: float) -> None:
        tb = self._writer()
        if tb is None:
            return
        for name, x in (("loss", loss), ("loss_scale", float(v.scale)), ("skipped", float(v.skipped)),
                        ("grad_l2", _num(v.grad_l2)), ("grad_norm", _num(v.grad_norm))):
            if isinstance(x, float) and math.isfinite(x):
                tb.add_scalar(f"watch/{name}", x, v.step)

    def _writer(self):
        if not self._want_tb:
            return None
        if self._tb is None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(self.path("tensorboard"))
        return self._tb

    # -- reports ------------------------------------------------------------------------------------
    def report(self, *, collective: bool) -> WatchReport:
        w = self.watch
        profile, lost = w.sampler.profile(), self._lost_updates()
        triggers = [{**t, "rank": w.rank} for t in w.triggers]
        faults = list(w.faults)
        counters = {"skipped": w.skipped, "nonfinite_steps": w.nonfinite_steps, "dropped": w.dropped}
        if collective and w.world_size > 1:
            profile, lost, triggers, counters, faults = _reduce(w, profile, lost, triggers, counters, faults)
        self._series_from(w.sampler.samples)
        title, spec = self._title(), self._spec()
        last_scale = self.history.final_scale if self.history.total else w.reader.init_scale
        findings = Findings(title=title, recipe_spec=spec, precision_map=None, ranges=profile,
                            loss_scale=last_scale if math.isfinite(last_scale) else 1.0,
                            gradient_loss=GradientLoss(), faults=faults, lost_updates=lost, history=self.history,
                            loop=w.advice_loop, json_name="watch.json and steps.csv")
        unsampled = max(0, w.step - len(w.sampler.samples))
        reads = {"total": sum(w.host_reads.values()), "by_reason": dict(w.host_reads), "unsampled": w.unsampled_reads,
                 "unsampled_steps": unsampled, "per_unsampled_step": _reads_rule(w)}
        info = {"source": w.source, "check": w.config.check, "every": w.config.every, "steps": w.step,
                "samples": len(w.sampler.samples), "on_fault": w.config.on_fault, "scaler": w.reader.kind,
                "world_size": w.world_size, "host_reads": reads, "captures": [t for t in triggers if t.get("capture")],
                "sampling": _sampling(w), **counters}
        return WatchReport(findings=findings, watch=info, triggers=triggers, samples=w.sampler.samples,
                           series=self.series)

    def write(self, *, final: bool, collective: bool, plots: bool = False) -> None:
        if not self.writes and not (collective and self.watch.world_size > 1):
            return  # nothing to write here, and no rank waits for this one's statistics
        report = self.report(collective=collective)
        if not self.writes:
            return
        write_json(self.path("watch.json"), report.to_dict())
        write_text(self.path("report.txt"), report.render() + "\n")
        if self._tb is not None and self.series:
            s = self.series[-1]
            if s.get("lost_fraction") is not None:
                self._tb.add_scalar("watch/lost_update_fraction", s["lost_fraction"], s["step"])
            self._tb.flush()
        cfg = self.watch.config
        if cfg.plots and (final or plots or time.monotonic() - self._last_plot >= cfg.plot_seconds):
            write_plots(report, self.out)
            self._last_plot = time.monotonic()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    # -- pieces -------------------------------------------------------------------------------------
    def _lost_updates(self) -> LostUpdates:
        mon = self.watch.sampler.monitor
        if mon is None:
            return LostUpdates(layers=[], steps=0)
        return mon.result([n for n, _ in self.watch.model.named_modules()])

    def _series_from(self, samples: list[dict[str, Any]]) -> None:
        low = self._spec()["compute"]
        fmt = "fp16" if low in ("fp16", "fp32") else low
        for s in samples[len(self.series):]:
            lu = s["lost_updates"]
            self.series.append({"step": s["step"], "loss_scale": s["loss_scale"], "format": fmt,
                                "lost_fraction": None if lu is None else lu["fraction"],
                                "gradient_underflow": {r["layer"]: r["gradients"].get(fmt, {}).get("underflow", 0.0)
                                                       for r in s["layers"]}})

    def _spec(self) -> dict[str, Any]:
        w = self.watch
        dtypes = [p.dtype for p in w.model.parameters()]
        params = max(set(dtypes), key=dtypes.count)
        low = w.compute_dtype or params
        stepped = {id(p) for g in w.optimizer.param_groups for p in g["params"]}
        return {"compute": dtype_name(low), "params": dtype_name(params), "loss_scaling": w.reader.enabled,
                "master_weights": not any(id(p) in stepped for p in w.model.parameters()), "emulated": False,
                "stochastic_rounding": False}

    def _title(self) -> dict[str, Any]:
        w, spec = self.watch, self._spec()
        scaler = {"torch": type(w.scaler).__name__, "mixprec": "DynamicLossScaler"}.get(w.reader.kind)
        compute = f"{spec['compute']} autocast" if w.compute_dtype is not None else f"{spec['compute']} compute"
        describe = f"{compute}, {spec['params']} weights" + (f", {scaler}" if scaler else ", no loss scaler") + (
            ", optimizer steps separate (master) tensors" if spec["master_weights"] else "")
        return {"recipe": f"{spec['compute']}/{spec['params']}" + ("+scaler" if scaler else ""), "impl": w.source,
                "describe": describe, "model": type(w.model).__name__, "device": str(w.device), "steps": w.step,
                "params": sum(p.numel() for p in w.model.parameters())}


def _sampling(w: Any) -> dict[str, Any]:
    """How much of each tensor a sampled step read (this rank's counts): watch.json's ``watch.sampling``."""
    limit = w.config.sample_elements
    mon = w.sampler.monitor
    lost = mon.result().layers if mon is not None else []
    return {"sample_elements": limit,
            "rule": ("tensors of more than sample_elements elements: a fixed strided subsample of about that "
                     "many; fractions are estimates, the largest magnitude and non-finite presence are exact")
            if limit else "every tensor whole",
            "histogram_elements": w.sampler.elements, "histogram_elements_binned": w.sampler.seen,
            "lost_update_elements": sum(lu.elements for lu in lost),
            "lost_update_elements_examined": sum(lu.examined for lu in lost)}


def _reads_rule(w: Any) -> str:
    if not w.reader.enabled and w.config.check == "deferred":
        return ("0: check='deferred': the finite flag of the gradients and loss waits on the device for the next "
                "sample (a non-finite step the loop applies is counted there, not replayed)")
    if not w.reader.enabled:
        return "1: the finite flag of the gradients and loss, before the optimizer step"
    if w.reader.fused:
        return "1: found_inf of the fused optimizer's step"
    return "0: the scaler's own found_inf check decides, the watch reads nothing (1 on a skipped step: the new scale)"


def _num(v: Any) -> Any:
    if v is None:
        return ""
    if isinstance(v, torch.Tensor):
        return ""  # not read yet (never: flush reads every tensor)
    return float(v)


def _reduce(w: Any, profile: RangeProfile, lost: LostUpdates, triggers: list, counters: dict, faults: list) -> tuple:
    """Sum the ranks' histograms and lost-update counts; collect their triggers and fault analyses (in step order,
    rank 0 first within a step), the counters' max and each rank's non-finite count (one all_gather_object)."""
    mine = {"ranges": profile.layers, "lost": lost.layers, "triggers": triggers, "counters": counters,
            "faults": faults}
    every: list[Any] = [None] * w.world_size
    dist.all_gather_object(every, mine)
    layers: dict[str, LayerRanges] = {}
    updates: dict[str, LayerUpdates] = {}
    for part in every:
        for lr in part["ranges"]:
            layers.setdefault(lr.name, LayerRanges(lr.name, lr.kind)).merge(lr)
        for lu in part["lost"]:
            total = updates.setdefault(lu.name, LayerUpdates(lu.name, lu.dtype))
            for field in ("updated", "lost", "unchanged", "examined", "elements"):
                setattr(total, field, getattr(total, field) + getattr(lu, field))
    merged_triggers = [t for part in every for t in part["triggers"]]
    merged_faults = sorted((f for part in every for f in part["faults"]), key=lambda f: f.step)  # stable: by rank
    counters = {k: max(part["counters"][k] for part in every) for k in counters}
    counters["ranks_nonfinite"] = [part["counters"]["nonfinite_steps"] for part in every]
    profile = RangeProfile(layers=list(layers.values()), steps=profile.steps, formats=profile.formats)
    lost = LostUpdates(layers=list(updates.values()), steps=lost.steps)
    return profile, lost, merged_triggers, counters, merged_faults
