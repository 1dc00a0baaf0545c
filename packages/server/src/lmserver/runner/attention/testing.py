"""A check shared by the attention-backend tests: one backend against a reference backend on the
same random steps (a chunked prefill over cached prefixes, then decode steps) over twin KV pools
with random stale contents, so a backend that reads an unwritten slot or writes a wrong one fails.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lmserver.forward.batch import AttentionBackend, AttentionLayer, ForwardBatch, ForwardMode
from lmserver.forward.kv_pool import KVPool, make_req_to_token
from lmserver.kernels.testing import rel_error

__all__ = ["compare_backends", "step_batch"]

BackendFactory = Callable[[KVPool, torch.Tensor], AttentionBackend]


def step_batch(mode: ForwardMode, rows: list[int], prefix: list[int], new: list[int], loc: torch.Tensor,
               device: str) -> ForwardBatch:
    """The ForwardBatch of one step: request rows, cached prefix lengths, new token counts, slots."""
    seq = [p + n for p, n in zip(prefix, new, strict=True)]
    dev = torch.device(device)
    batch = ForwardBatch(
        mode=mode, batch_size=len(rows), input_ids=torch.zeros(sum(new), dtype=torch.int64, device=dev),
        positions=torch.cat([torch.arange(p, p + n) for p, n in zip(prefix, new, strict=True)]).to(dev),
        out_cache_loc=loc.to(dev), req_pool_indices=torch.tensor(rows, device=dev),
        seq_lens=torch.tensor(seq, dtype=torch.int32, device=dev), seq_lens_cpu=seq, req_pool_indices_cpu=rows,
    )
    if mode == ForwardMode.EXTEND:
        starts = [sum(new[:i]) for i in range(len(new))]
        batch.extend_prefix_lens = torch.tensor(prefix, dtype=torch.int32, device=dev)
        batch.extend_seq_lens = torch.tensor(new, dtype=torch.int32, device=dev)
        batch.extend_start_loc = torch.tensor(starts, dtype=torch.int32, device=dev)
        batch.extend_prefix_lens_cpu, batch.extend_seq_lens_cpu = prefix, new
    return batch


def compare_backends(make_ref: BackendFactory, make_other: BackendFactory, *, device: str,
                     shape: tuple[int, int, int], dtype: torch.dtype, num_slots: int, width: int,
                     chunks: list[list[int]], decode_steps: int, tol: float, layers: int = 2,
                     stale_padding_slot: bool = True, kv_cache_dtype: torch.dtype | None = None,
                     rotate_k: bool = False) -> None:
    """Runs three requests through `chunks` (new tokens per request and extend step), then
    `decode_steps` decodes, on both backends (each call through `AttentionLayer`, as a model makes
    it); asserts outputs within `tol` (relative L2) and equal KV pools. `shape` = (heads, kv_heads,
    head_dim); with `stale_padding_slot` False slot 0 (padding) keeps zeros; `kv_cache_dtype`
    (float8_e4m3fn) makes both pools FP8 (scales 1.0); `rotate_k` stores K in the Hadamard basis."""
    heads, kv_heads, dim = shape
    g = torch.Generator().manual_seed(0)
    pools = [KVPool(num_slots, layers, kv_heads, dim, dtype, device, kv_cache_dtype, rotate_k=rotate_k)
             for _ in range(2)]
    first = 0 if stale_padding_slot else 1
    for layer_id in range(layers):  # random stale contents: nothing may read an unwritten slot
        for cache in ("k_cache", "v_cache"):
            noise = torch.randn(num_slots, kv_heads, dim, generator=g).to(dtype)
            for pool in pools:
                getattr(pool, cache)[layer_id][first:].copy_(noise[first:])
    tables = [make_req_to_token(6, width, device) for _ in range(2)]
    ref, other = make_ref(pools[0], tables[0]), make_other(pools[1], tables[1])
    attn = [AttentionLayer(i, heads, kv_heads, dim, dim**-0.5) for i in range(layers)]
    rows = [4, 0, 2]
    free = (torch.randperm(num_slots - 1, generator=g) + 1).tolist()
    lens = [0, 0, 0]
    steps: list[tuple[ForwardMode, list[int]]] = [(ForwardMode.EXTEND, c) for c in chunks]
    steps += [(ForwardMode.DECODE, [1, 1, 1])] * decode_steps
    for mode, new in steps:
        active = [i for i in range(3) if new[i] > 0]
        loc = []
        for i in active:
            slots = [free.pop() for _ in range(new[i])]
            for table in tables:
                table[rows[i], lens[i] : lens[i] + new[i]] = torch.tensor(slots, dtype=torch.int32)
            loc += slots
        args = ([rows[i] for i in active], [lens[i] for i in active], [new[i] for i in active],
                torch.tensor(loc, dtype=torch.int64), device)
        ref_batch, other_batch = step_batch(mode, *args), step_batch(mode, *args)
        ref_batch.attn_backend, other_batch.attn_backend = ref, other
        ref.plan(ref_batch)
        other.plan(other_batch)
        total = sum(new)
        for layer in attn:
            q = torch.randn(total, heads, dim, generator=g).to(dtype).to(device)
            k = torch.randn(total, kv_heads, dim, generator=g).to(dtype).to(device)
            v = torch.randn(total, kv_heads, dim, generator=g).to(dtype).to(device)
            want = layer(q, k, v, ref_batch)
            got = layer(q, k, v, other_batch)
            assert got.shape == want.shape == (total, heads * dim)
            assert rel_error(got, want) < tol, f"{mode} layer {layer.layer_id}: {rel_error(got, want)}"
        for i in active:
            lens[i] += new[i]
    for layer_id in range(layers):
        assert torch.equal(pools[0].k_cache[layer_id], pools[1].k_cache[layer_id])
        assert torch.equal(pools[0].v_cache[layer_id], pools[1].v_cache[layer_id])
