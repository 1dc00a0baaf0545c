"""`allOf`: two JSON Schemas merged keyword by keyword into one that requires both.

Keywords that merge exactly: bounds (the tighter one), `required` and `properties` (union, with
shared properties merged recursively), `type` and `enum` / `const` (intersection), `items`,
`additionalProperties` (nested `allOf`), `not` (nested `anyOf`), `pattern` and `format` (all kept, intersected
later), `anyOf` / `oneOf` (the cross product), integer `multipleOf` (their least common multiple). Any other keyword given two different values keeps
the first one: the merged schema accepts a superset, which the caller records (`approximate`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import regex

from cfsm.errors import UnsupportedSchemaError

__all__ = ["merge_schemas", "same_json", "ALL_PATTERNS", "ALL_FORMATS"]

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


def _integral(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0 and float(value).is_integer()


def _types(value: Any) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


def _enum_of(schema: dict[str, Any]) -> list[Any] | None:
    if "const" in schema:
        return [schema["const"]]
    return list(schema["enum"]) if "enum" in schema else None


def same_json(a: Any, b: Any) -> bool:
    """JSON equality (1 == 1.0, but True != 1)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_json(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_json(a[k], b[k]) for k in a)
    return bool(a == b)


def merge_schemas(a: dict[str, Any], b: Any, path: str, approximate: Approximate) -> dict[str, Any]:
    """One schema requiring both `a` and `b` (keyword by keyword). Pure, except for the calls to
    `approximate(keyword, path, detail)` for each keyword it could only keep one value of."""
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
            out[k] = [merge_schemas(x, y, path, approximate) if isinstance(x, dict) else y for x in av for y in v]
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
    return out


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
