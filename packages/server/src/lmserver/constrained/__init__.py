"""Constrained decoding in lmserver with cfsm: grammar compile stage, batch masks, jump-forward.

`EngineCore` owns one `ConstrainedDecoding`; see `engine_hooks` for what it does per request.
"""

from lmserver.constrained.backend import GrammarBackend, GrammarError, GrammarKey, GrammarTicket, grammar_key
from lmserver.constrained.bitmask import BatchMasker
from lmserver.constrained.engine_hooks import ConstrainedDecoding
from lmserver.constrained.grammar import JumpForward, ReqGrammar
from lmserver.constrained.policy import JumpPolicy

__all__ = [
    "BatchMasker",
    "ConstrainedDecoding",
    "GrammarBackend",
    "GrammarError",
    "GrammarKey",
    "GrammarTicket",
    "JumpForward",
    "JumpPolicy",
    "ReqGrammar",
    "grammar_key",
]
