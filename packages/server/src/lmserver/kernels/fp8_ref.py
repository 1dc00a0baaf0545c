"""FP8 (e4m3) in torch: quantize, dequantize, the dequantizing linear. The oracle of
`fp8_gemv` and of the FP8 KV cache, and the CPU path of the engine.

Weight layout shared by every FP8 path of lmserver (`lmserver.layers.fp8_linear.Fp8Linear`):
`weight` (N, K) float8_e4m3fn and `weight_scale` (N, ceil(K / group_k)) float32, so that
`W[n, k] = weight[n, k] * weight_scale[n, k // group_k]`. Per-channel scales are group_k = K
(one column); a per-tensor scale is the same value in every row; 128 x 128 block scales (DeepSeek,
Qwen3-FP8) become one value per (row, 128-column block), repeated over the block's 128 rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "dequantize_fp8",
    "expand_block_scale",
    "fp8_linear_ref",
    "hadamard",
    "quantize_fp8",
    "quantize_fp8_per_token",
    "quantize_kv_fp8",
    "rotate_heads",
]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
_MIN_SCALE = 1e-12  # an all-zero row gets this scale (any positive value dequantizes zeros to 0)


def num_groups(k: int, group_k: int) -> int:
    return -(-k // group_k)


def quantize_fp8(w: torch.Tensor, group_k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K) -> (weight (N, K) float8_e4m3fn, weight_scale (N, ceil(K / group_k)) float32),
    one scale per row and group of `group_k` columns (None: per channel, group_k = K), each the
    group's absolute maximum / 448. Pure."""
    n, k = w.shape
    g = k if group_k is None else group_k
    groups = num_groups(k, g)
    wf = w.float()
    if groups * g != k:
        wf = F.pad(wf, (0, groups * g - k))
    blocks = wf.view(n, groups, g)
    scale = (blocks.abs().amax(dim=-1) / FP8_MAX).clamp_min(_MIN_SCALE)  # (N, groups)
    q = (blocks / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(n, groups * g)[:, :k]
    return q.contiguous(), scale


def dequantize_fp8(weight: torch.Tensor, weight_scale: torch.Tensor, group_k: int,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(N, K) `dtype` values of an FP8 weight in the shared layout (module docstring). Pure."""
    k = weight.shape[1]
    scale = weight_scale.repeat_interleave(group_k, dim=1)[:, :k] if weight_scale.shape[1] > 1 else weight_scale
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    return (weight.to(compute) * scale.to(compute)).to(dtype)


def expand_block_scale(scale: torch.Tensor, rows: int, block_n: int) -> torch.Tensor:
    """A (ceil(N / block_n), groups) block scale -> (rows, groups): each block row repeated over
    its `block_n` weight rows, the last block cut at `rows`. Pure."""
    return scale.float().repeat_interleave(block_n, dim=0)[:rows].contiguous()


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, group_k: int,
                   bias: torch.Tensor | None = None, compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x (..., K) @ dequantized(weight).T (+ bias) -> (..., N) in x's dtype, computed in
    `compute_dtype` (default: x's dtype; float64 for a test oracle). Pure."""
    dtype = compute_dtype or x.dtype
    w = dequantize_fp8(weight, weight_scale, group_k, dtype)
    out = F.linear(x.to(dtype), w, None if bias is None else bias.to(dtype))
    return out.to(x.dtype)


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> (float8_e4m3fn (M, K), float32 scale (M, 1)): one dynamic scale per row
    (the activations of `torch._scaled_mm` prefill), amax / 448 correctly rounded. Pure."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    # NOTE: divided by a tensor on x's device, not the Python float: CUDA torch computes `tensor / python_scalar` as
    # tensor * fl(1 / scalar) (one ulp off the quotient for some values), the CPU divides; this is a division on both
    scale = (amax / amax.new_tensor(FP8_MAX)).clamp_min(_MIN_SCALE)
    # x times the scale's reciprocal (both IEEE-rounded on every device), as the kernels quantize (`fp8_quant`)
    return (x.float() * scale.reciprocal()).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_kv_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """K or V values -> float8_e4m3fn of x * (1 / scale) (the reciprocal rounded to float32, one multiply per
    value: what the kernels compute, lowlat's too), saturated at +-448 (a KV-cache write). Pure."""
    y = x.float() if scale == 1.0 else x.float() * (1.0 / scale)
    return y.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def hadamard(n: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """(n, n) orthonormal, symmetric Hadamard-type matrix (its own inverse): Sylvester's normalized
    Hadamard matrix of the largest power-of-two block dividing n, repeated on the diagonal (n = 64, 128:
    one block). The FP8 KV cache stores K in this basis (`KVPool.k_rotation`). Built in float64. Pure."""
    if n < 1:
        raise ValueError(f"hadamard needs n >= 1, got {n}")
    block = n & -n  # the largest power of two dividing n
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < block:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    h = h / block**0.5
    full = h if block == n else torch.block_diag(*[h] * (n // block))
    return full.to(dtype=dtype, device=device)


def rotate_heads(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """x (..., D) @ rotation (D, D), in x's dtype (what an attention layer does to q and k when the KV
    cache stores K rotated: q . k is unchanged for an orthogonal rotation). Pure."""
    return torch.matmul(x, rotation.to(x.dtype))
