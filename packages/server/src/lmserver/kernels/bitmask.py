"""Triton apply of a cfsm token bitmask to logits, in place.

The bitmask is (bs, ceil(vocab / 32)) int32: bit i of word w allows token 32 * w + i; a
disallowed token's logit becomes -inf. Rows past the mask's width (a vocab padded beyond the
tokenizer) are disallowed. Reference: `reference.apply_token_bitmask_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmserver.kernels._util import KernelInputError, check_last_dim_contiguous

__all__ = ["apply_token_bitmask_inplace"]


@triton.jit
def _bitmask_kernel(logits_ptr, bitmask_ptr, stride_l, stride_b, vocab, num_words, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = offs < vocab
    word_idx = offs // 32
    words = tl.load(bitmask_ptr + row * stride_b + word_idx, mask=in_vocab & (word_idx < num_words), other=0)
    allowed = ((words >> (offs % 32)) & 1) != 0
    tl.store(logits_ptr + row * stride_l + offs, float("-inf"), mask=in_vocab & ~allowed)


def apply_token_bitmask_inplace(logits: torch.Tensor, bitmask: torch.Tensor, block: int = 4096) -> None:
    """Set disallowed logits to -inf. logits (bs, vocab) float; bitmask (bs, ceil(vocab / 32))
    int32 on the same device. Mutates logits."""
    if logits.dim() != 2 or bitmask.dim() != 2 or bitmask.shape[0] != logits.shape[0]:
        raise KernelInputError(f"expected logits (bs, vocab) and bitmask (bs, words); got {tuple(logits.shape)}, {tuple(bitmask.shape)}")
    if bitmask.dtype != torch.int32:
        raise KernelInputError(f"bitmask must be int32, got {bitmask.dtype}")
    if bitmask.device != logits.device:
        raise KernelInputError(f"bitmask is on {bitmask.device} but logits on {logits.device}; move it first")
    check_last_dim_contiguous(logits=logits, bitmask=bitmask)
    bs, vocab = logits.shape
    if bs:
        _bitmask_kernel[(bs, triton.cdiv(vocab, block))](
            logits, bitmask, logits.stride(0), bitmask.stride(0), vocab, bitmask.shape[1], BLOCK=block, num_warps=8
        )
