"""SGLang-compatible frontend language for LM programs: gen, select, fork/join, roles, tracing, API speculative execution."""

__version__ = "0.1.0"

__all__ = ["__version__"]
