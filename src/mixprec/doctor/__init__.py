"""mixprec doctor: the probes (:mod:`mixprec.probes`) run over a built run for a few steps.

``diagnose(model, (x, y), loss_fn=None, precision="fp16-mixed")`` returns a :class:`DoctorReport`: the precision
map, the range profile (with the loss scale that loses the fewest gradients), the first non-finite op (with an
fp32 replay that finds the modules to keep in fp32), lost updates, the loss-scale history and the block-format
what-if table. ``mixprec doctor`` does the same for the built-in models and datasets.
"""

from ..probes.replay import FaultAnalysis, Fp32Modules, ReplayResult, minimal_fp32_set
from .api import DoctorError, diagnose, diagnose_run, find_first_nonfinite, precision_map, range_profile
from .report import DoctorReport

__all__ = [
    "diagnose",
    "diagnose_run",
    "precision_map",
    "range_profile",
    "find_first_nonfinite",
    "minimal_fp32_set",
    "Fp32Modules",
    "FaultAnalysis",
    "ReplayResult",
    "DoctorReport",
    "DoctorError",
]
