"""Compressed-FSM constrained decoding: regex and JSON Schema to token masks with jump-forward."""

__version__ = "0.1.0"

__all__ = ["__version__"]
