"""Inference server composing radixcache, cfsm, lmdsl and lowlat: OpenAI-compatible and SGLang-native APIs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["Engine", "__version__"]

if TYPE_CHECKING:
    from lmserver.engine.offline import Engine


def __getattr__(name: str) -> Any:
    # NOTE: lazy, so `import lmserver` (CLI, HTTP front end) does not import torch
    if name == "Engine":
        from lmserver.engine.offline import Engine

        return Engine
    raise AttributeError(f"module 'lmserver' has no attribute {name!r}")
