"""Fused expert MLP (Mixtral style) in two Triton launches, with no host sync: CUDA-graph safe.

The router's softmax and top-k run on the device and the token-expert pairs (token t's j-th choice
is pair ``t * top_k + j``) are grouped by expert there (`route_and_align`: one Triton program up to
2,048 tokens of 8 experts, else torch ops, `align_pairs`): each expert's pairs fill whole blocks of
``block_m`` rows, padded with an out-of-range pair id, and every block knows its expert. Then

1. gate-up: per (block, tile of the intermediate dimension), the block's token rows times the
   expert's gate and up rows, ``silu(gate) * up`` in the epilogue -> ``h`` (pairs, inter);
2. down: per (block, tile of hidden), ``h`` rows times the expert's down rows, scaled by the
   pair's routing weight -> ``y`` (pairs, hidden); the output sums each token's ``top_k`` rows.

So an expert no token chose is not read, and one chosen by several tokens of a block is read once
for all of them. Launch shapes depend only on (tokens, top_k, experts, block_m): blocks past the
used ones exit at once. Rounding follows `lmserver.layers.moe.moe_forward_native` (float32
accumulation; gate and up, silu, their product, the down output and its weighted value each
rounded to the activation dtype). Reference: ``moe_forward_native``.

FP8 (e4m3) experts (`lmserver.layers.moe.MoE` layout: ``w13`` / ``w2`` float8_e4m3fn with ``w13_scale`` /
``w2_scale``): one float32 scale per weight row, applied to the finished float32 sums, or one per
(``group_n`` rows, ``group_k`` columns) block (128 x 128 checkpoints), applied to each K tile's partial sums
(``block_k`` divides ``group_k``). Each weight tile is widened to fp16 in registers (exact; one
``cvt.rn.f16x2.e4m3x2`` per two weights: widening to bf16 goes through float32, three slow conversions per
weight, which made 8-row FP8 GEMMs conversion-bound on the H200, benchmarks/fp8/GPU_NOTES.md) and multiplied on
the tensor cores against the activation rows in fp16. fp16 holds magnitudes up to 65,504 only, so bf16 / float32
rows are scaled by 2^-4 before the cast (inline PTX ``mul.rn.f32``: LLVM moves a plain multiply past the
truncation) and the float32 sums by 16 (both exact): rows up to ~1.05e6 stay finite, as in lowlat's
``mrow_f16s``. The rows are converted once, not per K tile: the token rows by extra programs of the routing
kernel's launch (``MoeLaunch.rows_f16``; converted in the K loop, each program and warp would repeat it: in sm_90
PTX of the decode tiles, 128 multiplies and 64 conversions per thread and K step against the weights' 64
``cvt.rn.f16x2.e4m3x2``), ``h`` by the gate-up epilogue, which writes it in fp16 (rounded to the activation dtype
first, so the values are the bf16 path's). Reference: ``moe_forward_native`` with the same scales (it dequantizes).

Prefill-sized batches of per-row-scaled FP8 experts (``MoeLaunch.w8a8``, `choose_moe_launch` above 16 pairs per
expert) run W8A8 instead, as vLLM's and SGLang's FP8 MoE prefill do and as lmserver's dense FP8 prefill does
(`lmserver.layers.fp8_linear`: `torch._scaled_mm` on per-token-quantized rows): the token rows are quantized per
token to e4m3 (`fp8_quant.quantize_fp8_per_token`: scale = amax / 448, the bytes of
`fp8_ref.quantize_fp8_per_token`), both MMA operands are e4m3 (Hopper's FP8 tensor cores, twice the fp16 rate, no
weight conversion; float32 sums, with the tensor cores' fast FP8 accumulation on sm_90, as ``_scaled_mm`` with
``use_fast_accum`` in the dense path), and the epilogue multiplies the float32 sums by the row's token scale and
the column's expert-row scale (exact up to float32 rounding: the result is the product of the dequantized FP8 rows
and experts). The gate-up kernel writes ``h = silu(gate) * up`` in the activation dtype (the roundings above), one
`quantize_fp8_per_token` launch quantizes each pair's h row over the whole intermediate dimension, and the down
kernel multiplies those FP8 rows likewise. So W8A8 differs from the W8A16 path by the activations' e4m3 rounding
(~2^-4 relative per element, ~3-6% of the output's norm end to end; test_fp8_moe_kernels.py bounds it). Block-scaled
(128 x 128) experts keep the fp16 path by default; a ``w8a8`` launch (``FP8_PREFILL_BLOCKS_W8A8_LAUNCH``, not yet
measured) quantizes x and h per token and ``group_k`` columns instead (one scale per row and K block, as vLLM's and
SGLang's block-scaled FP8 MoE: `_quantize_groups`), and each K tile's FP8 sums are scaled by the rows' and the weight
block's scales before they are added. Reference: the float64 product of the dequantized FP8 rows (``x`` and then
``h``, quantized per token or per token and K block) and the dequantized experts (test_fp8_moe_kernels.py's
``w8a8_reference``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from lmserver.kernels import fp8_ref
from lmserver.kernels._util import KernelInputError, check_last_dim_contiguous, dot_precision
from lmserver.kernels.fp8_quant import _fp8_scale, _to_fp8, quantize_fp8_per_token
from lmserver.kernels.fp8_ref import FP8_DTYPE

__all__ = ["MoeLaunch", "align_pairs", "choose_moe_launch", "descriptors_ok", "fused_moe", "route_and_align",
           "scale_block_k"]

# One program routes and groups the pairs when the (tokens, experts) tile is at most this many elements (2,048 tokens
# of 8 experts); larger steps run `route` and `align_pairs` as torch ops (H200, CUDA graphs, 8 experts: the torch ops
# take 60-100 us from 1 to 2,048 tokens, the kernel 1.8-23.3; larger tiles not measured).
ROUTE_ALIGN_MAX_ELEMENTS = 16384
ROWS_F16_BLOCK = 1024  # columns per program that casts the FP8 experts' token rows to fp16 (`_rows_f16_block`)
QUANT_GROUP_COLUMNS = 1024  # columns per program of `_quantize_groups` (8 groups of 128)
_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (no inline assembly there)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> (e4m3 (M, K), float32 (M, ceil(K / group))): one scale per row and ``group`` columns (a power of
    two), amax / 448 as `_quantize_rows`; the bytes of `fp8_ref.quantize_fp8_per_token` on each row's groups (the
    last one zero-padded). One launch; under Triton's interpreter the torch quantizer (`_quantize_rows`' NOTE)."""
    rows, cols = x.shape
    groups = triton.cdiv(cols, group)
    if _interpreted():
        padded = torch.nn.functional.pad(x, (0, groups * group - cols)) if groups * group != cols else x
        q, scale = fp8_ref.quantize_fp8_per_token(padded.reshape(rows * groups, group))
        return q.view(rows, groups * group)[:, :cols].contiguous(), scale.view(rows, groups)
    q = torch.empty(rows, cols, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(rows, groups, dtype=torch.float32, device=x.device)
    per_program = max(1, min(triton.next_power_of_2(groups), QUANT_GROUP_COLUMNS // group))
    if rows:
        _quantize_groups_kernel[(rows, triton.cdiv(groups, per_program))](
            x, q, scale, cols, x.stride(0), q.stride(0), scale.stride(0), GROUP=group, GROUPS=per_program,
            num_warps=4)
    return q, scale


@triton.jit
def _quantize_groups_kernel(x_ptr, q_ptr, s_ptr, cols, stride_x, stride_q, stride_s, GROUP: tl.constexpr,
                            GROUPS: tl.constexpr):
    # row program_id(0), groups GROUPS * program_id(1) + [0, GROUPS): each group's scale and e4m3 bytes as
    # fp8_quant's per-token quantizers make them (`_fp8_scale`, `_to_fp8`)
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    offs = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    ok = offs < cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    scale = _fp8_scale(tl.max(tl.abs(x), 1))
    tl.store(q_ptr + row * stride_q + offs, _to_fp8(x, scale[:, None], q_ptr), mask=ok)
    tl.store(s_ptr + row * stride_s + g, scale, mask=g * GROUP < cols)


def _quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W8A8's per-token e4m3 rows and (rows, 1) scales: `fp8_quant.quantize_fp8_per_token` (one launch; the bytes of
    `fp8_ref.quantize_fp8_per_token`, test_fp8_kernels.py on CUDA). NOTE: under Triton's interpreter, the torch
    quantizer itself: the interpreter narrows float32 to e4m3 without carrying a rounded-up mantissa into the exponent
    (7.88 -> 4 instead of 8), which would put a few wrong bytes in every row of h."""
    return fp8_ref.quantize_fp8_per_token(x) if _interpreted() else quantize_fp8_per_token(x)


@dataclass(frozen=True)
class MoeLaunch:
    """Tile sizes of the two launches. ``block_m`` rows of one expert per block (16 at least: ``tl.dot``)."""

    block_m: int = 16
    block_n_up: int = 32
    block_n_down: int = 64
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 4
    # expert weight tiles through TMA tensor descriptors (Hopper and newer; `fused_moe` falls back to pointer loads
    # where `descriptors_ok` says no)
    tma: bool = False
    # FP8 experts with bf16 / float32 activations: the token rows converted to fp16 (times 2^-4) once, before the
    # gate-up kernel (in the routing kernel's launch, `route_and_align`); False: in every program's K loop (the
    # conversion repeated per program and, in the MMA operand's layout, per warp)
    rows_f16: bool = True
    # FP8 experts: W8A8 (module docstring), the activation rows quantized per token (block scales: per token and
    # group_k columns) to e4m3 and FP8 x FP8 MMAs; False: the rows in fp16 against weight tiles widened to fp16
    w8a8: bool = False
    # W8A8: K elements the FP8 MMAs sum in the tensor cores' reduced precision before each float32 add (Triton's
    # max_num_imprecise_acc; a multiple of 32 dividing block_k); 0: sm_90's default, never (fast accumulation, as
    # vLLM's and SGLang's FP8 MoE and `_scaled_mm(use_fast_accum=True)` in the dense path). The promotion holds one
    # more accumulator: a 128 x 256 down tile spills (sm_90, Triton 3.6: 232 bytes), 128 x 128 fits
    fp8_acc_k: int = 0
    # program order: 0, a block's column tiles one after the other, each over every block (the grid's x: blocks);
    # g > 0: groups of g blocks, each group's blocks over all its column tiles before the next group (vLLM's
    # GROUP_SIZE_M): the programs running at once share g blocks' rows and few experts' weight columns. NOTE: W8A8's
    # down kernel at 4,096 tokens reads 117 MB of FP8 h rows, more than the L2 holds, once per wave of column tiles
    # in the default order (benchmarks/fp8/bench_fp8_moe.py times both)
    group_m: int = 0


# H200, Mixtral-8x7B layer, bf16 (bench_moe.py): decode, 16-row blocks up to 8 tokens (best of 36 tiles); prefill, 128 x
# 128 x 64 with 8 warps, 3 stages (best of 32 with pointer loads; 1.4x faster than 64 x 64 x 64 with 4 warps, 144 KB
# of shared memory); with TMA descriptors, 256-wide down tiles and 4 stages (192 KB; 2,795 us at 2,048 tokens
# against 3,005 for the pointer tiles, 6-8% from 256 to 2,048 tokens)
DECODE_LAUNCH = MoeLaunch()
PREFILL_LAUNCH = MoeLaunch(block_m=128, block_n_up=128, block_n_down=128, block_k=64, num_warps=8, num_stages=3)
PREFILL_TMA_LAUNCH = MoeLaunch(block_m=128, block_n_up=128, block_n_down=256, block_k=64, num_warps=8, num_stages=4,
                               tma=True)


# FP8 experts at decode sizes: the bf16 tiles (a weight tile is half the bytes; one more pipeline stage keeps as many
# weight bytes in flight per program as bf16's four: down runs one 64-row program per SM at one token). H200, Mixtral-8x7B
# layer (benchmarks/fp8/bench_fp8_moe.py, RESULTS.md issue 33, 2026-12-03): 107.2 us at 1 token, 328.8 at 8 (bf16 173.6
# / 578.6); the --sweep's best candidates within 1% (1 token) and 5% (8 tokens) of these tiles
FP8_DECODE_LAUNCH = MoeLaunch(num_stages=5)
# prefill, W8A8 (module docstring; H200 before it: 4,096 tokens on the fp16 path, these pointer tiles, 7,973 us against
# bf16's 5,462): the bf16 tiles' shared memory per stage with 128-wide K tiles (a 128 x 128 e4m3 tile holds the bytes
# of a 128 x 64 bf16 one; vLLM's tuned H200 FP8 table at 1k-4k tokens: 128 x 256 x 128, 8 warps, 3-4 stages); with
# TMA descriptors where `descriptors_ok`, as bf16. H200 (same entry): 4,096 tokens 3,086.9 us with the TMA tiles,
# 3,533.6 with these pointer tiles (bf16 5,508.7); the sweep's best (grouped programs) within 1.1%
FP8_PREFILL_LAUNCH = MoeLaunch(block_m=128, block_n_up=128, block_n_down=128, block_k=128, num_warps=8, num_stages=3,
                               w8a8=True)
FP8_PREFILL_TMA_LAUNCH = MoeLaunch(block_m=128, block_n_up=128, block_n_down=256, block_k=128, num_warps=8,
                                   num_stages=4, tma=True, w8a8=True)
# block-scaled FP8 prefill: each K tile's sums are scaled before they are added, so the gate and up MMAs need an
# accumulator each on top of the running sums; at 128 x 128 ptxas spills (sm_90, benchmarks/fp8/ptx_fp8_moe.py: 255
# registers, 168 bytes spilled), 64-wide gate-up tiles fit
FP8_PREFILL_BLOCKS_LAUNCH = replace(PREFILL_LAUNCH, block_n_up=64)
# block-scaled W8A8 (opt-in, not yet measured: benchmarks/fp8/bench_fp8_moe.py --blocks times it): rows quantized per
# token and 128-column block, each K tile's sums scaled before they are added (an accumulator more per MMA, as above:
# 64-wide gate-up tiles; sm_90, Triton 3.6: no spills)
FP8_PREFILL_BLOCKS_W8A8_LAUNCH = MoeLaunch(block_m=128, block_n_up=64, block_n_down=128, block_k=128, num_warps=8,
                                           num_stages=4, tma=True, w8a8=True)


def scale_block_k(block_k: int, group_k: int | None) -> int:
    """``block_k`` halved until it divides ``group_k`` (a K tile never straddles two scale blocks); unchanged for
    None (per-row scales). At least 16 (``tl.dot``): a ``group_k`` with no such divisor is refused by `fused_moe`."""
    if group_k is None:
        return block_k
    while block_k > 16 and group_k % block_k:
        block_k //= 2
    return block_k


def choose_moe_launch(num_pairs: int, num_experts: int, element_size: int = 2, descriptors: bool = False,
                      fp8: bool = False, group_k: int | None = None) -> MoeLaunch:
    """Tiles for ``num_pairs`` token-expert pairs over ``num_experts``: decode-sized batches (a few
    rows per expert) stream weights with 16-row blocks; prefill-sized ones use square tiles, with TMA
    descriptors for the weights where ``descriptors`` (see `descriptors_ok`). Four-byte elements halve
    ``block_k`` (the same shared memory per pipeline stage). ``fp8``: FP8 expert weights (``FP8_*_LAUNCH``),
    ``block_k`` dividing the scale blocks' ``group_k`` (`scale_block_k`); per-row-scaled FP8 experts at prefill
    sizes: the W8A8 tiles (``FP8_PREFILL_LAUNCH`` / ``FP8_PREFILL_TMA_LAUNCH``, ``w8a8``)."""
    decode = num_pairs / max(num_experts, 1) <= 16
    if fp8 and not decode and group_k is None:  # W8A8: e4m3 operands whatever the activation dtype
        return FP8_PREFILL_TMA_LAUNCH if descriptors else FP8_PREFILL_LAUNCH
    if fp8:
        launch = FP8_DECODE_LAUNCH if decode else FP8_PREFILL_BLOCKS_LAUNCH
    elif decode:
        launch = DECODE_LAUNCH
    else:
        launch = PREFILL_TMA_LAUNCH if descriptors else PREFILL_LAUNCH
    if element_size > 2:
        launch = replace(launch, block_k=launch.block_k // 2)
    return replace(launch, block_k=scale_block_k(launch.block_k, group_k)) if group_k is not None else launch


def descriptors_ok(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether the expert weights can be read through TMA tensor descriptors: a Hopper-or-newer GPU (or the CPU,
    where only the Triton interpreter runs these kernels), weights contiguous with 16-byte aligned rows. Not on ROCm
    (never run there)."""
    if x.device.type == "cuda" and (torch.version.hip is not None or torch.cuda.get_device_capability(x.device)[0] < 9):
        return False
    return all(w.is_contiguous() and w.data_ptr() % 16 == 0 and w.shape[-1] * w.element_size() % 16 == 0
               for w in weights)


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Blocks enough for any routing: each of at most min(pairs, experts) used experts pads < block_m rows."""
    return triton.cdiv(num_pairs + min(num_pairs, num_experts) * (block_m - 1), block_m)


def align_pairs(experts: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Groups the pairs of ``experts`` (tokens, top_k) by expert, in blocks of ``block_m`` rows.

    Returns ``(pair_ids, block_expert)``: ``pair_ids`` (max_blocks * block_m,) int32, each expert's
    pairs in ascending order from the first row of its first block, the rest of its last block set
    to ``num_pairs`` (no pair); ``block_expert`` (max_blocks,) int32, the expert of each block and
    -1 for the unused blocks at the end. Torch ops of fixed shapes only (no host sync).
    """
    flat = experts.reshape(-1).to(torch.int64)
    num_pairs = flat.numel()
    dev = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    sorted_experts, order = torch.sort(flat, stable=True)
    rank = torch.arange(num_pairs, device=dev) - (torch.cumsum(counts, 0) - counts)[sorted_experts]
    dest = (padded_end - padded)[sorted_experts] + rank
    blocks = max_blocks(num_pairs, num_experts, block_m)
    pair_ids = torch.full((blocks * block_m,), num_pairs, dtype=torch.int32, device=dev)
    pair_ids.scatter_(0, dest, order.to(torch.int32))
    block_start = torch.arange(blocks, device=dev) * block_m
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return pair_ids, block_expert


@triton.jit
def _rows_f16(a, SCALE: tl.constexpr, ASM: tl.constexpr):
    # activation values -> fp16, the operand of an FP8 weight tile's MMA; SCALE: times 2^-4 first (the sums are
    # multiplied by 16 after the K loop). NOTE: the multiply is inline PTX on the GPU: written `a * 0.0625`, LLVM
    # narrows it past the cast (`cvt.rn.f16x2.f32` then `mul.f16x2`, a comes from a bf16 load) and the cast overflows
    # first (benchmarks/fp8/GPU_NOTES.md); ASM is False only under Triton's interpreter (no inline assembly there,
    # and numpy keeps the order)
    if SCALE and ASM:
        out = tl.inline_asm_elementwise("mul.rn.f32 $0, $1, 0f3D800000;", "=r,r", [a.to(tl.float32)],
                                        dtype=tl.float32, is_pure=True, pack=1).to(tl.float16)
    elif SCALE:
        out = (a.to(tl.float32) * 0.0625).to(tl.float16)
    else:
        out = a.to(tl.float16)
    return out


@triton.jit
def _rows_f16_block(x_ptr, out_ptr, row, col_block, cols, stride_x, stride_out, BLOCK: tl.constexpr,
                    ASM: tl.constexpr):
    # out[row, block] = fp16(x[row, block] * 2^-4) (`_rows_f16`): the FP8 experts' gate-up operand, once per token
    offs = col_block * BLOCK + tl.arange(0, BLOCK)
    ok = offs < cols
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=ok, other=0.0)
    tl.store(out_ptr + row.to(tl.int64) * stride_out + offs, _rows_f16(x, True, ASM), mask=ok)


@triton.jit
def _rows_f16_kernel(x_ptr, out_ptr, cols, stride_x, stride_out, BLOCK: tl.constexpr, ASM: tl.constexpr):
    # `_rows_f16_block` over a (rows, column blocks) grid: where the routing does not run in one program
    _rows_f16_block(x_ptr, out_ptr, tl.program_id(0), tl.program_id(1), cols, stride_x, stride_out, BLOCK, ASM)


@triton.jit
def _route_align_kernel(
    logits_ptr, weights_ptr, pair_ids_ptr, block_expert_ptr,
    tokens, experts, stride_l, num_blocks,
    x_ptr, xo_ptr, cols, stride_x, stride_xo,
    TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr,
    ROWS: tl.constexpr, ROWS_BLOCK: tl.constexpr, ASM: tl.constexpr,
):
    # `route` then `align_pairs` in program 0: softmax, top-k (lowest index among equal probabilities), weights;
    # each expert's pairs in token order from the start of its padded block range; each block's expert. ROWS: the
    # other programs write the FP8 experts' fp16 rows (`_rows_f16_block`, one (token, column block) each), so that
    # decode needs no launch of its own for them
    if ROWS:
        pid = tl.program_id(0)
        if pid > 0:
            col_blocks = tl.cdiv(cols, ROWS_BLOCK)
            _rows_f16_block(x_ptr, xo_ptr, (pid - 1) // col_blocks, (pid - 1) % col_blocks, cols, stride_x,
                            stride_xo, ROWS_BLOCK, ASM)
            return
    offs_t = tl.arange(0, BLOCK_T)
    offs_e = tl.arange(0, BLOCK_E)
    t_ok = offs_t < tokens
    e_ok = offs_e < experts
    ok = t_ok[:, None] & e_ok[None, :]
    logits = tl.load(logits_ptr + offs_t[:, None] * stride_l + offs_e[None, :], mask=ok, other=0.0)
    logits = tl.where(e_ok[None, :], logits.to(tl.float32), float("-inf"))  # rows past `tokens`: finite, unused
    p = tl.exp(logits - tl.max(logits, 1)[:, None])
    p = p / tl.sum(p, 1)[:, None]
    p = tl.where(e_ok[None, :], p, -1.0)
    slot = tl.full((BLOCK_T, BLOCK_E), -1, tl.int32)  # which of the token's choices this expert is, -1: none
    chosen_p = tl.zeros((BLOCK_T, BLOCK_E), tl.float32)
    total = tl.zeros((BLOCK_T,), tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, 1)
        idx = tl.min(tl.where(p == best[:, None], offs_e[None, :], BLOCK_E), 1)
        hit = offs_e[None, :] == idx[:, None]
        slot = tl.where(hit, j, slot)
        chosen_p = tl.where(hit, best[:, None], chosen_p)
        total += best
        p = tl.where(hit, -1.0, p)
    if RENORMALIZE:
        chosen_p = chosen_p / total[:, None]
    chosen = (slot >= 0) & t_ok[:, None]
    pair = offs_t[:, None] * TOP_K + slot
    tl.store(weights_ptr + pair, chosen_p.to(weights_ptr.dtype.element_ty), mask=chosen)
    hits = chosen.to(tl.int32)
    counts = tl.sum(hits, 0)  # (BLOCK_E,)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, 0)
    rank = tl.cumsum(hits, 0) - hits  # earlier tokens that chose the same expert
    dest = (padded_end - padded)[None, :] + rank
    num_pairs = tokens * TOP_K
    for s0 in range(0, num_blocks * BLOCK_M, BLOCK_S):  # every row "no pair" first ...
        offs_s = s0 + tl.arange(0, BLOCK_S)
        tl.store(pair_ids_ptr + offs_s, tl.full((BLOCK_S,), 0, tl.int32) + num_pairs, mask=offs_s < num_blocks * BLOCK_M)
    tl.debug_barrier()  # ... then the pairs over them (one program: the barrier orders the two writes)
    tl.store(pair_ids_ptr + dest, pair, mask=chosen)
    for b0 in range(0, num_blocks, BLOCK_S):
        offs_b = b0 + tl.arange(0, BLOCK_S)
        before = tl.sum((padded_end[None, :] <= (offs_b * BLOCK_M)[:, None]).to(tl.int32), 1)  # searchsorted, right
        expert = tl.where(before < experts, before, -1)
        tl.store(block_expert_ptr + offs_b, expert, mask=offs_b < num_blocks)


def route_and_align_warps(elements: int) -> int:
    """Warps of the one-program routing kernel for a (tokens, experts) tile of ``elements``: 4 for decode-sized
    tiles, 16 above 1,024 (H200, 8 experts, CUDA graphs: 2,048 tokens 302 us with 4 warps, 28.4 with 8, 23.3 with
    16, where the torch ops take 100; 128 tokens 3.1 / 2.9 / 3.2)."""
    return 4 if elements <= 1024 else 16


def route_and_align(router_logits: torch.Tensor, top_k: int, renormalize: bool, dtype: torch.dtype,
                    block_m: int, rows: tuple[torch.Tensor, torch.Tensor] | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(weights (T, top_k) in dtype, pair_ids, block_expert)``: `lmserver.kernels.reference.route`'s weights and
    `align_pairs`'s grouping of its experts; one Triton program up to ``ROUTE_ALIGN_MAX_ELEMENTS`` (tokens x
    experts, padded to powers of two), torch ops above. Ties between equal probabilities go to the lower expert index
    in the kernel. ``rows`` (x (T, K), out (T, K) float16): also writes out = fp16(x * 2^-4), the FP8 experts'
    operand (`_rows_f16`): in the routing kernel's launch (more programs), or in a launch of its own above the
    one-program limit. Mutates ``rows[1]`` only."""
    from lmserver.kernels.reference import route

    tokens, experts = router_logits.shape
    block_t, block_e = triton.next_power_of_2(tokens), triton.next_power_of_2(experts)
    asm = not _interpreted()
    if block_t * block_e > ROUTE_ALIGN_MAX_ELEMENTS:
        if rows is not None:
            x, out = rows
            _rows_f16_kernel[(tokens, triton.cdiv(x.shape[1], ROWS_F16_BLOCK))](
                x, out, x.shape[1], x.stride(0), out.stride(0), BLOCK=ROWS_F16_BLOCK, ASM=asm, num_warps=4)
        weights, chosen = route(router_logits, top_k, renormalize, dtype)
        return (weights, *align_pairs(chosen, experts, block_m))
    num_blocks = max_blocks(tokens * top_k, experts, block_m)
    dev = router_logits.device
    weights = torch.empty(tokens, top_k, dtype=dtype, device=dev)
    pair_ids = torch.empty(num_blocks * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=dev)
    x, out = rows if rows is not None else (router_logits, router_logits)  # placeholders, not read without ROWS
    conversions = tokens * triton.cdiv(x.shape[1], ROWS_F16_BLOCK) if rows is not None else 0
    _route_align_kernel[(1 + conversions,)](
        router_logits, weights, pair_ids, block_expert, tokens, experts, router_logits.stride(0), num_blocks,
        x, out, x.shape[1], x.stride(0), out.stride(0),
        TOP_K=top_k, RENORMALIZE=renormalize, BLOCK_M=block_m, BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_S=128,
        ROWS=rows is not None, ROWS_BLOCK=ROWS_F16_BLOCK, ASM=asm, num_warps=route_and_align_warps(block_t * block_e),
    )
    return weights, pair_ids, block_expert


@triton.jit
def _program_tile(GROUP_M: tl.constexpr):
    # (block, column tile) of this program of a (blocks, column tiles) grid, in `MoeLaunch.group_m`'s order
    if GROUP_M == 0:
        block = tl.program_id(0)
        tile = tl.program_id(1)
    else:
        blocks = tl.num_programs(0)
        pid = tl.program_id(1) * blocks + tl.program_id(0)  # the hardware's launch order
        in_group = GROUP_M * tl.num_programs(1)
        first = (pid // in_group) * GROUP_M
        size = tl.minimum(blocks - first, GROUP_M)
        block = first + (pid % in_group) % size
        tile = (pid % in_group) // size
    return block, tile


@triton.jit
def _block_pairs(block, block_expert_ptr, pair_ids_ptr, num_pairs, BLOCK_M: tl.constexpr):
    # block `block`: (its expert, -1 past the used blocks; its pair ids; which rows hold a pair)
    pairs = tl.load(pair_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    return tl.load(block_expert_ptr + block), pairs, pairs < num_pairs


@triton.jit
def _mma(a, w, acc, s_ptr, k0, n_ok, as_rows, a_ok, PRECISION: tl.constexpr, W_SCALE: tl.constexpr,
         GROUP_K: tl.constexpr, A_SCALE: tl.constexpr, ASM: tl.constexpr, ACC_K: tl.constexpr):
    # acc + a (BLOCK_M, BLOCK_K) @ w (BLOCK_N, BLOCK_K).T. W_SCALE 0: model-dtype weights; 1: FP8 with per-row scales
    # (applied after the K loop, `_scaled`); 2: FP8 with block scales, the tile's partial sums times its scale block
    # (s_ptr: the rows' scale rows, this K tile's column k0 // GROUP_K). FP8: `a` is fp16 already (A_SCALE False) or
    # converted here, in every program and K step (A_SCALE: times 2^-4; `MoeLaunch.rows_f16` False). 3: W8A8, `a`
    # e4m3 rows too (both per-row scales applied after the K loop), ACC_K: `MoeLaunch.fp8_acc_k`. 4: W8A8 with block
    # scales, e4m3 rows with one scale per K block (as_rows: the rows' scale rows, a_ok: which rows hold a pair), the
    # tile's sums times the rows' and the weight block's scales
    if W_SCALE == 0:
        out = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
    elif W_SCALE == 3 and ACC_K == 0:
        out = tl.dot(a, tl.trans(w), acc)
    elif W_SCALE == 3:
        out = tl.dot(a, tl.trans(w), acc, max_num_imprecise_acc=ACC_K)
    elif W_SCALE == 4:
        s = tl.load(s_ptr + k0 // GROUP_K, mask=n_ok, other=0.0)
        a_s = tl.load(as_rows + k0 // GROUP_K, mask=a_ok, other=0.0)
        out = acc + tl.dot(a, tl.trans(w)) * (a_s[:, None] * s[None, :])
    elif W_SCALE == 1:
        out = tl.dot(_rows_f16(a, A_SCALE, ASM), tl.trans(w.to(tl.float16)), acc)
    else:
        s = tl.load(s_ptr + k0 // GROUP_K, mask=n_ok, other=0.0)
        out = acc + tl.dot(_rows_f16(a, A_SCALE, ASM), tl.trans(w.to(tl.float16))) * s[None, :]
    return out


@triton.jit
def _scaled(acc, s_ptr, n_ok, W_SCALE: tl.constexpr, UNSCALE: tl.constexpr):
    # the finished float32 sums: per-row scales (s_ptr: the rows' scales) and the rows' 2^-4 undone (UNSCALE; exact).
    # W8A8 (3): the weight rows' scales here, the activation rows' by the caller
    if W_SCALE == 1 or W_SCALE == 3:
        acc = acc * tl.load(s_ptr, mask=n_ok, other=0.0)[None, :]
    if (W_SCALE == 1 or W_SCALE == 2) and UNSCALE:
        acc = acc * 16.0
    return acc


@triton.jit
def _gate_up_kernel(
    x_ptr, w, s_ptr, h_ptr, pair_ids_ptr, block_expert_ptr, xs_ptr,
    num_pairs, inter, hidden,
    stride_x, stride_we, stride_wn, stride_h, stride_se, stride_sn, stride_xs,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, W_DESC: tl.constexpr,
    W_SCALE: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, A_SCALE: tl.constexpr,
    UNSCALE: tl.constexpr, ACT: tl.constexpr, ASM: tl.constexpr, ACC_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # W_DESC: `w` is a tensor descriptor over the (experts * 2 * inter, hidden) weight rows, else a pointer.
    # W_SCALE (`_mma`): s_ptr the (E, 2 * inter) row scales (stride_sn 1) or (E, row blocks, column blocks) block
    # scales. ACT: the activation dtype (the epilogue's roundings); FP8 experts: x is fp16 (scaled by 2^-4 when
    # UNSCALE) unless A_SCALE, and h is written in fp16, times 2^-4 when UNSCALE (the down kernel's operand); W8A8
    # (W_SCALE 3, 4): x is e4m3 with its tokens' scales at xs_ptr (4: per K block), and h is written in ACT (quantized
    # after)
    block, tile = _program_tile(GROUP_M)
    expert, pairs, valid = _block_pairs(block, block_expert_ptr, pair_ids_ptr, num_pairs, BLOCK_M)
    if expert < 0:
        return
    tokens = tl.where(valid, pairs // TOP_K, 0).to(tl.int64)
    n0 = tile * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + tokens[:, None] * stride_x
    xs_rows = xs_ptr + tokens * stride_xs  # W8A8: the token rows' scales (W_SCALE 4: a row of K blocks' scales)
    row_gate = expert * (2 * inter) + n0  # descriptor rows; past `inter` they belong to other rows: masked on store
    if not W_DESC:
        w_gate = w + expert.to(tl.int64) * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
        w_up = w_gate + inter * stride_wn
    s_rows = s_ptr + expert.to(tl.int64) * stride_se
    if W_SCALE == 2 or W_SCALE == 4:
        s_gate = s_rows + (offs_n // GROUP_N) * stride_sn
        s_up = s_rows + ((inter + offs_n) // GROUP_N) * stride_sn
    else:
        s_gate = s_rows + offs_n * stride_sn
        s_up = s_gate + inter * stride_sn
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < hidden
        a = tl.load(x_rows + k[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        if W_DESC:
            g = w.load([row_gate, k0])  # columns past `hidden` read as zeros
            u = w.load([row_gate + inter, k0])
        else:
            g = tl.load(w_gate + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            u = tl.load(w_up + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc_gate = _mma(a, g, acc_gate, s_gate, k0, n_ok, xs_rows, valid, PRECISION, W_SCALE, GROUP_K, A_SCALE, ASM,
                        ACC_K)
        acc_up = _mma(a, u, acc_up, s_up, k0, n_ok, xs_rows, valid, PRECISION, W_SCALE, GROUP_K, A_SCALE, ASM, ACC_K)
    acc_gate = _scaled(acc_gate, s_gate, n_ok, W_SCALE, UNSCALE)
    acc_up = _scaled(acc_up, s_up, n_ok, W_SCALE, UNSCALE)
    if W_SCALE == 3:  # the token rows' scales (padding rows: 0)
        x_scale = tl.load(xs_rows, mask=valid, other=0.0)[:, None]
        acc_gate = acc_gate * x_scale
        acc_up = acc_up * x_scale
    gate = acc_gate.to(ACT).to(tl.float32)
    up = acc_up.to(ACT).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(ACT).to(tl.float32)
    h = (act * up).to(ACT)
    if W_SCALE == 1 or W_SCALE == 2:
        h = _rows_f16(h, UNSCALE, ASM)  # exact: an fp16 value times 2^-4 (within fp16's range up to ~1.05e6)
    h_rows = h_ptr + pairs[:, None].to(tl.int64) * stride_h
    tl.store(h_rows + offs_n[None, :], h, mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(
    h_ptr, w, s_ptr, y_ptr, weights_ptr, pair_ids_ptr, block_expert_ptr, hs_ptr,
    num_pairs, hidden, inter,
    stride_h, stride_we, stride_wn, stride_y, stride_se, stride_sn, stride_hs,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    W_DESC: tl.constexpr,
    W_SCALE: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, UNSCALE: tl.constexpr, ACC_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # W_DESC: `w` is a tensor descriptor over the (experts * hidden, inter) weight rows, else a pointer.
    # W_SCALE (`_mma`): s_ptr the (E, hidden) row scales (stride_sn 1) or (E, row blocks, column blocks) block scales;
    # FP8 experts: h is fp16, times 2^-4 when UNSCALE (the gate-up kernel wrote it so); W8A8 (W_SCALE 3, 4): h is
    # e4m3 with its pairs' scales at hs_ptr (4: per K block)
    block, tile = _program_tile(GROUP_M)
    expert, pairs, valid = _block_pairs(block, block_expert_ptr, pair_ids_ptr, num_pairs, BLOCK_M)
    if expert < 0:
        return
    safe_pairs = tl.where(valid, pairs, 0).to(tl.int64)
    n0 = tile * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    h_rows = h_ptr + safe_pairs[:, None] * stride_h
    hs_rows = hs_ptr + safe_pairs * stride_hs  # W8A8: the pair rows' scales (W_SCALE 4: a row of K blocks' scales)
    if not W_DESC:
        w_rows = w + expert.to(tl.int64) * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
    if W_SCALE == 2 or W_SCALE == 4:
        s_rows = s_ptr + expert.to(tl.int64) * stride_se + (offs_n // GROUP_N) * stride_sn
    else:
        s_rows = s_ptr + expert.to(tl.int64) * stride_se + offs_n * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < inter
        a = tl.load(h_rows + k[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        if W_DESC:
            wt = w.load([expert * hidden + n0, k0])
        else:
            wt = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc = _mma(a, wt, acc, s_rows, k0, n_ok, hs_rows, valid, PRECISION, W_SCALE, GROUP_K, False, False, ACC_K)
    acc = _scaled(acc, s_rows, n_ok, W_SCALE, UNSCALE)
    if W_SCALE == 3:  # the pair rows' scales
        acc = acc * tl.load(hs_rows, mask=valid, other=0.0)[:, None]
    dtype = y_ptr.dtype.element_ty
    scale = tl.load(weights_ptr + safe_pairs, mask=valid, other=0.0).to(tl.float32)
    out = (acc.to(dtype).to(tl.float32) * scale[:, None]).to(dtype)
    tl.store(y_ptr + safe_pairs[:, None] * stride_y + offs_n[None, :], out, mask=valid[:, None] & n_ok[None, :])


def _check(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int) -> None:
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise KernelInputError(f"expected x (T, hidden), w13 (E, 2*inter, hidden), w2 (E, hidden, inter); got "
                               f"{tuple(x.shape)}, {tuple(w13.shape)}, {tuple(w2.shape)}")
    experts, two_inter, hidden = w13.shape
    if x.shape[1] != hidden or w2.shape != (experts, hidden, two_inter // 2) or two_inter % 2:
        raise KernelInputError(f"shapes disagree: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    if router_logits.shape != (x.shape[0], experts):
        raise KernelInputError(f"router_logits must be ({x.shape[0]}, {experts}), got {tuple(router_logits.shape)}")
    if not 1 <= top_k <= experts:
        raise KernelInputError(f"top_k must be in [1, {experts}], got {top_k}")
    if w2.dtype != w13.dtype or (x.dtype != w13.dtype and w13.dtype != FP8_DTYPE):
        raise KernelInputError(f"x, w13 and w2 must share a dtype (or w13 and w2 be {FP8_DTYPE} with scales), got "
                               f"{x.dtype}, {w13.dtype}, {w2.dtype}")
    check_last_dim_contiguous(x=x, router_logits=router_logits, w13=w13, w2=w2)


def _check_scales(w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor | None, w2_scale: torch.Tensor | None,
                  scale_block: tuple[int, int] | None) -> None:
    fp8 = w13.dtype == FP8_DTYPE
    if not fp8:
        if w13_scale is not None or w2_scale is not None or scale_block is not None:
            raise KernelInputError(f"scales are for {FP8_DTYPE} experts; w13 is {w13.dtype}")
        return
    if w13_scale is None or w2_scale is None:
        raise KernelInputError(f"{FP8_DTYPE} experts need w13_scale and w2_scale")
    experts, two_inter, hidden = w13.shape
    want13: tuple[int, ...]
    want2: tuple[int, ...]
    if scale_block is None:
        want13, want2 = (experts, two_inter), (experts, hidden)
    else:
        bn, bk = scale_block
        if bk < 16 or bk % 16:
            raise KernelInputError(f"block scales need a multiple of 16 columns per block, got {scale_block}")
        want13 = (experts, triton.cdiv(two_inter, bn), triton.cdiv(hidden, bk))
        want2 = (experts, triton.cdiv(hidden, bn), triton.cdiv(two_inter // 2, bk))
    for name, s, want in (("w13_scale", w13_scale, want13), ("w2_scale", w2_scale, want2)):
        if tuple(s.shape) != want or s.dtype != torch.float32 or s.device != w13.device:
            raise KernelInputError(f"{name} must be float32 {want} on {w13.device} (scale_block {scale_block}), got "
                                   f"{s.dtype} {tuple(s.shape)} on {s.device}")
    check_last_dim_contiguous(w13_scale=w13_scale, w2_scale=w2_scale)


def fused_moe(
    x: torch.Tensor,  # (T, hidden)
    router_logits: torch.Tensor,  # (T, num_experts)
    w13: torch.Tensor,  # (E, 2 * inter, hidden): gate rows then up rows
    w2: torch.Tensor,  # (E, hidden, inter)
    top_k: int,
    renormalize: bool = True,
    launch: MoeLaunch | None = None,
    w13_scale: torch.Tensor | None = None,  # FP8: (E, 2 * inter) float32, or (E, row blocks, column blocks)
    w2_scale: torch.Tensor | None = None,  # FP8: (E, hidden) float32, or (E, row blocks, column blocks)
    scale_block: tuple[int, int] | None = None,  # FP8 block scales: (rows, columns) per block; None: per row
) -> torch.Tensor:
    """``moe_forward_native``'s result from two Triton launches; returns a new (T, hidden) tensor.
    Mutates nothing. ``launch`` overrides `choose_moe_launch` (benchmarks, tests); its ``tma`` is honoured only
    where `descriptors_ok` (else the same tiles with pointer loads). FP8 experts (w13 and w2 float8_e4m3fn) take
    their scales (module docstring; the `lmserver.layers.moe.MoE` layout); ``launch.block_k`` must divide
    ``scale_block[1]``; a ``launch.w8a8`` quantizes the activation rows per token (block scales: per token and
    ``scale_block[1]`` columns, a power of two) to e4m3 (W8A8, module docstring: the dense FP8 prefill's semantics;
    `choose_moe_launch` picks it at prefill sizes for per-row scales)."""
    _check(x, router_logits, w13, w2, top_k)
    _check_scales(w13, w2, w13_scale, w2_scale, scale_block)
    tokens, hidden = x.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    if tokens == 0:
        return torch.empty_like(x)
    num_pairs = tokens * top_k
    fp8 = w13.dtype == FP8_DTYPE
    group_n, group_k = scale_block or (1, 1)
    descriptors = descriptors_ok(x, w13, w2)
    cfg = launch or choose_moe_launch(num_pairs, num_experts, x.element_size(), descriptors, fp8,
                                      scale_block[1] if scale_block else None)
    if scale_block is not None and group_k % cfg.block_k:
        raise KernelInputError(f"block_k {cfg.block_k} must divide the scale blocks' {group_k} columns")
    w8a8 = fp8 and cfg.w8a8
    if w8a8 and cfg.block_k < 32:
        raise KernelInputError(f"W8A8 launches (MoeLaunch.w8a8) need block_k >= 32 (FP8 MMAs), got {cfg.block_k}")
    if w8a8 and scale_block is not None and group_k & (group_k - 1):
        raise KernelInputError(f"W8A8 launches with block scales need a power-of-two group_k, got {scale_block}")
    acc_k = cfg.fp8_acc_k if w8a8 else 0
    if acc_k and (acc_k % 32 or cfg.block_k % acc_k):
        raise KernelInputError(f"fp8_acc_k {acc_k} must be a multiple of 32 dividing block_k {cfg.block_k}")
    # W_SCALE 0 / 1 / 2: model-dtype / per-row / block-scaled FP8 weights. FP8: the MMA's operands in fp16, bf16 and
    # float32 activations times 2^-4 (UNSCALE: the sums times 16), converted once per token in the routing launch
    # (`MoeLaunch.rows_f16`) or in each program's K loop; h in fp16 (written so by the gate-up kernel). 3: W8A8,
    # per-row-scaled FP8 weights and per-token e4m3 rows (x quantized here, h after the gate-up kernel); 4: W8A8 with
    # block scales, the rows quantized per token and group_k columns
    w_scale = 0 if not fp8 else (4 if scale_block else 3) if w8a8 else 2 if scale_block else 1
    unscale = fp8 and not w8a8 and x.dtype != torch.float16
    asm = fp8 and not _interpreted()
    x_op = x
    x_scale = x  # a placeholder pointer, never read without W8A8
    if w8a8:
        x_op, x_scale = _quantize_groups(x, group_k) if scale_block else _quantize_rows(x)
    elif unscale and cfg.rows_f16:
        x_op = torch.empty(tokens, hidden, dtype=torch.float16, device=x.device)
    weights, pair_ids, block_expert = route_and_align(router_logits, top_k, renormalize, x.dtype, cfg.block_m,
                                                      rows=(x, x_op) if unscale and x_op is not x else None)
    blocks = block_expert.numel()
    precision = dot_precision(x.dtype)
    tma = cfg.tma and descriptors
    w_up: torch.Tensor | TensorDescriptor = w13
    w_down: torch.Tensor | TensorDescriptor = w2
    if tma:  # the weights as 2-D row tables, one tile per load
        w_up = TensorDescriptor.from_tensor(w13.view(-1, hidden), [cfg.block_n_up, cfg.block_k])
        w_down = TensorDescriptor.from_tensor(w2.view(-1, inter), [cfg.block_n_down, cfg.block_k])
    s13 = w13_scale if w13_scale is not None else w13  # a placeholder pointer, never read without W_SCALE
    s2 = w2_scale if w2_scale is not None else w2
    s13_strides = (s13.stride(0), s13.stride(1)) if fp8 else (0, 0)
    s2_strides = (s2.stride(0), s2.stride(1)) if fp8 else (0, 0)
    h = torch.empty(num_pairs, inter, dtype=torch.float16 if fp8 and not w8a8 else x.dtype, device=x.device)
    _gate_up_kernel[(blocks, triton.cdiv(inter, cfg.block_n_up))](
        x_op, w_up, s13, h, pair_ids, block_expert, x_scale, num_pairs, inter, hidden,
        x_op.stride(0), w13.stride(0), w13.stride(1), h.stride(0), *s13_strides, x_scale.stride(0),
        TOP_K=top_k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n_up, BLOCK_K=cfg.block_k, PRECISION=precision,
        W_DESC=tma, num_warps=cfg.num_warps, num_stages=cfg.num_stages, W_SCALE=w_scale, GROUP_N=group_n,
        GROUP_K=group_k, A_SCALE=unscale and x_op is x, UNSCALE=unscale, ACT=_TL_DTYPES[x.dtype], ASM=asm,
        ACC_K=acc_k, GROUP_M=cfg.group_m,
    )
    h_op, h_scale = h, h  # W8A8: each pair's whole row under one scale, or one per group_k columns
    if w8a8:
        h_op, h_scale = _quantize_groups(h, group_k) if scale_block else _quantize_rows(h)
    y = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    _down_kernel[(blocks, triton.cdiv(hidden, cfg.block_n_down))](
        h_op, w_down, s2, y, weights, pair_ids, block_expert, h_scale, num_pairs, hidden, inter,
        h_op.stride(0), w2.stride(0), w2.stride(1), y.stride(0), *s2_strides, h_scale.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n_down, BLOCK_K=cfg.block_k, PRECISION=precision,
        W_DESC=tma, num_warps=cfg.num_warps, num_stages=cfg.num_stages, W_SCALE=w_scale, GROUP_N=group_n,
        GROUP_K=group_k, UNSCALE=unscale, ACC_K=acc_k, GROUP_M=cfg.group_m,
    )
    return y.view(tokens, top_k, hidden).sum(dim=1) if top_k > 1 else y
