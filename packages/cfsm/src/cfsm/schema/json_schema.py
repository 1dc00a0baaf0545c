"""JSON Schema -> syntax tree (then the usual DFA and `Index`).

Drafts 4 to 2020-12 as found in the wild. Objects list their properties in schema order (or in
any order with `CfsmConfig.any_order`); strings, numbers and formats are exact languages (see
`numeric` and `formats`); `pattern` has the specification's search semantics. Unknown keywords
are annotations and are ignored. Keywords a regular language cannot express exactly are
over-approximated (the grammar accepts a superset) and each is recorded as an `Approximation`
(`oneOf` as `anyOf` where its branches may overlap and lack simple negations, `uniqueItems`,
`not` beyond types and values, `if`/`then`/`else` without a simple negation, `dependencies`,
`contains`, `propertyNames`, `unevaluated*` where `unevaluated` cannot expand them, unknown
formats, patterns outside the regular subset, `multipleOf` that is not an integer or a power of
ten, thousands of counted characters / items: `MAX_COUNTED`, length bounds beside a `pattern` whose
product passes `MAX_PATTERN_LENGTH_STATES`); `CfsmConfig.strict` refuses them
instead. Malformed schemas raise `UnsupportedSchemaError` with their JSON path.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
from decimal import Decimal, InvalidOperation
from typing import Any
from urllib.parse import urldefrag

import numpy as np

from cfsm.automata.automaton import Dfa
from cfsm.config import CfsmConfig
from cfsm.errors import (
    Approximation,
    CfsmError,
    SchemaTooLargeError,
    UnsupportedRegexError,
    UnsupportedSchemaError,
)
from cfsm.grammar.rules import RuleRef
from cfsm.regex.formats import FORMAT_REGEXES
from cfsm.regex.json_lexical import JSON_CHAR, JSON_STRING, SHORT_ESCAPES
from cfsm.regex.json_values import BOOLEAN, INT, NUMBER, STRING_BODY, format_node, piece
from cfsm.regex.parser import parse_regex
from cfsm.regex.syntax import (
    EMPTY,
    NOTHING,
    Chars,
    Complement,
    Intersect,
    Node,
    Repeat,
    Scope,
    Sep,
    alt,
    cat,
    lit,
)
from cfsm.schema.json_object import MAX_ANY_ORDER_PROPERTIES, object_members
from cfsm.schema.keywords import (
    ALL_TYPES,
    STRUCTURAL,
    negation,
)
from cfsm.schema.merge import (
    ALL_FORMATS,
    ALL_PATTERNS,
    JSON_TYPES,
    Approximate,
    finite_values,
    json_type,
    merge_schemas,
    quiet_merge,
    same_json,
    type_set,
)
from cfsm.schema.narrow import (
    META_SCHEMA_SUBSET,
    multiple_of_subset,
    negation_subset,
    possible_types,
    prefer_declared,
    unique_by_type,
    unique_sequences,
)
from cfsm.schema.numeric import decimal_range, int_range, multiple_of
from cfsm.schema.patterns import search_body
from cfsm.schema.refs import RefResolver, check_depth, is_meta_schema, meta_schema_fragment
from cfsm.schema.unevaluated import expand_unevaluated, mentions_unevaluated

__all__ = ["schema_to_node", "schema_tree", "schema_grammar", "json_value_node", "json_value_grammar",
           "JSON_VALUE_RULE", "MAX_ANY_ORDER_PROPERTIES", "MAX_SCHEMA_DEPTH"]

JSON_VALUE_RULE = "json_value"  # the rule of free JSON in rule mode

# `uniqueItems` is exact over items of at most this many scalar values (sequences of distinct
# values: one automaton state per subset), and `contains` for `minContains` up to this
MAX_UNIQUE_VALUES = 8
# string lengths counted exactly when a schema's exact automaton is too large (`schema_tree(...,
# loose_lengths=True)`, the compiler's last resort)
MAX_EXACT_LENGTH = 256
# a string's length bounds beside a `pattern` are exact while the pattern's DFA states times the
# bound stay within this (their product's size); past it the bounds are approximated (reported)
MAX_PATTERN_LENGTH_STATES = 20_000
# likewise item counts (`minItems` / `maxItems` over items that are not free JSON)
MAX_EXACT_ITEMS = 64
# counted characters and items above those bounds that one exact compile spells out; past this
# (outside strict mode) the bounds above them are approximated up front (reported)
MAX_COUNTED = 2048
MAX_MIN_CONTAINS = 4
# `oneOf` of branches that may overlap is exact as the alternatives "branch i and no other" when
# there are at most this many branches, each with a simple negation
MAX_ONE_OF_PRODUCT = 4
# unevaluated* expansions nested in one another's flat schemas (a reference with siblings back
# to an ancestor would expand forever; past this the approximation takes over)
MAX_EXPANSION_NESTING = 8
# objects and arrays nested deeper than this in a schema document are refused up front (real
# schemas stay far below; the compile recurses per level)
MAX_SCHEMA_DEPTH = 128
# schema nodes one compile may visit: `CfsmLimits.max_schema_visits` (recursive references
# unrolled `max_recursion_depth` deep can grow exponentially: six definitions referring to each
# other; past it the compile starts over with recursion unrolled less deep)

_TYPES = JSON_TYPES
_TYPE_KEYWORDS = {
    "object": {"properties", "required", "additionalProperties", "patternProperties", "minProperties",
               "maxProperties", "propertyNames", "dependencies", "dependentRequired", "dependentSchemas",
               "unevaluatedProperties"},
    "array": {"items", "prefixItems", "minItems", "maxItems", "additionalItems", "uniqueItems", "contains",
              "minContains", "maxContains", "unevaluatedItems"},
    "string": {"minLength", "maxLength", "pattern", "format", ALL_PATTERNS, ALL_FORMATS},
    "number": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"},
}
# keywords recorded as approximations when present (what the grammar does instead)
_UNEVALUATED = frozenset({"unevaluatedProperties", "unevaluatedItems"})
# keywords that apply subschemas to the same instance (their evaluations count for unevaluated*)
_IN_PLACE = frozenset({"allOf", "anyOf", "oneOf", "if", "then", "else", "$ref", "$dynamicRef", "$recursiveRef",
                       "dependentSchemas", "dependencies"})

# an integer may be written with a zero fraction (`CfsmConfig.integers_as_floats`)
_ZERO_FRACTION = Repeat(cat(lit("."), Repeat(lit("0"), 1, None)), 0, 1)


def _dump(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


class SchemaCompiler:
    """`rules` (a dict, filled here) turns on rule mode: free JSON is a call of rule
    `JSON_VALUE_RULE`, and a `$ref` re-entered while it is being compiled becomes a call of a
    rule compiled once from its target, so nesting has no bound (cfsm.grammar matches it)."""

    def __init__(self, root: Any, config: CfsmConfig, rules: dict[str, Node] | None = None,
                 refs_as_rules: bool = False, loose_lengths: bool = False) -> None:
        self.root = root
        self.cfg = config
        self.rules = rules
        # every plain `$ref` is a call of its target's rule, compiled once (rule mode; for schemas
        # whose references, copied inline, make too large an automaton)
        self.refs_as_rules = refs_as_rules and rules is not None
        # string length bounds above MAX_EXACT_LENGTH are approximated (for schemas whose exact
        # automaton is too large: each counted character is a few states)
        self.loose_lengths = loose_lengths
        # characters and items counted exactly above those bounds (past MAX_COUNTED, the compile
        # starts over with loose bounds instead of building a giant automaton)
        self.counted = 0
        self._rule_of: dict[str, str] = {}  # reference target -> its rule (rule mode)
        if config.whitespace_pattern is not None:
            self.ws: Node = parse_regex(config.whitespace_pattern)
        elif config.whitespace == "flexible":
            self.ws = Repeat(Chars(((9, 10), (13, 13), (32, 32))), 0, None)
        else:
            self.ws = EMPTY
        self.comma = cat(self.ws, lit(","), self.ws)
        self.colon = cat(self.ws, lit(":"), self.ws)
        # references being compiled (by target) and how many of them are re-entries: recursion
        # nests at most `max_recursion_depth` re-entries deep, whichever references recur
        self.active_refs: dict[str, int] = {}
        self.recursion_level = 0
        self.refs = RefResolver(root)
        self.bases: list[str] = [""]  # base URIs of the schema resources being compiled
        self.approximations: dict[tuple[str, str], Approximation] = {}
        self.visits = 0
        self.recursion_seen = False
        # whether the document names unevaluated* at all (most do not: no expansion to look for)
        self.mentions_unevaluated = "unevaluated" in json.dumps(root, default=str)
        self.expansions = 0  # unevaluated* expansions being compiled, one inside another
        self._any: dict[int, Node] = {}
        # per compile: equal number bounds and formats share one (immutable) syntax tree
        self.memo: dict[tuple[Any, ...], Node] = {}

    # ---- helpers ---------------------------------------------------------------------------
    def approximate(self, keyword: str, path: str, detail: str) -> None:
        """Record that `keyword` at `path` is over-approximated; in strict mode, refuse it."""
        if self.cfg.strict:
            raise UnsupportedSchemaError(keyword, path, f"{detail}; refused in strict mode")
        self.approximations.setdefault((keyword, path), Approximation(keyword, path, detail))

    def narrowed(self, keyword: str, path: str, detail: str) -> None:
        """Record that `keyword` at `path` compiles to a subset of its language
        (`CfsmConfig.narrow`); in strict mode, refuse it."""
        if self.cfg.strict:
            raise UnsupportedSchemaError(keyword, path, f"{detail}; refused in strict mode")
        self.approximations.setdefault((keyword, path), Approximation(keyword, path, detail, "subset"))

    def any_value(self, depth: int) -> Node:
        if self.rules is not None:
            return self._value_rule()
        if depth not in self._any:
            scalars = alt(JSON_STRING, NUMBER, lit("true"), lit("false"), lit("null"))
            if depth <= 0:
                self._any[depth] = scalars
            else:
                inner = self.any_value(depth - 1)
                pair = cat(JSON_STRING, self.colon, inner)
                obj = cat(lit("{"), self.ws, Repeat(Sep(pair, self.comma), 0, 1), self.ws, lit("}"))
                arr = cat(lit("["), self.ws, Repeat(Sep(inner, self.comma), 0, 1), self.ws, lit("]"))
                self._any[depth] = alt(obj, arr, scalars)
        return self._any[depth]

    def _value_rule(self) -> Node:
        assert self.rules is not None
        if JSON_VALUE_RULE not in self.rules:
            value = RuleRef(JSON_VALUE_RULE)
            scalars = alt(JSON_STRING, NUMBER, lit("true"), lit("false"), lit("null"))
            pair = cat(JSON_STRING, self.colon, value)
            obj = cat(lit("{"), self.ws, Repeat(Sep(pair, self.comma), 0, 1), self.ws, lit("}"))
            arr = cat(lit("["), self.ws, Repeat(Sep(value, self.comma), 0, 1), self.ws, lit("]"))
            self.rules[JSON_VALUE_RULE] = alt(obj, arr, scalars)
        return RuleRef(JSON_VALUE_RULE)

    def free_object(self, depth: int) -> Node:
        pair = cat(JSON_STRING, self.colon, self.any_value(max(depth - 1, 0)))
        return cat(lit("{"), self.ws, Repeat(Sep(pair, self.comma), 0, 1), self.ws, lit("}"))

    # ---- schemas ---------------------------------------------------------------------------
    def node(self, schema: Any, path: str) -> Node:
        """The tree of `schema` (found at JSON pointer `path`). Raises `UnsupportedSchemaError`."""
        if not isinstance(schema, dict):
            return self._node(schema, path)
        base = self.refs.base_of(schema, self.bases[-1])
        self.bases.append(base)
        try:
            return self._node(schema, path)
        except (CfsmError, _TooManyVisits):
            raise
        except (TypeError, ValueError, KeyError, AttributeError, InvalidOperation, OverflowError) as exc:
            # NOTE: a keyword with a value of the wrong kind ("minLength": "3", "required": true)
            raise UnsupportedSchemaError("schema", path, f"malformed schema: {type(exc).__name__}: {exc}") from None
        finally:
            self.bases.pop()

    def _ref(self, schema: dict[str, Any], path: str) -> Node:
        key = "$ref" if "$ref" in schema else "$dynamicRef" if "$dynamicRef" in schema else "$recursiveRef"
        ref = schema[key]
        if not isinstance(ref, str):
            raise UnsupportedSchemaError(key, f"{path}/{key}", "must be a string")
        rest = {k: v for k, v in schema.items() if k != key}
        target, base = self.refs.resolve(ref, self.bases[-1], f"{path}/{key}")
        if key != "$ref":
            dynamic = self._dynamic_target(key, ref, target, base, rest, path)
            if dynamic is not None:
                return dynamic
        fragment = urldefrag(ref)[1]
        if target is True and is_meta_schema(base) and fragment.strip("/"):
            # NOTE: a part of a meta-schema: its own subschema where it is known (exact), else any JSON
            known = meta_schema_fragment(base, fragment)
            if known is not None:
                target = known
            elif self.cfg.narrow:
                self.narrowed(key, f"{path}/{key}", "an unknown part of a meta-schema accepts nothing")
                target = False
            else:
                self.approximate(key, f"{path}/{key}", "an unknown part of a meta-schema accepts any JSON")
        elif target is True and ref.split("://", 1)[-1].startswith(("json-schema.org", "spec.openapis.org")):
            if self.cfg.narrow:
                self.narrowed(key, f"{path}/{key}", "a meta-schema reference accepts the schemas true, false and {}")
                # NOTE: draft 4's meta-schema takes objects only
                target = {"const": {}} if "draft-04" in base or "draft-03" in base else META_SCHEMA_SUBSET
            else:
                self.approximate(key, f"{path}/{key}", "a meta-schema reference accepts any JSON")
        entered: list[tuple[str, bool]] = []
        ident = f"{base}#{id(target)}"
        if self.rules is not None and (self.refs_as_rules or self.active_refs.get(ident, 0) > 0) and \
                not any(_is_assertion(k) for k in rest):
            return self._ref_rule(ident, target, base, f"{path}/{key}")
        if not self._enter(ident, entered):
            return NOTHING
        self.bases.append(base)
        try:
            if any(_is_assertion(k) for k in rest):
                return self.node({"allOf": [target, rest]}, path)
            return self.node(target, f"{path}/{key}")
        finally:
            self.bases.pop()
            self._leave(entered)

    def _dynamic_target(self, key: str, ref: str, target: Any, base: str, rest: dict[str, Any],
                        path: str) -> Node | None:
        """`$dynamicRef` / `$recursiveRef`: None where the caller compiles it like `$ref` (exact when
        its static target is no dynamic anchor; else approximated and reported); else the node of
        the target the dynamic scope picks: the root resource's anchor of that name where it has
        one (outermost in every dynamic scope: exact), otherwise all the document's anchors of
        that name together (a subset, with `CfsmConfig.narrow`)."""
        name = ref.rsplit("#", 1)[-1] if key == "$dynamicRef" else ""
        anchor_key = "$dynamicAnchor" if key == "$dynamicRef" else "$recursiveAnchor"
        bookend = isinstance(target, dict) and (target.get(anchor_key) == name if key == "$dynamicRef"
                                                else target.get(anchor_key) is True)
        if key == "$dynamicRef" and not bookend:
            return None  # NOTE: the static target is no dynamic anchor: exactly a `$ref`
        if not bookend or not name:
            self.approximate(key, f"{path}/{key}", "resolved like $ref (no dynamic scope)")
            return None
        candidates = self.refs.dynamic_anchors(name)
        root_base = self.refs.base_of(self.root, "") if isinstance(self.root, dict) else ""
        outer = [c for c, b in candidates if b == root_base]
        chosen: list[tuple[Any, str]] = [(outer[0], root_base)] if outer else candidates
        if len(chosen) > 1 or chosen[0][0] is not target:
            if len(chosen) > 1:
                if not self.cfg.narrow or any(b == "" and self.bases[-1] != "" for _, b in chosen):
                    self.approximate(key, f"{path}/{key}", "resolved like $ref (no dynamic scope)")
                    return None
                self.narrowed(key, f"{path}/{key}", f"every $dynamicAnchor {name!r} of the document applies")
            refs = [{"$ref": f"{b}#{name}"} for _, b in chosen]
            return self.node({"allOf": [*refs, *([rest] if rest else [])]}, path)
        return None

    def _ref_rule(self, ident: str, target: Any, base: str, path: str) -> Node:
        """A call of the rule of reference target `ident`, compiled once (rule mode)."""
        assert self.rules is not None
        name = self._rule_of.get(ident)
        if name is None:
            name = self._rule_of[ident] = f"ref{len(self._rule_of)}"
            self.rules[name] = NOTHING  # NOTE: a placeholder while the body (which may call it) compiles
            self.bases.append(base)
            try:
                self.rules[name] = self.node(target, path)
            finally:
                self.bases.pop()
        return RuleRef(name)

    def _enter(self, ident: str, entered: list[tuple[str, bool]]) -> bool:
        """Mark reference target `ident` as being compiled (appended to `entered`); False when it
        is a re-entry beyond `max_recursion_depth` (the branch is dropped)."""
        reentry = self.active_refs.get(ident, 0) > 0
        self.recursion_seen |= reentry
        if reentry and self.recursion_level >= self.cfg.max_recursion_depth:
            return False
        self.active_refs[ident] = self.active_refs.get(ident, 0) + 1
        self.recursion_level += reentry
        entered.append((ident, reentry))
        return True

    def _leave(self, entered: list[tuple[str, bool]]) -> None:
        for ident, reentry in entered:
            self.active_refs[ident] -= 1
            self.recursion_level -= reentry
        entered.clear()

    def _resolved(self, sub: Any, path: str, entered: list[tuple[str, bool]]) -> Any:
        """`sub` with its `$ref`s followed (for merging under allOf); the targets are entered
        (see `_enter`; the caller leaves them after compiling). False when recursion is too deep."""
        while isinstance(sub, dict) and isinstance(sub.get("$ref"), str):
            extra = {k: v for k, v in sub.items() if k != "$ref"}
            target, base = self.refs.resolve(sub["$ref"], self.bases[-1], f"{path}/$ref")
            if target is True and is_meta_schema(base):
                known = meta_schema_fragment(base, urldefrag(sub["$ref"])[1])
                target = True if known is None else known
            if not self._enter(f"{base}#{id(target)}", entered):
                return False
            # NOTE: the target first, so that its `$id` stays the base of what it contains
            sub = extra if target is True else merge_schemas(self._inner(target, path), extra, path, self.approximate,
                                                             self._cut) if isinstance(target, dict) else target
        return sub

    def _merge(self, a: dict[str, Any], b: Any, path: str) -> dict[str, Any]:
        """`a` and `b` both; `b` is the inner schema (a subschema `a` applies in place)."""
        return merge_schemas(a, self._inner(b, path), path, self.approximate, self._cut)

    @property
    def _cut(self) -> Approximate | None:
        """How merges cut a product of alternatives too large to spell out: to a subset (reported
        by `narrowed`, `CfsmConfig.narrow`), else to a superset (None: reported by `approximate`)."""
        return self.narrowed if self.cfg.narrow else None

    def _inner(self, b: Any, path: str) -> Any:
        """`b` made ready to merge into the schema that applies it in place: its conditionals kept
        together (`_conditional_kept_together`), its `unevaluated*` keywords (which would see only
        its own evaluations, lost in the merge) dropped and approximated."""
        if isinstance(b, dict) and _CONDITIONAL & b.keys():
            b = _conditional_kept_together(b)
        if isinstance(b, dict) and _UNEVALUATED & b.keys():
            for key in sorted(_UNEVALUATED & b.keys()):
                if b[key] not in (True, {}):
                    self.approximate(key, f"{path}/{key}", "not enforced inside an in-place applicator")
            b = {k: v for k, v in b.items() if k not in _UNEVALUATED}
        return b

    def _plain_ref(self, rest: dict[str, Any], sub: Any) -> bool:
        """Rule mode, and `sub` a reference that `rest` does not narrow: compiled as a reference
        (a rule where it recurses) rather than merged (which unrolls)."""
        return (self.rules is not None and isinstance(sub, dict) and isinstance(sub.get("$ref"), str)
                and not any(_is_assertion(k) for k in rest))

    def branch(self, rest: dict[str, Any], sub: Any, path: str) -> Node:
        """`rest` and `sub` both (one branch of anyOf / oneOf / if)."""
        if self._plain_ref(rest, sub) or not any(_is_assertion(k) for k in rest):
            # NOTE: `rest` asserts nothing: `sub` alone, under the current base (merged, `rest`'s `$id` would win)
            return self.node(sub, path)
        entered: list[tuple[str, bool]] = []
        try:
            sub = self._resolved(sub, path, entered)
            if sub is False:
                return NOTHING
            return self.node(rest if sub is True else self._merge(rest, sub, path), path)
        finally:
            self._leave(entered)

    def _node(self, schema: Any, path: str) -> Node:
        self.visits += 1
        if self.visits > self.cfg.limits.max_schema_visits:
            raise _TooManyVisits
        if schema is True or schema == {}:
            return self.any_value(self.cfg.json_depth)
        if schema is False:
            return NOTHING
        if not isinstance(schema, dict):
            raise UnsupportedSchemaError("schema", path, f"expected an object or a boolean, got {type(schema).__name__}")
        if _IN_PLACE & schema.keys() and set(schema) - STRUCTURAL != {"$ref"} and \
                self.expansions < MAX_EXPANSION_NESTING and mentions_unevaluated(self, schema):
            # exact where it can be: alternatives whose evaluated properties / items are known
            # (a plain `$ref` compiles its target, which expands itself)
            flats = expand_unevaluated(self, schema, path)
            if flats is not None:
                self.expansions += 1
                try:
                    return alt(*(self.node(flat, path) for flat in flats)) if flats else NOTHING
                finally:
                    self.expansions -= 1
        if _UNEVALUATED & schema.keys() and _IN_PLACE & schema.keys():
            # NOTE: in-place applicators evaluate properties / items the merged schema cannot
            # attribute (anyOf branches that also match, `if`, conflicting prefixItems): the
            # unevaluated* keywords beside them are approximated (dropped); alone, they are exact
            narrowed = _unevaluated_narrowed(schema) if self.cfg.narrow else None
            for key in sorted(_UNEVALUATED & schema.keys()):
                if schema[key] in (True, {}):
                    continue
                if narrowed is not None:
                    self.narrowed(key, f"{path}/{key}", "applied to every member the schema's own keywords do not "
                                  "declare (also those its in-place applicators evaluate)")
                else:
                    self.approximate(key, f"{path}/{key}", "not enforced beside in-place applicators")
            schema = narrowed if narrowed is not None else {k: v for k, v in schema.items() if k not in _UNEVALUATED}
        if "$ref" in schema or "$dynamicRef" in schema or "$recursiveRef" in schema:
            return self._ref(schema, path)
        if "allOf" in schema:
            if not isinstance(schema["allOf"], list):
                raise UnsupportedSchemaError("allOf", f"{path}/allOf", "must be a list")
            merged = {k: v for k, v in schema.items() if k != "allOf"}
            if len(schema["allOf"]) == 1 and self._plain_ref(merged, schema["allOf"][0]):
                return self.node(schema["allOf"][0], f"{path}/allOf/0")
            entered: list[tuple[str, bool]] = []
            try:
                for i, sub in enumerate(schema["allOf"]):
                    sub = self._resolved(sub, f"{path}/allOf/{i}", entered)
                    if sub is False:
                        return NOTHING
                    if sub is True:
                        continue
                    merged = self._merge(merged, sub, f"{path}/allOf/{i}")
                return self.node(merged, path)
            finally:
                self._leave(entered)
        for key in ("anyOf", "oneOf"):
            if key in schema:
                if not isinstance(schema[key], list):
                    raise UnsupportedSchemaError(key, f"{path}/{key}", "must be a list")
                rest = {k: v for k, v in schema.items() if k != key}
                branches = list(schema[key])
                if key == "oneOf" and len(branches) > 1:
                    branches = self.exclusive(branches, f"{path}/oneOf", rest)
                return alt(*(self.branch(rest, sub, f"{path}/{key}/{i}") for i, sub in enumerate(branches)))
        dependent = _dependent_schema(schema)
        if dependent is None and self.cfg.narrow:
            absent = _dependents_absent(schema)
            if absent is not None:
                self.narrowed("dependentSchemas", f"{path}/dependentSchemas", "the properties with dependent schemas "
                              "are absent")
                return self.node(absent, path)
        if dependent is not None:
            # exact: either the property is absent, or present and the dependent schema holds
            key, name, sub, rest = dependent
            present = {**rest, "required": [*rest.get("required", []), name]}
            absent = {**rest, "properties": {**rest.get("properties", {}), name: False}}
            return alt(self.branch(present, sub, f"{path}/{key}/{name}"), self.node(absent, path))
        if "if" in schema:
            rest = {k: v for k, v in schema.items() if k not in ("if", "then", "else")}
            negated = negation(schema["if"]) if "then" in schema or "else" in schema else None
            if negated is not None:
                # exact: (if and then) or (not if and else), `not if` spelled as a schema
                return alt(self.branch(rest, {"allOf": [schema["if"], schema.get("then", True)]}, f"{path}/then"),
                           self.branch(rest, {"allOf": [negated, schema.get("else", True)]}, f"{path}/else"))
            if self.cfg.narrow and ("then" in schema or "else" in schema):
                # a subset: (if and then) or (a subset of `not if`, and else)
                self.narrowed("if", f"{path}/if", "the else branch only for values the condition surely rejects "
                              "(by type or simple keywords)")
                subset = negation_subset(schema["if"], declare=not self.mentions_unevaluated)
                return alt(self.branch(rest, {"allOf": [schema["if"], schema.get("then", True)]}, f"{path}/then"),
                           self.branch(rest, {"allOf": [subset, schema.get("else", True)]}, f"{path}/else")
                           if subset is not False else NOTHING)
            if "then" in schema and "else" in schema:
                self.approximate("if", f"{path}/if", "compiled as anyOf [then, else] (the condition is not checked)")
                # NOTE: (if and then) or else, a superset still; the condition's property names are declared
                # (asserting nothing) in both, so that they may come before the branches' own
                cond = schema["if"]
                names: dict[str, Any] = {"properties": dict.fromkeys(cond["properties"], {})} \
                    if isinstance(cond, dict) and isinstance(cond.get("properties"), dict) else {}
                return alt(self.branch(rest, {"allOf": [cond, schema["then"]]}, f"{path}/then"),
                           self.branch(rest, {"allOf": [names, schema["else"]]}, f"{path}/else"))
            if "then" in schema or "else" in schema:
                self.approximate("if", f"{path}/if", "the conditional branch is not enforced")
            return self.node(rest, path)
        if self.cfg.narrow and "not" in schema and not _not_exact(schema["not"]):
            # a subset: the values failing one of the negated schema's simple keywords, or of a type it cannot have
            self.narrowed("not", f"{path}/not", "only values that surely fail the negated schema (by type, simple "
                          "keywords or properties)")
            subset = negation_subset(schema["not"], declare=not self.mentions_unevaluated)
            rest = {k: v for k, v in schema.items() if k != "not"}
            return NOTHING if subset is False else self.branch(rest, subset, f"{path}/not")
        return self._typed_union(schema, path)

    def exclusive(self, branches: list[Any], path: str, rest: dict[str, Any] | None = None) -> list[Any]:
        """`oneOf` as alternatives that are exact where they can be: the branches themselves when
        no two can match one value beside the schema's other keywords `rest` (`_disjoint`), else
        branch i with every other branch negated where each has a simple negation (`negation`);
        otherwise the branches as `anyOf`, reported."""
        resolved = [self.peek(b) for b in branches]
        applied = [quiet_merge(rest, b) if isinstance(b, dict) and rest else b for b in resolved]
        if all(_disjoint(a, b) for a, b in itertools.combinations(applied, 2)):
            return branches
        negated = [negation(b) for b in resolved]
        if len(branches) <= MAX_ONE_OF_PRODUCT and all(n is not None for n in negated):
            return [{"allOf": [b, *(n for j, n in enumerate(negated) if j != i)]} for i, b in enumerate(branches)]
        if self.cfg.narrow:
            subsets = [negation_subset(b, declare=not self.mentions_unevaluated) for b in resolved]
            kept = [possible_types({"allOf": [b, *(n for j, n in enumerate(subsets) if j != i)]})
                    for i, b in enumerate(resolved)]
            if all(kept):  # NOTE: else a branch would lose every value (objects negated only by type)
                self.narrowed("oneOf", path, "each branch only where no other branch can match (by type or simple "
                              "keywords)")
                return [{"allOf": [b, *(prefer_declared(n, applied[i]) for j, n in enumerate(subsets) if j != i)]}
                        for i, b in enumerate(branches)]
        self.approximate("oneOf", path, "compiled as anyOf (exclusivity not enforced)")
        return branches

    def peek(self, sub: Any) -> Any:
        """`sub` with a plain `$ref` followed (for comparisons only; nothing is entered), or
        `sub` itself where the reference does not resolve here."""
        for _ in range(8):
            if not (isinstance(sub, dict) and isinstance(sub.get("$ref"), str) and not set(sub) - STRUCTURAL - {"$ref"}):
                break
            try:
                sub, _base = self.refs.resolve(sub["$ref"], self.bases[-1], "#")
            except CfsmError:
                break
        return sub

    def _typed_union(self, schema: dict[str, Any], path: str) -> Node:
        types = self._types(schema, path)
        excluded: list[Any] = []
        if "not" in schema:
            types = self._not(schema["not"], types, f"{path}/not", excluded)
        if "enum" in schema or "const" in schema:
            values = [schema["const"]] if "const" in schema else list(schema["enum"])
            if types is not None:
                values = [v for v in values if json_type(v) in types or (json_type(v) == "integer" and "number" in types)]
            values = [v for v in values if not any(same_json(v, x) for x in excluded)]
            if any(x is _NON_INTEGER for x in excluded):
                values = [v for v in values if json_type(v) != "integer"]
            if not values:
                return NOTHING
            listed = alt(*(self.value_node(v) for v in values))
            others = {k: v for k, v in schema.items() if k not in ("enum", "const", "type", "not") and _is_assertion(k)}
            if not others:
                return listed
            # NOTE: other keywords still apply to the listed values (exact: the intersection)
            rest = {k: v for k, v in schema.items() if k not in ("enum", "const")}
            return Intersect([listed, self._typed_union(rest, path)])
        if excluded:
            if types is None:
                inferred = [t for t, kws in _TYPE_KEYWORDS.items() if kws & schema.keys()]
                types = inferred if self.cfg.infer_types and inferred else list(ALL_TYPES)
            if "number" in types and "integer" in types:
                types = [t for t in types if t != "integer"]
            return alt(*(self._excluding(t, self.typed(t, schema, path), excluded, f"{path}/not") for t in types))
        if types is None:
            inferred = [t for t, kws in _TYPE_KEYWORDS.items() if kws & schema.keys()]
            if not self.cfg.infer_types:
                if not inferred:
                    return self.any_value(self.cfg.json_depth)
                types = list(ALL_TYPES)
            elif not inferred:
                return self.any_value(self.cfg.json_depth)
            else:
                types = inferred
        if "number" in types and "integer" in types:
            types = [t for t in types if t != "integer"]
        return alt(*(self.typed(t, schema, path) for t in types))

    def value_node(self, value: Any) -> Node:
        """The JSON text of `value`, with this compile's whitespace between its tokens."""
        if isinstance(value, dict):
            if self.cfg.any_order and len(value) > 1:
                # NOTE: object equality ignores key order: the object of exactly these members, in any order
                # (the properties machinery, with its own bound on the orders it spells out)
                return self.typed("object", {"properties": {k: {"const": v} for k, v in value.items()},
                                             "required": list(value), "additionalProperties": False}, "/const")
            pairs = [cat(lit(_dump(k)), self.colon, self.value_node(v)) for k, v in value.items()]
            return cat(lit("{"), self.ws, _joined(pairs, self.comma), self.ws, lit("}"))
        if isinstance(value, list):
            return cat(lit("["), self.ws, _joined([self.value_node(v) for v in value], self.comma), self.ws, lit("]"))
        if self.cfg.integers_as_floats and isinstance(value, int | float) and not isinstance(value, bool) \
                and float(value).is_integer() and abs(value) < 2**63:
            return cat(lit(str(int(value))), _ZERO_FRACTION)  # 1, 1.0 and 1.00 are one value
        return lit(_dump(value))

    def _types(self, schema: dict[str, Any], path: str) -> list[str] | None:
        types = schema.get("type")
        if types is None:
            return None
        if isinstance(types, str):
            types = [types]
        if not isinstance(types, list):
            raise UnsupportedSchemaError("type", f"{path}/type", f"expected a string or a list, got {types!r}")
        known: list[str] = []
        for t in types:
            if t in _TYPES:
                known.append(t)
            elif t == "any" or isinstance(t, dict):  # draft 3: "any", or a schema as a type
                return None
            else:
                raise UnsupportedSchemaError("type", f"{path}/type", f"unknown type {t!r}; expected one of {_TYPES}")
        return known

    def _not(self, sub: Any, types: list[str] | None, path: str, excluded: list[Any]) -> list[str] | None:
        """`not`: exact when it only names types (they are removed), lists values (`const` /
        `enum`: appended to `excluded`, which the caller removes) or is a boolean; otherwise
        recorded as an approximation. Returns the remaining types (None: any)."""
        if sub is True or sub == {}:
            return []
        if sub is False:
            return types
        if isinstance(sub, dict) and set(sub) - STRUCTURAL == {"anyOf"} and isinstance(sub["anyOf"], list):
            for i, part in enumerate(sub["anyOf"]):  # neither of them (`not` merged under allOf)
                types = self._not(part, types, f"{path}/anyOf/{i}", excluded)
            return types
        if isinstance(sub, dict) and set(sub) - STRUCTURAL in ({"const"}, {"enum"}) and \
                isinstance(sub.get("enum", []), list):
            excluded.extend([sub["const"]] if "const" in sub else sub["enum"])
            return types
        if isinstance(sub, dict) and set(sub) <= {"type", "title", "description", "$comment"}:
            named = self._types(sub, path) or []
            if "number" in named:
                named = [*named, "integer"]
            base = list(types) if types is not None else list(_TYPES)
            if "integer" in named and "number" in base and "number" not in named:
                # numbers that are not integers: spelled with a non-zero fraction digit and no
                # exponent (`_excluding`; a subset, as for excluded values)
                excluded.append(_NON_INTEGER)
            return [t for t in base if t not in named]
        if self.cfg.narrow:
            self.narrowed("not", path, "only the JSON types the negated schema cannot have")
            rejected = type_set(sub)
            base = list(types) if types is not None else list(_TYPES)
            return [t for t in base if ("number" if t == "integer" else t) not in rejected]
        self.approximate("not", path, "not enforced (only `not` over types is)")
        return types

    def _excluding(self, t: str, node: Node, excluded: list[Any], path: str) -> Node:
        """`node` (of type `t`) without the JSON values in `excluded` (`not` of `const` / `enum`).
        Exact for scalars; numbers are then spelled without an exponent (a subset: the spellings of
        a number with exponents are not a regular language); objects and arrays are approximated."""
        if any(v is _NON_INTEGER for v in excluded):
            excluded = [v for v in excluded if v is not _NON_INTEGER]
            if t == "integer":
                return NOTHING
            if t == "number":
                node = Intersect([node, _NON_INTEGER_TEXT])
        mine = [v for v in excluded if json_type(v) == t or t == "number" and json_type(v) == "integer"]
        if not mine:
            return node
        if t == "null":
            return NOTHING
        if t == "boolean":
            return alt(*(lit(_dump(b)) for b in (True, False) if not any(same_json(b, v) for v in mine)))
        if t == "string":
            return Intersect([node, Complement(alt(*(_string_spellings(v) for v in mine)))])
        if t in ("number", "integer"):
            spelled = alt(*(_number_spellings(v) for v in mine))
            plain = cat(INT, Repeat(cat(lit("."), Repeat(Chars(((48, 57),)), 1, None)), 0, 1))
            return Intersect([node, plain, Complement(spelled)])
        self.approximate("not", path, f"{t} values of a const / enum are not excluded")
        return node

    def property_names(self, sub: Any, path: str) -> Node | None:
        """`propertyNames` as the language of quoted key texts (None: any key). Exact for string
        keywords (pattern, lengths, format, enum / const); anything else is approximated."""
        if sub is True or sub == {}:
            return None
        if sub is False:
            return NOTHING
        keys = set(sub) - STRUCTURAL if isinstance(sub, dict) else {"?"}
        types = sub.get("type", "string") if isinstance(sub, dict) else None
        if not keys <= _NAME_KEYWORDS or not (types == "string" or isinstance(types, list) and "string" in types):
            self.approximate("propertyNames", path, "not enforced on property names (only string keywords are)")
            return None
        lang = self.string(sub, path)
        if "enum" in sub or "const" in sub:
            values = [sub["const"]] if "const" in sub else list(sub["enum"])
            listed = alt(*(lit(_dump(v)) for v in values if isinstance(v, str)))
            lang = Intersect([listed, lang])
        return lang

    def typed(self, t: str, schema: dict[str, Any], path: str) -> Node:
        if t == "null":
            return lit("null")
        if t == "boolean":
            return piece(BOOLEAN)
        if t == "string":
            return self.string(schema, path)
        if t in ("integer", "number"):
            return self.number(schema, path, integer=t == "integer")
        if t == "array":
            return self.array(schema, path)
        return self.object(schema, path)

    def string(self, schema: dict[str, Any], path: str) -> Node:
        langs: list[Node] = []
        formats = [schema["format"]] if "format" in schema else []
        if not self.cfg.assert_formats:
            formats = []  # NOTE: an annotation, as draft 2019-09 and later say by default
        for fmt in [*formats, *(schema.get(ALL_FORMATS, []) if self.cfg.assert_formats else [])]:
            if fmt in FORMAT_REGEXES:
                langs.append(piece(format_node(fmt)))
            else:
                self.approximate("format", f"{path}/format", f"format {fmt!r} is not checked (known: {sorted(FORMAT_REGEXES)})")
        patterns = [schema["pattern"]] if "pattern" in schema else []
        pattern_states = 1
        for pattern in [*patterns, *schema.get(ALL_PATTERNS, [])]:
            try:
                lang, states = _pattern_lang(pattern, self.cfg.limits.max_dfa_states)
            except UnsupportedRegexError as exc:
                self.approximate("pattern", f"{path}/pattern", f"not enforced: {exc}")
            else:
                langs.append(lang)
                pattern_states *= states
        lo, hi = int(schema.get("minLength", 0)), schema.get("maxLength")
        if hi is not None and lo > int(hi):
            return NOTHING  # NOTE: no string is valid (a Repeat with lo > hi would build some language)
        if (lo or hi is not None) and pattern_states > 1:
            # NOTE: the exact language beside a pattern is their product, up to the pattern's states
            # times the bound (a word-count pattern {0,199} beside maxLength 300: ~10^6 states)
            size = pattern_states * (max(lo, 0 if hi is None else int(hi)) + 1)
            if size > MAX_PATTERN_LENGTH_STATES:
                self.approximate("maxLength" if hi is not None else "minLength", path,
                                 f"length bounds beside `pattern` are not enforced (the exact automaton would "
                                 f"have up to {size} states)")
                lo, hi = 0, None
        if not self.loose_lengths and (lo > MAX_EXACT_LENGTH or hi is not None and int(hi) > MAX_EXACT_LENGTH):
            self.counted += max(lo, 0 if hi is None else int(hi))
        if self.loose_lengths and (lo > MAX_EXACT_LENGTH or hi is not None and int(hi) > MAX_EXACT_LENGTH):
            self.approximate("maxLength" if hi is not None and int(hi) > MAX_EXACT_LENGTH else "minLength", path,
                             f"length bounds above {MAX_EXACT_LENGTH} are not enforced (the exact automaton is too large)")
            lo = lo if lo <= MAX_EXACT_LENGTH else 0
            hi = hi if hi is not None and int(hi) <= MAX_EXACT_LENGTH else None
        if lo or hi is not None:
            langs.append(Repeat(JSON_CHAR, lo, None if hi is None else int(hi)))
        if not langs:
            body: Node = STRING_BODY
        elif len(langs) == 1:
            body = langs[0]
        else:
            body = Intersect(langs)
        return cat(lit('"'), body, lit('"'))

    def number(self, schema: dict[str, Any], path: str, integer: bool) -> Node:
        keys = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
        key = ("number", integer, *(repr(schema.get(k)) for k in keys))
        hit = self.memo.get(key)
        if hit is None:
            hit = self._number(schema, path, integer)
            mult = schema.get("multipleOf")
            whole = integer or isinstance(mult, int | float) and not isinstance(mult, bool) and mult > 0 and \
                float(mult).is_integer()  # `_number` spells multiples of an integer as integers
            if whole and self.cfg.integers_as_floats:
                hit = cat(hit, _ZERO_FRACTION)
            self.memo[key] = hit
        return hit

    def _number(self, schema: dict[str, Any], path: str, integer: bool) -> Node:
        lo, lo_excl = schema.get("minimum"), False
        hi, hi_excl = schema.get("maximum"), False
        xmin, xmax = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
        if isinstance(xmin, bool):  # draft 4
            lo_excl = xmin
        elif xmin is not None and (lo is None or Decimal(str(xmin)) >= Decimal(str(lo))):
            lo, lo_excl = xmin, True
        if isinstance(xmax, bool):
            hi_excl = xmax
        elif xmax is not None and (hi is None or Decimal(str(xmax)) <= Decimal(str(hi))):
            hi, hi_excl = xmax, True
        dlo = None if lo is None else Decimal(str(lo))
        dhi = None if hi is None else Decimal(str(hi))
        mult = schema.get("multipleOf")
        if mult is not None:
            dm = Decimal(str(mult))
            if dm <= 0:
                raise UnsupportedSchemaError("multipleOf", f"{path}/multipleOf", "must be positive")
            if dm == dm.to_integral_value():
                integer = True
            elif not integer and dm.as_tuple().digits == (1,):
                places = -int(dm.as_tuple().exponent)
                frac = Repeat(cat(lit("."), Repeat(Chars(((48, 57),)), 1, places)), 0, 1)
                base = cat(INT, frac) if dlo is None and dhi is None else decimal_range(dlo, lo_excl, dhi, hi_excl)
                return Intersect([base, cat(INT, frac)])
            elif self.cfg.narrow:
                mult = multiple_of_subset(dm)
                self.narrowed("multipleOf", f"{path}/multipleOf", f"integer multiples of {mult}" if mult else "only 0")
                integer = True
            else:
                self.approximate("multipleOf", f"{path}/multipleOf",
                                 "not enforced (only integers and powers of ten: 0.1, 0.01, ...)")
                mult = None
        if integer:
            ilo = None if dlo is None else int(dlo.to_integral_value(rounding="ROUND_CEILING"))
            ihi = None if dhi is None else int(dhi.to_integral_value(rounding="ROUND_FLOOR"))
            if ilo is not None and lo_excl and Decimal(ilo) == dlo:
                ilo += 1
            if ihi is not None and hi_excl and Decimal(ihi) == dhi:
                ihi -= 1
            rng = piece(INT) if ilo is None and ihi is None else int_range(ilo, ihi)
            if mult == 0:
                return Intersect([rng, lit("0")])
            if mult is not None and int(Decimal(str(mult))) != 1:
                return Intersect([rng, multiple_of(int(Decimal(str(mult))))])
            return rng
        if dlo is None and dhi is None:
            return piece(NUMBER)
        return decimal_range(dlo, lo_excl, dhi, hi_excl)

    def array(self, schema: dict[str, Any], path: str) -> Node:
        prefix = schema.get("prefixItems", [])
        items = schema.get("items")
        if isinstance(items, list):  # draft 4-7 tuple form
            prefix, items = items, schema.get("additionalItems")
        unevaluated = schema.get("unevaluatedItems", True)
        if unevaluated not in (True, {}) and items is None:
            negated = negation(schema["contains"]) if "contains" in schema else None
            if "contains" not in schema:
                items = unevaluated  # NOTE: the items after the prefix are the unevaluated ones
            elif negated is not None:
                # an item after the prefix matches `contains` (evaluated) or is unevaluated
                items = {"anyOf": [schema["contains"], {"allOf": [negated, unevaluated]}]}
            else:
                self.approximate("unevaluatedItems", f"{path}/unevaluatedItems", "not enforced beside contains")
        nodes = [self.node(p, f"{path}/prefixItems/{i}") for i, p in enumerate(prefix)]
        rest = None if items is False else (self.any_value(self.cfg.json_depth - 1) if items is None
                                            else self.node(items, f"{path}/items"))
        lo, hi = int(schema.get("minItems", 0)), schema.get("maxItems")
        if rest is not None and (lo > MAX_EXACT_ITEMS or hi is not None and int(hi) > MAX_EXACT_ITEMS):
            if not self.loose_lengths:
                self.counted += max(lo, 0 if hi is None else int(hi))
            else:
                self.approximate("maxItems" if hi is not None and int(hi) > MAX_EXACT_ITEMS else "minItems", path,
                                 f"item counts above {MAX_EXACT_ITEMS} are not enforced (the exact automaton is too "
                                 "large)")
                lo = min(lo, MAX_EXACT_ITEMS)
                hi = hi if hi is None or int(hi) <= MAX_EXACT_ITEMS else None
        k = len(nodes)
        contains = "contains" in schema and (schema.get("minContains", 1) != 0 or "maxContains" in schema)
        if schema.get("uniqueItems") is True and (hi is None or int(hi) > 1):
            listed = [self._finite_values(p) for p in prefix]
            more = [] if items is False else self._finite_values(items)
            if not contains and more is not None and all(v is not None for v in listed):
                distinct: list[Any] = []
                for v in [x for values in [*listed, more] for x in values or ()]:
                    if not any(same_json(v, x) for x in distinct):
                        distinct.append(v)
                where = [[next(i for i, x in enumerate(distinct) if same_json(v, x)) for v in values or ()]
                         for values in [*listed, more]]
                body = _unique_sequences([self.value_node(v) for v in distinct], where[:-1], where[-1], self.comma,
                                         lo, None if hi is None else int(hi))
                return cat(lit("["), self.ws, body, self.ws, lit("]"))
            # NOTE: exact only for items of at most MAX_UNIQUE_VALUES scalar values (above)
            if self.cfg.narrow and not contains:
                return unique_by_type(self, prefix, items, lo, None if hi is None else int(hi), path)
            if not contains and k > 1 and rest is not None and all(v is not None for v in listed):
                # the prefix items distinct from each other; the later ones may repeat any item
                self.approximate("uniqueItems", f"{path}/uniqueItems",
                                 "enforced among the prefix items only (later items may repeat)")
                distinct = []
                for v in [x for values in listed for x in values or ()]:
                    if not any(same_json(v, x) for x in distinct):
                        distinct.append(v)
                where = [[next(i for i, x in enumerate(distinct) if same_json(v, x)) for v in values or ()]
                         for values in listed]
                values = [self.value_node(v) for v in distinct]
                top = None if hi is None else int(hi)
                options: list[Node] = []
                if lo < k and (top is None or top >= 0):
                    options.append(_unique_sequences(values, where, [], self.comma, lo, min(k - 1, top if top is not None
                                                                                          else k - 1)))
                if top is None or top >= k:
                    full = _unique_sequences(values, where, [], self.comma, k, k)
                    tail_hi = None if top is None else top - k
                    options.append(cat(full, Repeat(cat(self.comma, rest), max(0, lo - k), tail_hi)))
                return cat(lit("["), self.ws, alt(*options) if options else NOTHING, self.ws, lit("]"))
            self.approximate("uniqueItems", f"{path}/uniqueItems", "not enforced (items may repeat)")
        if contains:
            wanted = int(schema.get("minContains", 1))
            if schema["contains"] is False:
                return NOTHING if wanted else self.array({k: v for k, v in schema.items() if k != "contains"}, path)
            most = schema.get("maxContains")
            simple = k == 0 and rest is not None and lo <= 1 and hi is None and schema.get("uniqueItems") is not True
            base = {} if items is None else {"allOf": [items]}
            if simple and rest is not None and most is None and wanted <= MAX_MIN_CONTAINS:
                hit = self.branch(base, schema["contains"], f"{path}/contains")
                loop = Repeat(cat(rest, self.comma), 0, None)
                body = cat(loop, hit, *([self.comma, loop, hit] * (wanted - 1)), Repeat(cat(self.comma, rest), 0, None))
                return cat(lit("["), self.ws, body, self.ws, lit("]"))
            negated = negation(schema["contains"])
            if simple and negated is not None and most is not None and int(most) <= MAX_MIN_CONTAINS:
                # exact: items that match `contains` counted between minContains and maxContains
                hit = self.branch(base, schema["contains"], f"{path}/contains")
                miss = self.branch(base, negated, f"{path}/contains")
                counts = [_counted(hit, miss, self.comma, j) for j in range(wanted, int(most) + 1)]
                return cat(lit("["), self.ws, alt(*counts) if counts else NOTHING, self.ws, lit("]"))
            self.approximate("contains", f"{path}/contains", "not enforced beyond a non-empty array")
            lo = max(lo, 1)
        options = []
        for c in range(0, k):
            if lo <= c and (hi is None or c <= hi):
                options.append(_joined(nodes[:c], self.comma))
        more_lo, more_hi = max(0, lo - k), None if hi is None else int(hi) - k
        if more_hi is None or more_hi >= more_lo:
            if rest is None:
                if more_lo == 0:
                    options.append(_joined(nodes, self.comma))
            elif k == 0:
                if more_lo == 0:
                    options.append(EMPTY)
                if more_hi is None:
                    options.append(cat(Sep(rest, self.comma), *([Repeat(cat(self.comma, rest), more_lo - 1, more_lo - 1)] if more_lo > 1 else [])))
                elif more_hi >= 1:
                    options.append(cat(rest, Repeat(cat(self.comma, rest), max(more_lo - 1, 0), more_hi - 1)))
            else:
                options.append(cat(_joined(nodes, self.comma), Repeat(cat(self.comma, rest), more_lo, more_hi)))
        return cat(lit("["), self.ws, alt(*options) if options else NOTHING, self.ws, lit("]"))

    def _finite_values(self, items: Any) -> list[Any] | None:
        """The distinct scalar values `items` allows when it only lists them (`enum`, `const`,
        boolean / null types) and they are at most `MAX_UNIQUE_VALUES`; else None."""
        if not isinstance(items, dict) or not set(items) - STRUCTURAL <= {"enum", "const", "type"}:
            return None
        types = self._types(items, "#")
        if "enum" in items or "const" in items:
            values = [items["const"]] if "const" in items else list(items["enum"])
            if types is not None:
                values = [v for v in values if json_type(v) in types or (json_type(v) == "integer" and "number" in types)]
        elif types is not None and set(types) <= {"boolean", "null"}:
            values = [*([True, False] if "boolean" in types else []), *([None] if "null" in types else [])]
        else:
            return None
        distinct: list[Any] = []
        for v in values:
            if isinstance(v, dict | list):
                return None
            if not any(same_json(v, x) for x in distinct):
                distinct.append(v)
        return distinct if len(distinct) <= MAX_UNIQUE_VALUES else None

    def object(self, schema: dict[str, Any], path: str) -> Node:
        if not _TYPE_KEYWORDS["object"] & schema.keys():
            # NOTE: an object schema without object keywords is any object, in every config
            return self.free_object(self.cfg.json_depth)
        return cat(lit("{"), self.ws, Scope(object_members(self, schema, path)), self.ws, lit("}"))


