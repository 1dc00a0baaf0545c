"""`$ref` resolution inside one JSON Schema document: `$id` / `id` base URIs, JSON pointers and
anchors. Nothing is ever fetched: a reference outside the document raises
`UnsupportedSchemaError`, except the published meta-schemas, which resolve to `True` (any JSON).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote, urldefrag, urljoin

from cfsm.errors import UnsupportedSchemaError

__all__ = ["RefResolver", "check_depth", "is_meta_schema", "meta_schema_fragment", "META_FRAGMENTS"]

# values of these keywords are data, not schemas: their `$id` keys mean nothing
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples", "example"})
# keywords whose value maps names to subschemas (a name such as "default" or "enum" is no keyword there)
_NAME_MAPS = frozenset({"$defs", "definitions", "properties", "patternProperties", "dependentSchemas", "dependencies"})
_META_HOSTS = ("json-schema.org/", "spec.openapis.org/")


_NON_NEGATIVE: dict[str, Any] = {"type": "integer", "minimum": 0}
_STRING: dict[str, Any] = {"type": "string"}
_SIMPLE_TYPES: dict[str, Any] = {"enum": ["array", "boolean", "integer", "null", "number", "object", "string"]}
# the subschemas of the draft 4 to 7 meta-schemas that real schemas reference by JSON pointer (the
# meta-schemas' own text, where it holds no reference back to a whole schema)
META_FRAGMENTS: dict[str, Any] = {
    "/definitions/positiveInteger": _NON_NEGATIVE, "/definitions/positiveIntegerDefault0": _NON_NEGATIVE,
    "/definitions/nonNegativeInteger": _NON_NEGATIVE, "/definitions/nonNegativeIntegerDefault0": _NON_NEGATIVE,
    "/definitions/simpleTypes": _SIMPLE_TYPES,
    "/definitions/stringArray": {"type": "array", "items": _STRING, "uniqueItems": True},
    "/properties/id": _STRING, "/properties/$id": _STRING, "/properties/$schema": _STRING,
    "/properties/$ref": _STRING, "/properties/$comment": _STRING, "/properties/title": _STRING,
    "/properties/description": _STRING, "/properties/default": True, "/properties/examples": {"type": "array"},
    "/properties/multipleOf": {"type": "number", "exclusiveMinimum": 0}, "/properties/maximum": {"type": "number"},
    "/properties/minimum": {"type": "number"}, "/properties/format": _STRING,
    "/properties/pattern": _STRING, "/properties/uniqueItems": {"type": "boolean"},
    "/properties/readOnly": {"type": "boolean"}, "/properties/enum": {"type": "array", "minItems": 1, "uniqueItems": True},
    "/properties/type": {"anyOf": [_SIMPLE_TYPES, {"type": "array", "items": _SIMPLE_TYPES, "minItems": 1,
                                                   "uniqueItems": True}]},
    **{f"/properties/{k}": _NON_NEGATIVE for k in ("maxLength", "minLength", "maxItems", "minItems",
                                                    "maxProperties", "minProperties")},
}
# draft 4 (and 3) meta-schemas: their booleans are numeric-bound modifiers (draft 6 on: numbers)
_DRAFT4_FRAGMENTS: dict[str, Any] = {"/properties/exclusiveMaximum": {"type": "boolean"},
                                     "/properties/exclusiveMinimum": {"type": "boolean"},
                                     "/definitions/stringArray": {"type": "array", "items": _STRING, "minItems": 1,
                                                                  "uniqueItems": True}}


def meta_schema_fragment(uri: str, fragment: str) -> Any | None:
    """The subschema at JSON pointer `fragment` of the published meta-schema `uri` where it is
    known here (`META_FRAGMENTS`), else None."""
    pointer = unquote(fragment)
    if "draft-04" in uri or "draft-03" in uri:
        hit = _DRAFT4_FRAGMENTS.get(pointer)
        if hit is not None:
            return hit
    elif pointer in ("/properties/exclusiveMaximum", "/properties/exclusiveMinimum"):
        return {"type": "number"}
    return META_FRAGMENTS.get(pointer)


def is_meta_schema(uri: str) -> bool:
    """Whether `uri` names a published JSON Schema or OpenAPI meta-schema."""
    rest = uri.split("://", 1)[-1]
    return rest.startswith(_META_HOSTS)


def check_depth(schema: Any, max_depth: int) -> None:
    """Raise `UnsupportedSchemaError` when `schema` nests objects and arrays deeper than
    `max_depth` (checked without recursion, so a 10,000-deep schema is refused cleanly)."""
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            children: Any = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        if depth > max_depth:
            raise UnsupportedSchemaError("schema", "#", f"nested deeper than {max_depth} levels")
        stack.extend((v, depth + 1) for v in children)


def _join(base: str, ref: str) -> str:
    """`ref` resolved against `base` (`urljoin`, which leaves a fragment alone under schemes it
    does not know, such as `urn:`)."""
    if ref.startswith("#") and base:
        return urldefrag(base)[0] + ref
    return urljoin(base, ref)


def _own_id(schema: dict[str, Any]) -> str | None:
    """`$id`, or draft 4's `id` when it is a string and `$id` is absent."""
    for key in ("$id", "id"):
        ident = schema.get(key)
        if isinstance(ident, str) and ident:
            return ident
    return None


