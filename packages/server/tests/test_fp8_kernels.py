"""FP8 Triton kernels against the dequantized float64 references, on fresh random inputs.

CUDA cases are `gpu`-marked (model-like shapes, bf16 activations); the CPU cases run only in the
TRITON_INTERPRET=1 child that test_fp8.py starts (tiny shapes, float32 activations).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from lmserver.kernels import reference as ref
from lmserver.kernels.fp8_ref import FP8_DTYPE, fp8_linear_ref, quantize_fp8, quantize_kv_fp8
from lmserver.kernels.testing import kernel_devices, random_paged_batch, rel_error

pytest.importorskip("triton")

DEVICES = kernel_devices()


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _act_dtype(device: str) -> torch.dtype:
    return torch.float32 if device == "cpu" else torch.bfloat16


# (M, N, K, group_k): decode rows 1 / 3 / 8 and a 17-row tail tile; per channel (None) and K groups
GEMV_CASES = [(1, 40, 96, None), (3, 33, 256, 128), (17, 20, 200, 64), (1, 16, 130, 128)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", GEMV_CASES, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("variant", ["rows", "dot", "auto"])
def test_fp8_gemv_matches_dequantized_reference(device: str, case: tuple[int, int, int, int | None],
                                                variant: str) -> None:
    from lmserver.kernels.fp8_gemv import Fp8GemvConfig, fp8_gemv

    # rows: 4-feature programs over 64-column tiles (several K steps, a masked tail); past ROWS_MAX_M
    # rows the wrapper takes the dot kernel. auto: the tuned / default choice
    config = {"rows": Fp8GemvConfig("rows", 4, 64, 4, 1), "dot": Fp8GemvConfig("dot", 16, 64, 4, 2),
              "auto": None}[variant]

    m, n, k, group = case
    if device == "cuda":
        m, n, k = m, n * 64, k * 16
    g = _gen(sum(case[:3]))
    dtype = _act_dtype(device)
    w = torch.randn(n, k, generator=g)
    weight, scale = quantize_fp8(w, group)
    group_k = k if group is None else group
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    weight, scale, x, bias = weight.to(device), scale.to(device), x.to(device), bias.to(device)
    expected = fp8_linear_ref(x, weight, scale, group_k, bias, compute_dtype=torch.float64)
    out = fp8_gemv(x, weight, scale, group_k, bias, config=config)
    assert out.dtype == dtype and out.shape == (m, n)
    assert rel_error(out, expected) < (1e-5 if dtype == torch.float32 else 8e-3)
    # strided rows (a view of a wider buffer, as the MLP's down projection reads)
    wide = torch.zeros(m, 2 * k, dtype=dtype, device=device)
    wide[:, :k] = x
    assert rel_error(fp8_gemv(wide[:, :k], weight, scale, group_k, bias, config=config), expected) < (
        1e-5 if dtype == torch.float32 else 8e-3)


def _same_bytes(q: torch.Tensor, q_ref: torch.Tensor, device: str, min_share: float = 0.97) -> None:
    """FP8 tensors equal byte for byte on CUDA; under the interpreter, all but a few bytes."""
    same = q.view(torch.uint8) == q_ref.view(torch.uint8)
    if device == "cuda":
        assert bool(same.all()), f"{int((~same).sum())} of {same.numel()} bytes differ"
    else:
        # NOTE: Triton's interpreter narrows to e4m3 without carrying a rounded-up mantissa into the exponent
        # (124 -> 64, not 128): a few values differ there
        assert float(same.double().mean()) > min_share


def _graded_rows(rows: int, k: int, device: str, seed: int, peaks: tuple[int, ...] = (-1,)) -> torch.Tensor:
    """(rows, k) random rows of magnitudes 1e-3 to 1e2; row 1 all zero (the smallest scale, zeros out); the
    last row's largest values in columns `peaks` (the masked tail step of a two-pass launch)."""
    x = torch.randn(rows, k, generator=_gen(seed)) * torch.logspace(-3, 2, rows)[:, None]
    x[1] = 0.0
    x[-1, list(peaks)] = 4 * x[-1].abs().max()
    return x.to(_act_dtype(device)).to(device)


