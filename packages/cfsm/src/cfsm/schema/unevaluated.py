"""`unevaluatedProperties` / `unevaluatedItems` beside in-place applicators, made exact by
expanding the applicators into alternatives whose evaluated properties and items are known.

A schema with `allOf`, `anyOf`, `oneOf`, `if` / `then` / `else`, `$ref` or `dependentSchemas`
becomes a list of flat schemas (no in-place applicators), each the conjunction of the
subschemas one way of validating takes, together with what they evaluate: declared property
names, `patternProperties` patterns, whether `additionalProperties` saw the rest; the prefix
length and whether `items` saw the rest. An `unevaluated*` keyword then becomes the
`additionalProperties` / `items` of each flat schema. `anyOf` takes every non-empty subset of
its branches (the subset of branches that match is the one whose evaluations count), `oneOf`
each branch alone (with the others negated where `SchemaCompiling.exclusive` can), `if` the two cases (the
failed condition's evaluations dropped). A subschema's own `unevaluated*` applies to what it
evaluates alone (cousins do not see each other), so conjunctions merge each side's
`additionalProperties` / `items` only over the members that side does not declare itself.

Returns None where this is not exact (`contains` beside `unevaluatedItems`, `patternProperties`
meeting another side's `additionalProperties`, `$dynamicRef`, `$id` changes, too many
alternatives): the caller then approximates as before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from typing import Any

from cfsm.errors import CfsmError
from cfsm.schema.compiling import SchemaCompiling
from cfsm.schema.keywords import negation
from cfsm.schema.merge import merge_schemas
from cfsm.schema.narrow import negation_subset

__all__ = ["expand_unevaluated", "mentions_unevaluated", "MAX_ALTERNATIVES"]

UNEVALUATED = frozenset({"unevaluatedProperties", "unevaluatedItems"})
# keywords expanded into alternatives (the in-place applicators)
_EXPANDED = frozenset({"allOf", "anyOf", "oneOf", "if", "then", "else", "$ref", "dependentSchemas"})
# flat schemas per expansion, branches of one anyOf (its non-empty subsets are expanded), depth of references
MAX_ALTERNATIVES = 64
MAX_ANY_OF = 4
MAX_DEPTH = 8
_TRIVIAL = (True, None)


@dataclasses.dataclass(frozen=True)
class Evaluated:
    """What one way of validating evaluates (draft 2020-12 annotations) at one instance location."""

    names: frozenset[str] = frozenset()
    patterns: frozenset[str] = frozenset()
    all_properties: bool = False
    prefix: int = 0
    all_items: bool = False
    contains: bool = False

    def __or__(self, other: Evaluated) -> Evaluated:
        return Evaluated(self.names | other.names, self.patterns | other.patterns,
                         self.all_properties or other.all_properties, max(self.prefix, other.prefix),
                         self.all_items or other.all_items, self.contains or other.contains)


class _Inexact(Exception):
    """The expansion would not be exact (the caller falls back to its approximation)."""


Alternative = tuple[dict[str, Any], Evaluated]


def mentions_unevaluated(comp: SchemaCompiling, schema: Any, depth: int = 0) -> bool:
    """Whether an `unevaluated*` keyword sits in `schema` or a subschema it applies in place."""
    if not isinstance(schema, dict) or depth > MAX_DEPTH or not comp.mentions_unevaluated:
        return False
    if UNEVALUATED & schema.keys():
        return True
    subs: list[Any] = []
    for key in ("allOf", "anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            subs += schema[key]
    subs += [schema[k] for k in ("if", "then", "else") if k in schema]
    if isinstance(schema.get("dependentSchemas"), dict):
        subs += list(schema["dependentSchemas"].values())
    if isinstance(schema.get("$ref"), str):
        with contextlib.suppress(CfsmError):
            subs.append(comp.refs.resolve(schema["$ref"], comp.bases[-1], "#")[0])
    return any(mentions_unevaluated(comp, s, depth + 1) for s in subs)


def expand_unevaluated(comp: SchemaCompiling, schema: dict[str, Any], path: str) -> list[dict[str, Any]] | None:
    """`schema` as flat alternatives (see the module docstring), or None where that is not exact."""
    try:
        return [_declare_required(flat) for flat, _ in _alternatives(comp, schema, path, comp.bases[-1], 0)]
    except _Inexact:
        return None


def _declare_required(flat: dict[str, Any]) -> dict[str, Any]:
    """Required names a flat schema does not declare, declared `false` when its
    `additionalProperties` is `false` (impossible: the object compiler would let them take any
    value; a schema there it applies already)."""
    required, props = flat.get("required", []), _dict(flat, "properties")
    if not isinstance(required, list) or flat.get("additionalProperties", True) is not False or \
            flat.get("patternProperties"):
        return flat
    missing = [n for n in required if isinstance(n, str) and n not in props]
    if not missing:
        return flat
    return {**flat, "properties": {**props, **dict.fromkeys(missing, False)}}


def _evaluated(local: dict[str, Any]) -> Evaluated:
    props = local.get("properties")
    patterns = local.get("patternProperties")
    items = local.get("items")
    if isinstance(items, list):  # draft 4-7 tuple form
        prefix, all_items = len(items), "additionalItems" in local
    else:
        prefix = len(local.get("prefixItems", []) or [])
        all_items = "items" in local
    return Evaluated(frozenset(props) if isinstance(props, dict) else frozenset(),
                     frozenset(patterns) if isinstance(patterns, dict) else frozenset(),
                     "additionalProperties" in local, prefix, all_items, "contains" in local)


def _product(comp: SchemaCompiling, a: list[Alternative], b: list[Alternative], path: str) -> list[Alternative]:
    if len(a) * len(b) > MAX_ALTERNATIVES:
        raise _Inexact
    return [(_conjoin(comp, fa, fb, path), ea | eb) for fa, ea in a for fb, eb in b]


def _alternatives(comp: SchemaCompiling, schema: Any, path: str, base: str, depth: int) -> list[Alternative]:
    if depth > MAX_DEPTH:
        raise _Inexact
    if schema is True or schema == {}:
        return [({}, Evaluated())]
    if schema is False:
        return []
    if not isinstance(schema, dict) or {"$dynamicRef", "$recursiveRef"} & schema.keys():
        raise _Inexact
    if depth and ("$id" in schema or "id" in schema and isinstance(schema["id"], str)):
        raise _Inexact  # NOTE: a new base for the references inside: flattening would lose it
    deps = schema.get("dependencies")
    if isinstance(deps, dict) and any(isinstance(v, dict | bool) for v in deps.values()):
        raise _Inexact
    local = {k: v for k, v in schema.items() if k not in _EXPANDED and k not in UNEVALUATED}
    acc: list[Alternative] = [(local, _evaluated(local))]
    if isinstance(schema.get("$ref"), str):
        target, tbase = comp.refs.resolve(schema["$ref"], base, f"{path}/$ref")
        if tbase != base:
            raise _Inexact
        acc = _product(comp, acc, _alternatives(comp, target, f"{path}/$ref", tbase, depth + 1), path)
    elif "$ref" in schema:
        raise _Inexact
    for i, sub in enumerate(_list(schema, "allOf")):
        acc = _product(comp, acc, _alternatives(comp, sub, f"{path}/allOf/{i}", base, depth + 1), path)
    branches = _list(schema, "anyOf")
    if branches:
        if len(branches) > MAX_ANY_OF:
            raise _Inexact
        each = [_alternatives(comp, b, f"{path}/anyOf/{i}", base, depth + 1) for i, b in enumerate(branches)]
        options: list[Alternative] = []
        for size in range(1, len(each) + 1):
            for subset in itertools.combinations(each, size):
                joined: list[Alternative] = [({}, Evaluated())]
                for alts in subset:
                    joined = _product(comp, joined, alts, path)
                options += joined
        acc = _product(comp, acc, options, path)
    branches = _list(schema, "oneOf")
    if branches:
        if len(branches) > 1:
            branches = comp.exclusive(branches, f"{path}/oneOf")
        options = [x for i, b in enumerate(branches) for x in _alternatives(comp, b, f"{path}/oneOf/{i}", base,
                                                                            depth + 1)]
        acc = _product(comp, acc, options, path)
    if "if" in schema:
        acc = _product(comp, acc, _conditional(comp, schema, path, base, depth), path)
    dependent = schema.get("dependentSchemas")
    if isinstance(dependent, dict):
        for name, sub in dependent.items():
            absent: Alternative = ({"properties": {name: False}}, Evaluated())
            present = _product(comp, [({"required": [name]}, Evaluated())],
                               _alternatives(comp, sub, f"{path}/dependentSchemas/{name}", base, depth + 1), path)
            acc = _product(comp, acc, [absent, *present], path)
    return [_own_unevaluated(schema, flat, ev) for flat, ev in acc]


def _list(schema: dict[str, Any], key: str) -> list[Any]:
    value = schema.get(key, [])
    if not isinstance(value, list):
        raise _Inexact
    return value


def _conditional(comp: SchemaCompiling, schema: dict[str, Any], path: str, base: str, depth: int) -> list[Alternative]:
    """`if` / `then` / `else`: (if and then, both evaluated) or (not if and else, else evaluated)."""
    negated = negation(schema["if"])
    if negated is None and comp.cfg.narrow and ("then" in schema or "else" in schema):
        comp.narrowed("if", f"{path}/if", "the else branch only for values the condition surely rejects")
        negated = negation_subset(schema["if"], declare=False)
    if negated is None:
        if "then" in schema or "else" in schema:
            comp.approximate("if", f"{path}/if", "the condition is not checked on the else branch")
        # NOTE: without then / else, "if passes" evaluates a superset of "if fails" (nothing), so
        # taking any value there adds nothing the first alternative would not accept
        negated = True
    passed = _product(comp, _alternatives(comp, schema["if"], f"{path}/if", base, depth + 1),
                      _alternatives(comp, schema.get("then", True), f"{path}/then", base, depth + 1), path)
    # the failed condition's annotations are dropped
    failed = [(flat, Evaluated()) for flat, _ in _alternatives(comp, negated, f"{path}/if", base, depth + 1)]
    return [*passed, *_product(comp, failed, _alternatives(comp, schema.get("else", True), f"{path}/else", base,
                                                          depth + 1), path)]


def _own_unevaluated(schema: dict[str, Any], flat: dict[str, Any], ev: Evaluated) -> Alternative:
    """`schema`'s own unevaluated* keywords applied to one flat alternative (they evaluate the rest)."""
    # NOTE: present at all (`true` too), they evaluate every property / item left
    if "unevaluatedProperties" in schema and not ev.all_properties:
        props = schema["unevaluatedProperties"]
        if props not in (True, {}):
            flat = {**flat, "additionalProperties": props}
        ev = dataclasses.replace(ev, all_properties=True)
    if "unevaluatedItems" in schema and not ev.all_items:
        items = schema["unevaluatedItems"]
        if items not in (True, {}):
            if ev.contains:
                raise _Inexact  # NOTE: contains evaluates the items it matches, which no flat keyword says
            key = "additionalItems" if isinstance(flat.get("items"), list) else "items"
            flat = {**flat, key: items}
        ev = dataclasses.replace(ev, all_items=True)
    return flat, ev


