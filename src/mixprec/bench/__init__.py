"""The benchmark: ``compare`` from Python (:mod:`.api`), ``mixprec bench`` from the shell (:mod:`.command`); both
build a :class:`~mixprec.bench.config.BenchConfig` and run a :class:`~mixprec.bench.session.Session`."""

from .api import Comparison, compare
from .config import BenchConfig

__all__ = ["compare", "Comparison", "BenchConfig"]
