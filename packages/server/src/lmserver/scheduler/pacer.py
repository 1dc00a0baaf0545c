"""PrefillPacer: sizes the prefill part of a mixed step so that running requests keep a bounded
gap between two tokens. No torch.

While requests decode, every prefill chunk rides in a step together with their decode rows
(mixed batches), so a step's duration is the gap between two of their tokens. The pacer keeps
one number, the prefill tokens of the next mixed step, and moves it after each measured step
toward the size whose step takes `target_s`: n' = n * target_s / seconds, changed by at most a
factor of 2 per step and kept within [min_tokens, max_tokens]. A step costs a + c * n (fixed
overhead plus per-token work), so the update overshoots nothing: it converges from either side
to the n with a + c * n = target_s (the overhead makes each move toward a larger n smaller than
the ratio asks). Nothing is measured when no request decodes: prefill then runs in full chunks.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PacerConfig:
    target_s: float  # the step duration to aim for while requests decode
    min_tokens: int  # never fewer prefill tokens per mixed step (progress on a slow device)
    max_tokens: int  # never more (the chunked prefill size)
    start_tokens: int  # the first mixed step's size (before any measurement)

    def __post_init__(self) -> None:
        if self.target_s <= 0:
            raise ValueError(f"target_s must be > 0, got {self.target_s}")
        if not 1 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"need 1 <= min_tokens <= max_tokens, got {self.min_tokens}, {self.max_tokens}")


MAX_STEP_FACTOR = 2.0  # the most one measurement may grow or shrink the size


class PrefillPacer:
    def __init__(self, config: PacerConfig) -> None:
        self.config = config
        self._tokens = float(min(max(config.start_tokens, config.min_tokens), config.max_tokens))
        self.num_observed = 0

    @property
    def tokens(self) -> int:
        """Prefill tokens for the next mixed step."""
        return int(self._tokens)

    def observe(self, prefill_tokens: int, seconds: float) -> None:
        """Records a mixed step of `prefill_tokens` prompt tokens (besides its decode rows) that
        took `seconds` from launch to sampled tokens. A step smaller than the current size (the
        prompts ran out) says nothing about larger ones: it only shrinks the size, when it overran."""
        if prefill_tokens <= 0 or seconds <= 0:
            return
        cfg = self.config
        ratio = min(max(cfg.target_s / seconds, 1.0 / MAX_STEP_FACTOR), MAX_STEP_FACTOR)
        if prefill_tokens >= self.tokens:  # a full step: scale the size itself (not its integer part)
            proposed = self._tokens * ratio
        elif seconds <= cfg.target_s:
            return
        else:
            proposed = min(prefill_tokens * ratio, self._tokens)
        self._tokens = min(max(proposed, float(cfg.min_tokens)), float(cfg.max_tokens))
        self.num_observed += 1
