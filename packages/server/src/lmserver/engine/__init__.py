"""The engine: model runner, KV pool, sampler, detokenizer, EngineCore and the offline Engine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["Engine", "EngineCore"]

if TYPE_CHECKING:
    from lmserver.engine.core import EngineCore
    from lmserver.engine.offline import Engine


def __getattr__(name: str) -> Any:
    # NOTE: lazy, so the attention backends can import engine.forward_batch without a cycle
    if name == "EngineCore":
        from lmserver.engine.core import EngineCore

        return EngineCore
    if name == "Engine":
        from lmserver.engine.offline import Engine

        return Engine
    raise AttributeError(f"module 'lmserver.engine' has no attribute {name!r}")
