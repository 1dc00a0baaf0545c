"""Compressed-FSM constrained decoding: regex and JSON Schema to token masks with jump-forward.

Importing `cfsm` imports neither torch nor transformers; `cfsm.torch` and `cfsm.hf` do.

    index = cfsm.compile_json_schema(schema, vocab)   # or compile_regex, compile_ebnf (GBNF)
    guide = cfsm.Guide(index)                         # one per request (a GrammarGuide for a CFG)
    guide.fill_mask(bitmask, row)                     # int32 (batch, ceil(V/32))
    guide.advance(token_id)                           # RejectedTokenError if not allowed
"""

from cfsm.compiler import (
    Compiler,
    compile_ebnf,
    compile_json_object,
    compile_json_schema,
    compile_lark,
    compile_regex,
    regex_dfa,
)
from cfsm.config import CfsmConfig, CfsmLimits, IndexTuning
from cfsm.errors import (
    Approximation,
    CfsmError,
    GrammarError,
    GrammarTooLargeError,
    PushdownTooLargeError,
    RejectedTokenError,
    SchemaTooLargeError,
    UnsupportedRegexError,
    UnsupportedSchemaError,
    VocabularyError,
)
from cfsm.grammar import GrammarIndex
from cfsm.guide import GrammarGuide, Guide, fill_next_token_bitmasks
from cfsm.masks.compressed import JumpPlan, plan_jump_forward
from cfsm.masks.index import Index
from cfsm.masks.vocab import Vocabulary

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "Approximation",
    "CfsmConfig",
    "CfsmLimits",
    "IndexTuning",
    "CfsmError",
    "Compiler",
    "GrammarError",
    "GrammarGuide",
    "GrammarIndex",
    "GrammarTooLargeError",
    "PushdownTooLargeError",
    "SchemaTooLargeError",
    "Guide",
    "Index",
    "JumpPlan",
    "RejectedTokenError",
    "UnsupportedRegexError",
    "UnsupportedSchemaError",
    "Vocabulary",
    "VocabularyError",
    "compile_ebnf",
    "compile_lark",
    "compile_json_object",
    "compile_json_schema",
    "compile_regex",
    "fill_next_token_bitmasks",
    "plan_jump_forward",
    "regex_dfa",
]
