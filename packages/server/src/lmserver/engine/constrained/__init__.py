"""Constrained decoding in lmserver with cfsm: grammar compile stage, batch masks, jump-forward.

`EngineCore` owns one `ConstrainedDecoding`; see `engine_hooks` for what it does per request.
Names are imported on first use, so a grammar compile worker process (`workers`) imports cfsm
and not torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lmserver.engine.constrained.backend import (
        GrammarBackend,
        GrammarError,
        GrammarKey,
        GrammarQueueFullError,
        GrammarTicket,
        grammar_key,
    )
    from lmserver.engine.constrained.bitmask import BatchMasker
    from lmserver.engine.constrained.engine_hooks import ConstrainedDecoding
    from lmserver.engine.constrained.grammar import JumpForward, ReqGrammar
    from lmserver.engine.constrained.policy import JumpPolicy

_MODULES = {
    "BatchMasker": "bitmask",
    "ConstrainedDecoding": "engine_hooks",
    "GrammarBackend": "backend",
    "GrammarError": "backend",
    "GrammarKey": "backend",
    "GrammarQueueFullError": "backend",
    "GrammarTicket": "backend",
    "JumpForward": "grammar",
    "JumpPolicy": "policy",
    "ReqGrammar": "grammar",
    "grammar_key": "backend",
}

__all__ = [
    "BatchMasker",
    "ConstrainedDecoding",
    "GrammarBackend",
    "GrammarError",
    "GrammarKey",
    "GrammarQueueFullError",
    "GrammarTicket",
    "JumpForward",
    "JumpPolicy",
    "ReqGrammar",
    "grammar_key",
]


def __getattr__(name: str) -> Any:
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module 'lmserver.engine.constrained' has no attribute {name!r}")
    return getattr(importlib.import_module(f"lmserver.engine.constrained.{module}"), name)
