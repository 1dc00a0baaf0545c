"""Object members of a JSON Schema object: properties in order (or any order), extras, counts."""

from __future__ import annotations

import json
from typing import Any

import regex

from cfsm.automata.automaton import DfaNode, build_dfa
from cfsm.errors import UnsupportedRegexError, UnsupportedSchemaError
from cfsm.regex.json_lexical import JSON_CHAR, JSON_STRING
from cfsm.regex.syntax import EMPTY, NOTHING, Complement, Intersect, Node, Repeat, Sep, Shared, alt, cat, lit
from cfsm.schema.compiling import SchemaCompiling
from cfsm.schema.patterns import search_body

__all__ = ["MAX_ANY_ORDER_PROPERTIES", "object_members"]

# `CfsmConfig.any_order` compiles objects of at most this many properties (every order: one automaton
# state per subset of the properties written)
MAX_ANY_ORDER_PROPERTIES = 10
# patternProperties whose overlaps are compiled exactly (2^n - 1 key regions)
MAX_OVERLAPPING_PATTERNS = 3


def _shared_key(comp: SchemaCompiling, shape: tuple[Any, ...] | None, key: Node) -> Node:
    """`key` (a key language of products and complements) as a ready DFA, built once per compile
    for each object `shape` (patterns, declared names, region): objects copied where references
    are unrolled repeat them (JSONSchemaBench's govuk schemas: 224 complements of a few shapes)."""
    if shape is None:
        return key
    hit = comp.memo.get(shape)
    if hit is None:
        dfa = build_dfa(key)
        hit = comp.memo[shape] = DfaNode(dfa) if dfa.num_states else NOTHING
    return hit


def _search(pattern: str, name: str) -> bool:
    """Whether `pattern` (search semantics) matches the property name (False where `regex` cannot
    parse it: the compiler then reports the pattern itself)."""
    try:
        return regex.search(pattern, name) is not None
    except (regex.error, TypeError):
        return False


def _key(name: str) -> Node:
    return lit(json.dumps(name, ensure_ascii=False))


