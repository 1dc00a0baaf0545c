"""`LmdslConfig`: the one frozen configuration object of the package."""

from __future__ import annotations

from dataclasses import dataclass, replace

PREFIX_HINT_MODES = ("auto", "always", "never")
SELECT_METHODS = ("token_length_normalized", "greedy_token_selection", "unconditional_likelihood_normalized")


@dataclass(frozen=True)
class LmdslConfig:
    """Interpreter and backend defaults.

    max_workers: threads of one program's executor pool (primitives of one state run in order;
        states of one program, forks included, run in parallel up to this many).
    batch_num_threads: threads `run_batch(num_threads="auto")` uses, capped by the batch size.
    chat_spec_max_tries: chat-model API speculative execution calls per assistant turn before
        `SpeculationError` is recorded.
    http_timeout_s: timeout of one HTTP request of the built-in backends.
    default_select_method: `select(choices_method=None)` resolves to this.
    wait_for_prefix_hints: whether a fork waits for the backend to answer its prefix hint before
        the children run (SGLang's interpreter waits). Off by default: the children's requests
        follow the hint at once, and a server that shares a prefix among requests in one batch
        (lmserver, SGLang) computes it once either way, while waiting costs a server round trip
        per fork (a tree-of-thought program with 15 forks ran 9.3 s waiting, 7.1 s without hints).
    prefix_hints: when the interpreter sends prefix hints. "auto" (default): a fork's hint (its
        committed prefix, one request per fork) only to a backend that wants it
        (`Backend.wants_prefix_hints`: lmserver says no in `/get_model_info`, since its scheduler
        computes a prefix shared by the requests of one batch once; a server without the field,
        e.g. SGLang, gets them), and `run_batch`'s one hint of the program's constant prefix always;
        "always": both everywhere (SGLang's frontend); "never": neither. On the H200 program suite
        (lmserver, Llama-3-8B shape) fork hints cost tree-of-thought a third of its throughput
        (2.15 vs 3.26 and 2.52 vs 3.43 programs/s); the batch hint costs one request per batch.
        An explicit `Function.cache()` call is always sent.
    """

    max_workers: int = 32
    batch_num_threads: int = 64
    chat_spec_max_tries: int = 3
    http_timeout_s: float = 600.0
    default_select_method: str = "token_length_normalized"
    wait_for_prefix_hints: bool = False
    prefix_hints: str = "auto"

    def __post_init__(self) -> None:
        if self.max_workers < 1 or self.batch_num_threads < 1:
            raise ValueError("LmdslConfig: max_workers and batch_num_threads must be >= 1")
        if self.chat_spec_max_tries < 1:
            raise ValueError("LmdslConfig: chat_spec_max_tries must be >= 1")
        if self.prefix_hints not in PREFIX_HINT_MODES:
            raise ValueError(f"LmdslConfig: prefix_hints must be one of {PREFIX_HINT_MODES}, got {self.prefix_hints!r}")
        if self.default_select_method not in SELECT_METHODS:
            raise ValueError(f"LmdslConfig: default_select_method must be one of {SELECT_METHODS}")

    def fork_hints_for(self, wanted: bool) -> bool:
        """Whether forks send prefix hints to a backend whose `wants_prefix_hints` is `wanted`."""
        return self.prefix_hints == "always" or (self.prefix_hints == "auto" and wanted)

    @property
    def batch_prefix_hint(self) -> bool:
        """Whether `run_batch` sends the program's constant prefix once before the batch."""
        return self.prefix_hints != "never"

    def with_(self, **changes: object) -> LmdslConfig:
        """A copy with `changes` applied (this object is not mutated)."""
        return replace(self, **changes)  # type: ignore[arg-type]


DEFAULT_CONFIG = LmdslConfig()