def _launches(device: str, k: int) -> list:
    """The chosen launch, a two-pass one (steps of a quarter row or less, a masked tail) and the old one-pass one."""
    from lmserver.kernels._util import next_pow2
    from lmserver.kernels.fp8_quant import QuantLaunch

    small = QuantLaunch(64, 1) if device == "cpu" else QuantLaunch(2048, 4)
    return [None, small, QuantLaunch(next_pow2(k), max(1, min(16, next_pow2(k) // 512)))]


@pytest.mark.parametrize("device", DEVICES)
def test_per_token_quantizer_matches_reference(device: str) -> None:
    from lmserver.kernels.fp8_quant import quantize_fp8_per_token
    from lmserver.kernels.fp8_ref import quantize_fp8_per_token as reference

    rows, k = (5, 200) if device == "cpu" else (300, 14336)
    x = _graded_rows(rows, k, device, 9)
    q_ref, scale_ref = reference(x)
    first = quantize_fp8_per_token(x)[0]
    for launch in _launches(device, k):
        q, scale = quantize_fp8_per_token(x, launch)
        assert q.dtype == FP8_DTYPE and scale.shape == (rows, 1)
        # NOTE: exact on both: the reference divides amax by 448 (a device tensor, not a Python float: CUDA torch
        # turns `tensor / python_scalar` into a product with the rounded reciprocal, one ulp off the quotient for some
        # rows, which failed this test on the H200 until 2026-12-02)
        assert torch.equal(scale, scale_ref), launch
        _same_bytes(q, q_ref, device)
        # one or two passes, any step: the same bytes
        assert torch.equal(q.view(torch.uint8), first.view(torch.uint8)), launch


def _assert_near_reference(q: torch.Tensor, scale: torch.Tensor, act: torch.Tensor, device: str) -> None:
    """A fused kernel's FP8 rows against torch's activation `act`: the Triton norm and SiLU round like torch up to
    test_kernels_triton's tolerance (exp, rsqrt and sums may differ in their last float32 bit, which can flip one
    rounding to the activation dtype), so the scales agree within it, and each value within one e4m3 rounding (half
    a step: 2^-4 of the value, 2^-10 of the scale below the normal range) plus twice it (all on CUDA; under the
    interpreter, whose e4m3 narrowing drops a carry, most)."""
    from lmserver.kernels.fp8_ref import quantize_fp8_per_token as reference

    scale_ref = reference(act)[1]
    tol = 1e-5 if act.dtype == torch.float32 else 2.5 * torch.finfo(act.dtype).eps
    assert float(((scale - scale_ref).abs() / scale_ref).max()) <= tol
    deq, exact = q.double() * scale.double(), act.double()
    within = (deq - exact).abs() <= exact.abs() * (2.0**-4 + 2 * tol) + scale.double() * 2.0**-9
    share = float(within.double().mean())
    assert share == 1.0 if device == "cuda" else share > 0.95, share


# (rows, d): non-powers of two, one step or several; on CUDA the Llama-3-8B down_proj input and a tail
SILU_FP8_CASES = {"cpu": [(5, 200), (3, 1000), (2, 64)], "cuda": [(300, 14336), (37, 1000)]}


@pytest.mark.parametrize("device", DEVICES)
def test_silu_and_mul_quantizer_matches_reference(device: str) -> None:
    from lmserver.kernels.activation import silu_and_mul
    from lmserver.kernels.fp8_quant import quantize_fp8_per_token, silu_and_mul_quantize_fp8
    from lmserver.kernels.fp8_ref import quantize_fp8_per_token as reference

    for rows, d in SILU_FP8_CASES[device]:
        gate_up = _graded_rows(rows, 2 * d, device, rows + d, peaks=(d - 1, -1))  # gate and up of one column
        # the two-launch path it replaces: the same bytes and scales (same SiLU rounding, same quantizer)
        q_two, scale_two = quantize_fp8_per_token(silu_and_mul(gate_up))
        act = ref.silu_and_mul_ref(gate_up)
        for launch in _launches(device, d):
            q, scale = silu_and_mul_quantize_fp8(gate_up, launch)
            assert q.dtype == FP8_DTYPE and q.shape == (rows, d) and scale.shape == (rows, 1)
            assert torch.equal(scale, scale_two) and torch.equal(q.view(torch.uint8), q_two.view(torch.uint8))
            _assert_near_reference(q, scale, act, device)
            assert not q[1].float().any()  # the zero row
            if act.dtype == torch.float32:
                _same_bytes(q, reference(act)[0], device, 0.95)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_residual", [False, True], ids=["norm", "add_norm"])
def test_rmsnorm_quantizer_matches_reference(device: str, with_residual: bool) -> None:
    from lmserver.kernels.fp8_quant import quantize_fp8_per_token, rmsnorm_quantize_fp8
    from lmserver.kernels.norm import fused_add_rmsnorm, rmsnorm

    for rows, hidden in ([(5, 200), (3, 64)] if device == "cpu" else [(300, 4096), (37, 1000)]):
        x = _graded_rows(rows, hidden, device, rows + hidden)
        residual = _graded_rows(rows, hidden, device, rows + hidden + 1).flip(0).contiguous() if with_residual else None
        weight = (torch.rand(hidden, generator=_gen(hidden)) + 0.5).to(x.dtype).to(device)
        x_before = x.clone()
        # the two-launch path it replaces (the norm kernel's output, then the quantizer) and the torch reference
        if residual is None:
            q_two, scale_two = quantize_fp8_per_token(rmsnorm(x, weight, 1e-6))
            normed, summed = ref.rmsnorm_ref(x, weight, 1e-6), None
        else:
            normed, summed = ref.fused_add_rmsnorm_ref(x, residual, weight, 1e-6)
            out, res_two = x.clone(), residual.clone()
            fused_add_rmsnorm(out, res_two, weight, 1e-6)
            q_two, scale_two = quantize_fp8_per_token(out)
        q, scale = rmsnorm_quantize_fp8(x, weight, 1e-6, residual)
        assert q.dtype == FP8_DTYPE and q.shape == (rows, hidden) and scale.shape == (rows, 1)
        assert torch.equal(x, x_before)
        if residual is not None:
            assert torch.equal(residual, res_two) and torch.equal(residual, summed)
        assert torch.equal(scale, scale_two) and torch.equal(q.view(torch.uint8), q_two.view(torch.uint8))
        _assert_near_reference(q, scale, normed, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_fp8_linear_takes_fused_fp8_rows(device: str, bias: bool) -> None:
    """`Fp8Linear` fed the fused quantizer's rows (`forward_fp8_rows`, the MLP's prefill path) gives what it gives
    fed silu_and_mul's output (quantized inside `forward`), both through `_scaled_mm` (torch's CPU one under the
    interpreter); the product against the float64 linear of the dequantized rows and weights."""
    from torch import nn

    from lmserver.kernels.activation import silu_and_mul
    from lmserver.kernels.fp8_quant import silu_and_mul_quantize_fp8
    from lmserver.layers.fp8_linear import GEMV_MAX_M, Fp8Linear

    d, n = (96, 48) if device == "cpu" else (14336, 4096)
    g = _gen(21)
    dtype = _act_dtype(device)
    dense = nn.Linear(d, n, bias=bias, dtype=dtype)
    with torch.no_grad():
        dense.weight.copy_(torch.randn(n, d, generator=g) * 0.05)
        if bias:
            dense.bias.copy_(torch.randn(n, generator=g))
    layer = Fp8Linear.from_linear(dense.to(device))
    layer.use_path("triton", scaled_mm=True if device == "cpu" else None)
    assert layer.scaled_mm and not layer.takes_fp8_rows(GEMV_MAX_M) and layer.takes_fp8_rows(GEMV_MAX_M + 1)
    for m in (GEMV_MAX_M + 1, 40):
        gate_up = (torch.randn(m, 2 * d, generator=g) * 2).to(dtype).to(device)
        xq, xs = silu_and_mul_quantize_fp8(gate_up)
        out = layer.forward_fp8_rows(xq, xs, out_dtype=dtype)
        assert out.dtype == dtype and out.shape == (m, n)
        assert torch.equal(out, layer(silu_and_mul(gate_up)))
        expected = fp8_linear_ref(xq.double() * xs.double(), layer.weight, layer.weight_scale, layer.group_k,
                                  layer.bias)
        assert rel_error(out, expected) < (1e-5 if dtype == torch.float32 else 8e-3), m
        if device == "cuda":  # against the unquantized activation: the per-token FP8 error
            act = ref.silu_and_mul_ref(gate_up)
            expected = fp8_linear_ref(act, layer.weight, layer.weight_scale, layer.group_k, layer.bias,
                                      compute_dtype=torch.float64)
            assert rel_error(out, expected) < 6e-2, m


@pytest.mark.parametrize("device", DEVICES)
def test_store_kv_quantizes_into_fp8_cache(device: str) -> None:
    from lmserver.kernels.kv_store import store_kv

    g = _gen(13)
    k = (torch.randn(6, 3, 64, generator=g) * 40).to(_act_dtype(device)).to(device)  # some beyond 448 * scale
    v = torch.randn(6, 3, 64, generator=g).to(_act_dtype(device)).to(device)
    k_cache = torch.zeros(16, 3, 64, dtype=FP8_DTYPE, device=device)
    v_cache = torch.zeros_like(k_cache)
    loc = torch.tensor([3, 9, 1, 15, 4, 7], device=device)
    store_kv(k, v, k_cache, v_cache, loc, k_scale=0.25, v_scale=0.01)
    for cache, x, scale in ((k_cache, k, 0.25), (v_cache, v, 0.01)):
        got, want = cache[loc].view(torch.uint8), quantize_kv_fp8(x, scale).view(torch.uint8)
        same = got == want
        # NOTE: the interpreter's e4m3 narrowing drops a rounded-up mantissa's carry (see the quantizer test)
        assert bool(same.all()) if device == "cuda" else float(same.double().mean()) > 0.97
        assert float(cache[loc].float().abs().max()) <= 448
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[loc.cpu()] = False
    assert not k_cache[untouched.to(device)].float().any()


@pytest.mark.parametrize("device", DEVICES)
def test_store_kv_gives_back_what_the_fp8_cache_holds(device: str) -> None:
    """k_out / v_out (an extend step's K / V): the stored bytes scaled back, as KVPool.dequantize_k / _v give them,
    from strided k / v rows (views of a wider qkv buffer, as the attention layer passes them)."""
    from lmserver.forward.kv_pool import KVPool
    from lmserver.kernels._util import KernelInputError
    from lmserver.kernels.kv_store import store_kv

    dtype = _act_dtype(device)
    qkv = (torch.randn(7, 4, 2, 64, generator=_gen(17)) * 30).to(dtype).to(device)  # some beyond 448 * scale
    k, v = qkv[:, 1], qkv[:, 3]
    pool = KVPool(16, 1, 2, 64, dtype, device, FP8_DTYPE, k_scales=[0.25], v_scales=[1.0])
    loc = torch.tensor([3, 9, 1, 15, 4, 7, 0], device=device)
    k_out, v_out = torch.full_like(k.contiguous(), float("nan")), torch.full_like(v.contiguous(), float("nan"))
    store_kv(k, v, pool.k_cache[0], pool.v_cache[0], loc, k_scale=0.25, v_scale=1.0, k_out=k_out, v_out=v_out)
    assert torch.equal(k_out, pool.dequantize_k(0, pool.k_cache[0][loc], dtype))
    assert torch.equal(v_out, pool.dequantize_v(0, pool.v_cache[0][loc], dtype))
    with pytest.raises(KernelInputError, match="k_out and v_out"):
        store_kv(k, v, pool.k_cache[0], pool.v_cache[0], loc, k_out=k_out)
    with pytest.raises(KernelInputError, match="in k's dtype"):
        store_kv(k, v, pool.k_cache[0], pool.v_cache[0], loc, k_out=k_out.double(), v_out=v_out.double())


def _fp8_cache(cache: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(the FP8 cache of `cache` at `scale`, its dequantized float64 values)."""
    q = quantize_kv_fp8(cache, scale)
    return q, q.double() * scale


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(9, 3, 64), (4, 4, 32)], ids=lambda s: "x".join(map(str, s)))
def test_decode_attention_reads_fp8_cache(device: str, shape: tuple[int, int, int]) -> None:
    from lmserver.kernels.decode_attention import decode_attention

    heads, kv_heads, dim = shape
    dtype = _act_dtype(device)
    seq_lens = [1, 23, 70] if device == "cpu" else [1, 300, 4096, 64]
    batch = random_paged_batch([s - 1 for s in seq_lens], [1] * len(seq_lens), heads, kv_heads, dim, dtype,
                               device, _gen(5))
    k_scale, v_scale = 0.05, 0.02
    k8, k_ref = _fp8_cache(batch.k_cache * 3, k_scale)
    v8, v_ref = _fp8_cache(batch.v_cache, v_scale)
    assert k8.dtype == FP8_DTYPE
    expected = ref.decode_attention_ref(batch.q, k_ref, v_ref, batch.req_to_token, batch.req_pool_indices,
                                        batch.seq_lens, dim**-0.5)
    for splits in (1, 3):
        out = decode_attention(batch.q, k8, v8, batch.req_to_token, batch.req_pool_indices, batch.seq_lens,
                               dim**-0.5, num_kv_splits=splits, block_n=16 if device == "cpu" else 128,
                               k_scale=k_scale, v_scale=v_scale)
        assert rel_error(out, expected) < (1e-5 if dtype == torch.float32 else 1.6e-2), splits


@pytest.mark.parametrize("device", DEVICES)
def test_extend_attention_reads_fp8_prefix(device: str) -> None:
    from lmserver.kernels.extend_attention import extend_attention

    heads, kv_heads, dim = 6, 2, 32
    dtype = _act_dtype(device)
    prefix, ext = ([0, 20, 7], [5, 9, 18]) if device == "cpu" else ([0, 700, 33], [300, 90, 1000])
    batch = random_paged_batch(prefix, ext, heads, kv_heads, dim, dtype, device, _gen(6))
    k_scale, v_scale = 0.03, 0.5
    k8, k_ref = _fp8_cache(batch.k_cache, k_scale)
    v8, v_ref = _fp8_cache(batch.v_cache, v_scale)
    expected = ref.extend_attention_ref(
        batch.q, batch.k_extend, batch.v_extend, k_ref, v_ref, batch.req_to_token, batch.req_pool_indices,
        batch.prefix_lens, batch.extend_lens, batch.extend_start_loc, dim**-0.5)
    out = extend_attention(
        batch.q, batch.k_extend, batch.v_extend, k8, v8, batch.req_to_token, batch.req_pool_indices,
        batch.prefix_lens, batch.extend_lens, batch.extend_start_loc, dim**-0.5, max(ext),
        k_scale=k_scale, v_scale=v_scale)
    assert rel_error(out, expected) < (1e-5 if dtype == torch.float32 else 1.6e-2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rotate_k", [False, True], ids=["k", "rotated_k"])
def test_triton_backend_with_fp8_pool_matches_torch_native(device: str, rotate_k: bool) -> None:
    from lmserver.runner.attention.testing import compare_backends
    from lmserver.runner.attention.torch_native import TorchNativeBackend
    from lmserver.runner.attention.triton_backend import TritonBackend

    dtype = _act_dtype(device)
    compare_backends(TorchNativeBackend, TritonBackend, device=device, shape=(6, 2, 32), dtype=dtype,
                     num_slots=160, width=64, chunks=[[5, 9, 3], [7, 1, 12]], decode_steps=3,
                     tol=1e-5 if dtype == torch.float32 else 1.6e-2, kv_cache_dtype=FP8_DTYPE, rotate_k=rotate_k)


@pytest.mark.gpu
@pytest.mark.parametrize("group", [None, 128])
def test_fp8_linear_cuda_paths_match_the_dequantized_linear(group: int | None) -> None:
    """Fp8Linear on CUDA: the GEMV up to 16 rows, then `_scaled_mm` (per-channel, Hopper+: per-token
    FP8 activations, a wider tolerance) or dequantize + matmul for a prefill."""
    from torch import nn

    from lmserver.layers.fp8_linear import Fp8Linear

    g = _gen(7)
    dense = nn.Linear(4096, 1024, bias=True, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        dense.weight.copy_(torch.randn(1024, 4096, generator=g).cuda())
    layer = Fp8Linear.from_linear(dense, group)
    layer.use_path("triton")
    for m in (1, 8, 16, 300):
        x = torch.randn(m, 4096, generator=g).cuda().bfloat16()
        expected = fp8_linear_ref(x, layer.weight, layer.weight_scale, layer.group_k, layer.bias,
                                  compute_dtype=torch.float64)
        tol = 6e-2 if m > 16 and layer.scaled_mm else 8e-3
        assert rel_error(layer(x), expected) < tol, (m, layer.scaled_mm)


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_llama_prefill_takes_the_fused_quantizers(tmp_path: Path, device: str) -> None:
    """A tiny Llama with online FP8 weights and the Triton layer kernels: a prefill feeds qkv_proj and gate_up_proj
    from the fused (add +) RMSNorm + FP8 quantizer and down_proj from the fused SiLU-and-mul + FP8 quantizer (all
    through `_scaled_mm`; torch's CPU one under the interpreter); a prompt of at most GEMV_MAX_M tokens takes the
    GEMV on bf16 / float32 rows as before. Logits identical to the two-launch path (the norm or silu_and_mul kernel,
    then the per-token quantizer) the fusions replace, and near the unquantized model's."""
    transformers = pytest.importorskip("transformers")
    from lmserver.kernels.dispatch import select_kernels
    from lmserver.kernels.fp8_quant import quantize_fp8_per_token
    from lmserver.layers.fp8_linear import GEMV_MAX_M
    from lmserver.models.loader import load_model, read_model_config
    from lmserver.models.quantization import fp8_linear_layers
    from lmserver.runner.accuracy import window_logits, window_runner

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=128, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64)).eval()
    hf.save_pretrained(tmp_path / "tiny")
    config = read_model_config(tmp_path / "tiny")
    dtype = _act_dtype(device)
    model = load_model(config, tmp_path / "tiny", dtype=dtype, device=device, max_positions=64, quantization="fp8")
    dense = load_model(config, tmp_path / "tiny", dtype=dtype, device=device, max_positions=64)
    if device == "cpu":
        for layer in fp8_linear_layers(model).values():
            layer.use_path("triton", scaled_mm=True)
    assert all(layer.scaled_mm for layer in fp8_linear_layers(model).values())
    kernels = select_kernels(device, interpret=device == "cpu")
    fused_rows: list[tuple[str, int]] = []

    def fused_act(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        fused_rows.append(("silu", gate_up.shape[0]))
        return kernels.silu_and_mul_fp8(gate_up)

    def fused_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        fused_rows.append(("norm" if residual is None else "add_norm", x.shape[0]))
        return kernels.rmsnorm_fp8(x, weight, eps, residual)

    def two_launches_act(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_fp8_per_token(kernels.silu_and_mul(gate_up))

    def two_launches_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                          residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return quantize_fp8_per_token(kernels.rmsnorm(x, weight, eps))
        kernels.fused_add_rmsnorm(x, residual, weight, eps)  # x is the layer's to overwrite
        return quantize_fp8_per_token(x)

    ids = torch.randint(0, 128, (37,), generator=_gen(3)).tolist()
    logits = {}
    for name, act, norm in (("fused", fused_act, fused_norm), ("two", two_launches_act, two_launches_norm)):
        model.use_kernels(replace(kernels, silu_and_mul_fp8=act, rmsnorm_fp8=norm))
        logits[name] = window_logits(window_runner(model, 64), ids)
    t = len(ids)
    assert fused_rows == [("norm", t), ("add_norm", t), ("silu", t)] + [
        ("add_norm", t), ("add_norm", t), ("silu", t)] * (config.num_hidden_layers - 1)
    assert torch.equal(logits["fused"], logits["two"])
    # FP8 weights and per-token FP8 activations of every projection (0.106 under the interpreter, whose e4m3
    # narrowing adds to it)
    assert rel_error(logits["fused"], window_logits(window_runner(dense, 64), ids)) < 0.15
    # a short prompt: the GEMV path, the fused quantizer not called
    calls = len(fused_rows)
    window_logits(window_runner(model, 64), ids[:GEMV_MAX_M])
    assert len(fused_rows) == calls
