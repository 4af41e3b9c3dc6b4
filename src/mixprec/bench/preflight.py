"""Hardware preflight: before the matrix, say per recipe whether this machine runs its dtype fast (from
:meth:`mixprec.precision.Recipe.hardware_facts`). Nothing is rewritten: a slow recipe runs as asked."""

from __future__ import annotations

import dataclasses

from ..precision import Recipe

__all__ = ["Preflight", "preflight"]


@dataclasses.dataclass(frozen=True)
class Preflight:
    recipe: str
    impl: str
    matmul_dtype: str
    """What the matmuls run in (the MFU peak's dtype)."""
    fast: bool
    line: str

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def preflight(recipe: Recipe, notes: list[str] = ()) -> Preflight:
    """What ``recipe`` will run as on its device, in one line (plus ``notes`` on flags that do not apply)."""
    facts = recipe.hardware_facts()
    line = "; ".join([f"{recipe.label}: {facts.note}", *notes])
    return Preflight(recipe.entry_name, recipe.impl, facts.matmul_dtype, facts.fast, line)
