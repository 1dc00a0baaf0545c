"""Sampler: penalties, logit bias, min-new-tokens, temperature / top-k / top-p / min-p, seeds,
and logprobs (the model's log-softmax over raw logits).

Each request owns a CPU `torch.Generator` seeded from `sampling_seed` (or the engine seed and
its arrival number); it draws one uniform number per sampled token, so a request's samples do
not depend on its batch-mates (same seed, same output).

`sample_tensor` keeps the chosen ids on the logits' device and never waits for the device (every
host list goes over with a non-blocking copy): the overlap scheduler (engine/overlap.py) feeds
them to the next forward before the host sees them. `sample` is it plus the host copy.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from lmserver.io_struct import SamplingParams
from lmserver.runner.host_tensors import pinned_for
from lmserver.runner.host_tensors import to_device as _dev


@dataclass
class SamplingInfo:
    """Per-request inputs of one sampling row."""

    params: SamplingParams
    generator: torch.Generator
    prompt_ids: list[int]
    output_ids: list[int]
    stop_ids: list[int]  # EOS + stop_token_ids (masked while len(output) < min_new_tokens)
    allowed_mask: torch.Tensor | None = None  # (vocab,) bool from a grammar, None = all allowed
    extra: dict[str, object] = field(default_factory=dict)


def changes_logits(info: SamplingInfo) -> bool:
    """True when `apply_penalties` changes this request's row (bias, a penalty, the min-new-tokens
    stop mask, a grammar mask). Pure."""
    p = info.params
    return bool(
        p.logit_bias
        or p.repetition_penalty != 1.0
        or p.frequency_penalty != 0.0
        or p.presence_penalty != 0.0
        or (len(info.output_ids) < p.min_new_tokens and info.stop_ids)
        or info.allowed_mask is not None
    )


def takes_argmax(info: SamplingInfo) -> bool:
    """True when this request's next token is the argmax of its raw logits (greedy, nothing
    changes its row). Pure."""
    return info.params.is_greedy and not changes_logits(info)


def apply_penalties(logits: torch.Tensor, infos: list[SamplingInfo]) -> torch.Tensor:
    """Returns processed logits (B, V): bias, penalties, min-new-tokens and grammar masks.

    The input tensor is not mutated (a copy is made when anything applies).
    """
    out = logits
    copied = False
    vocab = logits.shape[-1]
    for i, info in enumerate(infos):
        p = info.params
        if not changes_logits(info):
            continue
        if not copied:
            out = logits.clone()
            copied = True
        row = out[i]
        if p.logit_bias:
            ids = _dev(list(p.logit_bias.keys()), torch.long, row.device)
            vals = _dev(list(p.logit_bias.values()), row.dtype, row.device)
            row.index_add_(0, ids, vals)
        if p.repetition_penalty != 1.0:
            seen = _dev(sorted(set(info.prompt_ids) | set(info.output_ids)), torch.long, row.device)
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0) and info.output_ids:
            counts = torch.bincount(
                _dev(info.output_ids, torch.long, row.device), minlength=vocab
            )[:vocab].to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
        if len(info.output_ids) < p.min_new_tokens and info.stop_ids:
            row[_dev(info.stop_ids, torch.long, row.device)] = float("-inf")
        if info.allowed_mask is not None:
            row.masked_fill_(~info.allowed_mask.to(row.device), float("-inf"))
    return out


@functools.lru_cache(maxsize=16)
def _argmax_chunks(vocab: int) -> int:
    """Chunks for `greedy_argmax`: the largest divisor of `vocab` up to 1024 leaving chunks of at least
    64 entries, or 1 (no split) when there is none above 8."""
    for chunks in range(min(1024, vocab // 64), 8, -1):
        if vocab % chunks == 0:
            return chunks
    return 1


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(dim=-1)` for (B, V) logits, for a large vocabulary on a GPU in two reductions: the max of
    each of ~1000 chunks of a row, then the argmax over the chunk maxima. `torch.argmax` reduces a row in one
    thread block: 26.4 us of GPU time for a 128k vocabulary on an H200 against 10.6 us for the two steps in a
    CUDA graph; but they are five launches, ~67 us of host time against ~27 eagerly (benchmarks/RESULTS.md), so
    the split is used from 65,536 entries only, where the GPU time saved is largest. Ties resolve to the first
    index, as in `torch.argmax` (`max` along a dim returns the first maximal index; the chunks are in order)."""
    vocab = logits.shape[-1]
    if not (logits.is_cuda and logits.dim() == 2 and vocab >= 65536):
        return logits.argmax(dim=-1)
    return chunked_argmax(logits, _argmax_chunks(vocab))


