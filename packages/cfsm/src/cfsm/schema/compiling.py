"""`SchemaCompiling`: what the schema compiler's helper modules (`json_object`, `narrow`,
`unevaluated`) use of the one compiling a schema (`json_schema.SchemaCompiler`), so that they
name an interface below it instead of importing it back."""

from __future__ import annotations

from typing import Any, Protocol

from cfsm.config import CfsmConfig
from cfsm.regex.syntax import Node
from cfsm.schema.refs import RefResolver

__all__ = ["SchemaCompiling"]


class SchemaCompiling(Protocol):
    """One schema's compile in progress (`cfsm.schema.json_schema.SchemaCompiler` is one)."""

    cfg: CfsmConfig
    ws: Node  # whitespace between tokens (`CfsmConfig.whitespace`)
    comma: Node  # "," with that whitespace around it
    colon: Node  # ":" likewise
    refs: RefResolver
    bases: list[str]  # base URIs of the schema resources being compiled, innermost last
    memo: dict[tuple[Any, ...], Node]  # trees built once per compile, by shape
    mentions_unevaluated: bool  # the document has an unevaluated* keyword somewhere

    def node(self, schema: Any, path: str) -> Node:
        """The syntax tree of `schema` (at JSON path `path`)."""
        ...

    def any_value(self, depth: int) -> Node:
        """Free JSON, nested at most `depth` deep (a rule call in rule mode)."""
        ...

    def approximate(self, keyword: str, path: str, detail: str) -> None:
        """Record a keyword compiled as a superset (refused in strict mode)."""
        ...

    def narrowed(self, keyword: str, path: str, detail: str) -> None:
        """Record a keyword compiled as a subset (refused in strict mode)."""
        ...

    def property_names(self, sub: Any, path: str) -> Node | None:
        """`propertyNames` as the language of quoted key texts (None: any key)."""
        ...

    def branch(self, rest: dict[str, Any], sub: Any, path: str) -> Node:
        """Subschema `sub` beside the schema's other keywords `rest`."""
        ...

    def exclusive(self, branches: list[Any], path: str, rest: dict[str, Any] | None = None) -> list[Any]:
        """`oneOf` branches made mutually exclusive where that is simple."""
        ...

    def peek(self, sub: Any) -> Any:
        """`sub` with a leading `$ref` resolved (itself where it does not resolve)."""
        ...
