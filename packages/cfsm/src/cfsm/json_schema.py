"""JSON Schema -> syntax tree (then the usual DFA and `Index`).

Objects list their properties in schema order (or in any order with `CfsmConfig.any_order`);
strings, numbers and formats are exact languages (see `numeric` and `formats`); `pattern` has
the specification's search semantics. `oneOf` is compiled like `anyOf` (exclusivity is not
enforced). Unsupported keywords raise `UnsupportedSchemaError` with their JSON path.
"""

from __future__ import annotations

import functools
import json
from decimal import Decimal
from typing import Any

from cfsm.charset import negate
from cfsm.config import CfsmConfig
from cfsm.errors import UnsupportedRegexError, UnsupportedSchemaError
from cfsm.formats import FORMAT_REGEXES
from cfsm.json_object import object_members
from cfsm.numeric import INT, NUMBER, decimal_range, int_range, multiple_of
from cfsm.regex_ast import (
    EMPTY,
    NOTHING,
    Alt,
    Cat,
    Chars,
    Intersect,
    Node,
    Piece,
    Repeat,
    Scope,
    Sep,
    alt,
    cat,
    lit,
)
from cfsm.regex_parser import parse_regex

__all__ = ["schema_to_node", "json_value_node", "MAX_ANY_ORDER_PROPERTIES"]

MAX_ANY_ORDER_PROPERTIES = 10

_ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
                "readOnly", "writeOnly", "$defs", "definitions", "contentMediaType", "contentEncoding",
                "$anchor", "discriminator", "nullable"}
_KEYWORDS = {"type", "enum", "const", "properties", "required", "additionalProperties", "patternProperties",
             "minProperties", "maxProperties", "items", "prefixItems", "minItems", "maxItems", "minLength",
             "maxLength", "pattern", "format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
             "multipleOf", "anyOf", "oneOf", "allOf", "$ref", "additionalItems"}
_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
_TYPE_KEYWORDS = {
    "object": {"properties", "required", "additionalProperties", "patternProperties", "minProperties",
               "maxProperties"},
    "array": {"items", "prefixItems", "minItems", "maxItems", "additionalItems"},
    "string": {"minLength", "maxLength", "pattern", "format"},
    "number": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"},
}

_SPECIAL = ((0, 0x1F), (0x22, 0x22), (0x5C, 0x5C))
_HEX = Chars(((48, 57), (65, 70), (97, 102)))
_PLAIN = Chars(negate(_SPECIAL))
# NOTE: `\\uXXXX` escapes are limited to control characters (`\\u0000`-`\\u001F`): other characters
# are written as themselves (UTF-8). General `\\u` escapes would add four hex states per character
# position, which multiplies the index size of every length-bounded string.
JSON_CHAR = alt(_PLAIN, cat(lit("\\"), Chars(((0x22, 0x22), (0x2F, 0x2F), (0x5C, 0x5C), (0x62, 0x62), (0x66, 0x66),
                                              (0x6E, 0x6E), (0x72, 0x72), (0x74, 0x74)))),
                cat(lit("\\u00"), Chars(((0x30, 0x31),)), _HEX))
JSON_STRING = cat(lit('"'), Repeat(JSON_CHAR, 0, None), lit('"'))
# the pieces of every schema's unbounded string and boolean (one node each per process, so that
# the direct construction finds their blocks built in advance: `standard_pieces`)
_STRING_BODY = Repeat(JSON_CHAR, 0, None)
_BOOLEAN = alt(lit("true"), lit("false"))
_SHORT_ESCAPES = {0x22: '\\"', 0x5C: "\\\\", 0x08: "\\b", 0x0C: "\\f", 0x0A: "\\n", 0x0D: "\\r", 0x09: "\\t"}


def _escape_code_point(cp: int) -> Node:
    if cp in _SHORT_ESCAPES:
        return lit(_SHORT_ESCAPES[cp])
    hi, lo = f"{cp:04x}"[2], f"{cp:04x}"[3]
    return cat(lit("\\u00" + hi), Chars(tuple(sorted({(ord(lo), ord(lo)), (ord(lo.upper()), ord(lo.upper()))}))))


