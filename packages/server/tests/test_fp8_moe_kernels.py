"""The fused MoE kernels with FP8 (e4m3) experts against the dequantized float64 torch path, on fresh random inputs.

CUDA cases are `gpu`-marked (Mixtral's layer shape, bf16 and fp16 activations); the CPU cases run only in the
TRITON_INTERPRET=1 child that test_fp8_moe.py starts (tiny shapes, float32 and fp16 activations).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from lmserver.kernels.fp8_ref import quantize_fp8_per_token
from lmserver.kernels.reference import route
from lmserver.kernels.testing import kernel_devices, rel_error
from lmserver.layers.moe import dequantize_experts, moe_forward_native, quantize_experts

pytest.importorskip("triton")

DEVICES = kernel_devices()
# (hidden, inter, experts, top_k, scale block or None: per row). CPU: ragged K blocks (96 = 3 x 32) and scale blocks
# holding gate and up rows together (inter 80 is not a multiple of 32); GPU: Mixtral-8x7B's layer, 128 x 128 blocks
SHAPES = {
    "cpu": [(64, 96, 4, 2, None), (96, 80, 4, 2, (32, 32))],
    "cuda": [(4096, 14336, 8, 2, None), (4096, 14336, 8, 2, (128, 128)), (1024, 720, 6, 3, (128, 128))],
}


def _gen(seed: int, device: str) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _randn(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g, device=g.device)


def fp8_experts(hidden: int, inter: int, experts: int, block: tuple[int, int] | None, device: str,
                g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """(w13, w13_scale, w2, w2_scale) FP8 experts of random weights, quantized per row or per block."""
    w13 = _randn(g, experts, 2 * inter, hidden) / hidden**0.5
    w2 = _randn(g, experts, hidden, inter) / inter**0.5
    return (*quantize_experts(w13, block), *quantize_experts(w2, block))


def distinct_logits(tokens: int, experts: int, g: torch.Generator) -> torch.Tensor:
    """Router logits distinct within each row (which of two equal probabilities top-k picks is no contract)."""
    cpu = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,), generator=g, device=g.device)))
    return torch.stack([torch.randperm(experts, generator=cpu) for _ in range(tokens)]) * 0.25 - experts / 8


# (device, shape) pairs: each device's shapes, with the device parameter's marks and id ("interpret" on the CPU)
CASES = [pytest.param(p.values[0], shape, id=f"{p.id}-{'x'.join(map(str, shape[:4]))}-{shape[4] or 'rows'}",
                      marks=p.marks) for p in DEVICES for shape in SHAPES[p.values[0]]]


@pytest.mark.parametrize(("device", "shape"), CASES)
def test_fp8_fused_moe_matches_the_dequantized_float64_reference(
        device: str, shape: tuple[int, int, int, int, tuple[int, int] | None]) -> None:
    # Oracle: the sparse torch path in float64 on the dequantized experts (the same FP8 bytes and scales). The
    # kernel's own error (activation rows rounded to fp16 for the MMA, the activation-dtype roundings of the torch
    # path) must stay within a small factor of the torch path's in that dtype; a wrong scale is of order 1.
    from lmserver.kernels.fused_moe import PREFILL_LAUNCH, MoeLaunch, fused_moe

    hidden, inter, experts, top_k, block = shape
    g = _gen(40 + hidden, device)
    q13, s13, q2, s2 = fp8_experts(hidden, inter, experts, block, device, g)
    d13, d2 = (dequantize_experts(q, s, block, torch.float64) for q, s in ((q13, s13), (q2, s2)))
    small = MoeLaunch(block_m=16, block_n_up=16, block_n_down=16, block_k=16, num_warps=1, num_stages=1)
    # the fp16-operand path at prefill sizes: the default for block scales; per-row scales take W8A8 there by default
    # (test_fp8_w8a8_prefill_matches_the_float64_w8a8_reference), so the prefill tiles without it
    prefill = None if block else PREFILL_LAUNCH
    # (dtype, tokens, launches): decode and prefill tiles (the defaults), the weights through TMA descriptors
    # (rows_f16 False: the rows converted in the K loop)
    cases = ([(torch.float32, 1, [None]), (torch.float32, 5, [replace(small, tma=True, rows_f16=False)]),
              (torch.float32, 40, [prefill]), (torch.float16, 5, [small])] if device == "cpu" else
             [(dtype, tokens, [None]) for dtype in (torch.bfloat16, torch.float16) for tokens in (1, 4, 8)]
             # (the default block_k, 256, halved to divide block scales of 128 columns, as choose_moe_launch does)
             + [(torch.bfloat16, 8, [MoeLaunch(rows_f16=False, block_k=min(MoeLaunch().block_k, block[1]) if block
                                               else MoeLaunch().block_k)])]
             + [(torch.bfloat16, 300, [prefill, MoeLaunch(64, 64, 64, 64, tma=True)])])
    for dtype, tokens, launches in cases:
        x = _randn(g, tokens, hidden).to(dtype)
        logits = distinct_logits(tokens, experts, g).to(device, dtype)
        want = moe_forward_native(x.double(), logits.double(), d13, d2, top_k)
        torch_err = rel_error(moe_forward_native(x, logits, q13, q2, top_k, scales=(s13, s2, block)), want)
        for launch in launches:
            out = fused_moe(x, logits, q13, q2, top_k, launch=launch, w13_scale=s13, w2_scale=s2,
                            scale_block=block)
            assert out.dtype == dtype and out.shape == x.shape
            err = rel_error(out, want)
            # float32 rows: the fp16 operand's rounding (2^-11) bounds the error; a wiring error is of order 1
            assert err <= 2 * torch_err + (2e-3 if dtype == torch.float32 else 1e-3), (
                f"{shape} {dtype} tokens={tokens} {launch}: {err} vs torch {torch_err}")


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_fused_moe_keeps_large_and_small_activations(device: str) -> None:
    """Token rows of very different magnitudes: one whose expert activations (the down projection's input,
    silu(gate) * up) reach ~4e5, beyond fp16's 65,504 (a bf16 model's large activations), ordinary, small and
    medium ones; each row finite and as close to the float64 reference as ordinary rows are (the rows are scaled by
    2^-4 before the fp16 cast, the sums by 16 after)."""
    from lmserver.kernels.fused_moe import choose_moe_launch, fused_moe

    hidden, inter, experts, top_k = (64, 96, 4, 2) if device == "cpu" else (4096, 14336, 8, 2)
    g = _gen(7, device)
    q13, s13, q2, s2 = fp8_experts(hidden, inter, experts, None, device, g)
    d13, d2 = (dequantize_experts(q, s, None, torch.float64) for q, s in ((q13, s13), (q2, s2)))
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    x = _randn(g, 4, hidden).double()
    logits = distinct_logits(4, experts, g).to(device, dtype)

    def down_input_max(rows: torch.Tensor) -> torch.Tensor:  # max |silu(gate) * up| of each row over all experts
        gu = torch.einsum("enh,th->ten", d13, rows)
        return (F.silu(gu[..., :inter]) * gu[..., inter:]).abs().amax(dim=(1, 2))

    # h grows as the square of the row's scale: put the first row's largest activation near 4e5
    mags = torch.tensor([(4e5 / float(down_input_max(x[:1])[0])) ** 0.5, 1.0, 0.05, 30.0], dtype=torch.float64)
    x = (x * mags.to(device)[:, None]).to(dtype)
    peaks = down_input_max(x.double())
    assert 65504.0 < float(peaks[0]) < 1.0e6, peaks  # the case fp16 alone cannot hold, within the scaled range
    want = moe_forward_native(x.double(), logits.double(), d13, d2, top_k)
    ordinary = rel_error(moe_forward_native(x[1:2], logits[1:2], q13, q2, top_k, scales=(s13, s2, None)), want[1:2])
    for rows_f16 in (True, False):  # the rows converted once, or in the K loop
        launch = replace(choose_moe_launch(8, experts, x.element_size(), fp8=True), rows_f16=rows_f16)
        out = fused_moe(x, logits, q13, q2, top_k, launch=launch, w13_scale=s13, w2_scale=s2)
        assert torch.isfinite(out).all(), rows_f16
        for row in range(4):
            err = rel_error(out[row], want[row])
            assert err <= 2 * ordinary + (3e-3 if dtype == torch.float32 else 2e-3), (rows_f16, row, err)


def quantize_groups_ref(x: torch.Tensor, group: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) quantized to e4m3 per row (group None) or per row and ``group`` columns (the last group zero-padded):
    `fp8_ref.quantize_fp8_per_token` on each group; (q (M, K), scales (M, groups))."""
    if group is None:
        return quantize_fp8_per_token(x)
    m, k = x.shape
    groups = -(-k // group)
    q, scale = quantize_fp8_per_token(F.pad(x, (0, groups * group - k)).reshape(m * groups, group))
    return q.view(m, groups * group)[:, :k], scale.view(m, groups)


def dequantized_rows(x: torch.Tensor, group: int | None = None) -> torch.Tensor:
    """x's rows quantized to e4m3 (`quantize_groups_ref`), dequantized in float64."""
    q, scale = quantize_groups_ref(x, group)
    per_column = scale.double() if group is None else scale.double().repeat_interleave(group, dim=1)[:, :x.shape[1]]
    return q.double() * per_column


def w8a8_reference(x: torch.Tensor, logits: torch.Tensor, d13: torch.Tensor, d2: torch.Tensor, top_k: int,
                   group: int | None = None) -> torch.Tensor:
    """The W8A8 MoE in float64 (T, hidden): each token's row quantized per token (or per token and ``group``
    columns) to e4m3 and dequantized, times the dequantized experts (d13, d2 float64); gate, up, silu(gate) and
    h = silu(gate) * up rounded to x's dtype (where the kernel rounds them), h quantized per (token, expert) pair over
    the whole intermediate dimension (or per ``group`` columns), times the down rows, weighted by the routing weights
    in x's dtype. Nothing of the output rounded."""
    dtype, inter = x.dtype, d2.shape[2]
    weights, chosen = route(logits, top_k, True, dtype)
    rows = dequantized_rows(x, group)
    out = torch.zeros(x.shape[0], d2.shape[1], dtype=torch.float64, device=x.device)
    for e in torch.unique(chosen).tolist():
        token, slot = torch.nonzero(chosen == e, as_tuple=True)
        gate_up = rows[token] @ d13[e].t()
        gate, up = gate_up[:, :inter].to(dtype).double(), gate_up[:, inter:].to(dtype).double()
        h = (F.silu(gate).to(dtype).double() * up).to(dtype)
        out.index_add_(0, token, (dequantized_rows(h, group) @ d2[e].t()) * weights[token, slot].double()[:, None])
    return out


# W8A8 against the float64 W8A8 reference: float32 rows, float32 roundings only; fp16 / bf16 rows: the output's and
# each pair's y rounded to the activation dtype (the reference rounds neither), on CUDA the FP8 MMA's fast
# accumulation (sm_90: no periodic float32 promotion, as `_scaled_mm(use_fast_accum=True)` in the dense path) too. A
# wrong token or pair scale is of order 1 in its row, h left unquantized ~2.5e-2. bf16 on the H200 at Mixtral's layer
# (2026-12-03): max row error 3.1-3.3e-2 with fast accumulation, 2.1-2.5e-2 with float32 promotion every 128 K (and
# 4.6e-2 against the unquantized rows for both): h's bf16 rounding before its e4m3 quantization lands some elements
# in the neighbouring e4m3 bin (~6% each) where the float64 oracle does not, so in bf16 this bound no longer tells h
# unquantized apart; the float32 interpreter cases (1e-5) do.
W8A8_TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 4e-2}
# W8A8 against the unquantized activations (float64 product of the rows and the dequantized experts): the e4m3
# rounding of x and of h, ~2^-4 relative per element: 4.1-4.7e-2 of the output's norm for Gaussian rows, from 64 x 96
# to Mixtral's 4,096 x 14,336 experts (float64 torch emulation); documented bound
W8A8_VS_UNQUANTIZED = 8e-2
# (hidden, inter, experts, top_k, tokens, scale block or None: per row). Block scales: inter 80 / 720 end in a part
# block (h's last group of columns)
W8A8_CASES = {
    "cpu": [(64, 96, 4, 2, 40, None), (96, 80, 4, 2, 40, (32, 32))],
    "cuda": [(4096, 14336, 8, 2, 300, None), (4096, 14336, 8, 2, 4096, None), (4096, 14336, 8, 2, 300, (128, 128)),
             (1024, 720, 6, 3, 300, (128, 128))],
}


