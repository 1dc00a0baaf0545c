"""When a jump-forward pays: the jump-forward policy of `ConstrainedDecoding`.

A jump appends a request's forced text (n tokens) at once, saving that request n decode rounds.
A request that is already running then needs an extend (re-prefill) round. On the CPU an extend
round of a few tokens costs about what a decode round costs, so every jump pays. On a GPU a
decode round is a CUDA-graph replay of well under a millisecond of device time, while a round
that carries an extend is an eager forward that every running request waits for: measured on an
H200 (SmolLM2-135M shape), jumps of 1-4 tokens (a regex form's labels) made requests 0.83x as
fast one at a time and 0.61x at 32 concurrent, jumps of 12-16 tokens (long JSON keys) 4.36x.

Cost model, in decode rounds: a round that carries jump extends costs `c = min_tokens - 1` more
than a decode round, for each of the B running requests (they all wait for it). The jumps of a
round are made when the rounds they save exceed that cost:

    sum(n_i) > (min_tokens - 1) * B

One request (B = 1): jump when n >= min_tokens. Requests that reach their forced text in the
same round (a batch over one schema) share the round: each jumps when n >= min_tokens.
`min_tokens = 1` (c = 0) jumps always (the behaviour without a policy).

Jumps that cost no extra round are always made: a request that is not decoding yet (its forced
text joins its first prefill), a jump that ends the request (the grammar is complete after the
forced text, or it reaches max_new_tokens: no forward follows), and jumps that ride along with
an extend round that happens anyway (a prefill chunk, a new request's prefill, another jump).

"auto": 1 on the CPU, 8 on CUDA. The H200 numbers above separate at any value from 5 to 12;
estimates of the extend round's extra cost from the two H200 workloads range from about 1 to 7
decode rounds, so 8 is the value at which a jump pays even at the upper estimate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = ["AUTO_MIN_TOKENS", "JumpPolicy", "NowDecision", "parse_min_tokens"]

# resolved "auto" values by device type (see the module docstring for the GPU value)
AUTO_MIN_TOKENS = {"cpu": 1, "cuda": 8}

NowDecision = Literal["jump", "defer", "skip"]


def parse_min_tokens(value: int | str) -> int | None:
    """`--jump-forward-min-tokens`: a positive int, or "auto" (None: resolved per device).
    Raises ValueError otherwise. Pure."""
    if isinstance(value, str):
        if value.strip().lower() == "auto":
            return None
        try:
            value = int(value)
        except ValueError:
            raise ValueError(f"jump_forward_min_tokens must be 'auto' or an integer >= 1, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"jump_forward_min_tokens must be 'auto' or an integer >= 1, got {value!r}")
    return value


@dataclass(frozen=True)
class JumpPolicy:
    """The decisions of the module docstring for one engine. Pure (no state, no clock)."""

    min_tokens: int = 1

    def __post_init__(self) -> None:
        if self.min_tokens < 1:
            raise ValueError(f"min_tokens must be >= 1, got {self.min_tokens}")

    @classmethod
    def for_device(cls, min_tokens: int | str, device_type: str) -> JumpPolicy:
        """`min_tokens` as given, or the "auto" value of `device_type` ("cpu", "cuda", ...;
        other accelerators take the CUDA value: their decode rounds are graph-like too)."""
        parsed = parse_min_tokens(min_tokens)
        if parsed is None:
            parsed = AUTO_MIN_TOKENS["cpu" if device_type == "cpu" else "cuda"]
        return cls(parsed)

    @property
    def always(self) -> bool:
        """True when every jump is made at once (no extra-round cost to weigh)."""
        return self.min_tokens == 1

    def now(self, new_tokens: int, *, decoding: bool, ends_request: bool, extend_pending: bool,
            deferrable: bool) -> NowDecision:
        """The decision right after a sampled token for a jump adding `new_tokens` tokens.

        `decoding`: the request is running (a jump needs an extend round); `ends_request`: no
        forward follows the jump; `extend_pending`: the next round is an extend round anyway;
        `deferrable`: the jump can wait for the round's batch decision (`batch`) at the next
        schedule, i.e. applying it then cannot finish the request (no stop strings, not ending).
        "defer" hands it to `batch`; "skip": the model decodes the next forced token instead.
        """
        if self.always or not decoding or ends_request or extend_pending:
            return "jump"
        if deferrable:
            return "defer"
        return "jump" if new_tokens >= self.min_tokens else "skip"

    def batch(self, new_tokens: Sequence[int], num_running: int, *, extend_pending: bool) -> bool:
        """Whether the deferred jumps of one round (their token counts) are made, with
        `num_running` requests decoding. All or none: once the round carries one extend, the
        others ride along for free."""
        if not new_tokens:
            return False
        if self.always or extend_pending:
            return True
        return sum(new_tokens) > (self.min_tokens - 1) * max(num_running, 1)
