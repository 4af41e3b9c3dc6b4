"""mixprec: mixed-precision training for PyTorch, implemented from scratch and measured."""

__version__ = "0.1.0"