@pytest.mark.parametrize(("device", "shape"), [
    pytest.param(p.values[0], shape, id=f"{p.id}-{'x'.join(map(str, shape[:5]))}-{shape[5] or 'rows'}",
                 marks=p.marks) for p in DEVICES for shape in W8A8_CASES[p.values[0]]])
def test_fp8_w8a8_prefill_matches_the_float64_w8a8_reference(
        device: str, shape: tuple[int, int, int, int, int, tuple[int, int] | None]) -> None:
    # FP8 experts at prefill sizes on W8A8 launches: rows quantized per token (block scales: per token and K block),
    # FP8 x FP8 MMAs, the scales in the epilogue (block scales: per K tile). Token rows of magnitudes 1e-2 .. 1e2 and
    # one all-zero row: a token / pair scale applied to the wrong row shows in that row's error; the oracle is exact
    # up to the roundings of W8A8_TOLERANCE
    from lmserver.kernels.fused_moe import (
        FP8_PREFILL_BLOCKS_W8A8_LAUNCH,
        FP8_PREFILL_LAUNCH,
        FP8_PREFILL_TMA_LAUNCH,
        MoeLaunch,
        choose_moe_launch,
        descriptors_ok,
        fused_moe,
    )

    hidden, inter, experts, top_k, tokens, block = shape
    g = _gen(50 + tokens, device)
    q13, s13, q2, s2 = fp8_experts(hidden, inter, experts, block, device, g)
    d13, d2 = (dequantize_experts(q, s, block, torch.float64) for q, s in ((q13, s13), (q2, s2)))
    small = MoeLaunch(block_m=16, block_n_up=16, block_n_down=32, block_k=32, num_warps=1, num_stages=1, w8a8=True)
    if device == "cpu" and block:
        cases = [(torch.float32, [replace(small, tma=True)]), (torch.float16, [small])]
    elif device == "cpu":  # (the interpreter sums exactly whatever fp8_acc_k says)
        cases = [(torch.float32, [None, replace(small, tma=True, group_m=5)]),  # 9 blocks: groups of 5 and 4
                 (torch.float16, [replace(small, fp8_acc_k=32)])]
    elif block:  # opt-in: TMA descriptors and pointer tiles
        cases = [(torch.bfloat16, [FP8_PREFILL_BLOCKS_W8A8_LAUNCH, replace(FP8_PREFILL_BLOCKS_W8A8_LAUNCH, tma=False)])]
    else:  # the default (TMA descriptors, fast FP8 accumulation), the pointer tiles, float32 promotion every 128 K
        cases = [(torch.bfloat16, [None, FP8_PREFILL_LAUNCH,
                                   replace(FP8_PREFILL_TMA_LAUNCH, block_n_down=128, fp8_acc_k=128)])]
    for dtype, launches in cases:
        mags = 10.0 ** (4 * torch.rand(tokens, 1, generator=g, device=device) - 2)
        x = (_randn(g, tokens, hidden) * mags).to(dtype)
        x[tokens // 2] = 0.0
        logits = distinct_logits(tokens, experts, g).to(device, dtype)
        if block is None:
            chosen = choose_moe_launch(tokens * top_k, experts, x.element_size(), descriptors_ok(x, q13, q2), fp8=True)
            assert chosen.w8a8 and chosen in (FP8_PREFILL_LAUNCH, FP8_PREFILL_TMA_LAUNCH)
        want = w8a8_reference(x, logits, d13, d2, top_k, block[1] if block else None)
        unquantized = moe_forward_native(x.double(), logits.double(), d13, d2, top_k)
        failures = []  # every launch's errors in the message (the default's fast accumulation against promotion)
        for launch in launches:
            out = fused_moe(x, logits, q13, q2, top_k, launch=launch, w13_scale=s13, w2_scale=s2, scale_block=block)
            assert out.dtype == dtype and out.shape == x.shape
            assert torch.all(out[tokens // 2] == 0)
            assert torch.isfinite(out).all()
            diff = (out.double() - want).norm(dim=1)
            row_err = float((diff / want.norm(dim=1).clamp_min(1e-30)).max())  # the zero row: 0 / tiny
            err = rel_error(out, unquantized)
            errors = f"{launch}: max row error {row_err:.2e} vs W8A8, {err:.2e} vs unquantized"
            if row_err > W8A8_TOLERANCE[dtype] or err > W8A8_VS_UNQUANTIZED:
                failures.append(errors)
        assert not failures, (shape, dtype, failures)


@pytest.mark.gpu
def test_quantize_groups_gives_the_reference_bytes() -> None:
    # block-scaled W8A8's row quantizer (one scale per row and group of columns; a part group last) on CUDA: the
    # bytes and scales of fp8_ref's per-token quantizer on each group (the interpreter runs that reference itself)
    from lmserver.kernels.fused_moe import _quantize_groups

    g = _gen(9, "cuda")
    for rows, cols, group in ((5, 4096, 128), (300, 720, 128), (3, 96, 32)):
        x = (_randn(g, rows, cols) * 10.0 ** (4 * torch.rand(rows, 1, generator=g, device="cuda") - 2)).bfloat16()
        x[0] = 0.0
        q, scale = _quantize_groups(x, group)
        want_q, want_scale = quantize_groups_ref(x, group)
        assert torch.equal(scale, want_scale), (rows, cols, group)
        assert torch.equal(q.view(torch.uint8), want_q.contiguous().view(torch.uint8)), (rows, cols, group)


@pytest.mark.parametrize("device", DEVICES)
def test_choose_moe_launch_takes_w8a8_for_per_row_fp8_prefill_only(device: str) -> None:
    from lmserver.kernels.fused_moe import (
        FP8_DECODE_LAUNCH,
        FP8_PREFILL_BLOCKS_LAUNCH,
        FP8_PREFILL_LAUNCH,
        FP8_PREFILL_TMA_LAUNCH,
        PREFILL_TMA_LAUNCH,
        choose_moe_launch,
    )

    for element_size in (2, 4):  # e4m3 operands whatever the activation dtype: the same K tiles
        assert choose_moe_launch(4096 * 2, 8, element_size, descriptors=True, fp8=True) == FP8_PREFILL_TMA_LAUNCH
        assert choose_moe_launch(300 * 2, 8, element_size, descriptors=False, fp8=True) == FP8_PREFILL_LAUNCH
    assert choose_moe_launch(128, 8, fp8=True) == FP8_DECODE_LAUNCH  # 16 pairs per expert: decode
    assert not choose_moe_launch(4096 * 2, 8, fp8=True, group_k=128).w8a8  # block scales: the fp16 path
    assert choose_moe_launch(4096 * 2, 8, fp8=True, group_k=128).block_n_up == FP8_PREFILL_BLOCKS_LAUNCH.block_n_up
    assert not choose_moe_launch(4096 * 2, 8, descriptors=True).w8a8 and PREFILL_TMA_LAUNCH.tma  # bf16 experts


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_fused_moe_refuses_bad_scales(device: str) -> None:
    from lmserver.kernels._util import KernelInputError
    from lmserver.kernels.fused_moe import MoeLaunch, fused_moe

    g = _gen(3, device)
    q13, s13, q2, s2 = fp8_experts(32, 32, 4, None, device, g)
    x = _randn(g, 2, 32)
    logits = _randn(g, 2, 4)
    with pytest.raises(KernelInputError, match="need w13_scale and w2_scale"):
        fused_moe(x, logits, q13, q2, 2)
    with pytest.raises(KernelInputError, match="w2_scale must be float32"):
        fused_moe(x, logits, q13, q2, 2, w13_scale=s13, w2_scale=s2[:, :3])
    with pytest.raises(KernelInputError, match="w13_scale must be float32"):  # block scales expected, row scales given
        fused_moe(x, logits, q13, q2, 2, w13_scale=s13, w2_scale=s2, scale_block=(32, 32))
    bq13, bs13, bq2, bs2 = fp8_experts(32, 32, 4, (32, 32), device, g)
    with pytest.raises(KernelInputError, match="block_k 64 must divide"):
        fused_moe(x, logits, bq13, bq2, 2, launch=MoeLaunch(block_k=64), w13_scale=bs13, w2_scale=bs2,
                  scale_block=(32, 32))
    with pytest.raises(KernelInputError, match="scales are for"):
        fused_moe(x, logits, q13.float(), q2.float(), 2, w13_scale=s13, w2_scale=s2)
    with pytest.raises(KernelInputError, match="fp8_acc_k 48 must be a multiple of 32"):
        fused_moe(x, logits, q13, q2, 2, launch=MoeLaunch(block_k=32, w8a8=True, fp8_acc_k=48), w13_scale=s13,
                  w2_scale=s2)
    with pytest.raises(KernelInputError, match="W8A8 launches .* need block_k >= 32"):
        fused_moe(x, logits, bq13, bq2, 2, launch=MoeLaunch(block_k=16, w8a8=True), w13_scale=bs13, w2_scale=bs2,
                  scale_block=(32, 32))
    oq13, os13, oq2, os2 = fp8_experts(32, 32, 4, (16, 48), device, g)
    with pytest.raises(KernelInputError, match="power-of-two group_k"):
        fused_moe(x, logits, oq13, oq2, 2, launch=MoeLaunch(block_k=48, w8a8=True), w13_scale=os13, w2_scale=os2,
                  scale_block=(16, 48))


@pytest.mark.gpu
@pytest.mark.parametrize("block", [None, (128, 128)], ids=["rows", "blocks"])
def test_fp8_moe_layer_replays_in_a_cuda_graph(block: tuple[int, int] | None) -> None:
    # the FP8 layer on the fused kernels captured in a CUDA graph (decode graphs), replayed on fresh inputs: each
    # replay's output is the dequantized reference on that replay's input
    from lmserver.kernels import select_kernels
    from lmserver.layers.moe import MoE

    dev = torch.device("cuda")
    g = _gen(11, "cuda")
    moe = MoE(512, 768, num_experts=8, top_k=2).to(dev, torch.bfloat16)
    with torch.no_grad():
        moe.gate.weight.normal_(0, 0.1, generator=g)
        moe.use_fp8_(block)
        q13, s13, q2, s2 = fp8_experts(512, 768, 8, block, "cuda", g)
        moe.w13.copy_(q13)
        moe.w2.copy_(q2)
        assert moe.w13_scale is not None and moe.w2_scale is not None
        moe.w13_scale.copy_(s13)
        moe.w2_scale.copy_(s2)
    moe.kernels = select_kernels(dev, prefer="triton")
    with torch.no_grad():
        static = torch.randn(4, 512, device=dev, dtype=torch.bfloat16)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            moe(static)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = moe(static)
        for _ in range(3):
            fresh = torch.randn(4, 512, device=dev, dtype=torch.bfloat16)
            static.copy_(fresh)
            graph.replay()
            torch.cuda.synchronize()
            want = moe_forward_native(fresh.double(), moe.gate(fresh).double(), q13, q2, 2,
                                      scales=(s13, s2, block))
            assert rel_error(out, want) < 2e-2


@pytest.mark.parametrize("device", DEVICES)
def test_route_and_align_writes_the_fp16_rows(device: str) -> None:
    # the FP8 experts' gate-up operand, fp16(x * 2^-4) exactly, written by the routing launch's extra programs (one
    # program routes) or by a launch of its own (torch routing ops above ROUTE_ALIGN_MAX_ELEMENTS); the routing is
    # the same as without the rows
    from lmserver.kernels.fused_moe import ROUTE_ALIGN_MAX_ELEMENTS, route_and_align

    g = _gen(5, device)
    for tokens, experts, hidden in ((3, 8, 1100), (257, 64, 40)):  # a ragged column block; past the one-program limit
        x = (_randn(g, tokens, hidden) * 3e4).to(torch.bfloat16 if device == "cuda" else torch.float32)
        logits = distinct_logits(tokens, experts, g).to(device)
        out = torch.full((tokens, hidden), float("nan"), dtype=torch.float16, device=device)
        got = route_and_align(logits, 2, True, x.dtype, 16, rows=(x, out))
        want = route_and_align(logits, 2, True, x.dtype, 16)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        assert torch.equal(out, (x.float() * 0.0625).half()), (tokens, experts)
        assert (tokens * experts > ROUTE_ALIGN_MAX_ELEMENTS) == (tokens == 257)
