"""The trainer. ``mixprec.train.fit(model, data, precision=...)`` is its Python entry point (see
:mod:`mixprec.train.api`); ``mixprec train`` its command line."""

__all__ = ["fit"]


def __getattr__(name: str):
    if name == "fit":  # lazy: `mixprec train --help` should not import the whole trainer
        from .api import fit

        return fit
    raise AttributeError(f"module 'mixprec.train' has no attribute {name!r}")
