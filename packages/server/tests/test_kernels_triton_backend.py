"""The `triton` attention backend against `torch_native` (its reference) on random batches:
a chunked prefill with cached prefixes, then decode steps; outputs and the KV pool must agree.
Runs on CUDA (`gpu`) and on the CPU in the TRITON_INTERPRET=1 child (test_kernels_interpret.py)."""

from __future__ import annotations

import os

import pytest
import torch

from lmserver.attention.base import AttentionLayer
from lmserver.attention.torch_native import TorchNativeBackend
from lmserver.engine.forward_batch import ForwardBatch, ForwardMode
from lmserver.engine.kv_pool import KVPool, make_req_to_token
from lmserver.kernels.testing import rel_error

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = [pytest.param("cuda", marks=pytest.mark.gpu, id="cuda")]
if INTERPRET:
    DEVICES.append(pytest.param("cpu", id="interpret"))


def _batch(mode: ForwardMode, rows: list[int], prefix: list[int], new: list[int], loc: torch.Tensor, device: str) -> ForwardBatch:
    seq = [p + n for p, n in zip(prefix, new, strict=True)]
    dev = torch.device(device)
    batch = ForwardBatch(
        mode=mode, batch_size=len(rows), input_ids=torch.zeros(sum(new), dtype=torch.int64, device=dev),
        positions=torch.cat([torch.arange(p, p + n) for p, n in zip(prefix, new, strict=True)]).to(dev),
        out_cache_loc=loc.to(dev), req_pool_indices=torch.tensor(rows, device=dev),
        seq_lens=torch.tensor(seq, dtype=torch.int32, device=dev), seq_lens_cpu=seq,
    )
    if mode == ForwardMode.EXTEND:
        starts = [sum(new[:i]) for i in range(len(new))]
        batch.extend_prefix_lens = torch.tensor(prefix, dtype=torch.int32, device=dev)
        batch.extend_seq_lens = torch.tensor(new, dtype=torch.int32, device=dev)
        batch.extend_start_loc = torch.tensor(starts, dtype=torch.int32, device=dev)
        batch.extend_prefix_lens_cpu, batch.extend_seq_lens_cpu = prefix, new
    return batch


# The interpreter child runs the SmolLM2 shape only (the Llama shape is slow there; its kernels are
# covered by test_kernels_triton.py); CUDA runs both.
SHAPES = [pytest.param((9, 3, 64), id="smollm2")]
if not INTERPRET:
    SHAPES.append(pytest.param((32, 8, 128), id="llama3-8b"))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_backend_matches_torch_native(device: str, shape: tuple[int, int, int]) -> None:
    from lmserver.attention.triton_backend import TritonBackend

    heads, kv_heads, dim = shape
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2
    g = torch.Generator().manual_seed(0)
    num_slots, layers = 400 if device == "cpu" else 20000, 2
    pools = [KVPool(num_slots, layers, kv_heads, dim, dtype, device) for _ in range(2)]
    for layer_id in range(layers):  # random stale contents: nothing may read an unwritten slot
        for cache in ("k_cache", "v_cache"):
            noise = torch.randn(num_slots, kv_heads, dim, generator=g).to(dtype)
            for pool in pools:
                getattr(pool, cache)[layer_id].copy_(noise)
    tables = [make_req_to_token(6, 512 if device == "cpu" else 8192, device) for _ in range(2)]
    ref_backend, tri_backend = TorchNativeBackend(pools[0], tables[0]), TritonBackend(pools[1], tables[1])
    attn = [AttentionLayer(i, heads, kv_heads, dim, dim**-0.5) for i in range(layers)]

    rows = [4, 0, 2]
    free = (torch.randperm(num_slots - 1, generator=g) + 1).tolist()
    lens = [0, 0, 0]
    chunks = [[30, 5, 17], [0, 40, 1]] if device == "cpu" else [[3000, 512, 1], [700, 0, 2000]]
    steps: list[tuple[ForwardMode, list[int]]] = [(ForwardMode.EXTEND, c) for c in chunks]
    steps += [(ForwardMode.DECODE, [1, 1, 1])] * 3
    for mode, new in steps:
        active = [i for i in range(3) if new[i] > 0]
        loc = []
        for i in active:
            slots = [free.pop() for _ in range(new[i])]
            for table in tables:
                table[rows[i], lens[i] : lens[i] + new[i]] = torch.tensor(slots, dtype=torch.int32)
            loc += slots
        batch_args = ([rows[i] for i in active], [lens[i] for i in active], [new[i] for i in active],
                      torch.tensor(loc, dtype=torch.int64), device)
        ref_backend.plan(_batch(mode, *batch_args))
        tri_backend.plan(_batch(mode, *batch_args))
        total = sum(new)
        for layer in attn:
            q = torch.randn(total, heads, dim, generator=g).to(dtype).to(device)
            k = torch.randn(total, kv_heads, dim, generator=g).to(dtype).to(device)
            v = torch.randn(total, kv_heads, dim, generator=g).to(dtype).to(device)
            want = ref_backend.forward(q, k, v, layer)
            got = tri_backend.forward(q, k, v, layer)
            assert got.shape == want.shape == (total, heads * dim)
            assert rel_error(got, want) < tol, f"{mode} layer {layer.layer_id}: {rel_error(got, want)}"
        for i in active:
            lens[i] += new[i]
    for layer_id in range(layers):
        assert torch.equal(pools[0].k_cache[layer_id], pools[1].k_cache[layer_id])
        assert torch.equal(pools[0].v_cache[layer_id], pools[1].v_cache[layer_id])
