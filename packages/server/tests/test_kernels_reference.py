"""The torch-native kernel references against independent oracles: torch SDPA, Hugging Face's
Llama modules, bit loops and a per-row sort in Python. Runs in process, no Triton needed."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmserver.kernels import KernelUnavailableError, native_kernels, select_kernels
from lmserver.kernels import reference as ref
from lmserver.kernels.testing import random_paged_batch, rel_error


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal_offset: int | None) -> torch.Tensor:
    """q (n, H, D), k/v (L, KV, D) -> (n, H, D) through torch SDPA in float64; with an offset,
    query i sits at position causal_offset + i."""
    group = q.shape[1] // k.shape[1]
    qh = q.double().transpose(0, 1)[None]
    kh = k.double().repeat_interleave(group, 1).transpose(0, 1)[None]
    vh = v.double().repeat_interleave(group, 1).transpose(0, 1)[None]
    mask = None
    if causal_offset is not None:
        mask = torch.arange(k.shape[0])[None, :] <= (causal_offset + torch.arange(q.shape[0]))[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("shape", [(9, 3, 64), (32, 8, 128), (6, 2, 80)])
def test_decode_reference_matches_sdpa(shape: tuple[int, int, int]) -> None:
    heads, kv_heads, dim = shape
    g = torch.Generator().manual_seed(0)
    seq_lens = [1, 40, 333]
    b = random_paged_batch([s - 1 for s in seq_lens], [1] * 3, heads, kv_heads, dim, torch.float32, "cpu", g)
    out = ref.decode_attention_ref(b.q, b.k_cache, b.v_cache, b.req_to_token, b.req_pool_indices, b.seq_lens, dim**-0.5)
    for i, n in enumerate(seq_lens):
        slots = b.req_to_token[b.req_pool_indices[i], :n].long()
        assert (slots > 0).all()
        want = _sdpa(b.q[i : i + 1], b.k_cache[slots], b.v_cache[slots], None)
        assert rel_error(out[i : i + 1], want) < 1e-6


def test_extend_reference_is_full_causal_attention_over_prefix_and_new_tokens() -> None:
    g = torch.Generator().manual_seed(1)
    prefix, new = [0, 25, 7], [13, 1, 30]
    b = random_paged_batch(prefix, new, 9, 3, 64, torch.float32, "cpu", g)
    out = ref.extend_attention_ref(
        b.q, b.k_extend, b.v_extend, b.k_cache, b.v_cache, b.req_to_token, b.req_pool_indices,
        b.prefix_lens, b.extend_lens, b.extend_start_loc, 64**-0.5,
    )
    for i in range(3):
        start = int(b.extend_start_loc[i])
        rows = slice(start, start + new[i])
        slots = b.req_to_token[b.req_pool_indices[i], : prefix[i]].long()
        k = torch.cat([b.k_cache[slots], b.k_extend[rows]])
        v = torch.cat([b.v_cache[slots], b.v_extend[rows]])
        assert rel_error(out[rows], _sdpa(b.q[rows], k, v, prefix[i])) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rmsnorm_and_silu_references_match_hugging_face_llama(dtype: torch.dtype) -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(2)
    norm = LlamaRMSNorm(576, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(576, generator=g) + 0.5)
    x = torch.randn(7, 576, generator=g).to(dtype)
    res = torch.randn(7, 576, generator=g).to(dtype)
    with torch.no_grad():
        assert torch.equal(ref.rmsnorm_ref(x, norm.weight, 1e-5), norm(x))
        normed, summed = ref.fused_add_rmsnorm_ref(x, res, norm.weight, 1e-5)
        assert torch.equal(summed, x + res)
        assert torch.equal(normed, norm(x + res))
    gate_up = torch.randn(5, 2 * 1536, generator=g).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(ref.silu_and_mul_ref(gate_up), torch.nn.functional.silu(gate) * up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rope_reference_matches_hugging_face_apply_rotary_pos_emb(dtype: torch.dtype) -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(3)
    n, dim = 11, 64
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = torch.outer(torch.arange(2048).float(), inv_freq)
    cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    pos = torch.randint(0, 2048, (n,), generator=g)
    q = torch.randn(n, 9, dim, generator=g).to(dtype)
    k = torch.randn(n, 3, dim, generator=g).to(dtype)
    emb = torch.cat([freqs, freqs], dim=-1)[pos]  # HF's (seq, dim) cos/sin layout, cast as its rotary module does
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1), k.transpose(0, 1), cos, sin, unsqueeze_dim=0)
    got_q, got_k = ref.rope_ref(pos, q, k, cache)
    # bit-identical in every dtype: the same roundings in the same order
    assert torch.equal(got_q, want_q.transpose(0, 1)) and torch.equal(got_k, want_k.transpose(0, 1))
    # Partial rotary: channels past rotary_dim stay as they were.
    got_q, _ = ref.rope_ref(pos, q, k, cache[:, :16].contiguous())
    assert torch.equal(got_q[..., 16:], q[..., 16:])


def test_store_kv_reference_scatters_into_slots() -> None:
    g = torch.Generator().manual_seed(4)
    k_cache, v_cache = torch.randn(20, 3, 8, generator=g), torch.randn(20, 3, 8, generator=g)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    k, v = torch.randn(4, 3, 8, generator=g), torch.randn(4, 3, 8, generator=g)
    loc = torch.tensor([7, 2, 19, 11])
    ref.store_kv_ref(k, v, k_cache, v_cache, loc)
    for i, slot in enumerate(loc.tolist()):
        assert torch.equal(k_cache[slot], k[i]) and torch.equal(v_cache[slot], v[i])
    untouched = [s for s in range(20) if s not in loc.tolist()]
    assert torch.equal(k_cache[untouched], before_k[untouched]) and torch.equal(v_cache[untouched], before_v[untouched])


@settings(max_examples=40, deadline=None)
@given(vocab=st.integers(1, 200), extra_words=st.integers(-1, 1), seed=st.integers(0, 2**31 - 1))
def test_bitmask_reference_matches_bit_loop(vocab: int, extra_words: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    words = max(1, -(-vocab // 32) + extra_words)
    mask = torch.randint(-(2**31), 2**31 - 1, (2, words), generator=g, dtype=torch.int64).to(torch.int32)
    logits = torch.randn(2, vocab, generator=g)
    out = ref.apply_token_bitmask_ref(logits, mask)
    for r in range(2):
        for t in range(vocab):
            w = t // 32
            allowed = w < words and (int(mask[r, w]) >> (t % 32)) & 1 == 1
            assert out[r, t].item() == (logits[r, t].item() if allowed else -math.inf)


def _naive_filter(logits: list[float], temp: float, top_k: int, top_p: float, min_p: float) -> list[float]:
    exps = [math.exp(x / temp - max(logits) / temp) for x in logits]
    total = sum(exps)
    probs = [e / total for e in exps]
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept, mass = set(), 0.0
    for rank, i in enumerate(order):
        dropped = (0 < top_k <= rank) or (top_p < 1 and mass >= top_p) or probs[i] < min_p * probs[order[0]]
        if dropped and rank > 0:
            continue
        kept.add(i)
        mass += probs[i]
    z = sum(probs[i] for i in kept)
    return [probs[i] / z if i in kept else 0.0 for i in range(len(probs))]


@settings(max_examples=60, deadline=None)
@given(
    vocab=st.integers(1, 60), temp=st.floats(0.2, 3.0), top_k=st.integers(-1, 70),
    top_p=st.sampled_from([1.0, 0.95, 0.7, 0.3, 0.01]), min_p=st.sampled_from([0.0, 0.05, 0.3]),
    seed=st.integers(0, 2**31 - 1),
)
def test_sampling_filter_reference_matches_python_sort(
    vocab: int, temp: float, top_k: int, top_p: float, min_p: float, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, vocab, generator=g, dtype=torch.float64) * 3
    got = ref.top_k_top_p_min_p_probs_ref(
        logits.float(), torch.tensor([temp]), torch.tensor([top_k]), torch.tensor([top_p]), torch.tensor([min_p])
    )
    want = _naive_filter(logits[0].float().double().tolist(), temp, top_k, top_p, min_p)
    assert ((got[0] > 0).tolist()) == [p > 0 for p in want]
    torch.testing.assert_close(got[0].double(), torch.tensor(want, dtype=torch.float64), rtol=1e-5, atol=1e-7)


def test_sample_from_probs_follows_the_distribution() -> None:
    pytest.importorskip("triton")
    from lmserver.kernels.sampling import sample_from_probs

    probs = torch.tensor([[0.5, 0.0, 0.3, 0.15, 0.05]]).repeat(20000, 1)
    draws = sample_from_probs(probs, generator=torch.Generator().manual_seed(5))
    counts = torch.bincount(draws, minlength=5).double()
    expected = probs[0].double() * 20000
    assert counts[1] == 0
    nz = expected > 0
    chi2 = float((((counts - expected) ** 2)[nz] / expected[nz]).sum())
    assert chi2 < 18.5, chi2  # 3 degrees of freedom: p < 0.0003


def test_choose_num_kv_splits_fills_the_gpu_only_for_small_batches() -> None:
    pytest.importorskip("triton")
    from lmserver.kernels.decode_attention import choose_num_kv_splits

    # The H200 sweep's choices at the Llama-3-8B shape (8 KV heads, 132 SMs).
    assert choose_num_kv_splits(1, 8, 132) == 16
    assert choose_num_kv_splits(8, 8, 132) == 4
    assert choose_num_kv_splits(32, 8, 132) == 1
    assert choose_num_kv_splits(256, 8, 132) == 1
    splits = [choose_num_kv_splits(bs, 3, 132) for bs in range(1, 300)]
    assert all(s >= 1 and s & (s - 1) == 0 for s in splits)  # powers of two
    assert splits == sorted(splits, reverse=True)  # never more splits for a larger batch


def test_select_kernels_on_cpu_takes_the_references_and_says_why() -> None:
    ops = select_kernels("cpu")
    assert ops.backend == "torch_native" and "cpu" in ops.reason
    assert select_kernels("cpu", prefer="torch_native").reason == "torch_native asked for"
    with pytest.raises(KernelUnavailableError, match="torch_native"):
        select_kernels("cpu", prefer="triton")
    with pytest.raises(ValueError, match="prefer"):
        select_kernels("cpu", prefer="fast")  # type: ignore[arg-type]


def test_native_kernel_ops_mutate_in_place_like_the_triton_ones() -> None:
    ops = native_kernels("test")
    g = torch.Generator().manual_seed(6)
    x, res, w = torch.randn(3, 32, generator=g), torch.randn(3, 32, generator=g), torch.rand(32, generator=g) + 0.5
    want_x, want_res = ref.fused_add_rmsnorm_ref(x, res, w, 1e-6)
    ops.fused_add_rmsnorm(x, res, w, 1e-6)
    assert torch.equal(x, want_x) and torch.equal(res, want_res)
    q, k = torch.randn(4, 2, 8, generator=g), torch.randn(4, 1, 8, generator=g)
    cache = torch.randn(10, 8, generator=g)
    pos = torch.tensor([0, 3, 9, 1])
    want_q, want_k = ref.rope_ref(pos, q, k, cache)
    ops.apply_rope_inplace(pos, q, k, cache)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    logits = torch.randn(1, 40, generator=g)
    mask = torch.tensor([[0x0000FFFF, 0x1]], dtype=torch.int32)
    want = ref.apply_token_bitmask_ref(logits, mask)
    ops.apply_token_bitmask_inplace(logits, mask)
    assert torch.equal(logits, want) and torch.isinf(logits).sum() == 40 - 17


def test_kernels_readme_example_runs() -> None:
    import re
    from pathlib import Path

    readme = Path(__file__).resolve().parents[1] / "src" / "lmserver" / "kernels" / "README.md"
    blocks = re.findall(r"```python\n(.*?)```", readme.read_text(), flags=re.S)
    assert blocks, "kernels/README.md has no python example"
    exec(compile(blocks[0], str(readme), "exec"), {})