def object_members(comp: SchemaCompiling, schema: dict[str, Any], path: str) -> Node:
    """The text between the braces: declared properties, then undeclared ("extra") members.

    # NOTE: the `Shared` suffix nodes are only referenced in tail position, so they may be
    # entered from several places (see `cfsm.regex.syntax.Shared`); the caller wraps this in a `Scope`.
    """

    raw_props = schema.get("properties", {})
    if not isinstance(raw_props, dict):
        raise UnsupportedSchemaError("properties", f"{path}/properties", "properties must be an object (property "
                                     f"names to schemas), got {type(raw_props).__name__}")
    props: dict[str, Any] = dict(raw_props)
    required = schema.get("required", [])
    if not isinstance(required, list):  # draft 3: "required": true on the property itself
        comp.approximate("required", f"{path}/required", "a non-list value (draft 3) is not enforced")
        required = []
    addl = schema.get("additionalProperties", comp.cfg.additional_properties_default)
    unevaluated = schema.get("unevaluatedProperties", True)
    if "additionalProperties" not in schema and unevaluated not in (True, {}):
        # NOTE: what properties and patternProperties (merged in from in-place applicators too)
        # leave unevaluated is what additionalProperties would see; `if` and dependent schemas
        # could evaluate more (they are approximated themselves, so the result stays a superset
        # only if the unevaluated keyword is too)
        if {"if", "dependentSchemas"} & schema.keys():
            comp.approximate("unevaluatedProperties", f"{path}/unevaluatedProperties",
                             "not enforced beside if / dependentSchemas")
        else:
            addl = unevaluated
    pattern_props: dict[str, Any] = schema.get("patternProperties", {})
    if isinstance(pattern_props, dict):
        # a declared name that matches patterns takes their schemas too
        for name in list(props):
            matching = [sub for pat, sub in pattern_props.items() if _search(pat, name)]
            if matching:
                props[name] = {"allOf": [props[name], *matching]}
    for name in required:
        if name not in props:
            props[name] = addl if isinstance(addl, dict) else True
    names = list(props)
    req = set(required)
    name_lang = comp.property_names(schema.get("propertyNames", True), f"{path}/propertyNames")
    # NOTE: a declared name outside `propertyNames` cannot be present (required: no object at all)
    allowed = [name_lang is None or _name_allowed(name_lang, n) for n in names]
    members = [cat(_key(n), comp.colon, comp.node(props[n], f"{path}/properties/{n}")) if ok else NOTHING
               for n, ok in zip(names, allowed, strict=True)]
    closed = addl is False and not pattern_props
    deps = _dependencies(comp, schema, names, closed, path)
    min_p = int(schema.get("minProperties", 0))
    max_p = schema.get("maxProperties")
    max_p = None if max_p is None else int(max_p)

    # undeclared members: keys matching patternProperties, then additionalProperties
    declared = alt(*(_key(n) for n in names)) if names else NOTHING
    extras: list[Node] = []
    pattern_keys: list[Node] = []
    for pat in pattern_props:
        try:
            body = search_body(pat, comp.cfg.limits.max_dfa_states)[0]
        except UnsupportedRegexError as exc:
            # NOTE: any key may then take this value (a superset); declared names keep theirs
            comp.approximate("patternProperties", f"{path}/patternProperties", f"pattern not enforced on keys: {exc}")
            body = Repeat(JSON_CHAR, 0, None)
        pattern_keys.append(cat(lit('"'), Intersect([body, Repeat(JSON_CHAR, 0, None)]), lit('"')))
    pats = list(pattern_props.items())
    if 2 <= len(pats) <= MAX_OVERLAPPING_PATTERNS:
        # exact: a key matching several patterns takes all their schemas (one region per subset)
        regions = [[i for i in range(len(pats)) if mask >> i & 1] for mask in range(1, 1 << len(pats))]
    else:
        regions = [[i] for i in range(len(pats))]  # NOTE: a key matching several may take any one's value
    shape = (tuple(pattern_props), tuple(names)) if name_lang is None else None
    for region in regions:
        parts = [pattern_keys[i] for i in region]
        if len(regions) > len(pats):
            parts += [Complement(pattern_keys[i]) for i in range(len(pats)) if i not in region]
        key = parts[0] if len(parts) == 1 else Intersect(parts)
        if names:
            key = _shared_key(comp, shape and ("pattern key", *shape, tuple(region)), Intersect([key, Complement(declared)]))
        if name_lang is not None:
            key = Intersect([key, name_lang])
        subs = [pats[i][1] for i in region]
        where = f"{path}/patternProperties/{pats[region[0]][0]}"
        value = comp.node(subs[0] if len(subs) == 1 else {"allOf": subs}, where)
        extras.append(cat(key, comp.colon, value))
    if addl is not False:
        excluded = [k for k in ([declared] if names else []) + pattern_keys]
        key = _shared_key(comp, shape and ("other key", *shape), Intersect([JSON_STRING, Complement(alt(*excluded))])) \
            if excluded else JSON_STRING
        if name_lang is not None:
            key = Intersect([key, name_lang])
        value = comp.any_value(comp.cfg.json_depth - 1) if addl is True else comp.node(addl, f"{path}/additionalProperties")
        extras.append(cat(key, comp.colon, value))
    extra = alt(*extras) if extras else None

    def tail_extras(count: int) -> Node:
        lo = max(0, min_p - count)
        hi = None if max_p is None else max_p - count
        if hi is not None and hi < lo:
            return NOTHING
        if extra is None or hi == 0:
            return EMPTY if lo == 0 else NOTHING
        sep = EMPTY if count == 0 else comp.comma
        if hi is None:
            body = cat(sep, Sep(extra, comp.comma))
            if lo > 1:
                body = cat(sep, extra, Repeat(cat(comp.comma, extra), lo - 1, None))
        else:
            body = cat(sep, extra, Repeat(cat(comp.comma, extra), max(lo - 1, 0), hi - 1))
        return alt(EMPTY, body) if lo == 0 else body

    if comp.cfg.any_order and len(names) > 1:
        if len(names) > MAX_ANY_ORDER_PROPERTIES:
            raise UnsupportedSchemaError(
                "properties", f"{path}/properties",
                f"any_order supports at most {MAX_ANY_ORDER_PROPERTIES} properties per object, got {len(names)}")
        memo_set: dict[tuple[frozenset[int], int], Node] = {}

        def tail_set(left: frozenset[int], count: int) -> Node:
            if min_p == 0 and max_p is None:
                count = min(count, 1)
            key = (left, count)
            if key not in memo_set:
                sep = EMPTY if count == 0 else comp.comma
                options = []
                if max_p is None or count < max_p:
                    options = [cat(sep, members[i], tail_set(left - {i}, count + 1)) for i in sorted(left)]
                if not any(names[i] in req for i in left) and _satisfied(deps, frozenset(range(len(names))) - left):
                    options.append(tail_extras(count))
                memo_set[key] = Shared(alt(*options) if options else NOTHING)
            return memo_set[key]

        return tail_set(frozenset(range(len(names))), 0)

    relevant = frozenset(deps) | frozenset().union(*deps.values()) if deps else frozenset()
    memo: dict[tuple[int, int, frozenset[int]], Node] = {}

    def tail(i: int, count: int, taken: frozenset[int]) -> Node:
        # `taken`: the members with a dependency role present so far (`dependentRequired`)
        if min_p == 0 and max_p is None:
            count = min(count, 1)  # only "first member or not" matters
        key = (i, count, taken)
        if key not in memo:
            if i == len(names):
                node = tail_extras(count) if _satisfied(deps, taken) else NOTHING
            else:
                sep = EMPTY if count == 0 else comp.comma
                took = taken | {i} if i in relevant else taken
                take = (cat(sep, members[i], tail(i + 1, count + 1, took))
                        if max_p is None or count < max_p else NOTHING)
                node = take if names[i] in req else alt(take, tail(i + 1, count, taken))
            memo[key] = Shared(node)
        return memo[key]

    return tail(0, 0, frozenset())


