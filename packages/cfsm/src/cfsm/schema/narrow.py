"""Narrowings (`CfsmConfig.narrow`, the default): subsets of a keyword's language where cfsm
cannot compile it exactly, so that generation never produces an invalid document.

Each narrowing is recorded as an `Approximation` of kind "subset" (`SchemaCompiling.narrowed`) and is
exact-safe by construction: every value it accepts is valid under the schema.

- `uniqueItems` over items that are not a few scalar values: the items have distinct JSON types
  (at most one object, one array, one string, one number, one boolean, one null): two values of
  different types are never equal, so the items are distinct.
- `not`, `if` and `oneOf` where a subschema has no simple negation: `negation_subset` stands for
  its negation, the JSON types the subschema cannot accept at all (`False` where it may accept
  every type); in a `oneOf` branch, the alternatives that require no property the branch leaves
  undeclared where there are such (`prefer_declared`).
- `$dynamicRef`: the static target and every `$dynamicAnchor` of that name in the document, all
  of them (the one the dynamic scope picks is among them).
- A reference to a published meta-schema: the schemas `true`, `false` and `{}`.
- `multipleOf` that is neither an integer nor a power of ten: the integers that are multiples of
  the numerator of its reduced fraction (`1.5` = 3/2: multiples of 3).
- Dependent schemas that cannot be merged: the property they depend on is absent.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from cfsm.regex.syntax import EMPTY, NOTHING, Node, Scope, Shared, alt, cat, lit
from cfsm.schema.compiling import SchemaCompiling
from cfsm.schema.keywords import ALL_TYPES, INDEPENDENT, STRUCTURAL, negation
from cfsm.schema.merge import type_set

__all__ = ["unique_by_type", "negation_subset", "prefer_declared", "possible_types", "META_SCHEMA_SUBSET", "multiple_of_subset", "TYPE_BUCKETS"]

# `uniqueItems` narrowing: one item per bucket at most (values of different buckets differ)
TYPE_BUCKETS = ("object", "array", "string", "number", "boolean", "null")
# what a reference to a published meta-schema narrows to: schemas every meta-schema accepts
META_SCHEMA_SUBSET: dict[str, Any] = {"enum": [True, False, {}]}
# the largest integer multiple spelled out (a counter automaton of this many states), else only 0
MAX_NARROWED_MULTIPLE = 10_000
# keywords whose evaluations `unevaluated*` would see (not inside a `not`)
_EVALUATING = frozenset({"properties", "patternProperties", "additionalProperties", "prefixItems", "items", "contains",
                         "allOf", "anyOf", "oneOf", "$ref", "$dynamicRef", "if", "then", "else", "dependentSchemas",
                         "unevaluatedProperties", "unevaluatedItems"})
# `properties` nested this deep in a negated schema are negated (deeper: not at all, a subset)
MAX_NEGATION_DEPTH = 3


def negation_subset(sub: Any, depth: int = 0, *, declare: bool = True) -> Any:
    """A schema accepting only values `sub` rejects: its exact negation where one is easy to
    spell (`keywords.negation`); for a conjunction of simple keywords and `properties`, the
    values failing one of them (a property present and failing its schema: this negation's
    subset, recursively); else the JSON types `sub` cannot accept (by its `type`, `const` and
    `enum`), or `False`. `declare=False`: no part declares a property with a schema other than
    `false` (where declared names count as evaluated: `unevaluatedProperties`)."""

    negated = negation(sub)
    if negated is not None:
        return negated
    if isinstance(sub, dict) and set(sub) - STRUCTURAL == {"not"} and \
            (declare or not (isinstance(sub["not"], dict) and _EVALUATING & sub["not"].keys())):
        return sub["not"]  # NOTE: exact, not (not x) = x (but x's evaluations do not count)
    allowed = type_set(sub)
    others = [t for t in ALL_TYPES if t not in allowed]
    parts: list[Any] = [{"type": others}] if others else []
    keys = set(sub) - STRUCTURAL if isinstance(sub, dict) else set()
    if isinstance(sub, dict) and keys and keys <= INDEPENDENT | {"properties"} and depth < MAX_NEGATION_DEPTH:
        # not (k1 and k2 ...) = (not k1) or (not k2) ...; a subset of any of them is a subset
        for key in sorted(keys):
            if key == "properties" and isinstance(sub[key], dict) and declare:
                for name, value in sub[key].items():
                    failing = negation_subset(value, depth + 1, declare=declare)
                    if failing is not False:
                        parts.append({"type": "object", "required": [name], "properties": {name: failing}})
            elif key != "properties":
                part = negation({key: sub[key]})
                if part is not None and part is not False:
                    parts.append(part)
    if not parts:
        return False
    return parts[0] if len(parts) == 1 else {"anyOf": parts}


def prefer_declared(subset: Any, branch: Any) -> Any:
    """`subset` (a `negation_subset`) narrowed further for values of `branch`: where some of its
    alternatives require no property `branch` leaves undeclared, only those (the others would
    make a branch's documents carry another branch's properties, of the wrong kind)."""
    if not isinstance(subset, dict) or set(subset) != {"anyOf"} or not isinstance(branch, dict):
        return subset
    declared: dict[str, Any] = branch["properties"] if isinstance(branch.get("properties"), dict) else {}

    def foreign(part: Any) -> bool:
        required = part.get("required") if isinstance(part, dict) else None
        return isinstance(required, list) and any(name not in declared for name in required)

    kept = [part for part in subset["anyOf"] if not foreign(part)]
    if not kept or len(kept) == len(subset["anyOf"]):
        return subset
    return kept[0] if len(kept) == 1 else {"anyOf": kept}


def possible_types(schema: Any) -> set[str]:
    """The JSON types (`json_schema._DISJOINT_TYPES`) a schema built here may accept (a superset:
    by `type`, `const`, `enum` and `anyOf` / `allOf`)."""
    out = type_set(schema)
    if isinstance(schema, dict):
        if isinstance(schema.get("anyOf"), list):
            out &= set().union(*(possible_types(part) for part in schema["anyOf"]))
        if isinstance(schema.get("allOf"), list):
            for part in schema["allOf"]:
                out &= possible_types(part)
    return out


def unique_by_type(comp: SchemaCompiling, prefix: list[Any], items: Any, lo: int, hi: int | None, path: str) -> Node:
    """`uniqueItems` narrowed: arrays (prefix items, then `items`; None: any value) lo to hi items
    long whose items all have different JSON types (`TYPE_BUCKETS`)."""
    comp.narrowed("uniqueItems", f"{path}/uniqueItems",
                  "items of distinct JSON types (at most one object, array, string, number, boolean, null)")

    def classes(sub: Any, where: str) -> dict[int, Node]:
        if sub is False:
            return {}
        sub = True if sub is None else sub
        allowed = type_set(comp.peek(sub))
        out: dict[int, Node] = {}
        for i, t in enumerate(TYPE_BUCKETS):
            if t in allowed:
                node = comp.branch({"type": t}, sub, where)
                if node is not NOTHING:
                    out[i] = node
        return out

    at = [classes(p, f"{path}/prefixItems/{i}") for i, p in enumerate(prefix)]
    more = classes(items, f"{path}/items")
    return cat(lit("["), comp.ws, unique_sequences(at, more, comp.comma, lo, hi), comp.ws, lit("]"))


def unique_sequences(prefix: list[dict[int, Node]], more: dict[int, Node], comma: Node, lo: int,
                     hi: int | None) -> Node:
    """Sequences of items with distinct keys, lo to hi items long: `prefix[i]` maps the keys allowed
    at position i to their item nodes, `more` those allowed after the prefix."""
    memo: dict[tuple[int, frozenset[int]], Node] = {}

    def rest(pos: int, used: frozenset[int]) -> Node:
        key = (pos, used)
        if key not in memo:
            options: list[Node] = [EMPTY] if pos >= lo else []
            if hi is None or pos < hi:
                sep = comma if pos else EMPTY
                allowed = prefix[pos] if pos < len(prefix) else more
                options += [cat(sep, node, rest(pos + 1, used | {i})) for i, node in allowed.items() if i not in used]
            memo[key] = Shared(alt(*options) if options else NOTHING)
        return memo[key]

    return Scope(rest(0, frozenset()))


def multiple_of_subset(mult: Any) -> int:
    """The integers that are multiples of this are multiples of `mult` (a positive decimal); 0
    where that number passes `MAX_NARROWED_MULTIPLE` (only 0 then: a multiple of everything)."""
    numerator = Fraction(str(mult)).numerator
    return numerator if numerator <= MAX_NARROWED_MULTIPLE else 0
