"""`select`'s three scoring methods over per-choice token logprobs (pure functions).

Each choice comes with the logprobs of its own tokens given the prompt (`token_logprobs[i]`);
`unconditional_likelihood_normalized` also needs the logprobs of the same tokens without the
prompt (`unconditional_logprobs[i]`).
"""

from __future__ import annotations

from collections.abc import Sequence

from lmdsl.backend.base import ChoiceDecision
from lmdsl.config import SELECT_METHODS


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("-inf")


def _argmax(scores: Sequence[float]) -> int:
    best = 0
    for i, score in enumerate(scores):
        if score > scores[best]:
            best = i
    return best


def token_length_normalized(choices: Sequence[str], token_logprobs: Sequence[Sequence[float]]) -> ChoiceDecision:
    """Highest mean token logprob (SGLang's default)."""
    scores = [_mean(lp) for lp in token_logprobs]
    return ChoiceDecision(choices[_argmax(scores)], {"normalized_prompt_logprobs": scores})


def greedy_token_selection(choices: Sequence[str], token_logprobs: Sequence[Sequence[float]]) -> ChoiceDecision:
    """Highest first-token logprob; ties go to the next position (a shorter choice is padded with its mean)."""
    width = max((len(lp) for lp in token_logprobs), default=0)
    matrix = [list(lp) + [_mean(lp)] * (width - len(lp)) for lp in token_logprobs]
    remaining = list(range(len(choices)))
    for j in range(width):
        best = max(matrix[i][j] for i in remaining)
        remaining = [i for i in remaining if matrix[i][j] == best]
        if len(remaining) == 1:
            break
    scores = [_mean(lp) for lp in token_logprobs]
    return ChoiceDecision(choices[remaining[0]], {"normalized_prompt_logprobs": scores})


def unconditional_likelihood_normalized(
    choices: Sequence[str], token_logprobs: Sequence[Sequence[float]], unconditional_logprobs: Sequence[Sequence[float]]
) -> ChoiceDecision:
    """Highest mean of (logprob given the prompt - logprob without it) over the choice's tokens."""
    scores = []
    for cond, uncond in zip(token_logprobs, unconditional_logprobs, strict=True):
        if len(cond) != len(uncond):
            raise ValueError("unconditional logprobs must cover the same tokens as the conditional ones")
        scores.append(_mean([c - u for c, u in zip(cond, uncond, strict=True)]))
    return ChoiceDecision(
        choices[_argmax(scores)],
        {"normalized_prompt_logprobs": [_mean(lp) for lp in token_logprobs],
         "normalized_unconditional_prompt_logprobs": scores},
    )


def decide(
    method: str,
    choices: Sequence[str],
    token_logprobs: Sequence[Sequence[float]],
    unconditional_logprobs: Sequence[Sequence[float]] | None = None,
) -> ChoiceDecision:
    """Dispatches on the method name (ValueError naming the three methods otherwise)."""
    if len(choices) != len(token_logprobs) or not choices:
        raise ValueError("select needs one logprob list per choice and at least one choice")
    if method == "token_length_normalized":
        return token_length_normalized(choices, token_logprobs)
    if method == "greedy_token_selection":
        return greedy_token_selection(choices, token_logprobs)
    if method == "unconditional_likelihood_normalized":
        if unconditional_logprobs is None:
            raise ValueError("unconditional_likelihood_normalized needs the unconditional logprobs")
        return unconditional_likelihood_normalized(choices, token_logprobs, unconditional_logprobs)
    raise ValueError(f"unknown choices_method {method!r}; use one of {SELECT_METHODS}")
