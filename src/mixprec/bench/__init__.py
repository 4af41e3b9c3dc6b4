"""The benchmark. ``mixprec.bench.compare(model, data, precisions=[...])`` is its Python entry point (see
:mod:`mixprec.bench.api`); ``mixprec bench`` its command line (:mod:`mixprec.bench.command`). Both build a
:class:`~mixprec.bench.config.BenchConfig` and run a :class:`~mixprec.bench.session.Session`."""

from .api import Comparison, compare
from .config import BenchConfig

__all__ = ["compare", "Comparison", "BenchConfig"]
