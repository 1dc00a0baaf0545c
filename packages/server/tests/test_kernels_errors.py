"""The kernel wrappers reject bad inputs with KernelInputError before any launch (no GPU or
interpreter needed: validation runs first)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from lmserver.kernels import KernelInputError  # noqa: E402


def test_attention_shape_errors_name_the_expected_layout() -> None:
    from lmserver.kernels.decode_attention import decode_attention
    from lmserver.kernels.extend_attention import extend_attention

    q = torch.randn(2, 9, 64)
    k_cache = torch.randn(10, 3, 64)
    table = torch.zeros(2, 8, dtype=torch.int32)
    idx, lens = torch.arange(2), torch.tensor([3, 4])
    with pytest.raises(KernelInputError, match="num_kv_heads"):
        decode_attention(q, torch.randn(10, 4, 64), torch.randn(10, 4, 64), table, idx, lens, 0.1)
    with pytest.raises(KernelInputError, match="head_dim"):
        decode_attention(torch.randn(2, 9, 32), k_cache, k_cache, table, idx, lens, 0.1)
    with pytest.raises(KernelInputError, match="contiguous"):
        decode_attention(torch.randn(2, 64, 9).transpose(1, 2), k_cache, k_cache, table, idx, lens, 0.1)
    with pytest.raises(KernelInputError, match="partial_out"):
        decode_attention(q, k_cache, k_cache, table, idx, lens, 0.1, num_kv_splits=4,
                         partial_out=torch.empty(2, 9, 2, 64), partial_lse=torch.empty(2, 9, 2))
    with pytest.raises(KernelInputError, match="out must"):
        decode_attention(q, k_cache, k_cache, table, idx, lens, 0.1, out=torch.empty(2, 9, 32))
    with pytest.raises(ValueError, match="num_kv_splits"):
        decode_attention(q, k_cache, k_cache, table, idx, lens, 0.1, num_kv_splits=0)
    with pytest.raises(KernelInputError, match="k_extend"):
        extend_attention(q, torch.randn(3, 3, 64), torch.randn(3, 3, 64), k_cache, k_cache, table, idx, lens, lens,
                         lens, 0.1, 4)
    with pytest.raises(KernelInputError, match="multiple of block_n"):
        extend_attention(q, torch.randn(2, 3, 64), torch.randn(2, 3, 64), k_cache, k_cache, table, idx, lens, lens,
                         lens, 0.1, 4, block_m=48, block_n=32)


def test_elementwise_shape_and_dtype_errors() -> None:
    from lmserver.kernels.activation import silu_and_mul
    from lmserver.kernels.bitmask import apply_token_bitmask_inplace
    from lmserver.kernels.kv_store import store_kv
    from lmserver.kernels.norm import fused_add_rmsnorm, rmsnorm
    from lmserver.kernels.rope import apply_rope_inplace
    from lmserver.kernels.sampling import top_k_top_p_min_p_probs

    x = torch.randn(3, 8)
    with pytest.raises(KernelInputError, match="weight"):
        rmsnorm(x, torch.ones(7), 1e-5)
    with pytest.raises(KernelInputError, match="residual"):
        fused_add_rmsnorm(x, torch.randn(3, 8, dtype=torch.float64), torch.ones(8), 1e-5)
    with pytest.raises(KernelInputError, match="2 \\* d"):
        silu_and_mul(torch.randn(3, 7))
    with pytest.raises(KernelInputError, match="rotary_dim"):
        apply_rope_inplace(torch.arange(3), torch.randn(3, 2, 8), torch.randn(3, 1, 8), torch.randn(10, 10))
    with pytest.raises(KernelInputError, match="loc"):
        store_kv(torch.randn(3, 2, 4), torch.randn(3, 2, 4), torch.randn(9, 2, 4), torch.randn(9, 2, 4), torch.arange(2))
    with pytest.raises(KernelInputError, match="int32"):
        apply_token_bitmask_inplace(torch.randn(2, 64), torch.zeros(2, 2, dtype=torch.int64))
    params = (torch.ones(2), torch.zeros(2, dtype=torch.int64), torch.ones(2), torch.zeros(2))
    with pytest.raises(KernelInputError, match="top_ps"):
        top_k_top_p_min_p_probs(torch.randn(2, 50), params[0], params[1], torch.ones(3), params[3])
    with pytest.raises(KernelInputError, match="num_pivots"):
        top_k_top_p_min_p_probs(torch.randn(2, 50), *params, num_pivots=12)
