"""Compile entry points: regex / JSON Schema / free JSON -> `Index`, with an LRU and disk cache."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from collections import OrderedDict
from typing import Any

import numpy as np

from cfsm.automaton import Dfa, build_dfa
from cfsm.config import CfsmConfig
from cfsm.direct import build_dfa_direct
from cfsm.errors import Approximation, UnsupportedSchemaError
from cfsm.index import Index, build_index
from cfsm.json_schema import json_value_node, schema_tree
from cfsm.regex_ast import Node
from cfsm.regex_parser import parse_regex
from cfsm.vocab import Vocabulary

__all__ = ["compile_regex", "compile_json_schema", "compile_json_object", "Compiler", "regex_dfa"]

_INDEX_ARRAYS = ("masks", "mask_row")


def regex_dfa(pattern: str) -> Dfa:
    """The minimal byte DFA of `pattern` (fullmatch semantics). Pure."""
    return build_dfa(parse_regex(pattern))


def _index_of(node: Node, vocab: Vocabulary, grammar: str, what: str) -> Index:
    dfa = build_dfa_direct(node) or build_dfa(node)  # the same Dfa either way
    if dfa.num_states == 0:
        raise UnsupportedSchemaError(what, "#", "the grammar accepts no string (check bounds, enum, recursion depth)")
    return build_index(dfa, vocab, grammar=grammar)


def compile_regex(pattern: str, vocab: Vocabulary, config: CfsmConfig | None = None) -> Index:
    """Compile a regex (fullmatch semantics) against `vocab`. No caching; mutates nothing.

    Raises `UnsupportedRegexError` for constructs outside the regular subset.
    """
    del config
    dfa = regex_dfa(pattern)
    return build_index(dfa, vocab, grammar=f"regex:{pattern}")


def _schema_text(schema: Any) -> str:
    if isinstance(schema, str | bytes):
        schema = json.loads(schema)
    return json.dumps(schema, sort_keys=False, separators=(",", ":"))


def compile_json_schema(schema: Any, vocab: Vocabulary, config: CfsmConfig | None = None) -> Index:
    """Compile a JSON Schema (dict, bool or JSON text) against `vocab`. No caching.

    Keywords it can only over-approximate are listed in `Index.approximations` (with
    `config.strict`, they raise). Raises `UnsupportedSchemaError` (keyword and JSON path) for
    what cannot be compiled.
    """
    cfg = config or CfsmConfig()
    node, approximations = schema_tree(schema, cfg)
    index = _index_of(node, vocab, f"schema:{_schema_text(schema)}|{cfg.schema_key()}", "schema")
    return dataclasses.replace(index, approximations=approximations) if approximations else index


def compile_json_object(vocab: Vocabulary, config: CfsmConfig | None = None, *, object_only: bool = True) -> Index:
    """Free JSON (an object, or any value) nested to `config.json_depth` levels. No caching."""
    cfg = config or CfsmConfig()
    node = json_value_node(cfg, object_only=object_only)
    return _index_of(node, vocab, f"json:{object_only}|{cfg.schema_key()}", "json")


class Compiler:
    """Compiles grammars for one vocabulary and keeps the results.

    In memory: an LRU of `config.cache_size` indexes keyed by (grammar, vocabulary
    fingerprint). On disk (when `config.cache_dir` is set): one `.npz` per key. Methods mutate
    only the caches; returned `Index` objects are shared and read-only.
    """

    def __init__(self, vocab: Vocabulary, config: CfsmConfig | None = None) -> None:
        self.vocab = vocab.prepare()  # the per-vocabulary tables, once, before any compile
        self.config = config or CfsmConfig()
        self._lru: OrderedDict[str, Index] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def compile_regex(self, pattern: str) -> Index:
        return self._get(f"regex:{pattern}", lambda: compile_regex(pattern, self.vocab, self.config))

    def compile_json_schema(self, schema: Any) -> Index:
        key = f"schema:{_schema_text(schema)}|{self.config.schema_key()}"
        return self._get(key, lambda: compile_json_schema(schema, self.vocab, self.config))

    def compile_json_object(self, *, object_only: bool = True) -> Index:
        key = f"json:{object_only}|{self.config.schema_key()}"
        return self._get(key, lambda: compile_json_object(self.vocab, self.config, object_only=object_only))

    def clear(self) -> None:
        """Drop the in-memory cache (the disk cache stays)."""
        self._lru.clear()

    def _get(self, grammar: str, build: Any) -> Index:
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

    def _save(self, key: str, index: Index) -> None:
        path = self._path(key)
        if path is None:
            return
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".npz")
        with os.fdopen(fd, "wb") as f:
            np.savez(f, transitions=index.dfa.transitions, accepting=index.dfa.accepting,
                     start=np.int64(index.dfa.start), **{name: getattr(index, name) for name in _INDEX_ARRAYS},
                     approximations=np.array(json.dumps([[a.keyword, a.path, a.detail] for a in index.approximations])))
        os.replace(tmp, path)
