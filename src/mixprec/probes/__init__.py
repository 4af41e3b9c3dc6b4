"""The instruments the doctor and the watch share, each written once.

======================  =====================================================================================
``ranges``              per-layer log2 histograms (:class:`~.ranges.HistogramBatch`, the one filler), the
                        doctor's fp32 pass (:class:`~.ranges.RangeProfiler`), observed gradient underflow
``subsample``           what a probe reads of a large tensor (strided elements, sampled rows)
``lost_updates``        updates rounded away, ``low(w + Δ) == w``, by a shadow fp32 optimizer step
``observer``            every ATen op of a step at the dispatcher (``attribution``: its module and phase)
``nonfinite``           the first op that produced inf/nan
``replay``              replays of a failed step on a copy: first non-finite op, largest finite loss scale,
                        minimal fp32 module set, :class:`~.replay.FaultAnalysis`
``precision_map``       which op ran in which dtype, with FLOPs and casts
``block_formats``       each linear layer's GEMM operands in every FP8/FP4 format (what-if)
``loss_scale``          what a probe reads of the loop's loss scaler (over :mod:`mixprec.scaler_view`)
``scale_history``       per step: loss scale, skip, cause
``report`` ``advice``   :class:`~.report.Findings`: every result, its JSON keys and text sections; the advice
``plots``               the PNGs both reports draw
======================  =====================================================================================
"""
