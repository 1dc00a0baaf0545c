"""Next-token agreement of two model setups (e.g. FP8 weights + FP8 KV cache against the
unquantized model) over fixed token windows: top-1 agreement and mean KL(reference || other).

Each window runs as one prefill through the real KV pool and attention backend, with the logits
of every position, so a quantized KV cache is read back for every position. Used by
benchmarks/fp8/bench_fp8_accuracy.py and the FP8 accuracy test.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lmserver.forward.kv_pool import KVPool, make_req_to_token
from lmserver.runner.attention.registry import default_registry
from lmserver.runner.model_runner import ModelRunner
from lmserver.runner.resolve import kv_cache_options
from lmserver.scheduler import ForwardItem, ScheduleDecision

__all__ = ["Agreement", "agreement", "calibration_forward", "window_logits", "window_runner"]


@dataclass(frozen=True)
class Agreement:
    """Over `num_positions` next-token predictions: the fraction where both setups' argmax is
    the same token, and the mean (and max) KL divergence of the other's distribution from the
    reference's, in nats."""

    num_positions: int
    top1: float
    mean_kl: float
    max_kl: float


def window_runner(model: torch.nn.Module, window: int, kv_cache_dtype: str = "auto",
                  attention_backend: str = "torch_native", rotate_k: bool = True) -> ModelRunner:
    """A ModelRunner over `model` with a KV pool of one `window` (slot 0 is padding); an FP8 pool
    stores K in the Hadamard basis as the engine's does, unless `rotate_k` is False."""
    param = next(model.parameters())
    config: Any = model.config
    device = param.device
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point() and p.element_size() > 1)
    pool = KVPool(window + 1, config.num_hidden_layers, config.num_key_value_heads, config.head_dim, dtype,
                  device, **kv_cache_options(kv_cache_dtype, model, rotate_k=rotate_k))
    table = make_req_to_token(1, window, device)
    backend = default_registry().create(attention_backend, pool, table)
    return ModelRunner(model, pool, table, backend, device)


def window_logits(runner: ModelRunner, ids: Sequence[int]) -> torch.Tensor:
    """float32 logits (len(ids), vocab) of one prefill of `ids` (every position). Mutates the
    runner's KV pool."""
    n = len(ids)
    slots = list(range(1, n + 1))
    item = ForwardItem(rid="w", req_pool_idx=0, prefix_len=0, token_ids=list(ids), out_slots=slots,
                       table_start=0, table_slots=slots, logit_offsets=list(range(n)), completes_prefill=True)
    return runner.forward(ScheduleDecision("extend", [item]))


def calibration_forward(model: torch.nn.Module, sequences: Sequence[Sequence[int]],
                        attention_backend: str = "torch_native") -> None:
    """One prefill of all `sequences` together (one extend batch, each its own request, a
    model-dtype KV pool of their total length, the last position's logits only): the single
    forward that `lmserver.models.fp8_gptq`'s sequential calibration needs. Runs the model."""
    param = next(model.parameters())
    config: Any = model.config
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point() and p.element_size() > 1)
    total, longest = sum(len(s) for s in sequences), max(len(s) for s in sequences)
    pool = KVPool(total + 1, config.num_hidden_layers, config.num_key_value_heads, config.head_dim, dtype,
                  param.device)
    table = make_req_to_token(len(sequences), longest, param.device)
    runner = ModelRunner(model, pool, table, default_registry().create(attention_backend, pool, table), param.device)
    items, start = [], 1
    for i, ids in enumerate(sequences):
        slots = list(range(start, start + len(ids)))
        start += len(ids)
        items.append(ForwardItem(rid=f"c{i}", req_pool_idx=i, prefix_len=0, token_ids=list(ids), out_slots=slots,
                                 table_start=0, table_slots=slots, logit_offsets=[len(ids) - 1],
                                 completes_prefill=True))
    runner.forward(ScheduleDecision("extend", items))


def agreement(ref_logits: torch.Tensor, logits: torch.Tensor) -> Agreement:
    """Top-1 agreement and KL(ref || other) per position of two (N, vocab) logit tensors. Pure."""
    ref_lp = torch.log_softmax(ref_logits.double(), dim=-1)
    lp = torch.log_softmax(logits.double(), dim=-1)
    kl = (ref_lp.exp() * (ref_lp - lp)).sum(dim=-1)  # (N,)
    same = (ref_logits.argmax(dim=-1) == logits.argmax(dim=-1)).double()
    return Agreement(int(kl.numel()), float(same.mean()), float(kl.mean()), float(kl.max()))


def merge(parts: Sequence[Agreement]) -> Agreement:
    """The agreement over the union of the parts' positions. Pure."""
    n = sum(p.num_positions for p in parts)
    return Agreement(
        n,
        sum(p.top1 * p.num_positions for p in parts) / n,
        sum(p.mean_kl * p.num_positions for p in parts) / n,
        max(p.max_kl for p in parts),
    )
