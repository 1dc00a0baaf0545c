"""`CfsmConfig`: the one configuration object of cfsm."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["CfsmConfig"]


@dataclass(frozen=True)
class CfsmConfig:
    """How grammars are compiled and cached.

    - `whitespace`: "compact" (no whitespace, like ``json.dumps(separators=(",", ":"))``) or
      "flexible" (JSON whitespace ``[ \\t\\n\\r]*`` around structural characters);
      `whitespace_pattern` (a regex) overrides both.
    - `any_order`: object properties may come in any order (each at most once; at most
      `MAX_ANY_ORDER_PROPERTIES` properties per object).
    - `max_recursion_depth`: how many times one `$ref` may be entered recursively; deeper
      branches are dropped (a schema that needs more raises `UnsupportedSchemaError`).
    - `json_depth`: nesting depth of free JSON (``{}`` / ``true`` schemas, `json_object`).
    - `ignore_unsupported`: skip unsupported schema keywords instead of raising.
    - `additional_properties_default`: whether objects without `additionalProperties` may
      have undeclared keys (JSON Schema says yes; constrained decoding usually wants no).
    - `cache_size`: compiled `Index` objects kept per `Compiler` (LRU); `cache_dir`: optional
      folder for an on-disk cache.
    """

    whitespace: Literal["compact", "flexible"] = "compact"
    whitespace_pattern: str | None = None
    any_order: bool = False
    max_recursion_depth: int = 3
    json_depth: int = 3
    ignore_unsupported: bool = False
    additional_properties_default: bool = False
    cache_size: int = 64
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        if self.whitespace not in ("compact", "flexible"):
            raise ValueError(f"whitespace must be 'compact' or 'flexible', got {self.whitespace!r}")
        if self.max_recursion_depth < 0 or self.json_depth < 0 or self.cache_size < 0:
            raise ValueError("max_recursion_depth, json_depth and cache_size must be >= 0")

    def schema_key(self) -> str:
        """The fields that change a compiled JSON Schema (part of cache keys)."""
        return (f"ws={self.whitespace}|wsp={self.whitespace_pattern}|ao={self.any_order}|"
                f"rd={self.max_recursion_depth}|jd={self.json_depth}|iu={self.ignore_unsupported}|"
                f"apd={self.additional_properties_default}")