def json_escape(node: Node) -> Node:
    """Map a tree over decoded characters to the tree of their JSON string encodings."""
    if isinstance(node, Chars):
        plain: list[tuple[int, int]] = []
        specials: list[int] = []
        for lo, hi in node.ranges:
            cur = lo
            for slo, shi in _SPECIAL:
                if shi < cur or slo > hi:
                    continue
                if slo > cur:
                    plain.append((cur, slo - 1))
                specials.extend(range(max(cur, slo), min(hi, shi) + 1))
                cur = shi + 1
            if cur <= hi:
                plain.append((cur, hi))
        parts: list[Node] = [Chars(tuple(plain))] if plain else []
        parts += [_escape_code_point(c) for c in specials]
        return alt(*parts) if parts else NOTHING
    if isinstance(node, Cat):
        return Cat([json_escape(x) for x in node.items])
    if isinstance(node, Alt):
        return Alt([json_escape(x) for x in node.items])
    if isinstance(node, Repeat):
        return Repeat(json_escape(node.item), node.lo, node.hi)
    if isinstance(node, Intersect):
        return Intersect([json_escape(x) for x in node.items])
    raise TypeError(f"cannot JSON-escape {type(node).__name__}")


@functools.cache
def format_node(fmt: str) -> Node:
    """The JSON-escaped syntax tree of a `format` (one immutable tree per format per process;
    `Vocabulary.prepare()` builds them all)."""
    return json_escape(parse_regex(FORMAT_REGEXES[fmt]))


@functools.cache
def piece(node: Node) -> Piece:
    """`node` kept whole inside a schema's tree: one `Piece` per standard value tree per process,
    so the direct construction copies its block prepared once (`direct.prepare_blocks`)."""
    return Piece(node)


def standard_pieces() -> tuple[Node, ...]:
    """The per-process value trees that schemas share (unbounded string body, boolean, number,
    integer, every format): `cfsm.direct.prepare_blocks` builds their blocks once."""
    return (_STRING_BODY, piece(_BOOLEAN), piece(NUMBER), piece(INT), *(piece(format_node(f)) for f in FORMAT_REGEXES))


