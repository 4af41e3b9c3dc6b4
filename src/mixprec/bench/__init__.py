"""The benchmark. ``mixprec.bench.compare(model, data, precisions=[...])`` is its Python entry point (see
:mod:`mixprec.bench.api`); ``mixprec bench`` its command line."""

__all__ = ["compare"]


def __getattr__(name: str):
    if name == "compare":  # lazy: the CLI imports bench.command without the API
        from .api import compare

        return compare
    raise AttributeError(f"module 'mixprec.bench' has no attribute {name!r}")
