"""Keyword facts the JSON Schema compiler and its helpers share: the JSON types, the keywords
that only annotate, the keywords that assert independently of each other, and `negation` (the
schema of exactly the values a schema rejects, where one is easy to spell). Pure."""

from __future__ import annotations

from typing import Any

from cfsm.schema.merge import JSON_TYPES

__all__ = ["ALL_TYPES", "BOUND_NEGATIONS", "COUNT_NEGATIONS", "INDEPENDENT", "MAX_NEGATED_KEYWORDS", "STRUCTURAL",
           "negation"]

# a schema without `type` takes every type but integer (a subset of number)
ALL_TYPES = ("object", "array", "string", "number", "boolean", "null")

# keywords that only annotate or structure a document (no assertion)
STRUCTURAL = {"$schema", "$id", "id", "$defs", "definitions", "$comment", "$anchor", "$dynamicAnchor",
               "$recursiveAnchor", "$vocabulary", "title", "description", "default", "examples", "deprecated",
               "readOnly", "writeOnly"}
# one numeric bound: the opposite bound over numbers
BOUND_NEGATIONS = {"minimum": "exclusiveMaximum", "maximum": "exclusiveMinimum",
                    "exclusiveMinimum": "maximum", "exclusiveMaximum": "minimum"}
# count bounds: (the type they apply to, the opposite bound, its offset)
COUNT_NEGATIONS = {"minLength": ("string", "maxLength", -1), "maxLength": ("string", "minLength", 1),
                    "minItems": ("array", "maxItems", -1), "maxItems": ("array", "minItems", 1),
                    "minProperties": ("object", "maxProperties", -1), "maxProperties": ("object", "minProperties", 1)}

# keywords whose assertions do not depend on each other (a schema of several is their conjunction)
INDEPENDENT = frozenset({"type", "const", "enum", *BOUND_NEGATIONS, *COUNT_NEGATIONS, "required"})
MAX_NEGATED_KEYWORDS = 3


def negation(sub: Any) -> Any:
    """A schema that accepts exactly the values `sub` rejects, where one is easy to spell: a
    boolean, types (but integer without number), scalar `const` / `enum` (as `not`, which
    compiles exactly), one numeric bound (the opposite bound over numbers); else None."""
    if isinstance(sub, bool):
        return not sub
    if not isinstance(sub, dict):
        return None
    keys = set(sub) - STRUCTURAL
    if not keys:
        return False
    if keys == {"type"}:
        named = [sub["type"]] if isinstance(sub["type"], str) else sub["type"]
        if not isinstance(named, list) or not set(named) <= set(JSON_TYPES) or "integer" in named and "number" not in named:
            return None
        return {"type": [t for t in JSON_TYPES if t not in named and not (t == "integer" and "number" in named)]}
    if keys in ({"const"}, {"enum"}):
        values = [sub["const"]] if "const" in sub else sub["enum"]
        if isinstance(values, list) and not any(isinstance(v, dict | list) for v in values):
            return {"not": {k: sub[k] for k in keys}}
        return None
    if len(keys) == 1:
        (key,) = keys
        value = sub[key]
        if key in BOUND_NEGATIONS and isinstance(value, int | float) and not isinstance(value, bool):
            return {"type": "number", BOUND_NEGATIONS[key]: value}
        if key in COUNT_NEGATIONS and isinstance(value, int | float) and not isinstance(value, bool) and \
                float(value).is_integer():
            t, opposite, step = COUNT_NEGATIONS[key]
            bound = int(value) + step
            return False if bound < 0 else {"type": t, opposite: bound}
        if key == "required" and isinstance(value, list) and all(isinstance(n, str) for n in value):
            # some required property absent: objects with one of them declared `false`
            absent = [{"type": "object", "properties": {n: False}} for n in dict.fromkeys(value)]
            return False if not absent else absent[0] if len(absent) == 1 else {"anyOf": absent}
        return None
    if len(keys) <= MAX_NEGATED_KEYWORDS and keys <= INDEPENDENT:
        # not (k1 and k2 ...) = (not k1) or (not k2) ..., each keyword asserting on its own
        parts = [negation({k: sub[k]}) for k in sorted(keys)]
        if any(p is None for p in parts):
            return None
        kept = [p for p in parts if p is not False]
        return False if not kept else kept[0] if len(kept) == 1 else {"anyOf": kept}
    return None
