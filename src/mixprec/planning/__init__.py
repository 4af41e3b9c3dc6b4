"""``mixprec plan``: memory and step time of every recipe before running, for models and GPUs you do not have.

- :mod:`.targets` -- the devices (a documented GPU table; ``cpu`` measured here);
- :mod:`.recorder` -- a dispatch mode recording allocations, the peak and every op's work;
- :mod:`.trace` -- one steady-state step of one recipe under ``FakeTensorMode``, the recipe as the target
  would run it, host reads modelled;
- :mod:`.roofline` -- step time from the ops; :mod:`.api` -- :func:`plan`; :mod:`.report` -- table,
  verdict, JSON and PNG; :mod:`.command` -- the CLI.

The package is ``planning`` so that ``mixprec.plan`` can be the function.
"""

from .api import Plan, PlanError, RecipePlan, plan
from .targets import TARGETS, Target, TargetError, get_target
from .trace import TraceError

__all__ = ["plan", "Plan", "RecipePlan", "PlanError", "TARGETS", "Target", "TargetError", "get_target",
           "TraceError"]