def _name_allowed(lang: Node, name: str) -> bool:
    return build_dfa(lang).fullmatch(json.dumps(name, ensure_ascii=False).encode())


def _satisfied(deps: dict[int, frozenset[int]], present: frozenset[int]) -> bool:
    return all(targets <= present for source, targets in deps.items() if source in present)


# more members than this with a `dependentRequired` role: the dependencies are approximated
# (exact tracking multiplies the object's states by 2 per member)
MAX_DEPENDENCY_MEMBERS = 10


def _dependencies(comp: SchemaCompiling, schema: dict[str, Any], names: list[str], closed: bool,
                  path: str) -> dict[int, frozenset[int]]:
    """`dependentRequired` (and draft 4-7 `dependencies` with lists, or with schemas that only
    require names) as {member index: member indices it needs}, exact over the declared members.
    A dependency on a name that can only come as an undeclared member is approximated unless
    undeclared members are closed (then a source naming one cannot be present either, which the
    caller expresses by the empty map entry pointing at an impossible member: see below)."""
    raw: dict[str, Any] = {}
    for key in ("dependencies", "dependentRequired", "dependentSchemas"):
        value = schema.get(key)
        if not isinstance(value, dict):
            continue
        for source, need in value.items():
            if isinstance(need, dict) and set(need) - _ANNOTATIONS <= {"required"} and \
                    isinstance(need.get("required", []), list):
                need = need.get("required", [])
            if need is True or need == {}:
                continue
            if not isinstance(need, list):
                comp.approximate(key, f"{path}/{key}", "a dependent schema is not enforced")
                continue
            raw.setdefault(source, []).extend(need)
    index = {n: i for i, n in enumerate(names)}
    deps: dict[int, frozenset[int]] = {}
    for source, need in raw.items():
        if source not in index:
            if not closed:
                comp.approximate("dependentRequired", f"{path}/dependentRequired",
                                 f"not enforced on the undeclared property {source!r}")
            continue  # NOTE: closed: the source cannot be present at all
        missing = [n for n in need if n not in index]
        if missing and not closed:
            comp.approximate("dependentRequired", f"{path}/dependentRequired",
                             f"not enforced for the undeclared properties {missing}")
            continue
        # a missing (closed) target can never be present: pointing at `len(names)` makes the source impossible
        deps[index[source]] = frozenset(index.get(n, len(names)) for n in need) - {index[source]}
    if len(set(deps) | set().union(*deps.values())) > MAX_DEPENDENCY_MEMBERS:
        comp.approximate("dependentRequired", f"{path}/dependentRequired",
                         f"not enforced (more than {MAX_DEPENDENCY_MEMBERS} properties involved)")
        return {}
    return deps


_ANNOTATIONS = frozenset({"title", "description", "$comment"})