def _unevaluated_narrowed(schema: dict[str, Any]) -> dict[str, Any] | None:
    """`schema` with its unevaluated* keywords applied to every member its own keywords do not
    evaluate (`additionalProperties` / `items`; merges carry them onto the members in-place
    applicators declare): a subset of its language. None where its own keywords already use them."""
    out = {k: v for k, v in schema.items() if k not in _UNEVALUATED}
    props, items = schema.get("unevaluatedProperties", True), schema.get("unevaluatedItems", True)
    if props not in (True, {}):
        if {"additionalProperties", "patternProperties"} & schema.keys():
            return None
        out["additionalProperties"] = props
    if items not in (True, {}):
        if {"items", "prefixItems", "contains", "additionalItems"} & schema.keys():
            return None
        out["items"] = items
    return out


def _dependents_absent(schema: dict[str, Any]) -> dict[str, Any] | None:
    """`schema` with every property that has a dependent schema (`dependentSchemas`, schema
    entries of `dependencies`) declared `false` (absent): a subset. None where there are none."""
    names = [name for key in ("dependentSchemas", "dependencies") if isinstance(schema.get(key), dict)
             for name, sub in schema[key].items() if isinstance(sub, dict | bool) and sub not in (True, {})]
    if not names:
        return None
    out = {k: v for k, v in schema.items() if k != "dependentSchemas"}
    if isinstance(schema.get("dependencies"), dict):
        out["dependencies"] = {k: v for k, v in schema["dependencies"].items() if isinstance(v, list)}
    out["properties"] = {**(schema.get("properties") or {}), **dict.fromkeys(names, False)}
    return out