class RefResolver:
    """The schema resources of one document by absolute URI, built once per compile.

    `resolve(ref, base)` returns (target schema, the base URI to compile it under). Mutates
    nothing after construction.
    """

    def __init__(self, root: Any) -> None:
        self.root = root
        self.resources: dict[str, Any] = {"": root}
        self.anchors: dict[str, Any] = {}
        self._resolved: dict[tuple[str, str], tuple[Any, str]] = {}
        self._uri_of: dict[int, str] = {}  # id of a document schema with `$id` -> its base URI (from the scan)
        self._scan(root)

    def _scan(self, root: Any) -> None:
        stack: list[tuple[Any, str]] = [(root, "")]
        names: set[int] = set()  # ids of the name maps met (`_NAME_MAPS` values)
        while stack:
            value, base = stack.pop()
            if isinstance(value, list):
                stack.extend((v, base) for v in value)
                continue
            if not isinstance(value, dict):
                continue
            if id(value) in names:
                stack.extend((v, base) for v in value.values())
                continue
            names.update(id(v) for k, v in value.items() if k in _NAME_MAPS and isinstance(v, dict))
            ident = _own_id(value)
            if ident is not None:
                uri, frag = urldefrag(_join(base, ident))
                if frag and not uri:  # draft 6/7 "$id": "#name" is a plain-name anchor
                    self.anchors.setdefault(f"{base}#{frag}", value)
                elif frag:
                    self.anchors.setdefault(f"{uri}#{frag}", value)
                    base = uri
                else:
                    self.resources.setdefault(uri, value)
                    base = uri
                self._uri_of.setdefault(id(value), base)
            for key in ("$anchor", "$dynamicAnchor"):
                anchor = value.get(key)
                if isinstance(anchor, str):
                    self.anchors.setdefault(f"{base}#{anchor}", value)
            stack.extend((v, base) for k, v in value.items() if k not in _DATA_KEYWORDS)

    def dynamic_anchors(self, name: str) -> list[tuple[Any, str]]:
        """Every schema with `"$dynamicAnchor": name`, with its base URI (document order)."""
        return [(value, key[: -len(name) - 1]) for key, value in self.anchors.items()
                if key.endswith(f"#{name}") and isinstance(value, dict) and value.get("$dynamicAnchor") == name]

    def base_of(self, schema: dict[str, Any], base: str) -> str:
        """The base URI inside `schema` (its own `$id` joined to `base`, or `base`)."""
        ident = _own_id(schema)
        if ident is None:
            return base
        known = self._uri_of.get(id(schema))
        if known is not None:
            return known  # NOTE: where the document puts it (the caller's base may already be this one's)
        uri = urldefrag(_join(base, ident))[0]
        return uri or base

    def resolve(self, ref: str, base: str, path: str) -> tuple[Any, str]:
        """(target, its base URI). Raises `UnsupportedSchemaError` for a reference outside the
        document or one that does not resolve. Mutates only its memo."""
        hit = self._resolved.get((ref, base))
        if hit is None:
            hit = self._resolved[(ref, base)] = self._resolve(ref, base, path)
        return hit

    def _resolve(self, ref: str, base: str, path: str) -> tuple[Any, str]:
        uri, frag = urldefrag(_join(base, ref))
        if uri not in self.resources and ref.startswith("#"):
            uri = ""  # NOTE: a base from an annotation-like `id` the scan did not reach this way
        if uri not in self.resources:
            if is_meta_schema(uri):
                return True, uri
            raise UnsupportedSchemaError(
                "$ref", path, f"{ref!r} points outside this schema ({uri!r}); remote references are never fetched: "
                "inline the referenced schema under $defs")
        try:
            return self._walk(self.resources[uri], uri, frag, ref, path)
        except UnsupportedSchemaError:
            # NOTE: an `id` used as a plain annotation (not a URI) makes a nested resource; a
            # document-local reference inside it that fails there is tried against the root
            if uri == "" or not ref.startswith("#"):
                raise
            return self._walk(self.root, "", frag, ref, path)

    def _walk(self, target: Any, uri: str, frag: str, ref: str, path: str) -> tuple[Any, str]:
        if frag and not frag.startswith("/"):
            hit = self.anchors.get(f"{uri}#{frag}")
            if hit is None:
                raise UnsupportedSchemaError("$ref", path, f"cannot resolve {ref!r}: no anchor {frag!r}")
            return hit, uri
        # NOTE: an empty segment is the key "" where there is one (else skipped: "#/", "#/a//b/" as written in the wild)
        for part in frag.split("/")[1:]:
            part = unquote(part).replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and part in target:
                target = target[part]
            elif not part:
                continue
            elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]
            else:
                raise UnsupportedSchemaError("$ref", path, f"cannot resolve {ref!r}")
            if isinstance(target, dict):
                uri = self.base_of(target, uri)
        return target, uri
