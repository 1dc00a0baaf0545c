"""Benchmark grammars and one valid target text for each (compact JSON)."""

from __future__ import annotations

import json
from typing import Any

IPV4 = r"((25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
DATE_TIME = (r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])T([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9]"
             r"(\.[0-9]{1,6})?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])")

SCHEMA_8: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "format": "email"},
        "city": {"type": "string"},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
        "active": {"type": "boolean"},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
    },
    "required": ["name", "age", "email", "city", "zip", "active", "score", "tags"],
    "additionalProperties": False,
}
TARGET_8 = {"name": "Alice Martin", "age": 34, "email": "alice.martin@example.org", "city": "Lyon",
            "zip": "69001", "active": True, "score": 87.5, "tags": ["admin", "beta"]}


def _section(prefix: str) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            f"{prefix}_id": {"type": "integer", "minimum": 1, "maximum": 1000000},
            f"{prefix}_label": {"type": "string", "maxLength": 40},
            f"{prefix}_kind": {"enum": ["alpha", "beta", "gamma"]},
            f"{prefix}_ratio": {"type": "number", "minimum": 0, "maximum": 1},
            f"{prefix}_enabled": {"type": "boolean"},
            f"{prefix}_created": {"type": "string", "format": "date"},
            f"{prefix}_notes": {"type": "string"},
            f"{prefix}_codes": {"type": "array", "items": {"type": "integer"}, "maxItems": 4},
        },
        "required": [f"{prefix}_{k}" for k in ("id", "label", "kind", "ratio", "enabled", "created", "notes", "codes")],
        "additionalProperties": False,
    }


_SECTIONS = ["account", "billing", "shipping", "profile", "usage"]
SCHEMA_40: dict[str, Any] = {
    "type": "object",
    "properties": {s: _section(s) for s in _SECTIONS},
    "required": _SECTIONS,
    "additionalProperties": False,
}
TARGET_40 = {s: {f"{s}_id": 1200 + i, f"{s}_label": f"{s.title()} record", f"{s}_kind": "beta",
                 f"{s}_ratio": 0.25, f"{s}_enabled": i % 2 == 0, f"{s}_created": "2024-03-1" + str(i),
                 f"{s}_notes": "Checked on site.", f"{s}_codes": [3, 14, 15]}
             for i, s in enumerate(_SECTIONS)}
SCHEMA_24: dict[str, Any] = {  # one flat object of 24 properties (a product record), every value type
    "type": "object",
    "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{6}$"},
        "title": {"type": "string", "maxLength": 120},
        "brand": {"type": "string"},
        "category": {"enum": ["books", "electronics", "garden", "toys", "grocery"]},
        "price": {"type": "number", "minimum": 0},
        "currency": {"enum": ["EUR", "USD", "GBP"]},
        "stock": {"type": "integer", "minimum": 0},
        "rating": {"type": "number", "minimum": 0, "maximum": 5},
        "reviews": {"type": "integer"},
        "in_stock": {"type": "boolean"},
        "discontinued": {"type": "boolean"},
        "released": {"type": "string", "format": "date"},
        "updated": {"type": "string", "format": "date-time"},
        "vendor_email": {"type": "string", "format": "email"},
        "homepage": {"type": "string", "format": "uri"},
        "id": {"type": "string", "format": "uuid"},
        "weight_kg": {"type": "number"},
        "color": {"type": ["string", "null"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "sizes": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 60}},
        "dimensions": {"type": "object", "properties": {"w": {"type": "number"}, "h": {"type": "number"},
                                                        "d": {"type": "number"}},
                       "required": ["w", "h", "d"], "additionalProperties": False},
        "warehouse": {"type": "string", "minLength": 2, "maxLength": 8},
        "barcode": {"type": "string", "pattern": "^[0-9]{13}$"},
        "notes": {"type": "string"},
    },
    "required": ["sku", "title", "brand", "category", "price", "currency", "stock", "rating", "reviews",
                 "in_stock", "discontinued", "released", "updated", "vendor_email", "homepage", "id",
                 "weight_kg", "color", "tags", "sizes", "dimensions", "warehouse", "barcode", "notes"],
    "additionalProperties": False,
}
TARGET_24 = {"sku": "ABC-123456", "title": "Garden hose, 20 m", "brand": "Hydra", "category": "garden",
             "price": 24.99, "currency": "EUR", "stock": 130, "rating": 4.5, "reviews": 212, "in_stock": True,
             "discontinued": False, "released": "2023-04-01", "updated": "2024-11-29T16:45:33Z",
             "vendor_email": "sales@hydra.example", "homepage": "https://hydra.example/hose",
             "id": "0b4f3c2e-8d1a-4c5e-9f6a-1b2c3d4e5f60", "weight_kg": 2.4, "color": None,
             "tags": ["hose", "garden"], "sizes": [20, 30], "dimensions": {"w": 0.3, "h": 0.3, "d": 0.1},
             "warehouse": "LYS2", "barcode": "4006381333931", "notes": "Frost-proof."}
TARGET_FREE = {"id": 7, "title": "Free JSON", "items": [{"k": "a", "v": 2.5}, {"k": "b", "v": None}],
               "ok": True, "tags": ["x", "y"]}  # depth 3: object > array > object


def dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


# name -> (kind, grammar, target text); kind is "regex", "schema" or "json"
GRAMMARS: dict[str, tuple[str, Any, str]] = {
    "ipv4": ("regex", IPV4, "192.168.100.254"),
    "date-time": ("regex", DATE_TIME, "2024-11-29T16:45:33.123+01:00"),
    "schema-8": ("schema", SCHEMA_8, dumps(TARGET_8)),
    "schema-40": ("schema", SCHEMA_40, dumps(TARGET_40)),
    "schema-24": ("schema", SCHEMA_24, dumps(TARGET_24)),
    "free-json": ("json", None, dumps(TARGET_FREE)),
}