def _not_exact(sub: Any) -> bool:
    """Whether `SchemaCompiler._not` compiles `not: sub` exactly (types, scalar values, booleans)."""
    if isinstance(sub, bool) or sub == {}:
        return True
    if not isinstance(sub, dict):
        return False
    keys = set(sub) - STRUCTURAL
    if keys == {"anyOf"} and isinstance(sub["anyOf"], list):
        return all(_not_exact(part) for part in sub["anyOf"])
    if keys in ({"const"}, {"enum"}):
        values = [sub["const"]] if "const" in sub else sub["enum"]
        return isinstance(values, list) and not any(isinstance(v, dict | list) for v in values)
    return set(sub) <= {"type", "title", "description", "$comment"}


def _counted(hit: Node, miss: Node, comma: Node, count: int) -> Node:
    """Comma-separated sequences of `hit` and `miss` items with exactly `count` hits."""
    more_misses = Repeat(cat(comma, miss), 0, None)
    if count == 0:
        return alt(EMPTY, cat(miss, more_misses))
    out = [Repeat(cat(miss, comma), 0, None), hit, more_misses]
    for _ in range(count - 1):
        out += [comma, hit, more_misses]
    return cat(*out)


_CONDITIONAL = frozenset({"if", "then", "else"})
# keywords whose meaning depends on their siblings (what properties / prefixItems declare)
_SIBLING_RELATIVE = frozenset({"additionalProperties", "additionalItems", "unevaluatedProperties", "unevaluatedItems",
                               "items"})
