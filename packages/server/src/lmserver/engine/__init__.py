"""The engine: model runner, KV pool, sampler, detokenizer, EngineCore and the offline Engine."""

from lmserver.engine.core import EngineCore
from lmserver.engine.offline import Engine

__all__ = ["Engine", "EngineCore"]
