"""``mixprec plan``: memory and step time of every recipe before running, for models and GPUs you do not have.

:mod:`.targets` (the devices), :mod:`.recorder` (allocations, the peak, every op's work), :mod:`.trace` (one
steady-state step under ``FakeTensorMode``), :mod:`.roofline` and :mod:`.kernels` (step time), :mod:`.api`
(:func:`plan`), :mod:`.report`, :mod:`.command`. The package is ``planning`` so that ``mixprec.plan`` can be the
function.
"""

from .api import Plan, PlanError, RecipePlan, plan
from .targets import TARGETS, Target, TargetError, get_target
from .trace import TraceError

__all__ = ["plan", "Plan", "RecipePlan", "PlanError", "TARGETS", "Target", "TargetError", "get_target",
           "TraceError"]
