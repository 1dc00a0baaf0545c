"""Plain data describing plugins, server set-ups and forward steps."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lowlat.build import BuildContext, Built


class StepKind(str, enum.Enum):
    """The kind of forward step a model runner is about to run."""

    DECODE = "decode"
    EXTEND = "extend"
    VERIFY = "verify"


@dataclass(frozen=True)
class Step:
    """One forward step as the dispatcher sees it.

    Attributes:
        kind: decode, extend (prefill / chunked prefill) or verify (speculative decoding).
        batch_size: number of requests, counting CUDA-graph padding.
        num_tokens: tokens in the step, counting graph padding (decode: equals batch_size).
        max_query_len: longest run of new tokens of one request (decode: 1).
        max_context: longest sequence length in the step, new tokens included.
    """

    kind: StepKind
    batch_size: int
    num_tokens: int
    max_query_len: int = 1
    max_context: int = 0

    @classmethod
    def decode(cls, batch_size: int, max_context: int = 0) -> Step:
        """A decode step of ``batch_size`` requests, one new token each."""
        return cls(StepKind.DECODE, batch_size, batch_size, 1, max_context)

    @classmethod
    def verify(cls, num_tokens: int, max_query_len: int, max_context: int = 0) -> Step:
        """A speculative verify step of ``num_tokens`` rows (counting graph padding), at most
        ``max_query_len`` of them per request (its last token and its drafts). Each row is a decode
        row of its request at its own position, attending causally up to itself: a runner may
        replay it in the decode graph of ``num_tokens`` rows. ``batch_size`` counts the fewest
        requests that many rows can be."""
        if not 1 <= max_query_len <= num_tokens:
            raise ValueError(f"need 1 <= max_query_len <= num_tokens, got {max_query_len} and {num_tokens}")
        return cls(StepKind.VERIFY, -(-num_tokens // max_query_len), num_tokens, max_query_len, max_context)


@dataclass(frozen=True)
class Requirements:
    """What a plugin needs from the server; checked once, before weights load.

    ``None`` or an empty tuple means "any". Compute capabilities are ``(major, minor)`` pairs,
    compared as tuples; ``amd_archs`` are gfx names such as ``"gfx942"``.
    """

    vendor: str | None = None  # "nvidia" | "amd" | "cpu"
    min_capability: tuple[int, int] | None = None
    max_capability: tuple[int, int] | None = None
    amd_archs: tuple[str, ...] = ()
    dtypes: tuple[str, ...] = ()
    kv_dtypes: tuple[str, ...] = ()
    tp_sizes: tuple[int, ...] = ()
    needed_features: frozenset[str] = frozenset()
    forbidden_features: frozenset[str] = frozenset()
    max_context: int | None = None


# Server feature: the model's linear weights are FP8 (e4m3) with scales (a checkpoint's or online quantization);
# a plugin that cannot read them lists it in ``forbidden_features``, so the guard says so before any weight loads.
FP8_WEIGHTS = "fp8_weights"


@dataclass(frozen=True)
class Coverage:
    """Which steps a plugin's forward serves; every other step runs the original forward.

    ``max_tokens`` counts CUDA-graph padding. ``max_query_len`` bounds new tokens per request.
    """

    step_kinds: frozenset[StepKind] = frozenset({StepKind.DECODE})
    max_tokens: int = 8
    max_query_len: int = 1
    max_context: int | None = None

    def why_not(self, step: Step) -> str | None:
        """The reason this coverage does not include ``step``, or None when it does. Pure."""
        if step.kind not in self.step_kinds:
            return f"step kind {step.kind.value} not covered"
        if step.num_tokens > self.max_tokens:
            return f"{step.num_tokens} tokens > max_tokens {self.max_tokens}"
        if step.max_query_len > self.max_query_len:
            return f"query length {step.max_query_len} > {self.max_query_len}"
        if self.max_context is not None and step.max_context > self.max_context:
            return f"context {step.max_context} > {self.max_context}"
        return None

    def intersect(self, other: Coverage) -> Coverage:
        """The coverage both ``self`` and ``other`` serve (used to agree across TP ranks). Pure."""
        if self.max_context is None:
            ctx = other.max_context
        elif other.max_context is None:
            ctx = self.max_context
        else:
            ctx = min(self.max_context, other.max_context)
        return Coverage(
            step_kinds=self.step_kinds & other.step_kinds,
            max_tokens=min(self.max_tokens, other.max_tokens),
            max_query_len=min(self.max_query_len, other.max_query_len),
            max_context=ctx,
        )

    def to_table(self) -> dict[str, Any]:
        """A picklable plain-dict form (sent between ranks)."""
        return {
            "step_kinds": sorted(k.value for k in self.step_kinds),
            "max_tokens": self.max_tokens,
            "max_query_len": self.max_query_len,
            "max_context": self.max_context,
        }

    @classmethod
    def from_table(cls, table: dict[str, Any]) -> Coverage:
        """Inverse of ``to_table``."""
        return cls(
            step_kinds=frozenset(StepKind(k) for k in table["step_kinds"]),
            max_tokens=int(table["max_tokens"]),
            max_query_len=int(table["max_query_len"]),
            max_context=table["max_context"],
        )


@dataclass(frozen=True)
class NotCovered:
    """A normal per-step fallback: the plugin is on, but this step is outside its coverage."""

    plugin: str
    reason: str


@dataclass(frozen=True)
class ServerSetup:
    """What the server will run, known before weights load; the input of the guards.

    ``device`` is ``"cuda"`` or ``"cpu"``; ``vendor`` is decided from ``torch.version.hip``
    (see ``lowlat.guards.detect_setup``).
    """

    arch: str
    dtype: str
    kv_dtype: str
    vendor: str = "cpu"
    capability: tuple[int, int] | None = None
    amd_arch: str | None = None
    tp_size: int = 1
    features: frozenset[str] = frozenset()
    max_context: int = 4096
    device: str = "cpu"


@dataclass(frozen=True)
class PluginSpec:
    """A plugin: what it serves, what it needs, and how to build it.

    Attributes:
        name, version: identify the plugin in reports and across TP ranks.
        archs: model architecture names served (``config.architectures[0]``, e.g. LlamaForCausalLM).
        requirements: checked once before weights load (``Unsupported`` on failure).
        coverage: which steps the built forward serves (``NotCovered`` per step otherwise).
        build: ``build(ctx) -> Built``, called after agreement and before the KV cache is sized.
        check_model: optional ``check_model(model) -> reasons`` run on the loaded model; an empty
            sequence means the model is fine.
        priority: the highest priority among supported plugins wins.
    """

    name: str
    version: str
    archs: tuple[str, ...]
    requirements: Requirements
    coverage: Coverage
    build: Callable[[BuildContext], Built]
    check_model: Callable[[Any], tuple[str, ...] | list[str]] | None = None
    priority: int = 0
    description: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"PluginSpec.name must be a non-empty identifier, got {self.name!r}")
        if not self.archs:
            raise ValueError(f"PluginSpec {self.name!r} serves no architecture (archs is empty)")
        if not callable(self.build):
            raise TypeError(f"PluginSpec {self.name!r}: build must be callable")
