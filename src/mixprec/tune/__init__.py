"""``mixprec tune``: per-layer formats that pay on a target and keep the loss (:mod:`.api`)."""

from .api import LayerChoice, Tuning, TuneError, tune

__all__ = ["tune", "Tuning", "LayerChoice", "TuneError"]