def _dump(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _type_of(value: Any) -> str:
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


class _Compiler:
    def __init__(self, root: Any, config: CfsmConfig) -> None:
        self.root = root
        self.cfg = config
        if config.whitespace_pattern is not None:
            self.ws: Node = parse_regex(config.whitespace_pattern)
        elif config.whitespace == "flexible":
            self.ws = Repeat(Chars(((9, 10), (13, 13), (32, 32))), 0, None)
        else:
            self.ws = EMPTY
        self.comma = cat(self.ws, lit(","), self.ws)
        self.colon = cat(self.ws, lit(":"), self.ws)
        self.ref_depth: dict[str, int] = {}
        self._any: dict[int, Node] = {}
        # per compile: equal number bounds and formats share one (immutable) syntax tree
        self._memo: dict[tuple[Any, ...], Node] = {}

    # ---- helpers ---------------------------------------------------------------------------
    def unsupported(self, keyword: str, path: str, hint: str = "") -> None:
        if not self.cfg.ignore_unsupported:
            raise UnsupportedSchemaError(keyword, path, hint)

    def resolve(self, ref: str, path: str) -> Any:
        if not ref.startswith("#"):
            raise UnsupportedSchemaError("$ref", path, f"only local references ('#/...') are supported, got {ref!r}")
        target = self.root
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and part in target:
                target = target[part]
            elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]
            else:
                raise UnsupportedSchemaError("$ref", path, f"cannot resolve {ref!r}")
        return target

    def any_value(self, depth: int) -> Node:
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

    def free_object(self, depth: int) -> Node:
        pair = cat(JSON_STRING, self.colon, self.any_value(max(depth - 1, 0)))
        return cat(lit("{"), self.ws, Repeat(Sep(pair, self.comma), 0, 1), self.ws, lit("}"))

    # ---- schemas ---------------------------------------------------------------------------
    def node(self, schema: Any, path: str) -> Node:
        if schema is True or schema == {}:
            return self.any_value(self.cfg.json_depth)
        if schema is False:
            return NOTHING
        if not isinstance(schema, dict):
            raise UnsupportedSchemaError("schema", path, f"expected an object or a boolean, got {type(schema).__name__}")
        for key in schema:
            if key not in _KEYWORDS and key not in _ANNOTATIONS:
                self.unsupported(key, f"{path}/{key}")
        if "$ref" in schema:
            ref = schema["$ref"]
            rest = {k: v for k, v in schema.items() if k != "$ref"}
            if self.ref_depth.get(ref, 0) > self.cfg.max_recursion_depth:
                return NOTHING
            self.ref_depth[ref] = self.ref_depth.get(ref, 0) + 1
            try:
                target = self.resolve(ref, path)
                if any(k not in _ANNOTATIONS for k in rest):
                    return self.node({"allOf": [target, rest]}, path)
                return self.node(target, f"{path}/$ref")
            finally:
                self.ref_depth[ref] -= 1
        if "allOf" in schema:
            merged = {k: v for k, v in schema.items() if k != "allOf"}
            for i, sub in enumerate(schema["allOf"]):
                sub_path = f"{path}/allOf/{i}"
                while isinstance(sub, dict) and "$ref" in sub:
                    extra = {k: v for k, v in sub.items() if k != "$ref"}
                    sub = _merge(self.resolve(sub["$ref"], sub_path), extra, sub_path)
                if sub is False:
                    return NOTHING
                if sub is True:
                    continue
                merged = _merge(merged, sub, sub_path)
            return self.node(merged, path)
        for key in ("anyOf", "oneOf"):
            if key in schema:
                rest = {k: v for k, v in schema.items() if k != key}
                branches = []
                for i, sub in enumerate(schema[key]):
                    sub_path = f"{path}/{key}/{i}"
                    if sub is False:
                        continue
                    branches.append(self.node(_merge(rest, sub, sub_path) if sub is not True else rest, sub_path))
                return alt(*branches) if branches else NOTHING
        types = schema.get("type")
        if isinstance(types, str):
            types = [types]
        if types is not None:
            for t in types:
                if t not in _TYPES:
                    raise UnsupportedSchemaError("type", f"{path}/type", f"unknown type {t!r}")
        if "enum" in schema or "const" in schema:
            values = [schema["const"]] if "const" in schema else list(schema["enum"])
            if types is not None:
                values = [v for v in values if _type_of(v) in types or (_type_of(v) == "integer" and "number" in types)]
            return alt(*(lit(_dump(v)) for v in values)) if values else NOTHING
        if types is None:
            inferred = [t for t, kws in _TYPE_KEYWORDS.items() if kws & schema.keys()]
            if not inferred:
                return self.any_value(self.cfg.json_depth)
            types = inferred
        return alt(*(self.typed(t, schema, path) for t in types))

    def typed(self, t: str, schema: dict[str, Any], path: str) -> Node:
        if t == "null":
            return lit("null")
        if t == "boolean":
            return piece(_BOOLEAN)
        if t == "string":
            return self.string(schema, path)
        if t in ("integer", "number"):
            return self.number(schema, path, integer=t == "integer")
        if t == "array":
            return self.array(schema, path)
        return self.object(schema, path)

    def string(self, schema: dict[str, Any], path: str) -> Node:
        langs: list[Node] = []
        fmt = schema.get("format")
        if fmt is not None:
            if fmt in FORMAT_REGEXES:
                langs.append(piece(format_node(fmt)))
            else:
                self.unsupported("format", f"{path}/format", f"unknown format {fmt!r}; supported: {sorted(FORMAT_REGEXES)}")
        if "pattern" in schema:
            try:
                langs.append(json_escape(parse_regex(schema["pattern"], search=True)))
            except UnsupportedRegexError as exc:
                raise UnsupportedSchemaError("pattern", f"{path}/pattern", str(exc)) from exc
        lo, hi = int(schema.get("minLength", 0)), schema.get("maxLength")
        if hi is not None and lo > int(hi):
            return NOTHING  # NOTE: no string is valid (a Repeat with lo > hi would build some language)
        if lo or hi is not None:
            langs.append(Repeat(JSON_CHAR, lo, None if hi is None else int(hi)))
        if not langs:
            body: Node = _STRING_BODY
        elif len(langs) == 1:
            body = langs[0]
        else:
            body = Intersect(langs)
        return cat(lit('"'), body, lit('"'))

    def number(self, schema: dict[str, Any], path: str, integer: bool) -> Node:
        keys = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
        key = ("number", integer, *(repr(schema.get(k)) for k in keys))
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = self._number(schema, path, integer)
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
            else:
                self.unsupported("multipleOf", f"{path}/multipleOf", "only integers and powers of ten (0.1, 0.01, ...)")
                mult = None
        if integer:
            ilo = None if dlo is None else int(dlo.to_integral_value(rounding="ROUND_CEILING"))
            ihi = None if dhi is None else int(dhi.to_integral_value(rounding="ROUND_FLOOR"))
            if ilo is not None and lo_excl and Decimal(ilo) == dlo:
                ilo += 1
            if ihi is not None and hi_excl and Decimal(ihi) == dhi:
                ihi -= 1
            rng = piece(INT) if ilo is None and ihi is None else int_range(ilo, ihi)
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
        nodes = [self.node(p, f"{path}/prefixItems/{i}") for i, p in enumerate(prefix)]
        rest = None if items is False else (self.any_value(self.cfg.json_depth - 1) if items is None
                                            else self.node(items, f"{path}/items"))
        lo, hi = int(schema.get("minItems", 0)), schema.get("maxItems")
        k = len(nodes)
        options: list[Node] = []
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

    def object(self, schema: dict[str, Any], path: str) -> Node:
        return cat(lit("{"), self.ws, Scope(object_members(self, schema, path)), self.ws, lit("}"))


