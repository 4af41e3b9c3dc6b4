"""Hardware preflight: before the matrix runs, say per recipe whether this machine runs its dtype fast.

Nothing is rewritten: a recipe the machine runs slowly still runs as asked, and the line says why it will
be slow. The facts come from the recipe itself (:meth:`mixprec.precision.Recipe.hardware_facts`, the
same source as its one-line ``describe()``): the dtype its matmuls actually run in, which picks the peak
its MFU is measured against (emulated fp16 multiplies in fp32, so its peak is fp32's), and whether this
device has fast kernels for it.
"""

from __future__ import annotations

import dataclasses

from ..precision import Recipe

__all__ = ["Preflight", "preflight"]


@dataclasses.dataclass(frozen=True)
class Preflight:
    recipe: str
    impl: str
    matmul_dtype: str
    """``fp32``, ``tf32``, ``bf16`` or ``fp16``: what the matmuls run in (the MFU peak's dtype)."""
    fast: bool
    """Whether this machine has native fast kernels for that dtype."""
    line: str

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def preflight(recipe: Recipe, notes: list[str] = ()) -> Preflight:
    """What ``recipe`` will run as on its device, in one line (plus ``notes`` on flags that do not apply)."""
    facts = recipe.hardware_facts()
    line = "; ".join([f"{recipe.label}: {facts.note}", *notes])
    return Preflight(recipe.name, recipe.impl, facts.matmul_dtype, facts.fast, line)