def chunked_argmax(logits: torch.Tensor, chunks: int) -> torch.Tensor:
    """Argmax over the last dim of (B, V) `logits` through `chunks` equal chunks (`chunks` divides V)."""
    vocab = logits.shape[-1]
    if chunks == 1:
        return logits.argmax(dim=-1)
    vals, idx = logits.reshape(logits.shape[0], chunks, vocab // chunks).max(dim=-1)
    best = vals.argmax(dim=-1, keepdim=True)
    return (best * (vocab // chunks) + idx.gather(1, best)).squeeze(1)


def _kept_sorted(logits: torch.Tensor, params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of processed `logits` (B, V) after temperature, sorted descending, with what top-k /
    top-p / min-p drop zeroed: (sorted ids, kept probabilities (unnormalized), dropped mask)."""
    device = logits.device
    temps = _dev([p.temperature for p in params], torch.float32, device)
    probs = torch.softmax(logits / temps[:, None], dim=-1)
    sorted_probs, sorted_ids = probs.sort(dim=-1, descending=True)
    vocab = probs.shape[-1]
    ranks = torch.arange(vocab, device=device)[None, :]
    top_k = _dev([p.top_k if p.top_k > 0 else vocab for p in params], torch.long, device)
    top_p = _dev([p.top_p for p in params], torch.float32, device)
    min_p = _dev([p.min_p for p in params], torch.float32, device)
    cum = sorted_probs.cumsum(dim=-1)
    drop = ranks >= top_k[:, None]
    drop |= (cum - sorted_probs) > top_p[:, None]  # keep the smallest prefix reaching top_p
    drop |= sorted_probs < (min_p[:, None] * sorted_probs[:, :1])
    drop[:, 0] = False
    return sorted_ids, sorted_probs.masked_fill(drop, 0.0), drop


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distributions `sample` draws from (temperature > 0 rows): (B, V) probabilities of
    processed `logits` after temperature, top-k, top-p and min-p, renormalized."""
    sorted_ids, kept, _ = _kept_sorted(logits, params)
    kept = kept / kept.sum(dim=-1, keepdim=True)
    return torch.zeros_like(kept).scatter_(1, sorted_ids, kept)


def sample(logits: torch.Tensor, infos: list[SamplingInfo]) -> list[int]:
    """Next token per row of processed `logits` (B, V); advances each request's generator."""
    if not infos:
        return []
    return [int(t) for t in sample_tensor(logits, infos).tolist()]


def sample_tensor(logits: torch.Tensor, infos: list[SamplingInfo]) -> torch.Tensor:
    """`sample` without the host copy: (B,) int64 ids on the logits' device; no host sync.
    Advances each non-greedy request's generator by one draw (on the host)."""
    result = greedy_argmax(logits)
    idx = [i for i, info in enumerate(infos) if not info.params.is_greedy]
    if not idx:
        return result
    device = logits.device
    all_rows = len(idx) == len(infos)
    idx_t = None if all_rows else _dev(idx, torch.long, device)
    sub = logits if idx_t is None else logits.index_select(0, idx_t)
    sorted_ids, kept, drop = _kept_sorted(sub, [infos[i].params for i in idx])
    vocab = kept.shape[-1]
    cdf = kept.cumsum(dim=-1)
    u = torch.cat([torch.rand(1, generator=infos[i].generator) for i in idx])
    u = pinned_for(u, device).to(device, non_blocking=True)
    target = u * cdf[:, -1]
    pick = torch.searchsorted(cdf, target[:, None], right=True).clamp_(max=vocab - 1)
    # NOTE: a pick past the last kept token (u * total rounding) falls back to the last kept one
    pick = torch.minimum(pick, (~drop).sum(dim=-1, keepdim=True) - 1)
    chosen = sorted_ids.gather(1, pick).squeeze(1)
    if idx_t is None:
        return chosen
    return result.index_copy(0, idx_t, chosen)


def token_logprobs(logits: torch.Tensor, token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(log_softmax (N, V) float32, logprob of token_ids[i] in row i (N,)) from raw logits."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(token_ids, dtype=torch.long, device=logits.device)
    return logprobs, logprobs.gather(1, ids[:, None]).squeeze(1)
