"""`CfsmConfig`: the one configuration object of cfsm."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

__all__ = ["CfsmConfig", "CfsmLimits", "IndexTuning"]


@dataclass(frozen=True)
class CfsmLimits:
    """The size limits of a compile (`CfsmConfig.limits`): where a grammar is refused, or where
    the compile switches to another construction. Past a limit the compile raises a typed error
    or falls back (a JSON Schema: to the pushdown matcher, then to approximated bounds), so a
    lower limit can change what a grammar compiles to; part of `CfsmConfig.schema_key()`.

    - `max_dfa_states`: states of one byte DFA (`GrammarTooLargeError` past it; the subset
      construction and the direct construction stop as soon as they pass it).
    - `max_schema_visits`: schema nodes one JSON Schema compile visits (references copied where
      used count every time; past it the recursion bound is halved, then `SchemaTooLargeError`).
    - `max_inline_nodes`: a non-recursive grammar rule whose inlined tree would pass this many
      nodes stays a rule (`cfsm.grammar.inline`).
    - `max_pda_states`: automaton states of a pushdown matcher's network (`GrammarError` past it).
    - `fallback_dfa_states`: a JSON Schema whose pushdown matcher is refused
      (`CfsmConfig.max_pushdown_positions`) compiles unrolled only while that DFA stays within
      this many states; a larger one compiles as rules per reference target instead.
    """

    max_dfa_states: int = 200_000
    max_schema_visits: int = 20_000
    max_inline_nodes: int = 4096
    max_pda_states: int = 200_000
    # NOTE: JSONSchemaBench's govuk schemas: the unrolled try ran 12-14 s into the 200,000-state
    # limit, or 38 s to an 84,000-state Index, where the pushdown matcher takes 1.6 s; the
    # unrolled ones that compile in a few seconds stay below
    fallback_dfa_states: int = 32_768

    def __post_init__(self) -> None:
        if min(self.max_dfa_states, self.max_schema_visits, self.max_inline_nodes, self.max_pda_states,
               self.fallback_dfa_states) < 1:
            raise ValueError("every CfsmLimits field must be >= 1")

    def key(self) -> str:
        """The limits as text (part of cache keys)."""
        return (f"ds={self.max_dfa_states}|sv={self.max_schema_visits}|in={self.max_inline_nodes}|"
                f"ps={self.max_pda_states}|fd={self.fallback_dfa_states}")


@dataclass(frozen=True)
class IndexTuning:
    """How the token-level `Index` is built (`cfsm.masks`): thresholds that choose between paths
    that give the same masks (so not part of any cache key); tests set them to force a path.

    - `share_depth`: states that allow the same tokens of up to this many bytes share one walk
      of those tokens; longer tokens are walked for every state.
    - `string_tables` / `fragment_tables`: JSON string states / broad `format` states take their
      masks from the vocabulary's precomputed tables (`templates`, `fragments`).
    - `classes_min_broad`: walk classes (Moore rounds over the DFA) are computed only when at
      least this many states have more candidate tokens than a batched walk takes.
    - `string_passes`: verification passes of the proposed string states (0: none recognized).
    - `walk_tiny`: states with at most this many candidate tokens are walked together, in
      batches of at most `walk_batch_pairs` (state, token) pairs; `walk_wide_first`: in those
      batches, first bytes starting more than this many tokens have their second byte checked
      first; `walk_long_chain_min`: states with more candidates longer than `share_depth` than
      this resolve them inside their chain's group by length.
    - `walk_tiny_python`: a state with at most this many candidates, not walked in a batch, is
      walked in plain Python; `walk_broad`: a state whose allowed first bytes start more than
      this share of the vocabulary walks it whole.
    - `min_group_bytes`: a state's main byte group of fewer bytes has no chain (counted repeats).
    - `loop_min_tokens`: a state looping on a byte set (whitespace) is walked as a loop state
      where those bytes start more than this many tokens (`loops`).
    - `tiny_states` / `tiny_pairs`: a DFA of at most `tiny_states` states walks all its states
      down the vocabulary's trie at once (`masks.tiny`) while that visits at most `tiny_pairs`
      (state, trie node) pairs and stays shallow (a small regex; not a state looping on a byte of
      long run tokens, whitespace: `masks.tiny`); past it, or with 0, the paths above.
    """

    share_depth: int = 16
    string_tables: bool = True
    fragment_tables: bool = True
    classes_min_broad: int = 16
    string_passes: int = 64
    walk_tiny: int = 8192
    walk_batch_pairs: int = 1 << 20
    walk_wide_first: int = 64
    walk_long_chain_min: int = 64
    walk_tiny_python: int = 96
    walk_broad: float = 0.15
    min_group_bytes: int = 32
    loop_min_tokens: int = 1024
    tiny_states: int = 128
    tiny_pairs: int = 16384


@dataclass(frozen=True)
class CfsmConfig:
    """How grammars are compiled and cached.

    - `whitespace`: "flexible" (the default, as xgrammar's and llguidance's: JSON whitespace
      ``[ \\t\\n\\r]*`` around structural characters) or "compact" (none, like
      ``json.dumps(separators=(",", ":"))``: more text is forced, so jump-forward does more);
      `whitespace_pattern` (a regex) overrides both.
    - `any_order`: object properties may come in any order (each at most once; at most
      `MAX_ANY_ORDER_PROPERTIES` properties per object).
    - `recursion`: "stack" (the default): recursive `$ref`s and free JSON (``{}`` / ``true``
      schemas, `json_object`) nest without a bound, through the pushdown matcher
      (`cfsm.GrammarIndex`); schemas without either stay regular (`cfsm.Index`). "unroll": the
      regular automaton only, recursion cut at the two depths below.
    - `max_recursion_depth` ("unroll", and recursion through `allOf` merges): how many re-entries
      of `$ref`s already being compiled may nest (recursive schemas are unrolled that deep;
      deeper branches are dropped, and a schema that needs more raises `UnsupportedSchemaError`
      at compile time).
    - `json_depth` ("unroll" only): nesting depth of free JSON.
    - `max_pushdown_positions` ("stack"): a JSON Schema whose pushdown matcher would have more
      rule positions than this compiles as "unroll" does instead (recursion cut at the two depths
      above; a narrower language, never a wider one). Each position costs the compile one walk
      of the vocabulary (about a millisecond): a large real-world schema with one free JSON value
      (``patternProperties: {"^x-": {}}``) has thousands, the regular compile shares that work.
      0: no limit.
    - `additional_properties_default`: whether objects without `additionalProperties` may
      have undeclared keys (JSON Schema says yes; constrained decoding usually wants no).
    - `infer_types`: a schema without `type` whose keywords all belong to some types (say
      `properties`) is narrowed to those types, as peers do for generation; the specification
      lets every other type pass (`spec()` turns this off).
    - `assert_formats`: `format` constrains strings (generation wants it; drafts 2019-09 and
      later make it an annotation by default, and `spec()` follows them).
    - `integers_as_floats`: integers (the `integer` type, integral `const` / `enum` values) may
      also be written with a zero fraction (`1.0`), which the specification counts as the same
      number (`spec()` turns it on).
    - `narrow`: where a keyword cannot be compiled exactly (`uniqueItems` over items that are
      not a few scalar values, `not` / `if` / `oneOf` without a simple negation, `$dynamicRef`,
      ...), compile a documented subset of its language (items of distinct JSON types, the
      types the negated schema cannot have, ...: never wider than the schema), reported as an
      `Approximation` of kind "subset". Off (`spec()`): the superset, reported as kind
      "superset" (every valid document accepted).
    - `strict`: a keyword cfsm can only over-approximate (the grammar accepts a superset, see
      `cfsm.Approximation`), or with `narrow` compiles to a subset, raises `UnsupportedSchemaError` naming it, instead of being noted in
      `Index.approximations` (OpenAI's strict mode refuses such schemas the same way).
    - `cache_size`: compiled `Index` objects kept per `Compiler` (LRU); `cache_dir`: optional
      folder for an on-disk cache.
    - `limits`: the size limits of a compile (`CfsmLimits`).
    - `tuning`: how the token-level index is built (`IndexTuning`; the same masks whatever it is).

    `CfsmConfig.spec()` gives the specification's language (undeclared properties allowed, any
    property order, no type inference); the defaults narrow it the way generation wants.
    """

    whitespace: Literal["compact", "flexible"] = "flexible"
    whitespace_pattern: str | None = None
    recursion: Literal["stack", "unroll"] = "stack"
    any_order: bool = False
    max_recursion_depth: int = 3
    json_depth: int = 3
    max_pushdown_positions: int = 2048
    additional_properties_default: bool = False
    infer_types: bool = True
    assert_formats: bool = True
    integers_as_floats: bool = False
    narrow: bool = True
    strict: bool = False
    cache_size: int = 64
    cache_dir: str | None = None
    limits: CfsmLimits = field(default_factory=CfsmLimits)
    tuning: IndexTuning = field(default_factory=IndexTuning)

    def __post_init__(self) -> None:
        if self.whitespace not in ("compact", "flexible"):
            raise ValueError(f"whitespace must be 'compact' or 'flexible', got {self.whitespace!r}")
        if self.recursion not in ("stack", "unroll"):
            raise ValueError(f"recursion must be 'stack' or 'unroll', got {self.recursion!r}")
        if min(self.max_recursion_depth, self.json_depth, self.cache_size, self.max_pushdown_positions) < 0:
            raise ValueError("max_recursion_depth, json_depth, max_pushdown_positions and cache_size must be >= 0")

    @classmethod
    def spec(cls, **overrides: object) -> CfsmConfig:
        """A config whose schemas mean what the specification says: undeclared properties
        allowed unless the schema forbids them, properties in any order, no type inference,
        `format` an annotation, integers also written as 1.0, supersets (not subsets) where a
        keyword cannot be exact."""
        fields: dict[str, object] = {"additional_properties_default": True, "any_order": True, "infer_types": False,
                                     "assert_formats": False, "integers_as_floats": True, "narrow": False}
        fields.update(overrides)
        return cls(**fields)  # type: ignore[arg-type]

    def schema_key(self) -> str:
        """The fields that change a compiled JSON Schema (part of cache keys)."""
        return (f"ws={self.whitespace}|wsp={self.whitespace_pattern}|ao={self.any_order}|rec={self.recursion}|"
                f"rd={self.max_recursion_depth}|jd={self.json_depth}|mpp={self.max_pushdown_positions}|"
                f"apd={self.additional_properties_default}|it={self.infer_types}|st={self.strict}|"
                f"af={self.assert_formats}|if={self.integers_as_floats}|nw={self.narrow}"
                + ("" if self.limits == CfsmLimits() else f"|{self.limits.key()}"))

    def grammar_key(self) -> str:
        """The fields that change a compiled grammar (GBNF, Lark; part of cache keys): the limits
        where they are not the defaults."""
        return "" if self.limits == CfsmLimits() else f"|{self.limits.key()}"
