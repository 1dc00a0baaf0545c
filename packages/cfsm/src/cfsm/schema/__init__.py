"""The JSON Schema frontend: a schema to a syntax tree (grammar rules where it recurses).

`json_schema` (the compiler of a schema), `json_object` (object members), `merge` (`allOf`),
`narrow` (exact subsets), `refs` (`$ref`), `unevaluated`, `numeric` (number ranges),
`formats` (the `format` regexes)."""
