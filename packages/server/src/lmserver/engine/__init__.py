"""The engine core: `EngineCore` (requests in, one step at a time, outputs out), the offline
`Engine`, and what a step composes: detokenizer, constrained decoding, speculative decoding,
multimodal inputs, the overlap schedule. The runner below turns each decision into tokens."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["Engine", "EngineCore"]

if TYPE_CHECKING:
    from lmserver.engine.core import EngineCore
    from lmserver.engine.offline import Engine


def __getattr__(name: str) -> Any:
    # lazy: importing a torch-free engine module (detokenizer, constrained policy) stays torch-free
    if name == "EngineCore":
        from lmserver.engine.core import EngineCore

        return EngineCore
    if name == "Engine":
        from lmserver.engine.offline import Engine

        return Engine
    raise AttributeError(f"module 'lmserver.engine' has no attribute {name!r}")
