"""The Mixtral-style expert MLP: the sparse torch path, its CUDA-graph-safe dense twin, and an oracle that applies
each token's chosen experts one token at a time."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from lmserver.kernels.fused_moe import align_pairs, max_blocks
from lmserver.layers.moe import MoE, moe_forward_dense, moe_forward_native


def oracle(x: torch.Tensor, logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int) -> torch.Tensor:
    """Token by token in float64: softmax, top-k, renormalize, sum of weight x down(silu(gate) * up)."""
    x, logits, w13, w2 = x.double(), logits.double(), w13.double(), w2.double()
    inter = w2.shape[2]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(logits[t], -1)
        top = torch.topk(probs, top_k)
        for p, e in zip(top.values / top.values.sum(), top.indices.tolist(), strict=True):
            gu = w13[e] @ x[t]
            out[t] += p * (w2[e] @ (F.silu(gu[:inter]) * gu[inter:]))
    return out


@settings(max_examples=40, deadline=None)
@given(tokens=st.integers(1, 9), experts=st.integers(2, 6), top_k=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_sparse_and_dense_paths_match_the_per_token_oracle(tokens: int, experts: int, top_k: int, seed: int) -> None:
    top_k = min(top_k, experts)
    g = torch.Generator().manual_seed(seed)
    hidden, inter = 8, 12
    x = torch.randn(tokens, hidden, generator=g)
    logits = torch.randn(tokens, experts, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / 3
    w2 = torch.randn(experts, hidden, inter, generator=g) / 3
    want = oracle(x, logits, w13, w2, top_k).float()
    sparse = moe_forward_native(x, logits, w13, w2, top_k)
    dense = moe_forward_dense(x, logits, w13, w2, top_k)
    torch.testing.assert_close(sparse, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dense, want, rtol=1e-4, atol=1e-5)


@settings(max_examples=80, deadline=None)
@given(tokens=st.integers(1, 40), experts=st.integers(1, 9), top_k=st.integers(1, 4),
       block_m=st.sampled_from([1, 2, 16, 64]), seed=st.integers(0, 2**16))
def test_align_pairs_groups_every_pair_once_by_expert(tokens: int, experts: int, top_k: int, block_m: int,
                                                      seed: int) -> None:
    # the fused kernels' plan: naive model = each expert's pairs in order, padded to whole blocks
    top_k = min(top_k, experts)
    g = torch.Generator().manual_seed(seed)
    chosen = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    pair_ids, block_expert = align_pairs(chosen, experts, block_m)
    num_pairs = tokens * top_k
    flat = chosen.reshape(-1).tolist()
    want_ids: list[int] = []
    want_experts: list[int] = []
    for e in range(experts):
        mine = [p for p in range(num_pairs) if flat[p] == e]
        blocks = -(-len(mine) // block_m)
        want_ids += mine + [num_pairs] * (blocks * block_m - len(mine))
        want_experts += [e] * blocks
    total = max_blocks(num_pairs, experts, block_m)
    assert len(want_experts) <= total
    want_ids += [num_pairs] * (total * block_m - len(want_ids))
    want_experts += [-1] * (total - len(want_experts))
    assert pair_ids.tolist() == want_ids
    assert block_expert.tolist() == want_experts


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["dense", "fused"])
def test_moe_layer_is_captured_in_a_cuda_graph(path: str) -> None:
    # the sparse path syncs with the host (the chosen experts): capturing it failed lmserver's Mixtral start-up;
    # under capture the layer runs the dense twin (torch ops) or the fused Triton kernels (`KernelOps.fused_moe`)
    from lmserver.kernels import select_kernels

    torch.manual_seed(0)
    dev = torch.device("cuda")
    moe = MoE(64, 96, num_experts=8, top_k=2).to(dev, torch.bfloat16)
    moe.kernels = select_kernels(dev, prefer="triton") if path == "fused" else None
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.1)
        x = torch.randn(4, 64, device=dev, dtype=torch.bfloat16)
        want = moe_forward_native(x, moe.gate(x), moe.w13, moe.w2, 2)
        static = x.clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            moe(static)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = moe(static)
        for _ in range(3):  # fresh inputs each replay: a different routing each time
            fresh = torch.randn(4, 64, device=dev, dtype=torch.bfloat16)
            static.copy_(fresh)
            graph.replay()
            torch.cuda.synchronize()
            torch.testing.assert_close(out, moe_forward_native(fresh, moe.gate(fresh), moe.w13, moe.w2, 2),
                                       rtol=2e-2, atol=2e-2)
    assert not torch.equal(want, out)  # the replay computed the new input, not the captured one
