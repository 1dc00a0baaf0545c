"""One adapter per engine: cfsm and the optional peers (xgrammar, outlines-core, llguidance).

Each adapter: `compile(kind, grammar) -> compiled`, `matcher(compiled) -> Matcher`; a Matcher has
`fill(row)` (writes the bitmask of the next token), `accept(token_id)`, `allowed(token_id)`.
`walk(compiled, token_ids)` says whether the engine accepts those tokens then EOS, through each
engine's own accept call (no mask fill: for checking many instances).
`whitespace` ("compact" or "flexible") picks each engine's JSON whitespace for schemas: cfsm
`CfsmConfig(whitespace=...)`, xgrammar `any_whitespace`, llguidance `whitespace_flexible`,
outlines-core its whitespace pattern (`[ \t\n\r]*` when flexible).
Peers are imported lazily; a missing one is reported, never installed.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

import cfsm


class Bundle:
    """A vocabulary in every form the engines need."""

    def __init__(self, name: str, tokenizer: Any, vocab: cfsm.Vocabulary) -> None:
        self.name = name
        self.tokenizer = tokenizer  # a transformers tokenizer
        self.vocab = vocab
        self.size = vocab.size


class CfsmEngine:
    name = "cfsm"

    def __init__(self, bundle: Bundle, whitespace: str = "compact", config: cfsm.CfsmConfig | None = None) -> None:
        self.bundle = bundle
        self.config = config or cfsm.CfsmConfig(whitespace=whitespace)  # type: ignore[arg-type]
        # per-vocabulary preparation (trie tables, JSON string walks), timed by the caller as
        # vocab_prep_ms, like the peers' tokenizer info / compiler / vocabulary construction
        bundle.vocab.prepare()

    def compile(self, kind: str, grammar: Any) -> cfsm.Index:
        if kind == "regex":
            return cfsm.compile_regex(grammar, self.bundle.vocab)
        if kind == "schema":
            return cfsm.compile_json_schema(grammar, self.bundle.vocab, self.config)
        return cfsm.compile_json_object(self.bundle.vocab, self.config)

    def matcher(self, compiled: cfsm.Index) -> Any:
        return _CfsmMatcher(compiled)

    def memory_bytes(self, compiled: cfsm.Index) -> int:
        return compiled.memory_bytes

    def walk(self, compiled: cfsm.Index, token_ids: list[int]) -> bool:
        guide = cfsm.Guide(compiled)
        try:
            guide.advance_many(token_ids)
            guide.advance(self.bundle.vocab.eos_token_ids[0])
        except cfsm.RejectedTokenError:
            return False
        return True


class _CfsmMatcher:
    def __init__(self, index: cfsm.Index) -> None:
        self.guide = cfsm.Guide(index)
        self.mask = np.zeros((1, index.vocab.mask_words), dtype=np.int32)

    def fill(self) -> None:
        self.guide.fill_mask(self.mask, 0)

    def allowed(self, token_id: int) -> bool:
        return bool((int(self.mask[0, token_id // 32]) >> (token_id % 32)) & 1)

    def accept(self, token_id: int) -> None:
        self.guide.advance(token_id)


class XgrammarEngine:
    name = "xgrammar"

    def __init__(self, bundle: Bundle, whitespace: str = "compact") -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.bundle = bundle
        self.whitespace = whitespace
        info = xgr.TokenizerInfo.from_huggingface(bundle.tokenizer, vocab_size=bundle.size)
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)

    def compile(self, kind: str, grammar: Any) -> Any:
        if kind == "regex":
            return self.compiler.compile_regex(grammar)
        if kind == "schema":
            if self.whitespace == "flexible":
                return self.compiler.compile_json_schema(json.dumps(grammar), any_whitespace=True)
            return self.compiler.compile_json_schema(json.dumps(grammar), any_whitespace=False, separators=(",", ":"))
        return self.compiler.compile_builtin_json_grammar()

    def matcher(self, compiled: Any) -> Any:
        return _XgrMatcher(self.xgr, compiled, self.bundle.size)

    def memory_bytes(self, compiled: Any) -> int:
        return int(compiled.memory_size_bytes) if hasattr(compiled, "memory_size_bytes") else -1

    def walk(self, compiled: Any, token_ids: list[int]) -> bool:
        m = self.xgr.GrammarMatcher(compiled)
        # NOTE: accept_token returns False (state unchanged) on a token the grammar forbids,
        # including EOS before the grammar is complete
        return all(m.accept_token(t) for t in token_ids) and m.accept_token(self.bundle.vocab.eos_token_ids[0])


class _XgrMatcher:
    def __init__(self, xgr: Any, compiled: Any, size: int) -> None:
        self.m = xgr.GrammarMatcher(compiled)
        self.mask = xgr.allocate_token_bitmask(1, size)
        self.np = self.mask.numpy()

    def fill(self) -> None:
        self.m.fill_next_token_bitmask(self.mask)

    def allowed(self, token_id: int) -> bool:
        return bool((int(self.np[0, token_id // 32]) >> (token_id % 32)) & 1)

    def accept(self, token_id: int) -> None:
        if not self.m.accept_token(token_id):
            raise ValueError(f"xgrammar rejected {token_id}")


class LlguidanceEngine:
    name = "llguidance"

    def __init__(self, bundle: Bundle, whitespace: str = "compact") -> None:
        import llguidance
        import llguidance.hf
        import llguidance.numpy

        self.ll = llguidance
        self.bundle = bundle
        self.defaults = {"whitespace_flexible": whitespace == "flexible"}
        self.tok = llguidance.hf.from_tokenizer(bundle.tokenizer, n_vocab=bundle.size)

    def compile(self, kind: str, grammar: Any) -> Any:
        LLMatcher = self.ll.LLMatcher
        if kind == "regex":
            grm = LLMatcher.grammar_from_regex(grammar)
        elif kind == "schema":
            grm = LLMatcher.grammar_from_json_schema(grammar, defaults=self.defaults)
        else:
            grm = LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=self.defaults)
        matcher = LLMatcher(self.tok, grm)  # compiles here
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return grm

    def matcher(self, compiled: Any) -> Any:
        return _LlMatcher(self.ll, self.tok, compiled, self.bundle.size)

    def memory_bytes(self, compiled: Any) -> int:
        return -1

    def walk(self, compiled: Any, token_ids: list[int]) -> bool:
        m = self.ll.LLMatcher(self.tok, compiled)
        # NOTE: consume_token returns False on a forbidden token (EOS included) and the matcher
        # stays in its error state
        return all(m.consume_token(t) for t in token_ids) and m.consume_token(self.bundle.vocab.eos_token_ids[0])


class _LlMatcher:
    def __init__(self, ll: Any, tok: Any, grm: Any, size: int) -> None:
        self.ll = ll
        self.m = ll.LLMatcher(tok, grm)
        self.mask = ll.numpy.allocate_token_bitmask(1, size)

    def fill(self) -> None:
        self.ll.numpy.fill_next_token_bitmask(self.m, self.mask, 0)

    def allowed(self, token_id: int) -> bool:
        return bool((int(self.mask[0, token_id // 32]) >> (token_id % 32)) & 1)

    def accept(self, token_id: int) -> None:
        if not self.m.consume_token(token_id):
            raise ValueError(f"llguidance rejected {token_id}: {self.m.get_error()}")


class OutlinesEngine:
    name = "outlines-core"

    def __init__(self, bundle: Bundle, whitespace: str = "compact") -> None:
        import outlines_core

        self.oc = outlines_core
        self.bundle = bundle
        self.whitespace_pattern = r"[ \t\n\r]*" if whitespace == "flexible" else ""
        groups: dict[bytes, list[int]] = {}
        for i, tok in enumerate(bundle.vocab.tokens):
            if tok and i not in bundle.vocab.special_token_ids:
                groups.setdefault(tok, []).append(i)
        self.vocabulary = outlines_core.Vocabulary(bundle.vocab.eos_token_ids[0], groups)

    def compile(self, kind: str, grammar: Any) -> Any:
        from outlines_core.json_schema import build_regex_from_schema

        if kind == "regex":
            pattern = grammar
        elif kind == "schema":
            pattern = build_regex_from_schema(json.dumps(grammar), self.whitespace_pattern)
        else:
            raise NotImplementedError("outlines-core has no free-JSON grammar (regular only)")
        return self.oc.Index(pattern, self.vocabulary)

    def matcher(self, compiled: Any) -> Any:
        return _OutlinesMatcher(self.oc, compiled, self.bundle.size, self.bundle.vocab.eos_token_ids[0])

    def memory_bytes(self, compiled: Any) -> int:
        return -1

    def walk(self, compiled: Any, token_ids: list[int]) -> bool:
        g = self.oc.Guide(compiled)
        try:
            for t in token_ids:
                g.advance(t)  # raises ValueError on a token without a transition
        except ValueError:
            return False
        return self.bundle.vocab.eos_token_ids[0] in g.get_tokens()


class _OutlinesMatcher:
    def __init__(self, oc: Any, index: Any, size: int, eos: int) -> None:
        self.g = oc.Guide(index)
        self.eos = eos
        self.mask = np.zeros((1, (size + 31) // 32), dtype=np.int32)

    def fill(self) -> None:
        self.g.write_mask_into(self.mask.ctypes.data, self.mask.size, self.mask.itemsize)

    def allowed(self, token_id: int) -> bool:
        return bool((int(self.mask[0, token_id // 32]) >> (token_id % 32)) & 1)

    def accept(self, token_id: int) -> None:
        if token_id == self.eos:  # outlines-core allows EOS in final states but has no transition for it
            return
        self.g.advance(token_id)


ENGINES = {"cfsm": CfsmEngine, "xgrammar": XgrammarEngine, "outlines-core": OutlinesEngine,
           "llguidance": LlguidanceEngine}
