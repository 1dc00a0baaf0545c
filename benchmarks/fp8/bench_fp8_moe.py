"""The fused MoE kernels with FP8 (e4m3) experts against bf16 ones on a GPU (issue 33; CUDA only).

Mixtral-8x7B's layer (hidden 4096, expert intermediate 14336, 8 experts, top-2), random weights quantized per row
(what `--quantization fp8` does; `--blocks` adds 128 x 128 block scales), random router logits per input set (8
sets rotated in a CUDA graph, so each replay routes differently). First a check of every path against the torch
reference on the dequantized experts in float32 (the exit status is 1 and nothing is timed when one fails): the
W8A16 paths (fp16 operands: decode, block scales, per-row prefill on its former tiles) against the product with the
unquantized rows; the W8A8 prefill (per-row scales above 16 pairs per expert: rows and h quantized per token to
e4m3, FP8 x FP8 MMAs) against the product with the dequantized per-token FP8 rows (`w8a8_reference`), and against the
unquantized one within W8A8_VS_UNQUANTIZED (the activations' e4m3 rounding): the default sums in the FP8 tensor
cores' fast accumulation (sm_90), "w8a8 promote" adds each 128-wide K tile's sums to float32 (its error against the
W8A8 reference says what fast accumulation costs). Then per token count: bf16 `fused_moe`
and FP8 `fused_moe` (the defaults: W8A8 with TMA descriptors at prefill sizes), µs per call (CUDA-graph replays),
GB/s of the expert bytes the routing actually reads (the experts touched, mean over the sets, their weights and
scales), and the floor: those bytes at 4.8 TB/s (the H200's peak) or the FLOPs at 989 TFLOP/s (fp16 / bf16 MMAs)
or 1,979 (W8A8's FP8 MMAs), whichever is larger. At prefill sizes also the W8A8 pointer tiles (no TMA), W8A8 with
float32 promotion, and the W8A16 prefill (the FP8 default before W8A8); with `--blocks`, the block-scaled experts'
opt-in W8A8 (rows quantized per token and 128 columns) next to their W8A16 default.

`--sweep` also times FP8 launch candidates (decode tiles at 1 and 8 tokens, W8A8 prefill tiles at 4,096) and prints
the best five with the default's time.

    python benchmarks/fp8/bench_fp8_moe.py [--tokens 1,2,4,8,16,64,512,4096] [--blocks] [--sweep] [--json out.json]

Never collected by pytest.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
from bench_kernels import rel_error, time_graph  # noqa: E402

from lmserver.kernels.fp8_ref import quantize_fp8_per_token  # noqa: E402
from lmserver.kernels.fused_moe import (  # noqa: E402
    FP8_PREFILL_BLOCKS_W8A8_LAUNCH,
    FP8_PREFILL_LAUNCH,
    FP8_PREFILL_TMA_LAUNCH,
    PREFILL_LAUNCH,
    MoeLaunch,
    choose_moe_launch,
    descriptors_ok,
    fused_moe,
)
from lmserver.kernels.reference import route  # noqa: E402
from lmserver.layers.moe import dequantize_experts, moe_forward_native, quantize_experts  # noqa: E402

HIDDEN, INTER, EXPERTS, TOP_K = 4096, 14336, 8, 2
PEAK_BYTES_S = 4.8e12  # H200 HBM3e peak
PEAK_BF16_FLOPS = 989e12  # H200 dense tensor-core peak (bf16 / fp16)
PEAK_FP8_FLOPS = 1979e12  # H200 dense tensor-core peak (e4m3)
NUM_SETS = 8
BLOCK = (128, 128)
CHECK_TOL = 2e-2  # every path against its float32 reference (the output's bf16 rounding: ~2e-3)
W8A8_VS_UNQUANTIZED = 8e-2  # W8A8 against the unquantized rows' product (test_fp8_moe_kernels.py: ~4.7e-2 expected)
# the FP8 variants checked and timed at prefill sizes besides the defaults (per-row: W8A8 with TMA descriptors on
# the H200, the FP8 MMAs' fast accumulation; blocks: W8A16): (column header, experts, launch); "blocks" ones with
# --blocks only
PREFILL_VARIANTS = {
    "w8a8 ptr": ("fp8 W8A8 pointer tiles us", "rows", FP8_PREFILL_LAUNCH),
    "w8a8 promote": ("fp8 W8A8 float32 promotion every 128 K us", "rows",
                     replace(FP8_PREFILL_TMA_LAUNCH, block_n_down=128, fp8_acc_k=128)),
    "w8a16": ("fp8 W8A16 prefill (fp16 operands) us", "rows", PREFILL_LAUNCH),
    "blocks w8a8": ("fp8 128x128 blocks W8A8 us", "blocks", FP8_PREFILL_BLOCKS_W8A8_LAUNCH),
}


def variants(kinds: list[str]) -> list[str]:
    """The PREFILL_VARIANTS whose experts are among ``kinds``."""
    return [name for name, (_, experts_kind, _) in PREFILL_VARIANTS.items() if experts_kind in kinds]
# FP8 candidates: (block_m, block_n_up, block_n_down, block_k, warps, stages)
# none spills in sm_90 code (benchmarks/fp8/ptx_fp8_moe.py's ptxas check; 512-column steps do in gate-up: its
# 16 x 512 fp16 operand is held whole by every warp)
DECODE_SWEEP = [MoeLaunch(*t) for t in (
    (16, 32, 64, 256, 4, 4), (16, 32, 64, 256, 4, 5), (16, 32, 64, 256, 4, 6), (16, 32, 32, 256, 4, 5),
    (16, 32, 32, 256, 4, 6), (16, 32, 128, 256, 4, 4), (16, 64, 64, 256, 4, 4), (16, 64, 64, 256, 8, 4),
    (16, 32, 64, 128, 4, 6), (16, 64, 128, 128, 4, 6), (16, 128, 64, 256, 8, 4), (16, 32, 64, 256, 8, 5),
)] + [MoeLaunch(16, 32, 64, 256, 4, 5, rows_f16=False)]  # the rows converted in the K loop
# W8A8 prefill candidates (128-wide e4m3 K tiles: the bytes of bf16's 64-wide ones; 256: two stages fit)
PREFILL_SWEEP = [MoeLaunch(*t, w8a8=True) for t in (
    (128, 128, 128, 128, 8, 4), (128, 128, 256, 128, 8, 3), (64, 128, 128, 128, 4, 4), (128, 64, 128, 128, 4, 4),
)] + [MoeLaunch(*t, tma=True, w8a8=True) for t in (
    (128, 128, 256, 128, 8, 3), (128, 128, 128, 128, 8, 4), (128, 128, 128, 128, 8, 3), (64, 128, 256, 128, 4, 4),
    (128, 128, 128, 256, 8, 2),
)] + [replace(FP8_PREFILL_TMA_LAUNCH, group_m=g) for g in (8, 16)]  # programs in groups of blocks (`group_m`)


def experts(g: torch.Generator, blocks: bool) -> dict[str, Any]:
    """bf16 experts and their FP8 quantizations (per row; per 128 x 128 block with `blocks`), on the GPU."""
    w13 = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g, device="cuda") / HIDDEN**0.5).bfloat16()
    w2 = (torch.randn(EXPERTS, HIDDEN, INTER, generator=g, device="cuda") / INTER**0.5).bfloat16()
    out: dict[str, Any] = {"bf16": (w13, w2), "rows": (*quantize_experts(w13), *quantize_experts(w2))}
    if blocks:
        out["blocks"] = (*quantize_experts(w13, BLOCK), *quantize_experts(w2, BLOCK))
    return out


def call(kind: str, w: dict[str, Any], launch: MoeLaunch | None = None) -> Callable[[torch.Tensor, torch.Tensor],
                                                                                     torch.Tensor]:
    """``kind``: "bf16", "rows", "blocks", or a PREFILL_VARIANTS name (its experts on its launch)."""
    if kind in PREFILL_VARIANTS:
        _, kind, launch = PREFILL_VARIANTS[kind]
    if kind == "bf16":
        w13, w2 = w["bf16"]
        return lambda x, lg: fused_moe(x, lg, w13, w2, TOP_K, launch=launch)
    q13, s13, q2, s2 = w[kind]
    block = BLOCK if kind == "blocks" else None
    return lambda x, lg: fused_moe(x, lg, q13, q2, TOP_K, launch=launch, w13_scale=s13, w2_scale=s2,
                                   scale_block=block)


def is_w8a8(kind: str, tokens: int, launch: MoeLaunch | None = None) -> bool:
    """Whether `call(kind, w, launch)` runs W8A8 at ``tokens`` (the default: `choose_moe_launch`'s)."""
    if kind in PREFILL_VARIANTS:
        return PREFILL_VARIANTS[kind][2].w8a8
    if kind != "rows":
        return False
    return (launch or choose_moe_launch(tokens * TOP_K, EXPERTS, 2, True, fp8=True)).w8a8


def dequantized_rows(x: torch.Tensor, group: int | None) -> torch.Tensor:
    """x's rows quantized to e4m3 per token (``group`` None) or per token and ``group`` columns, dequantized."""
    if group is None:
        q, scale = quantize_fp8_per_token(x)
        return q.float() * scale
    m, k = x.shape
    groups = -(-k // group)
    q, scale = quantize_fp8_per_token(torch.nn.functional.pad(x, (0, groups * group - k)).reshape(m * groups, group))
    return (q.float() * scale).view(m, groups * group)[:, :k]


def w8a8_reference(w: dict[str, Any], x: torch.Tensor, lg: torch.Tensor, kind: str = "rows") -> torch.Tensor:
    """The W8A8 MoE in float32 on the FP8 experts ``kind`` ("rows", "blocks": rows quantized per 128 columns): x
    quantized and dequantized, gate / up / silu / h rounded to x's dtype as the kernel does, h quantized per pair, the
    down rows, the routing weights."""
    q13, s13, q2, s2 = w[kind]
    block = BLOCK if kind == "blocks" else None
    group = BLOCK[1] if block else None
    weights, chosen = route(lg, TOP_K, True, x.dtype)
    rows = dequantized_rows(x, group)
    out = torch.zeros(x.shape[0], HIDDEN, dtype=torch.float32, device=x.device)
    for e in torch.unique(chosen).tolist():
        token, slot = torch.nonzero(chosen == e, as_tuple=True)
        gate_up = rows[token] @ dequantize_experts(q13[e:e + 1], s13[e:e + 1], block, torch.float32)[0].t()
        gate, up = gate_up[:, :INTER].to(x.dtype).float(), gate_up[:, INTER:].to(x.dtype).float()
        h = (torch.nn.functional.silu(gate).to(x.dtype).float() * up).to(x.dtype)
        y = dequantized_rows(h, group) @ dequantize_experts(q2[e:e + 1], s2[e:e + 1], block, torch.float32)[0].t()
        out.index_add_(0, token, y * weights[token, slot].float()[:, None])
    return out


def reference(kind: str, w: dict[str, Any], x: torch.Tensor, lg: torch.Tensor) -> torch.Tensor:
    """The sparse torch path in float32 on the experts (dequantized for FP8), the rows unquantized."""
    if kind in PREFILL_VARIANTS:
        kind = PREFILL_VARIANTS[kind][1]
    if kind == "bf16":
        w13, w2 = w["bf16"]
        return moe_forward_native(x.float(), lg.float(), w13.float(), w2.float(), TOP_K)
    q13, s13, q2, s2 = w[kind]
    return moe_forward_native(x.float(), lg.float(), q13, q2, TOP_K,
                              scales=(s13, s2, BLOCK if kind == "blocks" else None))


def check(w: dict[str, Any], kinds: list[str], g: torch.Generator) -> list[str]:
    """Every path against its float32 reference at decode and prefill sizes, and the FP8 paths' dequantized
    experts against the bf16 ones (a wrong scale layout); returns the failures."""
    failures = []
    w13, w2 = w["bf16"]
    for kind in kinds[1:]:
        q13, s13, q2, s2 = w[kind]
        block = BLOCK if kind == "blocks" else None
        for name, q, s, full in (("w13", q13, s13, w13), ("w2", q2, s2, w2)):
            err = rel_error(dequantize_experts(q[:2], s[:2], block, torch.float32), full[:2].float())
            if not err < 0.05:  # e4m3's rounding: ~2-3% of the norm
                failures.append(f"{kind} {name} dequantized vs bf16: {err:.2e}")
    for tokens in (1, 8, 300):
        x = torch.randn(tokens, HIDDEN, generator=g, device="cuda").bfloat16()
        lg = torch.randn(tokens, EXPERTS, generator=g, device="cuda").bfloat16()
        checked = kinds + (variants(kinds) if tokens == 300 else [])
        w8a8_want = {experts_kind: w8a8_reference(w, x, lg, experts_kind) for experts_kind in ("rows", "blocks")
                     if any(is_w8a8(k, tokens) and (PREFILL_VARIANTS[k][1] if k in PREFILL_VARIANTS else k)
                            == experts_kind for k in checked)}
        for kind in checked:
            want = reference(kind, w, x, lg)
            got = call(kind, w)(x, lg)
            bf16_path = rel_error(want.bfloat16(), want)  # the output's own rounding
            err = rel_error(got, want)
            if is_w8a8(kind, tokens):
                w8a8_err = rel_error(got, w8a8_want[PREFILL_VARIANTS[kind][1] if kind in PREFILL_VARIANTS else kind])
                ok = bool(torch.isfinite(got).all()) and w8a8_err < CHECK_TOL and err < W8A8_VS_UNQUANTIZED
                line = f"rel err {w8a8_err:.2e} vs W8A8 reference, {err:.2e} vs unquantized rows"
            else:
                ok = bool(torch.isfinite(got).all()) and err < CHECK_TOL
                line = f"rel err {err:.2e}"
            print(f"check {kind:12s} tokens={tokens:<4d} {line} (bf16 rounding of the output {bf16_path:.1e})"
                  f"{'' if ok else '  FAILED'}", flush=True)
            if not ok:
                failures.append(f"{kind} tokens={tokens}: {line}")
    return failures


def expert_bytes(kind: str) -> int:
    """Bytes of one expert's weights and scales."""
    weights = 3 * HIDDEN * INTER
    if kind == "bf16":
        return 2 * weights
    if kind in PREFILL_VARIANTS:
        kind = PREFILL_VARIANTS[kind][1]
    if kind == "rows":
        return weights + 4 * (2 * INTER + HIDDEN)
    rows = lambda n, k: -(-n // BLOCK[0]) * -(-k // BLOCK[1])  # noqa: E731
    return weights + 4 * (rows(2 * INTER, HIDDEN) + rows(HIDDEN, INTER))


def bench_tokens(tokens: int, w: dict[str, Any], kinds: list[str], g: torch.Generator) -> dict[str, Any]:
    xs = [torch.randn(tokens, HIDDEN, generator=g, device="cuda").bfloat16() for _ in range(NUM_SETS)]
    lgs = [torch.randn(tokens, EXPERTS, generator=g, device="cuda").bfloat16() for _ in range(NUM_SETS)]
    touched = sum(int(torch.unique(route(lg, TOP_K, True, torch.float32)[1]).numel()) for lg in lgs) / NUM_SETS
    flops = 2 * tokens * TOP_K * 3 * HIDDEN * INTER
    prefill = choose_moe_launch(tokens * TOP_K, EXPERTS, 2, True, fp8=True).w8a8
    row: dict[str, Any] = {"tokens": tokens, "experts_touched": touched, "fp8_w8a8": prefill}
    for kind in kinds + (variants(kinds) if prefill else []):
        fn = call(kind, w)
        us = time_graph(lambda i, fn=fn: fn(xs[i], lgs[i]), NUM_SETS, reps=25 if tokens < 1024 else 10)
        nbytes = touched * expert_bytes(kind)
        flops_us = flops / (PEAK_FP8_FLOPS if is_w8a8(kind, tokens) else PEAK_BF16_FLOPS) * 1e6
        floor = max(nbytes / PEAK_BYTES_S * 1e6, flops_us)
        row[kind] = {"us": us, "gb_s": nbytes / us / 1e3, "floor_us": floor, "x_floor": us / floor}
    fp8 = row["rows"]
    extra = "".join(f" {row[k]['us']:.1f} |" if k in row else " - |" for k in variants(kinds))
    print(f"| {tokens} | {touched:.2f} | {row['bf16']['us']:.1f} | {row['bf16']['gb_s']:.0f} | {fp8['us']:.1f}"
          f"{' (W8A8)' if prefill else ''} | {fp8['gb_s']:.0f} | {fp8['floor_us']:.1f} | {fp8['x_floor']:.2f} | "
          f"{row['bf16']['us'] / fp8['us']:.2f}x |{extra}" + (f" {row['blocks']['us']:.1f} |" if "blocks" in row else ""),
          flush=True)
    return row


def sweep(w: dict[str, Any], g: torch.Generator, budget_s: float) -> list[dict[str, Any]]:
    t_end = time.monotonic() + budget_s
    rows = []
    for tokens, candidates in ((1, DECODE_SWEEP), (8, DECODE_SWEEP), (4096, PREFILL_SWEEP)):
        xs = [torch.randn(tokens, HIDDEN, generator=g, device="cuda").bfloat16() for _ in range(NUM_SETS)]
        lgs = [torch.randn(tokens, EXPERTS, generator=g, device="cuda").bfloat16() for _ in range(NUM_SETS)]
        want = reference("rows", w, xs[0], lgs[0])
        w8a8_want = w8a8_reference(w, xs[0], lgs[0]) if tokens > 64 else want
        default = choose_moe_launch(tokens * TOP_K, EXPERTS, 2, descriptors_ok(xs[0], w["rows"][0], w["rows"][2]),
                                    fp8=True)
        results = []
        for launch in [default, *candidates]:
            if time.monotonic() > t_end:
                print(f"  sweep budget spent at tokens={tokens}", file=sys.stderr)
                break
            fn = call("rows", w, launch)
            try:
                err = rel_error(fn(xs[0], lgs[0]), w8a8_want if launch.w8a8 else want)
                if not err < CHECK_TOL:
                    print(f"  {launch}: rel err {err:.2e}, skipped", file=sys.stderr)
                    continue
                us = time_graph(lambda i, fn=fn, xs=xs, lgs=lgs: fn(xs[i], lgs[i]), NUM_SETS, reps=10)
            except Exception as exc:  # e.g. out of shared memory for the largest tiles
                print(f"  {launch}: {type(exc).__name__}: {str(exc)[:100]}", file=sys.stderr)
                continue
            results.append((us, launch))
        if not results:
            continue
        default_us = next((us for us, lc in results if lc is default), float("nan"))
        results.sort(key=lambda r: r[0])
        print(f"sweep fp8 tokens={tokens}: default {default_us:.1f} us; best: " + "; ".join(
            f"{us:.1f} {lc.block_m}/{lc.block_n_up}/{lc.block_n_down}/{lc.block_k}/w{lc.num_warps}/s{lc.num_stages}"
            f"{'/tma' if lc.tma else ''}{'' if lc.rows_f16 else '/rows-in-loop'}{'/w8a8' if lc.w8a8 else ''}"
            f"{f'/group{lc.group_m}' if lc.group_m else ''}{f'/acc{lc.fp8_acc_k}' if lc.fp8_acc_k else ''}"
            for us, lc in results[:5]),
            flush=True)
        rows.append({"tokens": tokens, "default_us": default_us,
                     "best": [{"us": us, **vars(lc)} for us, lc in results[:5]]})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1,2,4,8,16,64,512,4096")
    ap.add_argument("--blocks", action="store_true", help="also time 128 x 128 block-scaled FP8 experts")
    ap.add_argument("--sweep", action="store_true", help="time FP8 launch candidates at 1, 8 and 4,096 tokens")
    ap.add_argument("--sweep-budget-s", type=float, default=150.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_fp8_moe.py needs a CUDA GPU")
    g = torch.Generator(device="cuda").manual_seed(0)
    kinds = ["bf16", "rows", *(["blocks"] if args.blocks else [])]
    with torch.no_grad():
        w = experts(g, args.blocks)
        failures = check(w, kinds, g)
        if failures:
            print("CHECK FAILED: " + "; ".join(failures), flush=True)
            return 1
        print(f"{torch.cuda.get_device_name()}; Mixtral-8x7B layer (hidden {HIDDEN}, inter {INTER}, {EXPERTS} experts,"
              f" top-{TOP_K}); floor: expert bytes read at {PEAK_BYTES_S / 1e12:.1f} TB/s or FLOPs at "
              f"{PEAK_BF16_FLOPS / 1e12:.0f} TFLOP/s")
        print("| tokens | experts read | bf16 us | bf16 GB/s | fp8 us | fp8 GB/s | fp8 floor us | fp8 x floor | "
              "bf16 / fp8 |" + "".join(f" {PREFILL_VARIANTS[k][0]} |" for k in variants(kinds))
              + (" fp8 128x128 blocks us |" if args.blocks else ""))
        print("|---" * (9 + len(variants(kinds)) + args.blocks) + "|")
        rows = [bench_tokens(int(t), w, kinds, g) for t in args.tokens.split(",")]
        swept = sweep(w, g, args.sweep_budget_s) if args.sweep else []
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows, "sweep": swept},
                                              indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
