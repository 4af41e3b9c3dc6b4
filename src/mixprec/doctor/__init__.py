"""mixprec doctor: find out why low precision misbehaves.

``diagnose(model, (x, y), loss_fn=None, precision="fp16-mixed")`` returns a :class:`DoctorReport` with five
answers: the precision map (which op ran in which dtype), the range profile (per-layer magnitudes against
fp16/bf16/fp8 limits, with the loss scale that loses the fewest gradients), the first non-finite op (with an
fp32 replay that finds the modules to keep in fp32), lost updates in low-precision weights, and the
loss-scale history. ``mixprec doctor`` does the same for the built-in models and datasets.
"""

from .api import (
    DoctorError,
    FaultAnalysis,
    diagnose,
    diagnose_run,
    find_first_nonfinite,
    precision_map,
    range_profile,
)
from .replay import Fp32Modules, ReplayResult, minimal_fp32_set
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
