"""Every Triton kernel against its torch-native reference, on fresh random inputs.

Runs on CUDA (`gpu` marker: bf16 and fp16, model shapes) and on the CPU under Triton's
interpreter (tiny shapes, fp32 and fp16: the interpreter mishandles bf16 arithmetic). The CPU
cases run only in the TRITON_INTERPRET=1 child process that test_kernels_interpret.py starts,
because the variable must be set before triton is imported.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from lmserver.kernels import reference as ref
from lmserver.kernels.testing import kernel_devices, random_paged_batch, rel_error

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# The CPU cases exist only in the TRITON_INTERPRET=1 child (test_kernels_interpret.py).
DEVICES = kernel_devices()
SLOW_ON_CPU = kernel_devices(slow_on_cpu=True)  # the interpreter's longest cases (40-90 s on 2 busy cores)
# (num_heads, num_kv_heads, head_dim): SmolLM2-135M (GQA group 3), Llama-3-8B (group 4), MHA, odd dim.
SHAPES = [(9, 3, 64), (32, 8, 128), (4, 4, 32), (6, 2, 80)]


def _dtypes(device: str) -> list[torch.dtype]:
    return [torch.float32, torch.float16] if device == "cpu" else [torch.bfloat16, torch.float16]


def _tol(dtype: torch.dtype) -> float:
    return {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _scale(device: str, small: list[int], large: list[int]) -> list[int]:
    return small if device == "cpu" else large


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_decode_attention_matches_reference(device: str, shape: tuple[int, int, int]) -> None:
    from lmserver.kernels.decode_attention import decode_attention

    num_heads, num_kv_heads, head_dim = shape
    for i, dtype in enumerate(_dtypes(device)):
        seq_lens = _scale(device, [1, 23, 70], [1, 17, 300, 4096, 513, 64, 2, 1000])
        batch = random_paged_batch(
            [s - 1 for s in seq_lens], [1] * len(seq_lens), num_heads, num_kv_heads, head_dim, dtype, device, _gen(10 + i)
        )
        expected = ref.decode_attention_ref(
            batch.q, batch.k_cache, batch.v_cache, batch.req_to_token, batch.req_pool_indices, batch.seq_lens, head_dim**-0.5
        )
        for splits in (1, 3) if device == "cpu" else (1, 3, 8):
            out = torch.full_like(batch.q, float("nan"))  # poisoned: every element must be written
            decode_attention(
                batch.q, batch.k_cache, batch.v_cache, batch.req_to_token, batch.req_pool_indices, batch.seq_lens,
                head_dim**-0.5, out=out, num_kv_splits=splits, block_n=16 if device == "cpu" else (64 if splits == 3 else 128),
            )
            err = rel_error(out, expected)
            assert err < _tol(dtype), f"{dtype} splits={splits}: rel error {err}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_extend_attention_matches_reference(device: str, shape: tuple[int, int, int]) -> None:
    from lmserver.kernels.extend_attention import extend_attention

    num_heads, num_kv_heads, head_dim = shape
    for i, dtype in enumerate(_dtypes(device)):
        # prefix of any length (0, unaligned, long), chunks of 1 to many tokens, an empty one.
        prefix = _scale(device, [0, 19, 3, 40], [0, 1000, 37, 4096, 5])
        new = _scale(device, [21, 1, 0, 9], [700, 1, 129, 64, 2000])
        batch = random_paged_batch(prefix, new, num_heads, num_kv_heads, head_dim, dtype, device, _gen(20 + i))
        args = (
            batch.q, batch.k_extend, batch.v_extend, batch.k_cache, batch.v_cache, batch.req_to_token,
            batch.req_pool_indices, batch.prefix_lens, batch.extend_lens, batch.extend_start_loc, head_dim**-0.5,
        )
        expected = ref.extend_attention_ref(*args)
        for heavy_first in (False, True):  # the launch order of the query blocks changes no result
            out = torch.full_like(batch.q, float("nan"))
            extend_attention(*args, max(new), out=out, heavy_first=heavy_first)
            err = rel_error(out, expected)
            assert err < _tol(dtype), f"{dtype} heavy_first={heavy_first}: rel error {err}"


@pytest.mark.parametrize("device", DEVICES)
def test_extend_attention_without_prefix_loop_matches_reference(device: str) -> None:
    """has_prefix=False (fresh prompts only): the same outputs as with it, and no cache read: caches of NaN (or of
    FP8, whose scales then must not apply) and prefix lengths that lie (a caller's bug) change nothing; every new
    token still attends causally to the new tokens before it."""
    from lmserver.kernels.extend_attention import extend_attention

    dtype = _dtypes(device)[-1]
    new = _scale(device, [21, 1, 9], [700, 1, 2000])
    batch = random_paged_batch([0] * len(new), new, 4, 2, 64, dtype, device, _gen(31))
    args = (
        batch.q, batch.k_extend, batch.v_extend, batch.k_cache, batch.v_cache, batch.req_to_token,
        batch.req_pool_indices, batch.prefix_lens, batch.extend_lens, batch.extend_start_loc, 64**-0.5,
    )
    expected = ref.extend_attention_ref(*args)
    outs = []
    for has_prefix in (True, False):
        out = torch.full_like(batch.q, float("nan"))
        extend_attention(*args, max(new), out=out, has_prefix=has_prefix)
        assert rel_error(out, expected) < _tol(dtype), has_prefix
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    poisoned = [torch.full_like(batch.k_cache, float("nan")), torch.full_like(batch.v_cache, float("nan")),
                batch.k_cache.to(torch.float8_e4m3fn), batch.v_cache.to(torch.float8_e4m3fn)]
    lying = torch.tensor([19, 0, 3], dtype=batch.prefix_lens.dtype, device=batch.prefix_lens.device)
    for k_cache, v_cache, prefix_lens in ((*poisoned[:2], batch.prefix_lens), (*poisoned[2:], lying)):
        out = torch.full_like(batch.q, float("nan"))
        extend_attention(batch.q, batch.k_extend, batch.v_extend, k_cache, v_cache, batch.req_to_token,
                         batch.req_pool_indices, prefix_lens, batch.extend_lens, batch.extend_start_loc, 64**-0.5,
                         max(new), out=out, has_prefix=False, k_scale=7.0, v_scale=0.5)
        assert torch.equal(out, outs[1]), k_cache.dtype


def _close(out: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to rounding: the kernels compute in float32 and round where the reference does,
    but exp, rsqrt and sums may differ in their last float32 bit, which can flip one rounding."""
    assert out.dtype == expected.dtype and torch.isfinite(out.float()).all()
    if expected.dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    else:
        eps = torch.finfo(expected.dtype).eps
        torch.testing.assert_close(out.float(), expected.float(), rtol=2.5 * eps, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_rmsnorm_and_fused_add_rmsnorm(device: str) -> None:
    from lmserver.kernels.norm import fused_add_rmsnorm, rmsnorm

    g = _gen(1)
    for dtype in _dtypes(device):
        for hidden in (576, 4096, 100):
            x = torch.randn(_scale(device, [5], [257])[0], hidden, generator=g).to(dtype).to(device)
            res = torch.randn(x.shape, generator=g).to(dtype).to(device)
            w = (torch.rand(hidden, generator=g) + 0.5).to(dtype).to(device)
            _close(rmsnorm(x, w, 1e-5), ref.rmsnorm_ref(x, w, 1e-5))
            want_x, want_res = ref.fused_add_rmsnorm_ref(x, res, w, 1e-6)
            x2, res2 = x.clone(), res.clone()
            fused_add_rmsnorm(x2, res2, w, 1e-6)
            assert torch.equal(res2, want_res)
            _close(x2, want_x)


@pytest.mark.parametrize("device", DEVICES)
def test_silu_and_mul(device: str) -> None:
    from lmserver.kernels.activation import silu_and_mul

    g = _gen(2)
    for dtype in _dtypes(device):
        for d in (1536, 14336 if device == "cuda" else 100):
            x = torch.randn(_scale(device, [4], [129])[0], 2 * d, generator=g).to(dtype).to(device)
            _close(silu_and_mul(x), ref.silu_and_mul_ref(x))


# (hidden, inter, experts, top_k): tiny shapes with dims that are not multiples of the tiles, and on the GPU
# Mixtral's layer (4096, 14336, 8, 2) among them.
MOE_SHAPES = {"cpu": [(32, 48, 4, 2), (40, 24, 3, 1), (16, 16, 5, 3)],
              "cuda": [(4096, 14336, 8, 2), (576, 1536, 8, 2), (1000, 700, 6, 3), (64, 96, 64, 8)]}


def _distinct_logits(tokens: int, experts: int, g: torch.Generator) -> torch.Tensor:
    """Router logits distinct within each row (a permutation in steps of 1/4, exact in every dtype): which of two
    equal probabilities top-k picks is not part of its contract."""
    return torch.stack([torch.randperm(experts, generator=g) for _ in range(tokens)]) * 0.25 - experts / 8


@pytest.mark.parametrize("device", SLOW_ON_CPU)
def test_fused_moe_matches_the_float64_reference(device: str) -> None:
    # Oracle: the sparse torch path in float64. Each dtype's error must be within a small factor of the torch path's
    # own (same roundings), and every launch shape (decode-sized 16-row blocks, prefill-sized tiles) is exercised.
    from lmserver.kernels.fused_moe import MoeLaunch, fused_moe
    from lmserver.layers.moe import moe_forward_native

    g = _gen(12)
    small = MoeLaunch(block_m=16, block_n_up=16, block_n_down=16, block_k=16, num_warps=1, num_stages=1)
    # tma: the expert weights through tensor descriptors (the default prefill launch on a Hopper GPU)
    launches = ([None, small, replace(small, tma=True)] if device == "cpu" else
                [None, MoeLaunch(block_m=64, block_n_up=64, block_n_down=64, block_k=64),
                 MoeLaunch(block_m=64, block_n_up=64, block_n_down=64, block_k=64, tma=True)])
    for hidden, inter, experts, top_k in MOE_SHAPES[device]:
        # the weights once per shape (Mixtral's are 1.4e9 values), on the device
        w13_f = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(device)
        w2_f = (torch.randn(experts, hidden, inter, generator=g) / inter**0.5).to(device)
        for dtype in _dtypes(device) + ([torch.float32] if device == "cuda" else []):  # fp32: halved block_k
            w13, w2 = w13_f.to(dtype), w2_f.to(dtype)
            for tokens in _scale(device, [1, 3, 19, 70], [1, 4, 8, 300]):  # 70 (CPU), 300: prefill tiles
                x = torch.randn(tokens, hidden, generator=g)
                args = [x.to(dtype).to(device), _distinct_logits(tokens, experts, g).to(dtype).to(device), w13, w2]
                want = moe_forward_native(*(t.double() for t in args), top_k)
                torch_err = rel_error(moe_forward_native(*args, top_k), want)
                for launch in launches:
                    err = rel_error(fused_moe(*args, top_k, launch=launch), want)
                    # float32: K-blocked sums over up to 14,336 terms against cuBLAS's (measured on the H200: 2.8e-6
                    # vs 4.5e-7); a wiring error is of order 1
                    assert err <= 2 * torch_err + (1e-5 if dtype == torch.float32 else 1e-3), (
                        f"{(hidden, inter, experts, top_k)} {dtype} tokens={tokens} {launch}: {err} vs torch {torch_err}")


@pytest.mark.parametrize("device", DEVICES)
def test_moe_route_and_align_kernel_matches_the_torch_ops(device: str) -> None:
    # one program (up to ROUTE_ALIGN_MAX_ELEMENTS) against `route` + `align_pairs`: the same pairs in the same rows, the same
    # block experts, the same weights up to float32 exp/sum rounding; 300 x 64 is past the one-program limit (torch ops) on the
    # GPU, 2,048 x 8 its largest tile
    from lmserver.kernels.fused_moe import align_pairs, route_and_align
    from lmserver.kernels.reference import route

    g = _gen(13)
    for tokens, experts, top_k, block_m in [(1, 8, 2, 16), (3, 5, 1, 16), (17, 8, 2, 16), (40, 20, 4, 16),
                                             (64, 8, 2, 32), (9, 3, 3, 64), (300 if device == "cuda" else 33, 64, 8, 16),
                                             (2048 if device == "cuda" else 70, 8, 2, 128)]:  # Mixtral prefill
        for renormalize in (True, False):
            for dtype in _dtypes(device):
                logits = _distinct_logits(tokens, experts, g).to(dtype).to(device)
                want_w, want_e = route(logits, top_k, renormalize, dtype)
                want_ids, want_blocks = align_pairs(want_e, experts, block_m)
                w, ids, blocks = route_and_align(logits, top_k, renormalize, dtype, block_m)
                case = f"{(tokens, experts, top_k, block_m, renormalize, dtype)}"
                assert torch.equal(ids, want_ids), case
                assert torch.equal(blocks, want_blocks), case
                torch.testing.assert_close(w, want_w, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-6, msg=case)


def _cos_sin(max_pos: int, rotary_dim: int, base: float, device: str) -> torch.Tensor:
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).float().to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_rope_inplace(device: str, shape: tuple[int, int, int]) -> None:
    from lmserver.kernels.rope import apply_rope_inplace

    num_heads, num_kv_heads, head_dim = shape
    g = _gen(3)
    for dtype in _dtypes(device):
        for rotary_dim in (head_dim, head_dim // 2):
            cache = _cos_sin(5000, rotary_dim, 500000.0, device)
            n = _scale(device, [6], [300])[0]
            pos = torch.randint(0, 5000, (n,), generator=g).to(device)
            q = torch.randn(n, num_heads, head_dim, generator=g).to(dtype).to(device)
            k = torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype).to(device)
            want_q, want_k = ref.rope_ref(pos, q, k, cache)
            apply_rope_inplace(pos, q, k, cache)
            # bit-identical: a product of two values of q's dtype is exact in float32, the kernel
            # rounds where the reference does and contracts no FMA
            assert torch.equal(q, want_q) and torch.equal(k, want_k)


@pytest.mark.parametrize("device", DEVICES)
def test_store_kv(device: str) -> None:
    from lmserver.kernels.kv_store import store_kv

    g = _gen(4)
    for dtype in _dtypes(device):
        for kv_heads, head_dim in ((3, 64), (8, 128)):
            n, slots = _scale(device, [7, 40], [1000, 5000])
            k_cache = torch.randn(slots, kv_heads, head_dim, generator=g).to(dtype).to(device)
            v_cache = torch.randn(slots, kv_heads, head_dim, generator=g).to(dtype).to(device)
            loc = (torch.randperm(slots - 1, generator=g)[:n] + 1).to(device)
            k = torch.randn(n, kv_heads, head_dim, generator=g).to(dtype).to(device)
            v = torch.randn(n, kv_heads, head_dim, generator=g).to(dtype).to(device)
            want_k, want_v = k_cache.clone(), v_cache.clone()
            ref.store_kv_ref(k, v, want_k, want_v, loc)
            store_kv(k, v, k_cache, v_cache, loc)
            assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


@pytest.mark.parametrize("device", DEVICES)
def test_apply_token_bitmask(device: str) -> None:
    from lmserver.kernels.bitmask import apply_token_bitmask_inplace

    g = _gen(5)
    for vocab, words in ((1000, 32), (1000, 30), (_scale(device, [3000], [128256])[0], -1)):
        words = words if words > 0 else -(-vocab // 32)
        logits = torch.randn(5, vocab, generator=g).to(device)
        mask = torch.randint(-(2**31), 2**31 - 1, (5, words), generator=g, dtype=torch.int64).to(torch.int32)
        mask[0] = 0  # nothing allowed
        mask[1] = -1  # everything allowed
        mask = mask.to(device)
        expected = ref.apply_token_bitmask_ref(logits, mask)
        apply_token_bitmask_inplace(logits, mask)
        assert torch.equal(logits, expected)


def _check_filtered(out: torch.Tensor, expected: torch.Tensor, logits: torch.Tensor, temps: torch.Tensor) -> None:
    kept, kept_ref = out > 0, expected > 0
    assert not (kept_ref & ~kept).any(), "the kernel dropped a token the reference keeps"
    # Threshold semantics: extra tokens are exact ties with the reference's smallest kept one.
    probs = torch.softmax(logits.float() / temps[:, None], dim=-1)
    boundary = torch.where(kept_ref, probs, float("inf")).min(-1, keepdim=True).values
    extra = kept & ~kept_ref
    assert torch.equal(probs[extra], boundary.expand_as(probs)[extra]), "an extra token is no tie"
    if logits.dtype == torch.float32:
        assert not extra.any()  # no ties among random float32 logits
    want = probs * kept
    torch.testing.assert_close(out, want / want.sum(-1, keepdim=True), rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("device", SLOW_ON_CPU)
def test_top_k_top_p_min_p_probs(device: str) -> None:
    from lmserver.kernels.sampling import top_k_top_p_min_p_probs

    g = _gen(6)
    vocab, chunk, pivots = _scale(device, [1000, 256, 32], [128256, 4096, 32])
    temps = torch.tensor([1.0, 0.7, 1.3, 1.0, 0.5, 2.0, 1.0, 0.9])
    top_ks = torch.tensor([0, 50, vocab, 1, 200, 10, 40, -1])
    top_ps = torch.tensor([1.0, 0.9, 0.5, 1.0, 0.3, 0.99, 0.8, 0.95])
    min_ps = torch.tensor([0.0, 0.0, 0.05, 0.0, 0.1, 0.0, 0.02, 0.0])
    for dtype in (torch.float32, torch.float16 if device == "cpu" else torch.bfloat16):
        logits = (torch.randn(8, vocab, generator=g) * 4).to(dtype).to(device)
        params = [t.to(device) for t in (temps, top_ks, top_ps, min_ps)]
        out = top_k_top_p_min_p_probs(logits, *params, chunk=chunk, num_pivots=pivots)
        _check_filtered(out, ref.top_k_top_p_min_p_probs_ref(logits, *params), logits, params[0])
    # Searches skipped on the host (no row uses them): min-p only, and no filter at all; a
    # grammar-masked row with a whole chunk at -inf.
    logits = (torch.randn(3, vocab, generator=g) * 4).to(device)
    logits[1, : chunk + 7] = float("-inf")
    logits[2, torch.randperm(vocab, generator=g)[: vocab - 5].to(device)] = float("-inf")
    params = [t.to(device) for t in (torch.tensor([1.0, 0.8, 1.2]), torch.zeros(3, dtype=torch.int64),
                                      torch.ones(3), torch.tensor([0.1, 0.0, 0.3]))]
    for need_top_k, need_top_p in ((False, False), (True, False), (False, True)):
        out = top_k_top_p_min_p_probs(
            logits, *params, need_top_k=need_top_k, need_top_p=need_top_p, chunk=chunk, num_pivots=pivots
        )
        _check_filtered(out, ref.top_k_top_p_min_p_probs_ref(logits, *params), logits, params[0])


@pytest.mark.parametrize("device", DEVICES)
def test_dispatch_chooses_triton_where_it_runs(device: str) -> None:
    from lmserver.kernels import select_kernels

    ops = select_kernels(device, interpret=INTERPRET)
    assert ops.backend == "triton", ops.reason
    x = torch.randn(3, 64, generator=_gen(7)).to(device)
    w = torch.rand(64, generator=_gen(8)).to(device) + 0.5
    _close(ops.rmsnorm(x, w, 1e-5), ref.rmsnorm_ref(x, w, 1e-5))


@pytest.mark.gpu
def test_decode_attention_replays_in_cuda_graph() -> None:
    from lmserver.kernels.decode_attention import decode_attention

    g = _gen(9)
    batch = random_paged_batch([300, 4000, 17, 900], [1] * 4, 32, 8, 128, torch.bfloat16, "cuda", g)
    seq_lens = batch.seq_lens.clone()
    out = torch.empty_like(batch.q)
    part_out = torch.empty(4, 32, 8, 128, dtype=torch.float32, device="cuda")
    part_lse = torch.empty(4, 32, 8, dtype=torch.float32, device="cuda")

    def run() -> None:
        decode_attention(batch.q, batch.k_cache, batch.v_cache, batch.req_to_token, batch.req_pool_indices,
                         seq_lens, 128**-0.5, out=out, num_kv_splits=8, partial_out=part_out, partial_lse=part_lse)

    run()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for new_lens in ([300, 4000, 17, 900], [1, 2, 3000, 64]):
        seq_lens.copy_(torch.tensor(new_lens, device="cuda"))
        out.fill_(float("nan"))
        graph.replay()
        expected = ref.decode_attention_ref(batch.q, batch.k_cache, batch.v_cache, batch.req_to_token,
                                            batch.req_pool_indices, seq_lens, 128**-0.5)
        assert rel_error(out, expected) < 1.6e-2


@pytest.mark.gpu
def test_sampling_filter_replays_in_cuda_graph() -> None:
    from lmserver.kernels.sampling import top_k_top_p_min_p_probs

    g = _gen(10)
    logits = torch.randn(4, 32000, generator=g).cuda() * 3
    params = [t.cuda() for t in (torch.tensor([1.0, 0.8, 1.1, 0.6]), torch.tensor([0, 20, 100, 5]),
                                 torch.tensor([0.9, 1.0, 0.5, 0.99]), torch.tensor([0.0, 0.05, 0.0, 0.0]))]
    out = torch.empty_like(logits)
    top_k_top_p_min_p_probs(logits, *params, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        top_k_top_p_min_p_probs(logits, *params, out=out)
    for _ in range(2):
        logits.copy_(torch.randn(4, 32000, generator=g).cuda() * 3)
        out.fill_(float("nan"))
        graph.replay()
        _check_filtered(out, ref.top_k_top_p_min_p_probs_ref(logits, *params), logits, params[0])


@pytest.mark.parametrize("device", DEVICES)
def test_attention_kernels_on_random_shapes(device: str) -> None:
    """Property: any GQA group size, head_dim, prefix and chunk lengths (incl. exact multiples
    of the tile sizes) match the references."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from lmserver.kernels.decode_attention import decode_attention
    from lmserver.kernels.extend_attention import extend_attention

    block = 16 if device == "cpu" else 64
    lengths = st.one_of(st.integers(0, 3 * block), st.sampled_from([block - 1, block, block + 1, 2 * block]))

    @settings(max_examples=4 if device == "cpu" else 25, deadline=None, derandomize=True)
    @given(
        kv_heads=st.integers(1, 3), group=st.integers(1, 7), head_dim=st.sampled_from([16, 32, 48, 64, 96, 128]),
        prefix=st.lists(lengths, min_size=1, max_size=3), new=st.lists(lengths, min_size=3, max_size=3),
        seed=st.integers(0, 2**31 - 1), splits=st.integers(1, 5),
    )
    def check(kv_heads: int, group: int, head_dim: int, prefix: list[int], new: list[int], seed: int, splits: int) -> None:
        new = [max(1, n) for n in new[: len(prefix)]]
        dtype = torch.float32 if device == "cpu" else torch.bfloat16
        batch = random_paged_batch(prefix, new, kv_heads * group, kv_heads, head_dim, dtype, device, _gen(seed))
        scale = head_dim**-0.5
        args = (batch.q, batch.k_extend, batch.v_extend, batch.k_cache, batch.v_cache, batch.req_to_token,
                batch.req_pool_indices, batch.prefix_lens, batch.extend_lens, batch.extend_start_loc, scale)
        kwargs = {"block_m": block, "block_n": block} if device == "cpu" else {}
        out = extend_attention(*args, max(new), **kwargs)
        assert rel_error(out, ref.extend_attention_ref(*args)) < _tol(dtype)
        # Decode over the same rows: the last new token of each request as the query.
        last = batch.extend_start_loc + batch.extend_lens - 1
        q = batch.q[last].contiguous()
        for b in range(len(prefix)):  # the decode kernel reads every token from the cache
            row, start = int(batch.req_pool_indices[b]), int(batch.extend_start_loc[b])
            slots = batch.req_to_token[row, prefix[b] : prefix[b] + new[b]].long()
            batch.k_cache[slots] = batch.k_extend[start : start + new[b]]
            batch.v_cache[slots] = batch.v_extend[start : start + new[b]]
        seq_lens = batch.seq_lens
        want = ref.decode_attention_ref(q, batch.k_cache, batch.v_cache, batch.req_to_token, batch.req_pool_indices,
                                        seq_lens, scale)
        got = decode_attention(q, batch.k_cache, batch.v_cache, batch.req_to_token, batch.req_pool_indices, seq_lens,
                               scale, num_kv_splits=splits, block_n=block)
        assert rel_error(got, want) < _tol(dtype)
        # And the decode equals the extend output of each request's last token.
        assert rel_error(got, out[last]) < _tol(dtype)

    check()


@pytest.mark.parametrize("device", DEVICES)
def test_sampling_filter_on_random_parameters(device: str) -> None:
    """Property: vocab sizes around the chunk size, any mix of filters per row, grammar-masked
    logits; the kernel keeps the reference's set (plus exact ties) and renormalizes."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from lmserver.kernels.sampling import top_k_top_p_min_p_probs

    chunk = 256 if device == "cpu" else 4096
    row = st.tuples(st.floats(0.3, 2.0), st.integers(-1, 300), st.sampled_from([1.0, 0.99, 0.9, 0.5, 0.05]),
                    st.sampled_from([0.0, 0.0, 0.01, 0.2]), st.booleans())

    @settings(max_examples=5 if device == "cpu" else 25, deadline=None, derandomize=True)
    @given(vocab=st.sampled_from([1, 7, chunk - 1, chunk, chunk + 1, 3 * chunk - 5]),
           rows=st.lists(row, min_size=1, max_size=4), seed=st.integers(0, 2**31 - 1),
           need_top_k=st.booleans(), need_top_p=st.booleans())
    def check(vocab: int, rows: list[tuple[float, int, float, float, bool]], seed: int, need_top_k: bool,
              need_top_p: bool) -> None:
        g = _gen(seed)
        logits = torch.randn(len(rows), vocab, generator=g) * 3
        for i, (*_, masked) in enumerate(rows):
            if masked and vocab > 1:  # a grammar mask leaving at least one token
                keep = torch.rand(vocab, generator=g) < 0.3
                keep[torch.randint(0, vocab, (1,), generator=g)] = True
                logits[i, ~keep] = float("-inf")
        temps, ks, ps, mps = (torch.tensor([r[j] for r in rows]) for j in range(4))
        # a filter the host says is unused must be unused by every row
        ks = ks if need_top_k else torch.zeros_like(ks)
        ps = ps if need_top_p else torch.ones_like(ps)
        params = [t.to(device) for t in (temps.float(), ks, ps.float(), mps.float())]
        logits = logits.to(device)
        out = top_k_top_p_min_p_probs(logits, *params, need_top_k=need_top_k, need_top_p=need_top_p, chunk=chunk)
        _check_filtered(out, ref.top_k_top_p_min_p_probs_ref(logits, *params), logits, params[0])

    check()


@pytest.mark.parametrize("device", DEVICES)
def test_argmax_rows_matches_torch_with_ties(device: str) -> None:
    """The two-launch greedy argmax against `torch.argmax`: random rows, planted ties of the maximum
    (the first index must win, also across chunks), rows of -inf, half precision."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from lmserver.kernels.graph_step import ARGMAX_CHUNK, argmax_rows

    vocabs = [1, 5, ARGMAX_CHUNK - 1, ARGMAX_CHUNK, ARGMAX_CHUNK + 1, 3 * ARGMAX_CHUNK + 17]
    if device == "cuda":
        vocabs += [49152, 128256]

    @settings(max_examples=12 if device == "cpu" else 40, deadline=None, derandomize=True)
    @given(vocab=st.sampled_from(vocabs), rows=st.integers(1, 3), ties=st.integers(0, 4),
           dtype=st.sampled_from([torch.float32, torch.float16]), seed=st.integers(0, 2**31 - 1))
    def check(vocab: int, rows: int, ties: int, dtype: torch.dtype, seed: int) -> None:
        g = _gen(seed)
        logits = torch.randn(rows, vocab, generator=g)
        for r in range(rows):
            top = logits[r].max()
            logits[r, torch.randint(0, vocab, (ties,), generator=g)] = top  # planted ties of the max
        if rows > 1:
            logits[1] = float("-inf")  # every entry equal: index 0
        logits = logits.to(dtype).to(device)
        out = torch.full((rows,), -7, dtype=torch.int64, device=device)
        assert argmax_rows(logits, out=out) is out
        assert out.tolist() == logits.argmax(dim=-1).tolist()

    check()


@pytest.mark.parametrize("device", DEVICES)
def test_write_decode_inputs_matches_reference(device: str) -> None:
    """Lengths and the new KV slot of every real row land where a loop over the rows puts them;
    padding rows (the padding slot) write nothing, also into a table row a real request uses;
    input ids marked -(j + 1) become the previous step's argmax j."""
    from lmserver.kernels.graph_step import write_decode_inputs, write_decode_inputs_ref

    g = _gen(5)
    pad_slot = 0
    for n, real in ((1, 1), (4, 3), (8, 1), (16, 11), (37, 30)):
        table = torch.randint(1, 1000, (40, 64), generator=g, dtype=torch.int32)
        rows = torch.randperm(40, generator=g)[:n]
        ints = torch.stack([
            torch.randint(0, 50000, (n,), generator=g),  # input ids (not read)
            torch.randint(0, 64, (n,), generator=g),  # positions
            torch.randint(1, 10**6, (n,), generator=g),  # new KV slots (never the padding slot)
            rows,
            torch.randint(1, 64, (n,), generator=g),  # lengths
        ])
        ints[1:, real:] = torch.tensor([0, pad_slot, 0, 1])[:, None]  # padding rows: position 0 of row 0
        prev_ids = torch.randint(0, 50000, (n + 2,), generator=g)
        chained = torch.rand(n, generator=g) < 0.5  # these rows read the previous step's argmax
        src = torch.randint(0, n + 2, (n,), generator=g)
        ints[0, chained] = -(src[chained] + 1)
        ints = torch.cat([ints, torch.full((5, 3), -1)], dim=1)  # buffer wider than the batch
        expected_table = table.clone()  # oracle: a loop over the real rows
        for i in range(real):
            expected_table[ints[3, i], ints[1, i]] = int(ints[2, i])
        expected_lens = ints[4, :n].to(torch.int32)
        expected_ids = torch.where(chained, prev_ids[src], ints[0, :n])
        ref_ints, ref_table, ref_lens = ints.clone(), table.clone(), torch.zeros(n, dtype=torch.int32)
        write_decode_inputs_ref(ref_ints, ref_lens, ref_table, pad_slot, prev_ids)
        got_ints, got_table = ints.to(device), table.to(device)
        got_lens = torch.full((n,), -1, dtype=torch.int32, device=device)
        write_decode_inputs(got_ints, got_lens, got_table, pad_slot, prev_ids.to(device))
        for ids, lens, tab in ((ref_ints, ref_lens, ref_table), (got_ints.cpu(), got_lens.cpu(), got_table.cpu())):
            assert torch.equal(lens, expected_lens)
            assert torch.equal(tab, expected_table)
            assert torch.equal(ids[0, :n], expected_ids)
            assert torch.equal(ids[1:], ints[1:]) and torch.equal(ids[0, n:], ints[0, n:])
