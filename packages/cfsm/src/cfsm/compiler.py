"""Compile entry points: regex / JSON Schema / free JSON -> `Index`, with an LRU and disk cache."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import tempfile
from collections import OrderedDict
from typing import Any

import numpy as np

from cfsm.automata.automaton import Dfa, build_dfa
from cfsm.automata.direct import build_dfa_direct
from cfsm.config import CfsmConfig, CfsmLimits, IndexTuning
from cfsm.errors import (
    Approximation,
    GrammarError,
    GrammarTooLargeError,
    PushdownTooLargeError,
    SchemaTooLargeError,
    UnsupportedSchemaError,
)
from cfsm.grammar import (
    Grammar,
    GrammarIndex,
    compile_grammar,
    inline_rules,
    parse_ebnf,
    parse_lark,
    regular_root,
)
from cfsm.masks.index import Index, build_index
from cfsm.masks.vocab import Vocabulary
from cfsm.regex.parser import parse_regex
from cfsm.regex.syntax import Node
from cfsm.schema.json_schema import json_value_grammar, json_value_node, schema_grammar, schema_tree

__all__ = ["compile_ebnf", "compile_lark", "compile_regex", "compile_json_schema", "compile_json_object", "Compiler", "regex_dfa"]

_INDEX_ARRAYS = ("masks", "mask_row")


def regex_dfa(pattern: str) -> Dfa:
    """The minimal byte DFA of `pattern` (fullmatch semantics). Pure."""
    return build_dfa(parse_regex(pattern))


def _index_of(node: Node, vocab: Vocabulary, grammar: str, what: str, cfg: CfsmConfig,
              max_states: int | None = None) -> Index:
    """The `Index` of a syntax tree; `max_states`: `GrammarTooLargeError` past that many DFA states
    (`build_dfa`'s cap; the direct construction's DFA is checked after)."""
    limit = cfg.limits.max_dfa_states
    dfa = build_dfa_direct(node, limit=limit) or build_dfa(node, max_states, limit=limit)  # the same Dfa either way
    if max_states is not None and dfa.num_states > max_states:
        raise GrammarTooLargeError(f"the DFA exceeds {max_states} states")
    if dfa.num_states == 0:
        raise UnsupportedSchemaError(what, "#", "the grammar accepts no string (check bounds, enum, recursion depth)")
    return build_index(dfa, vocab, grammar=grammar, tuning=cfg.tuning)


def compile_regex(pattern: str, vocab: Vocabulary, config: CfsmConfig | None = None) -> Index:
    """Compile a regex (fullmatch semantics) against `vocab`. No caching; mutates nothing.

    Raises `UnsupportedRegexError` for constructs outside the regular subset.
    """
    cfg = config or CfsmConfig()
    dfa = build_dfa(parse_regex(pattern), limit=cfg.limits.max_dfa_states)
    return build_index(dfa, vocab, grammar=f"regex:{pattern}", tuning=cfg.tuning)


def compile_ebnf(text: str, vocab: Vocabulary, config: CfsmConfig | None = None, *,
                 root: str = "root") -> Index | GrammarIndex:
    """Compile a GBNF grammar (llama.cpp / xgrammar dialect, start rule `root`) against `vocab`.
    No caching; mutates nothing.

    A grammar that is regular once its non-recursive rules are inlined compiles to an `Index`
    (a DFA, as regexes do); a recursive one to a `GrammarIndex` (a pushdown matcher);
    `cfsm.Guide(index)` takes either. Raises `GrammarError` (line and column) for malformed text,
    undefined rules, left recursion or an empty language.
    """
    cfg = config or CfsmConfig()
    return _compile_rules(parse_ebnf(text, root), vocab, f"ebnf:{root}:{text}", cfg.limits, cfg.tuning)


def compile_lark(text: str, vocab: Vocabulary, config: CfsmConfig | None = None, *,
                 start: str = "start") -> Index | GrammarIndex:
    """Compile a Lark grammar (the subset `cfsm.grammar.lark` describes; `%ignore` text may come
    before every terminal) against `vocab`, like `compile_ebnf`. Raises `GrammarError`."""
    cfg = config or CfsmConfig()
    return _compile_rules(parse_lark(text, start), vocab, f"lark:{start}:{text}", cfg.limits, cfg.tuning)


def _compile_rules(parsed: Grammar, vocab: Vocabulary, key: str, limits: CfsmLimits,
                   tuning: IndexTuning) -> Index | GrammarIndex:
    grammar = inline_rules(parsed, limits.max_inline_nodes)
    root = grammar.root
    body = regular_root(grammar)
    if body is not None:
        dfa = build_dfa_direct(body, limit=limits.max_dfa_states) or build_dfa(body, limit=limits.max_dfa_states)
        if dfa.num_states == 0:
            raise GrammarError(f"the language of rule {root!r} is empty", *grammar.positions.get(root, (0, 0)))
        return build_index(dfa, vocab, grammar=key, tuning=tuning)
    return compile_grammar(grammar, vocab, key, limits=limits)


def _schema_text(schema: Any) -> str:
    if isinstance(schema, str | bytes):
        schema = json.loads(schema)
    return json.dumps(schema, sort_keys=False, separators=(",", ":"))


def _rules_index(root: Node, rules: dict[str, Node], vocab: Vocabulary, grammar: str, limits: CfsmLimits | None = None,
                 approximations: tuple[Approximation, ...] = (), max_positions: int = 0,
                 lazy_positions: int = 0) -> GrammarIndex:
    start = "root"
    while start in rules:
        start += "_"
    try:
        return compile_grammar(Grammar(rules={start: root, **rules}, root=start), vocab, grammar, approximations,
                               max_positions, lazy_positions, limits)
    except RecursionError:
        # NOTE: rules nested deeper than Python's stack while inlining (a JSONSchemaBench schema)
        raise GrammarError("the grammar nests too deep to compile") from None


def compile_json_schema(schema: Any, vocab: Vocabulary, config: CfsmConfig | None = None) -> Index | GrammarIndex:
    """Compile a JSON Schema (dict, bool or JSON text) against `vocab`. No caching.

    With `config.recursion == "stack"` (the default) a schema that recurses (`$ref`) or takes
    free JSON compiles to a `GrammarIndex` (no depth bound), any other to an `Index`. Keywords it
    can only over-approximate are listed in `approximations` (with `config.strict`, they raise).
    Intersections (`enum` beside other keywords) over recursion compile unrolled, as "unroll" does.
    A pushdown matcher over `config.max_pushdown_positions` compiles unrolled too, when that
    automaton has at most `config.limits.fallback_dfa_states` states; a larger one compiles as the pushdown
    matcher with one rule per reference target (the schema's own language, no depth bound) whose
    keys are walked on first use.
    Raises `UnsupportedSchemaError` (keyword and JSON path) for what cannot be compiled.
    Where `config.narrow`'s subsets leave no document at all, the superset is compiled instead
    (its approximations reported as kind "superset").
    """
    cfg = config or CfsmConfig()
    try:
        return _compile_json_schema(schema, vocab, cfg)
    except UnsupportedSchemaError as err:
        if not cfg.narrow or cfg.strict or "accepts no string" not in str(err):
            raise
        return _compile_json_schema(schema, vocab, dataclasses.replace(cfg, narrow=False))


def _compile_json_schema(schema: Any, vocab: Vocabulary, cfg: CfsmConfig) -> Index | GrammarIndex:
    key = f"schema:{_schema_text(schema)}|{cfg.schema_key()}"
    if cfg.recursion != "stack":
        return _regular_schema_index(schema, vocab, cfg, key)
    try:
        node, rules, approximations = schema_grammar(schema, cfg)
        if not rules:
            index = _index_of(node, vocab, key, "schema", cfg)
            return dataclasses.replace(index, approximations=approximations) if approximations else index
        try:
            return _rules_index(node, rules, vocab, key, cfg.limits, approximations, cfg.max_pushdown_positions)
        except GrammarError:
            # NOTE: an intersection (enum or `not` beside other keywords) over nested free JSON or
            # a recursive reference has no pushdown form here: the regular compile, unrolled
            return _regular_schema_index(schema, vocab, cfg, key)
        except PushdownTooLargeError:
            # NOTE: a vocabulary walk per rule position (f8c7c83 made "stack" the default: a JSONSchemaBench
            # schema with one free JSON value took 2 s unrolled, 38 s this way): unrolled, as "unroll" does,
            # while that automaton stays small (`CfsmLimits.fallback_dfa_states`: JSONSchemaBench's govuk
            # schemas ran 12-14 s unrolled into the DFA limit, 1.6 s as rules); past it, the rules below
            try:
                return _regular_schema_index(schema, vocab, cfg, key, cfg.limits.fallback_dfa_states)
            except GrammarTooLargeError:
                matcher = _refs_rules_index(schema, vocab, cfg, key)
                # NOTE: no rule form (an intersection over references): the whole unrolled try
                return _regular_schema_index(schema, vocab, cfg, key) if matcher is None else matcher
    except (GrammarTooLargeError, SchemaTooLargeError):
        # references copied inline made the automaton (or the tree) too large: each reference
        # target becomes one rule of a pushdown matcher instead, compiled once
        matcher = _refs_rules_index(schema, vocab, cfg, key)
        if matcher is not None:
            return matcher
        # last resort: long string bounds approximated (reported; refused in strict mode)
        node, approximations = schema_tree(schema, cfg, loose_lengths=True)
        index = _index_of(node, vocab, key, "schema", cfg)
        return dataclasses.replace(index, approximations=approximations)


def _refs_rules_index(schema: Any, vocab: Vocabulary, cfg: CfsmConfig, key: str) -> GrammarIndex | None:
    """The pushdown matcher with one rule per reference target (`schema_grammar(refs_as_rules=True)`),
    or None where the schema has no such form (no rules, or one the network refuses)."""
    node, rules, approximations = schema_grammar(schema, cfg, refs_as_rules=True)
    if rules:
        with contextlib.suppress(GrammarError, GrammarTooLargeError):
            # NOTE: no unrolled form is left to fall back to: past max_pushdown_positions the
            # keys are walked on first use instead of one walk per position here
            return _rules_index(node, rules, vocab, key, cfg.limits, approximations,
                                lazy_positions=cfg.max_pushdown_positions)
    return None


def _regular_schema_index(schema: Any, vocab: Vocabulary, cfg: CfsmConfig, key: str,
                          max_states: int | None = None) -> Index:
    node, approximations = schema_tree(schema, cfg)
    index = _index_of(node, vocab, key, "schema", cfg, max_states)
    return dataclasses.replace(index, approximations=approximations) if approximations else index


def compile_json_object(vocab: Vocabulary, config: CfsmConfig | None = None, *,
                        object_only: bool = True) -> Index | GrammarIndex:
    """Free JSON (an object, or any value). With `config.recursion == "stack"` (the default) any
    depth (a `GrammarIndex`: compiled once per vocabulary and configuration, kept by `vocab`,
    each call a copy of that compile), else nested to `config.json_depth` levels (an `Index`;
    no caching)."""
    cfg = config or CfsmConfig()
    key = f"json:{object_only}|{cfg.schema_key()}"
    if cfg.recursion == "stack":
        def build() -> GrammarIndex:
            root, rules = json_value_grammar(cfg, object_only=object_only)
            return _rules_index(root, rules, vocab, key, cfg.limits)

        # NOTE: a fixed grammar per (object_only, config); guides fill only their copy's caches
        return vocab.derived(f"grammar:{key}", build).copy()
    node = json_value_node(cfg, object_only=object_only)
    return _index_of(node, vocab, key, "json", cfg)


class Compiler:
    """Compiles grammars for one vocabulary and keeps the results.

    In memory: an LRU of `config.cache_size` indexes keyed by (grammar, vocabulary
    fingerprint). On disk (when `config.cache_dir` is set): one `.npz` per key. Methods mutate
    only the caches; returned `Index` objects are shared and read-only.
    """

    def __init__(self, vocab: Vocabulary, config: CfsmConfig | None = None) -> None:
        self.vocab = vocab.prepare()  # the per-vocabulary tables, once, before any compile
        self.config = config or CfsmConfig()
        self._lru: OrderedDict[str, Index | GrammarIndex] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def compile_regex(self, pattern: str) -> Index:
        return self._get(f"regex:{pattern}{self.config.grammar_key()}", lambda: compile_regex(pattern, self.vocab, self.config))

    def compile_json_schema(self, schema: Any) -> Index | GrammarIndex:
        key = f"schema:{_schema_text(schema)}|{self.config.schema_key()}"
        return self._get(key, lambda: compile_json_schema(schema, self.vocab, self.config))

    def compile_ebnf(self, text: str, *, root: str = "root") -> Index | GrammarIndex:
        return self._get(f"ebnf:{root}:{text}{self.config.grammar_key()}", lambda: compile_ebnf(text, self.vocab, self.config, root=root))

    def compile_lark(self, text: str, *, start: str = "start") -> Index | GrammarIndex:
        return self._get(f"lark:{start}:{text}{self.config.grammar_key()}", lambda: compile_lark(text, self.vocab, self.config, start=start))

    def compile_json_object(self, *, object_only: bool = True) -> Index | GrammarIndex:
        key = f"json:{object_only}|{self.config.schema_key()}"
        return self._get(key, lambda: compile_json_object(self.vocab, self.config, object_only=object_only))

    def clear(self) -> None:
        """Drop the in-memory cache (the disk cache stays)."""
        self._lru.clear()

    def _get(self, grammar: str, build: Any) -> Any:
        key = hashlib.sha256(f"{grammar}|{self.vocab.fingerprint}".encode()).hexdigest()
        hit = self._lru.get(key)
        if hit is not None:
            self._lru.move_to_end(key)
            self.hits += 1
            return hit
        self.misses += 1
        index = self._load(key, grammar)
        if index is None:
            index = build()
            self._save(key, index)
        self._lru[key] = index
        while len(self._lru) > self.config.cache_size:
            self._lru.popitem(last=False)
        return index

    def _path(self, key: str) -> str | None:
        if not self.config.cache_dir:
            return None
        return os.path.join(self.config.cache_dir, f"cfsm-{key}.npz")

    def _load(self, key: str, grammar: str) -> Index | None:
        path = self._path(key)
        if path is None or not os.path.exists(path):
            return None
        with np.load(path) as data:
            dfa = Dfa(transitions=data["transitions"], accepting=data["accepting"], start=int(data["start"]))
            arrays = {name: data[name] for name in _INDEX_ARRAYS}
            notes = json.loads(str(data["approximations"])) if "approximations" in data else []
        return Index(vocab=self.vocab, dfa=dfa, grammar=grammar, approximations=tuple(Approximation(*n) for n in notes),
                     **arrays)

    def _save(self, key: str, index: Index | GrammarIndex) -> None:
        path = self._path(key)
        if path is None or not isinstance(index, Index):  # NOTE: pushdown matchers stay in memory only
            return
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".npz")
        with os.fdopen(fd, "wb") as f:
            np.savez(f, transitions=index.dfa.transitions, accepting=index.dfa.accepting,
                     start=np.int64(index.dfa.start), **{name: getattr(index, name) for name in _INDEX_ARRAYS},
                     approximations=np.array(json.dumps([[a.keyword, a.path, a.detail, a.kind] for a in index.approximations])))
        os.replace(tmp, path)