def _conjoin(comp: SchemaCompiling, a: dict[str, Any], b: dict[str, Any], path: str) -> dict[str, Any]:
    """Both flat schemas, each side's `additionalProperties` / `items` applying to what that side
    does not declare (merge_schemas would let it see the other side's declarations)."""
    out = merge_schemas({k: v for k, v in a.items() if k not in _MEMBERWISE},
                        {k: v for k, v in b.items() if k not in _MEMBERWISE}, path, comp.approximate)
    for x, y in ((a, b), (b, a)):
        if x.get("additionalProperties", True) not in (True, {}) and y.get("patternProperties"):
            raise _Inexact  # NOTE: y's pattern keys outside x's declared names need x's rule too
    props: dict[str, Any] = {}
    for name in [*_dict(a, "properties"), *(n for n in _dict(b, "properties") if n not in _dict(a, "properties"))]:
        parts = [_member(x, name) for x in (a, b)]
        kept = [p for p in parts if p not in _TRIVIAL and p != {}]
        props[name] = kept[0] if len(kept) == 1 else {"allOf": kept} if kept else True
    if props:
        out["properties"] = props
    patterns = {**_dict(b, "patternProperties")}
    for pat, sub in _dict(a, "patternProperties").items():
        patterns[pat] = {"allOf": [sub, patterns[pat]]} if pat in patterns else sub
    if patterns:
        out["patternProperties"] = patterns
    if isinstance(a.get("items"), list) or isinstance(b.get("items"), list):
        # draft 4-7 tuples: `items` lists, then `additionalItems` (merged by merge_schemas)
        if "prefixItems" in a or "prefixItems" in b or any(not isinstance(x.get("items", []), list) for x in (a, b)):
            raise _Inexact
        prefix_key, rest_key = "items", "additionalItems"
    else:
        prefix_key, rest_key = "prefixItems", "items"
        rests = [x["items"] for x in (a, b) if "items" in x]
        if rests:
            out["items"] = rests[0] if len(rests) == 1 else {"allOf": rests}
    pa, pb = a.get(prefix_key, []), b.get(prefix_key, [])
    if not isinstance(pa, list) or not isinstance(pb, list):
        raise _Inexact
    if pa or pb:
        merged = []
        for i in range(max(len(pa), len(pb))):
            parts = [p[i] if i < len(p) else x.get(rest_key, True) for p, x in ((pa, a), (pb, b))]
            kept = [p for p in parts if p is not True and p != {}]
            merged.append(kept[0] if len(kept) == 1 else {"allOf": kept} if kept else True)
        out[prefix_key] = merged
    return out


# keywords `_conjoin` merges member by member itself
_MEMBERWISE = frozenset({"properties", "patternProperties", "prefixItems", "items"})


def _dict(schema: dict[str, Any], key: str) -> dict[str, Any]:
    value = schema.get(key, {})
    if not isinstance(value, dict):
        raise _Inexact
    return value


def _member(schema: dict[str, Any], name: str) -> Any:
    """What `schema` asks of property `name`: its declaration, else its additionalProperties
    (patternProperties aside: `_conjoin` refuses those beside another side's additionalProperties)."""
    props = _dict(schema, "properties")
    if name in props:
        return props[name]
    return schema.get("additionalProperties", True)