# dependent schemas expanded exactly per schema node (each doubles the branches)
MAX_DEPENDENT_SCHEMAS = 3


def _dependent_schema(schema: dict[str, Any]) -> tuple[str, str, Any, dict[str, Any]] | None:
    """The first dependent schema of `schema` (`dependentSchemas`, or a draft 4-7 `dependencies`
    entry with a schema) as (keyword, property, subschema, the schema without it), when there
    are at most `MAX_DEPENDENT_SCHEMAS`; else None (the object compiler approximates them)."""
    found = [(key, name, sub) for key in ("dependentSchemas", "dependencies") if isinstance(schema.get(key), dict)
             for name, sub in schema[key].items() if isinstance(sub, dict | bool) and sub not in (True, {})]
    if not found or len(found) > MAX_DEPENDENT_SCHEMAS:
        return None
    key, name, sub = found[0]
    if isinstance(sub, dict) and (_SIBLING_RELATIVE & sub.keys() or _SIBLING_RELATIVE & schema.keys()
                                  and {"properties", "patternProperties", "prefixItems", "items"} & sub.keys()):
        return None  # NOTE: merged, additionalProperties / items would see the other's properties / items
    left = {k: v for k, v in schema[key].items() if k != name}
    rest = {k: v for k, v in schema.items() if k != key}
    if left:
        rest[key] = left
    return key, name, sub, rest