def _joined(nodes: list[Node], sep: Node) -> Node:
    out: list[Node] = []
    for i, n in enumerate(nodes):
        if i:
            out.append(sep)
        out.append(n)
    return cat(*out)


def _merge(a: dict[str, Any], b: Any, path: str) -> dict[str, Any]:
    """allOf: one schema requiring both (keyword by keyword)."""
    if not isinstance(b, dict):
        raise UnsupportedSchemaError("allOf", path, "subschemas must be objects")
    out = dict(a)
    for k, v in b.items():
        if k not in out:
            out[k] = v
            continue
        av = out[k]
        if av == v:
            continue
        if k == "properties":
            merged = dict(av)
            for pk, pv in v.items():
                merged[pk] = {"allOf": [merged[pk], pv]} if pk in merged else pv
            out[k] = merged
        elif k == "required":
            out[k] = list(dict.fromkeys(list(av) + list(v)))
        elif k in ("minimum", "minLength", "minItems", "minProperties", "exclusiveMinimum"):
            out[k] = max(av, v)
        elif k in ("maximum", "maxLength", "maxItems", "maxProperties", "exclusiveMaximum"):
            out[k] = min(av, v)
        elif k == "type":
            ta, tb = ([av] if isinstance(av, str) else av), ([v] if isinstance(v, str) else v)
            both = [t for t in ta if t in tb or (t == "integer" and "number" in tb)]
            both += [t for t in tb if t == "integer" and "number" in ta and t not in both]
            out[k] = both
        elif k == "enum":
            out[k] = [x for x in av if x in v]
        elif k in ("items", "additionalProperties") and isinstance(av, dict) and isinstance(v, dict):
            out[k] = {"allOf": [av, v]}
        elif k in ("anyOf", "oneOf"):
            out[k] = [_merge(x, y, path) if isinstance(x, dict) else y for x in av for y in v]
        elif k == "allOf":
            out[k] = list(av) + list(v)
        elif k in _ANNOTATIONS:
            continue
        else:
            raise UnsupportedSchemaError("allOf", path, f"cannot merge two different values of {k!r}")
    return out


def schema_to_node(schema: Any, config: CfsmConfig | None = None) -> Node:
    """Syntax tree of the JSON texts valid under `schema` (a dict, bool or JSON string). Pure."""
    if isinstance(schema, str | bytes):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise UnsupportedSchemaError("schema", "#", f"not valid JSON: {exc}") from exc
    return _Compiler(schema, config or CfsmConfig()).node(schema, "#")


def json_value_node(config: CfsmConfig | None = None, *, object_only: bool = True) -> Node:
    """Free JSON to `config.json_depth` levels: an object (`json_object` mode) or any value."""
    cfg = config or CfsmConfig()
    comp = _Compiler({}, cfg)
    return comp.free_object(cfg.json_depth) if object_only else comp.any_value(cfg.json_depth)



