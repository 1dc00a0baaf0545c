"""`allOf`: two JSON Schemas merged keyword by keyword into one that requires both.

Keywords that merge exactly: bounds (the tighter one), `required` and `properties` (union, with
shared properties merged recursively), `type` and `enum` / `const` (intersection), `items`,
`additionalProperties` (nested `allOf`), `not` (nested `anyOf`), `pattern` and `format` (all kept, intersected
later), `anyOf` / `oneOf` (the cross product, see below), integer `multipleOf` (their least common multiple). Any
other keyword given two different values keeps the first one: the merged schema accepts a superset, which the
caller records (`approximate`).

`anyOf` / `oneOf` lists are distributed only as far as the merge needs (exact): alternatives that cannot hold
beside the rest of the merged schema are dropped (`is_empty`: disjoint types or values, a required property that
can have no value), and an `anyOf` one of whose alternatives the rest already implies (`implies`) is dropped whole.
A product still larger than `MAX_MERGED_ALTERNATIVES` is cut: with `narrowed` (the defaults) to a subset of its
alternatives (every alternative of the first list kept, with the first ones of the second; reported as narrowed),
else to the first list alone (the second not enforced: a superset, reported). Narrowed `not` / `if` / `oneOf`
(`narrow`) produce such lists, one per negated branch, which would otherwise multiply.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import regex

from cfsm.errors import UnsupportedSchemaError

__all__ = ["merge_schemas", "same_json", "ALL_PATTERNS", "ALL_FORMATS", "JSON_TYPES", "json_type", "type_set",
           "implies", "is_empty", "finite_values", "quiet_merge", "MAX_MERGED_ALTERNATIVES"]

# merged schemas keep every `pattern` / `format` under these keys (lists), intersected by the compiler
ALL_PATTERNS = "\x00patterns"
ALL_FORMATS = "\x00formats"
_LOWER = ("minimum", "minLength", "minItems", "minProperties", "minContains")
_UPPER = ("maximum", "maxLength", "maxItems", "maxProperties", "maxContains")
_NESTED = ("items", "additionalProperties", "propertyNames", "contains", "additionalItems",
           "unevaluatedProperties", "unevaluatedItems")
# keywords that constrain instances (besides the ones merged above)
_ASSERTIONS = frozenset({"multipleOf", "uniqueItems", "prefixItems", "patternProperties", "dependentRequired",
                         "dependentSchemas", "dependencies", "if", "then", "else", "$ref", "exclusiveMinimum",
                         "exclusiveMaximum"})
Approximate = Callable[[str, str, str], None]

JSON_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
# a value's JSON types for disjointness (integers are numbers)
_DISJOINT_TYPES = ("object", "array", "string", "number", "boolean", "null")
# the alternatives one merge of two `anyOf` / `oneOf` lists spells out (after pruning); past it the product is cut
MAX_MERGED_ALTERNATIVES = 64
# subschemas `implies` / `is_empty` look into (properties of properties ...)
_MAX_TEST_DEPTH = 3
# keywords `implies` understands in the implied schema (besides annotations)
_IMPLIED = frozenset({"type", "required", "properties", "not", "enum", "const", "anyOf"})
_ANNOTATIONS = frozenset({"$schema", "$id", "id", "$comment", "title", "description", "default", "examples",
                          "deprecated", "readOnly", "writeOnly"})
_METACHARACTERS = frozenset("\\.^$*+?()[]{}|")
_COUNTS = {"string": ("minLength", "maxLength"), "array": ("minItems", "maxItems"),
           "object": ("minProperties", "maxProperties")}


def _integral(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0 and float(value).is_integer()


def _types(value: Any) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


def _enum_of(schema: dict[str, Any]) -> list[Any] | None:
    if "const" in schema:
        return [schema["const"]]
    return list(schema["enum"]) if "enum" in schema else None


def json_type(value: Any) -> str:
    """The JSON type of a JSON value ("integer" for numbers without a fraction, 1.0 included)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "integer" if value.is_integer() else "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def type_set(schema: Any) -> set[str]:
    """The JSON types (`_DISJOINT_TYPES`: integers are numbers) that `schema` may accept, by its
    `type`, `const` and `enum` alone (every type where they do not say)."""
    if schema is False:
        return set()
    out = set(_DISJOINT_TYPES)
    if not isinstance(schema, dict):
        return out
    named = schema.get("type")
    if isinstance(named, str):
        named = [named]
    if isinstance(named, list) and all(isinstance(t, str) and t in JSON_TYPES for t in named):
        out &= {"number" if t == "integer" else t for t in named}
    values = [schema["const"]] if "const" in schema else schema.get("enum")
    if isinstance(values, list):
        out &= {"number" if t == "integer" else t for t in map(json_type, values)}
    return out


