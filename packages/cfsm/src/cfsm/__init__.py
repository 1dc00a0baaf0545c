"""Compressed-FSM constrained decoding: regex and JSON Schema to token masks with jump-forward.

Importing `cfsm` imports neither torch nor transformers; `cfsm.torch` and `cfsm.hf` do.
"""

from cfsm.errors import (
    CfsmError,
    RejectedTokenError,
    UnsupportedRegexError,
    UnsupportedSchemaError,
    VocabularyError,
)

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "CfsmError",
    "RejectedTokenError",
    "UnsupportedRegexError",
    "UnsupportedSchemaError",
    "VocabularyError",
]
