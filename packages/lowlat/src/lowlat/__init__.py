"""Low-latency kernel plugin framework: register, guard, build and dispatch specialized decoder kernels."""

__version__ = "0.1.0"

__all__ = ["__version__"]
