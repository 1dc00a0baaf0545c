"""Context-free grammars: GBNF text (and JSON Schemas that recurse) to a pushdown matcher.

    index = cfsm.compile_ebnf('root ::= "[" (root ("," root)*)? "]"', vocab)
    guide = cfsm.Guide(index)        # a cfsm.GrammarGuide: the cfsm.Guide interface

Modules: `rules` (the rule form all frontends produce), `ebnf` (the GBNF parser), `lark` (a
Lark subset), `pda` (rules to a network of byte DFAs that call each other), `index` (token
masks with context-independent caches). The per-request cursor, `GrammarGuide`, is in
`cfsm.guide` beside the `Guide` it extends.
"""

from __future__ import annotations

import numpy as np

from cfsm.config import CfsmLimits
from cfsm.errors import Approximation, PushdownTooLargeError
from cfsm.grammar.ebnf import parse_ebnf
from cfsm.grammar.index import GrammarIndex
from cfsm.grammar.inline import inline_rules, regular_root
from cfsm.grammar.lark import parse_lark
from cfsm.grammar.pda import Pda, build_pda
from cfsm.grammar.rules import Grammar, RuleRef
from cfsm.masks.vocab import Vocabulary

__all__ = ["Grammar", "GrammarIndex", "Pda", "RuleRef", "build_pda", "compile_grammar",
           "inline_rules", "parse_ebnf", "parse_lark", "regular_root"]


def compile_grammar(grammar: Grammar, vocab: Vocabulary, text: str = "",
                    approximations: tuple[Approximation, ...] = (), max_positions: int = 0,
                    lazy_positions: int = 0, limits: CfsmLimits | None = None) -> GrammarIndex:
    """Compile rules against `vocab` as a pushdown matcher (non-recursive rules inlined first;
    the vocabulary walks of every rule position, once). Raises `GrammarError`, and
    `PushdownTooLargeError` before any walk when `max_positions` (> 0) is below the number of
    rule positions that read bytes (while building the network, as soon as the count passes it:
    `build_pda`). With more positions than `lazy_positions` (> 0) nothing is walked at compile
    time: each key is walked on its first use (a millisecond or so per new key on the guide's
    thread instead of a walk per position here). `limits`: the size limits (`CfsmLimits`: inlined
    rule size, network states, DFA states). Mutates nothing (fills vocabulary caches)."""
    limits = limits or CfsmLimits()
    pda = build_pda(inline_rules(grammar, limits.max_inline_nodes), max_positions, limits)
    positions = int(np.count_nonzero(pda.has_bytes))
    if 0 < max_positions < positions:
        raise PushdownTooLargeError(positions, max_positions)
    if 0 < lazy_positions < positions:
        # NOTE: no shared walks: finding them over a network this large takes seconds, and only
        # the keys in use get walked
        index = GrammarIndex(pda, vocab, text, approximations, precompute=False,
                             reps=np.arange(pda.num_states, dtype=np.int32))
        index.mask(index.start)
        return index
    return GrammarIndex(pda, vocab, text, approximations)
