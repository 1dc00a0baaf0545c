"""Attention backends: `plan(batch)` once per forward, `forward(q, k, v, layer)` per layer.

Backends register themselves in an `AttentionRegistry`; `default_registry()` returns a fresh
registry holding the built-in ones (no global mutable state).
"""

from lmserver.forward.batch import AttentionBackend, AttentionLayer
from lmserver.runner.attention.registry import (
    AttentionRegistry,
    UnknownAttentionBackendError,
    default_registry,
)

__all__ = [
    "AttentionBackend",
    "AttentionLayer",
    "AttentionRegistry",
    "UnknownAttentionBackendError",
    "default_registry",
]
