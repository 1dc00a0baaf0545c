"""Inference server composing radixcache, cfsm, lmdsl and lowlat: OpenAI-compatible and SGLang-native APIs."""

__version__ = "0.1.0"

__all__ = ["__version__"]