def _conditional_kept_together(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` about to be merged into another (allOf, a branch): its `if` / `then` / `else`
    apply together, not with another subschema's, so they become an `anyOf` of (if and then),
    (not if and else) where the negation is simple; `then` / `else` without `if` (and `if`
    alone) assert nothing and are dropped. Otherwise they stay (approximated when compiled)."""
    rest = {k: v for k, v in schema.items() if k not in _CONDITIONAL}
    if "if" not in schema or not {"then", "else"} & schema.keys():
        return rest
    negated = negation(schema["if"])
    if negated is None:
        return schema
    branches = [{"allOf": [schema["if"], schema.get("then", True)]}, {"allOf": [negated, schema.get("else", True)]}]
    return {**rest, "allOf": [*rest.get("allOf", []), {"anyOf": branches}]}


def _disjoint(a: Any, b: Any) -> bool:
    """Whether no JSON value can be valid under both `a` and `b` (a sufficient test: disjoint
    types, disjoint `const` / `enum` lists or literal patterns (`finite_values`), or objects that require one property with disjoint
    schemas: a discriminated union)."""
    if not type_set(a) & type_set(b):
        return True
    if not isinstance(a, dict) or not isinstance(b, dict):
        return False
    va, vb = finite_values(a), finite_values(b)
    if va is not None and vb is not None and not any(same_json(x, y) for x in va for y in vb):
        return True
    if type_set(a) & type_set(b) == {"object"}:  # a value valid under both is an object
        pa, pb = a.get("properties"), b.get("properties")
        ra, rb = a.get("required"), b.get("required")
        if isinstance(pa, dict) and isinstance(pb, dict) and isinstance(ra, list) and isinstance(rb, list):
            return any(name in pa and name in pb and name in rb and _disjoint(pa[name], pb[name]) for name in ra)
    return False







def _unique_sequences(values: list[Node], prefix: list[list[int]], more: list[int], comma: Node, lo: int,
                      hi: int | None) -> Node:
    """`unique_sequences` over one list of `values` (indices: `prefix[i]` the ones allowed at
    position i, `more` those allowed after the prefix)."""
    return unique_sequences([{i: values[i] for i in p} for p in prefix], {i: values[i] for i in more}, comma, lo, hi)


def _joined(nodes: list[Node], sep: Node) -> Node:
    out: list[Node] = []
    for i, n in enumerate(nodes):
        if i:
            out.append(sep)
        out.append(n)
    return cat(*out)


# `excluded` marker of `not: {type: integer}` beside numbers (see `_not`)
_NON_INTEGER = object()
_DIGIT = Chars(((48, 57),))
_NON_INTEGER_TEXT = cat(Repeat(lit("-"), 0, 1), alt(lit("0"), cat(Chars(((49, 57),)), Repeat(_DIGIT, 0, None))), lit("."),
                        Repeat(_DIGIT, 0, None), Chars(((49, 57),)), Repeat(_DIGIT, 0, None))



def _string_spellings(value: str) -> Node:
    """Every text of the JSON string `value` that `JSON_CHAR` allows (escapes included)."""
    chars: list[Node] = []
    for ch in value:
        cp = ord(ch)
        options: list[Node] = []
        if cp > 0x1F and ch not in '"\\':
            options.append(lit(ch))
        if cp in SHORT_ESCAPES or ch == "/":
            options.append(lit(SHORT_ESCAPES.get(cp, "\\/")))
        if cp <= 0x1F:
            hi, lo = f"{cp:04x}"[2], f"{cp:04x}"[3]
            options.append(cat(lit("\\u00" + hi), Chars(tuple(sorted({(ord(lo), ord(lo)),
                                                                       (ord(lo.upper()), ord(lo.upper()))})))))
        chars.append(alt(*options))
    return cat(lit('"'), *chars, lit('"'))


def _number_spellings(value: Any) -> Node:
    """The exponent-free texts of the number `value` (trailing fraction zeros, and -0 for 0)."""
    d = Decimal(str(value))
    if d == 0:
        return cat(Repeat(lit("-"), 0, 1), lit("0"), _ZERO_FRACTION)
    text = format(d.normalize(), "f")
    if "." in text:
        return cat(lit(text), Repeat(lit("0"), 0, None))
    return cat(lit(text), _ZERO_FRACTION)


# `propertyNames` keywords compiled exactly (names are strings)
_NAME_KEYWORDS = frozenset({"type", "pattern", "minLength", "maxLength", "format", "enum", "const", ALL_PATTERNS,
                            ALL_FORMATS})


class _TooManyVisits(Exception):
    """A compile went past `CfsmLimits.max_schema_visits` (internal: `schema_tree` starts over)."""


def _is_assertion(keyword: str) -> bool:
    """Whether a keyword beside `$ref` may narrow it (everything but identifiers and annotations)."""
    return keyword not in STRUCTURAL


# NOTE: pure memoization of immutable inputs (a pattern and a DFA limit), bounded (128 entries)
@functools.lru_cache(maxsize=128)
def _pattern_lang(pattern: str, limit: int) -> tuple[Node, int]:
    """A JSON string body matching `pattern` (search semantics) as its ready DFA (built once per
    process and pattern: a counted pattern such as a word count `(?:\\S+\\s+){0,199}` is thousands of
    NFA copies), and its size for length bounds (`_cycle_states`); a pattern past the DFA limit
    stays a tree and counts as that limit. Raises `UnsupportedRegexError`."""
    node, dfa = search_body(pattern, limit)
    return (node, limit) if dfa is None else (node, _cycle_states(dfa))


def _cycle_states(dfa: Dfa) -> int:
    """`dfa`'s number of states when its language is infinite, 1 when finite (length bounds then
    cut no cycle: their product stays near the pattern's size)."""
    n = dfa.num_states
    table = dfa.class_table[:n]
    src = np.repeat(np.arange(n), table.shape[1])
    dst = table.reshape(-1).astype(np.int64)
    live = dst != n
    src, dst = src[live], dst[live]
    # Kahn's order: a state left with incoming edges is on a cycle
    pairs = np.unique(src * (n + 1) + dst)
    src, dst = pairs // (n + 1), pairs % (n + 1)
    indeg = np.bincount(dst, minlength=n)
    order = np.argsort(src, kind="stable")
    starts = np.searchsorted(src[order], np.arange(n + 1))
    out = dst[order].tolist()
    todo = np.flatnonzero(indeg == 0).tolist()
    deg = indeg.tolist()
    seen = 0
    while todo:
        q = todo.pop()
        seen += 1
        for r in out[starts[q]:starts[q + 1]]:
            deg[r] -= 1
            if deg[r] == 0:
                todo.append(r)
    return max(1, n) if seen < n else 1


def schema_tree(schema: Any, config: CfsmConfig | None = None, *,
                loose_lengths: bool = False) -> tuple[Node, tuple[Approximation, ...]]:
    """Syntax tree of the JSON texts valid under `schema` (a dict, bool or JSON text), and what it
    over-approximates. Pure. Raises `UnsupportedSchemaError` for a malformed schema, a
    reference outside it, or (strict mode) a keyword it can only over-approximate.
    `loose_lengths`: string length bounds above `MAX_EXACT_LENGTH` are approximated."""
    node, _, approximations = _compile_schema(schema, config, rule_mode=False, loose_lengths=loose_lengths)
    return node, approximations


def schema_grammar(schema: Any, config: CfsmConfig | None = None, *,
                   refs_as_rules: bool = False) -> tuple[Node, dict[str, Node], tuple[Approximation, ...]]:
    """Rule mode of `schema_tree`: (the root tree, the rules it calls, approximations). With no
    rules the root tree is regular (the schema neither recurses nor takes free JSON).
    `refs_as_rules`: every `$ref` not narrowed by siblings calls a rule of its target (compiled
    once) instead of copying it, recursive or not. Pure."""
    return _compile_schema(schema, config, rule_mode=True, refs_as_rules=refs_as_rules)


def _compile_schema(schema: Any, config: CfsmConfig | None, rule_mode: bool, refs_as_rules: bool = False,
                    loose_lengths: bool = False) -> tuple[Node, dict[str, Node], tuple[Approximation, ...]]:
    """Both modes: parse a JSON text, compile, and halve the recursion bound while the schema has
    too many nodes to compile (rules stay empty outside rule mode). Pure."""
    if isinstance(schema, str | bytes):
        try:
            schema = json.loads(schema)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise UnsupportedSchemaError("schema", "#", f"not valid JSON: {exc}") from None
    check_depth(schema, MAX_SCHEMA_DEPTH)
    cfg = config or CfsmConfig()
    while True:
        rules: dict[str, Node] = {}
        comp = SchemaCompiler(schema, cfg, rules if rule_mode else None, refs_as_rules, loose_lengths)
        try:
            node = comp.node(schema, "#")
        except RecursionError:
            raise UnsupportedSchemaError("schema", "#", "too deeply nested or recursive to compile") from None
        except _TooManyVisits:
            if cfg.max_recursion_depth == 0 or not comp.recursion_seen:
                raise SchemaTooLargeError("schema", "#", f"too large: more than {cfg.limits.max_schema_visits} schema nodes to "
                                          "compile") from None
            cfg = dataclasses.replace(cfg, max_recursion_depth=cfg.max_recursion_depth // 2)
            continue
        if comp.counted > MAX_COUNTED and not loose_lengths and not cfg.strict:
            # NOTE: thousands of counted characters / items make automata that take longer to build
            # than any timeout allows (a 5,000-character maxLength: 130,000 states to minimize)
            loose_lengths = True
            continue
        return node, rules, tuple(comp.approximations.values())


def json_value_grammar(config: CfsmConfig | None = None, *, object_only: bool = True) -> tuple[Node, dict[str, Node]]:
    """Free JSON without a depth bound: (the root tree, its rules). Pure."""
    rules: dict[str, Node] = {}
    comp = SchemaCompiler({}, config or CfsmConfig(), rules)
    return (comp.free_object(0) if object_only else comp.any_value(0)), rules


def schema_to_node(schema: Any, config: CfsmConfig | None = None) -> Node:
    """`schema_tree(schema, config)`'s tree. Pure."""
    return schema_tree(schema, config)[0]


def json_value_node(config: CfsmConfig | None = None, *, object_only: bool = True) -> Node:
    """Free JSON to `config.json_depth` levels: an object (`json_object` mode) or any value."""
    cfg = config or CfsmConfig()
    comp = SchemaCompiler({}, cfg)
    return comp.free_object(cfg.json_depth) if object_only else comp.any_value(cfg.json_depth)