def same_json(a: Any, b: Any) -> bool:
    """JSON equality (1 == 1.0, but True != 1)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_json(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_json(a[k], b[k]) for k in a)
    return bool(a == b)


def merge_schemas(a: dict[str, Any], b: Any, path: str, approximate: Approximate,
                  narrowed: Approximate | None = None) -> dict[str, Any]:
    """One schema requiring both `a` and `b` (keyword by keyword). Pure, except for the calls to
    `approximate(keyword, path, detail)` for each keyword it could only keep one value of, and to
    `narrowed` for an `anyOf` / `oneOf` product cut to a subset (None: cut to a superset)."""
    if b is True:
        return dict(a)
    if not isinstance(b, dict):
        raise UnsupportedSchemaError("allOf", path, "subschemas must be objects or booleans")
    out = dict(a)
    enums = [e for e in (_enum_of(a), _enum_of(b)) if e is not None]
    for k, v in b.items():
        if k not in out:
            out[k] = v
            continue
        av = out[k]
        if av == v:
            continue
        if k == "properties" and isinstance(av, dict) and isinstance(v, dict):
            merged = dict(av)
            for pk, pv in v.items():
                merged[pk] = {"allOf": [merged[pk], pv]} if pk in merged else pv
            out[k] = merged
        elif k == "required" and isinstance(av, list) and isinstance(v, list):
            out[k] = list(dict.fromkeys(list(av) + list(v)))
        elif k in _LOWER or k == "exclusiveMinimum" and not isinstance(v, bool):
            out[k] = max(av, v)
        elif k in _UPPER or k == "exclusiveMaximum" and not isinstance(v, bool):
            out[k] = min(av, v)
        elif k == "type":
            ta, tb = _types(av), _types(v)
            both = [t for t in ta if t in tb or (t == "integer" and "number" in tb)]
            both += [t for t in tb if t == "integer" and "number" in ta and t not in both]
            out[k] = both
        elif k in ("enum", "const"):
            continue  # intersected below
        elif k in ("pattern", "format"):
            bucket = ALL_PATTERNS if k == "pattern" else ALL_FORMATS
            out[bucket] = [*out.get(bucket, []), v]
        elif k in _NESTED and isinstance(av, dict | bool) and isinstance(v, dict | bool):
            out[k] = {"allOf": [av, v]}
        elif k == "multipleOf" and _integral(av) and _integral(v):
            out[k] = math.lcm(int(av), int(v))  # a multiple of both integers is a multiple of their lcm
        elif k == "not":
            out[k] = {"anyOf": [av, v]}  # neither a nor b
        elif k in ("anyOf", "oneOf"):
            continue  # distributed below
        elif k == "allOf":
            out[k] = list(av) + list(v)
        elif k in ("$defs", "definitions", "dependentRequired", "dependentSchemas", "dependencies") and \
                isinstance(av, dict) and isinstance(v, dict):
            out[k] = {**v, **av}
        elif k in _ASSERTIONS:
            approximate(k, f"{path}/{k}", "two different values under allOf; the first one is kept")
        # NOTE: any other keyword is an annotation (title, description, vendor keys): first one kept
    if len(enums) == 2:
        out.pop("const", None)
        out["enum"] = [x for x in enums[0] if any(same_json(x, y) for y in enums[1])]
    _close_declared(out, a, b)
    _close_prefix(out, a, b)
    for key in ("anyOf", "oneOf"):
        if key in out:
            _distribute(out, key, a.get(key), b.get(key), path, approximate, narrowed)
    return out


def _quiet(keyword: str, path: str, detail: str) -> None:
    """An `approximate` for merges made only to test a schema (`implies`, `is_empty`): a merge
    that keeps one value accepts a superset, which those tests may look at."""


def _distribute(out: dict[str, Any], key: str, mine: Any, theirs: Any, path: str, approximate: Approximate,
                narrowed: Approximate | None) -> None:
    """`out[key]` (`anyOf` / `oneOf`): the lists of both sides (`mine`, `theirs`; one may be
    missing) as one list, pruned against the rest of `out` (see the module's docstring)."""
    factors = [f for f in (mine, theirs) if f is not None]
    if len(factors) == 2 and (factors[0] is factors[1] or factors[0] == factors[1]):
        factors = factors[:1]  # A and A is A
    if not all(isinstance(f, list) for f in factors):
        return  # NOTE: malformed, left for the compiler to refuse
    rest = {k: v for k, v in out.items() if k not in ("anyOf", "oneOf")}
    kept: list[list[Any]] = []
    for factor in factors:
        if key == "anyOf" and any(implies(rest, part) for part in factor):
            continue  # rest and (x or y) = rest, where rest implies x
        kept.append([part for part in factor if not is_empty(quiet_merge(rest, part))])
    if not kept:
        del out[key]
        return
    product = kept[0]
    for factor in kept[1:]:
        combined: list[list[Any]] = []
        for x in product:
            row = [xy for y in factor if (xy := _both(x, y, path, approximate, narrowed)) is not False and
                   not is_empty(quiet_merge(rest, xy))]
            combined.append(row)
        if sum(map(len, combined)) > MAX_MERGED_ALTERNATIVES:
            if narrowed is not None and key == "anyOf":
                # a subset: every alternative of the first list with the first ones of the second
                narrowed(key, path, f"more than {MAX_MERGED_ALTERNATIVES} alternatives when merged under allOf: "
                         "some combinations left out")
                budget = max(MAX_MERGED_ALTERNATIVES - sum(1 for row in combined if row), 0)
                cut: list[Any] = []
                for row in combined:
                    take = min(len(row), 1 + budget)
                    budget -= max(take - 1, 0)
                    cut += row[:take]
                product = cut
            elif narrowed is not None:
                # NOTE: leaving out alternatives of a oneOf could let values match only one: none kept
                narrowed(key, path, f"more than {MAX_MERGED_ALTERNATIVES} alternatives when merged under allOf: "
                         "no value kept")
                product = [False]
            else:
                approximate(key, path, f"more than {MAX_MERGED_ALTERNATIVES} alternatives when merged under "
                            "allOf: one list is not enforced")
            continue
        product = [xy for row in combined for xy in row]
    out[key] = product if product else [False]


def _both(x: Any, y: Any, path: str, approximate: Approximate, narrowed: Approximate | None) -> Any:
    """Alternatives `x` and `y` of two lists, merged (booleans as themselves)."""
    if x is False or y is False:
        return False
    if x is True:
        return y
    if y is True or not isinstance(x, dict):
        return x
    return merge_schemas(x, y, path, approximate, narrowed)


def quiet_merge(a: dict[str, Any], b: Any) -> Any:
    """`a` and `b` merged for a test only (a superset where a keyword keeps one value)."""
    if b is False or b is True:
        return a if b is True else False
    if not isinstance(b, dict):
        return a
    return merge_schemas(a, b, "#", _quiet)


def _flat(schema: Any, depth: int) -> Any:
    """`schema` with its `allOf` merged in (for tests; a superset), False where a part is False."""
    while isinstance(schema, dict) and isinstance(schema.get("allOf"), list) and depth <= _MAX_TEST_DEPTH:
        depth += 1
        out: Any = {k: v for k, v in schema.items() if k != "allOf"}
        for part in schema["allOf"]:
            out = quiet_merge(out, part)
            if out is False:
                return False
        schema = out
    return schema


def is_empty(schema: Any, depth: int = 0) -> bool:
    """Whether no JSON value is valid under `schema` (a sufficient test: disjoint types and
    values, reversed count bounds of the only type it has, a required property of an object-only
    schema that can have no value)."""
    schema = _flat(schema, depth)
    if schema is False:
        return True
    if not isinstance(schema, dict) or depth > _MAX_TEST_DEPTH:
        return False
    types = type_set(schema)
    if not types or finite_values(schema) == []:
        return True
    if len(types) == 1:
        (only,) = types
        if only in _COUNTS:
            low, high = (schema.get(k) for k in _COUNTS[only])
            if isinstance(low, int | float) and isinstance(high, int | float) and _count(low) and _count(high) and \
                    low > high:
                return True
    if types == {"number"} and _bounds_cross(schema):
        return True
    parts = schema.get("anyOf")
    if isinstance(parts, list):
        rest = {k: v for k, v in schema.items() if k != "anyOf"}
        if all(is_empty(quiet_merge(rest, part), depth + 1) for part in parts):
            return True
    props = schema.get("properties")
    if types == {"object"} and isinstance(props, dict) and isinstance(schema.get("required"), list):
        return any(isinstance(name, str) and name in props and is_empty(props[name], depth + 1)
                   for name in schema["required"])
    return False


def finite_values(schema: Any) -> list[Any] | None:
    """The values `schema` may take where they are few and known (a superset of them): its `const`
    / `enum` values, or for string-only schemas the strings of a `pattern` that is an anchored
    alternation of plain literals (`^(A|B)$`); in both cases those every `pattern` matches."""
    if not isinstance(schema, dict):
        return None
    patterns = [p for p in [schema.get("pattern"), *(schema.get(ALL_PATTERNS) or [])] if isinstance(p, str)]
    values = _enum_of(schema)
    if values is None and type_set(schema) == {"string"}:
        literal = next((lits for p in patterns if (lits := _literal_strings(p)) is not None), None)
        values = None if literal is None else sorted(literal)
    if values is None:
        return None
    banned = schema.get("not")
    excluded = _enum_of(banned) if isinstance(banned, dict) and not set(banned) - _ANNOTATIONS - {"enum", "const"} \
        else None
    return [v for v in values if (not isinstance(v, str) or all(_search(p, v) for p in patterns))
            and not any(same_json(v, x) for x in excluded or [])]


def _literal_strings(pattern: str) -> set[str] | None:
    """The strings `pattern` (search semantics) matches, where it is `^literal$` or
    `^(literal|literal...)$` without other metacharacters (`$` also matches before a final newline)."""
    if len(pattern) < 2 or not pattern.startswith("^") or not pattern.endswith("$") or pattern.endswith("\\$"):
        return None
    body = pattern[1:-1]
    if body.startswith("(") and body.endswith(")"):
        body = body[3:-1] if body.startswith("(?:") else body[1:-1]
    elif "|" in body:
        return None  # NOTE: ^a|b$ is (^a)|(b$)
    parts = body.split("|")
    if any(set(part) & _METACHARACTERS for part in parts):
        return None
    return {*parts, *(part + "\n" for part in parts)}


def _bounds_cross(schema: dict[str, Any]) -> bool:
    """Whether no number lies within the numeric bounds of `schema` (draft 4's boolean
    exclusive flags are ignored: a superset)."""
    lows = [(v, k == "exclusiveMinimum") for k in ("minimum", "exclusiveMinimum")
            if isinstance(v := schema.get(k), int | float) and _count(v)]
    highs = [(v, k == "exclusiveMaximum") for k in ("maximum", "exclusiveMaximum")
             if isinstance(v := schema.get(k), int | float) and _count(v)]
    return any(lo > hi or lo == hi and (open_lo or open_hi) for lo, open_lo in lows for hi, open_hi in highs)


def _count(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def implies(a: Any, b: Any, depth: int = 0) -> bool:
    """Whether every value valid under `a` is valid under `b` (a sufficient test: `b` may only
    name types, values, required and declared properties, `not` of values or types, and `anyOf`
    of such schemas)."""
    if b is True or (isinstance(b, dict) and not set(b) - _ANNOTATIONS):
        return True
    a = _flat(a, depth)
    if a is False:
        return True
    if not isinstance(a, dict) or not isinstance(b, dict) or depth > _MAX_TEST_DEPTH or \
            not set(b) - _ANNOTATIONS <= _IMPLIED:
        return False
    if "anyOf" in b:
        parts = b["anyOf"]
        rest = {k: v for k, v in b.items() if k != "anyOf"}
        return isinstance(parts, list) and any(implies(a, part, depth + 1) for part in parts) and implies(a, rest, depth)
    values = _enum_of(a)
    if isinstance(values, list) and not all(_valid_scalar(v, b) for v in values):
        return False
    if values is None and not _types_within(a, b):
        return False
    if "required" in b and (not isinstance(b["required"], list) or not isinstance(a.get("required", []), list) or
                            not set(b["required"]) <= set(a.get("required", []))):
        return False
    if "properties" in b:
        if not isinstance(b["properties"], dict):
            return False
        mine: dict[str, Any] = a["properties"] if isinstance(a.get("properties"), dict) else {}
        closed = a.get("additionalProperties") is False and not a.get("patternProperties")
        for name, sub in b["properties"].items():
            if name in mine:
                if not implies(mine[name], sub, depth + 1):
                    return False
            elif not (closed or implies(True, sub)):
                return False
    return True


def _types_within(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """`a` (without a list of values) has only types `b` allows (by `type` and `not`)."""
    allowed = set(type_set(a))
    if "type" in b:
        named = _types(b["type"]) if isinstance(b["type"], str | list) else []
        mine = _types(a["type"]) if isinstance(a.get("type"), str | list) else None
        if mine is None or not all(t in named or (t == "integer" and "number" in named) for t in mine):
            return False
    if "not" in b:
        banned = b["not"]
        if not isinstance(banned, dict) or set(banned) - _ANNOTATIONS - {"type", "enum", "const"}:
            return False
        if "type" in banned and allowed & type_set({"type": banned["type"]}):
            return False
        listed = _enum_of(banned)
        if listed is not None and allowed & {("number" if t == "integer" else t) for t in map(json_type, listed)}:
            return False
    return "enum" not in b and "const" not in b


def _valid_scalar(value: Any, b: dict[str, Any]) -> bool:
    """Whether a scalar `value` is valid under `b` (its keywords among `_IMPLIED`)."""
    if isinstance(value, dict | list):
        return False
    if "type" in b:
        named = _types(b["type"]) if isinstance(b["type"], str | list) else []
        t = json_type(value)
        if t not in named and not (t == "integer" and "number" in named):
            return False
    listed = _enum_of(b)
    if listed is not None and not any(same_json(value, x) for x in listed):
        return False
    if "not" in b:
        banned = b["not"]
        if not isinstance(banned, dict) or set(banned) - _ANNOTATIONS - {"enum", "const"}:
            return False
        if any(same_json(value, x) for x in _enum_of(banned) or []):
            return False
    return True


def _close_prefix(out: dict[str, Any], a: dict[str, Any], b: dict[str, Any]) -> None:
    """The prefix items one side declares are items for the other side (draft 2020-12 `items`
    beside no `prefixItems`): its `items` applies to them too."""
    for side, other in ((a, b), (b, a)):
        items, prefix = side.get("items"), other.get("prefixItems")
        if "prefixItems" in side or items in (None, True, {}) or isinstance(items, list):
            continue
        if out.get("prefixItems") is prefix and isinstance(prefix, list):
            out["prefixItems"] = [{"allOf": [p, items]} for p in prefix]


def _close_declared(out: dict[str, Any], a: dict[str, Any], b: dict[str, Any]) -> None:
    """A name one side declares is an undeclared member for the other side, whose
    `additionalProperties` (or the `patternProperties` it matches) applies to it: added to the
    merged declaration (which `additionalProperties` no longer sees)."""
    merged = out.get("properties")
    if not isinstance(merged, dict):
        return
    for side, other in ((a, b), (b, a)):
        addl = side.get("additionalProperties")
        theirs = other.get("properties")
        if addl in (None, True, {}) or not isinstance(theirs, dict):
            continue
        mine: dict[str, Any] = side["properties"] if isinstance(side.get("properties"), dict) else {}
        patterns: dict[str, Any] = side["patternProperties"] if isinstance(side.get("patternProperties"), dict) else {}
        for name in theirs:
            if name in mine or name not in merged:
                continue
            matched = [sub for pat, sub in patterns.items() if _search(pat, name)]
            if not matched:
                merged[name] = {"allOf": [merged[name], addl]}


def _search(pattern: str, name: str) -> bool:
    try:
        return regex.search(pattern, name) is not None
    except (regex.error, TypeError):
        return False
