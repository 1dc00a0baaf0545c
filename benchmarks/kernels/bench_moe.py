"""The expert MLP on a GPU: lmserver's fused MoE kernels against its two torch paths, with a floor.

For each token count: the fused Triton path (`lmserver.kernels.fused_moe`) and the dense torch twin
(every expert on every token: what decode graphs ran before) timed from CUDA-graph replays, the
sparse torch path (host sync per layer, eager), and the floor: the bytes of the experts the
routing touches at the measured copy bandwidth, or the FLOPs at the dense bf16 peak, whichever
is larger. Relative error of each path against the sparse path in float32 on the same inputs.
Routing is random (fresh router logits per input set, as with dummy weights).

    python benchmarks/kernels/bench_moe.py [--shape mixtral] [--tokens 1,4,8,64,512] [--sweep decode,prefill] [--json PATH]

`--sweep decode,prefill,wide` also times launch configurations (decode: tokens 1, 4, 8; prefill: 256, 2048; wide:
more prefill tiles at 1,024 and 2,048)
and prints the best five of each with the default's time and the routing + grouping ops' share.
Needs CUDA. Never collected by pytest.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import measure_copy_bw, rel_error, time_eager, time_graph  # noqa: E402

from lmserver.kernels.fused_moe import (  # noqa: E402
    MoeLaunch,
    choose_moe_launch,
    descriptors_ok,
    fused_moe,
    route_and_align,
)
from lmserver.kernels.reference import route
from lmserver.layers.moe import moe_forward_dense, moe_forward_native

# (hidden, inter, experts, top_k)
SHAPES = {"mixtral": (4096, 14336, 8, 2), "small": (1024, 2816, 16, 4)}
PEAK_BF16_FLOPS = 989e12  # H200 dense bf16 tensor-core peak (NVIDIA's data sheet)
NUM_SETS = 8


def make_inputs(tokens: int, shape: tuple[int, int, int, int], g: torch.Generator) -> dict:
    hidden, inter, experts, top_k = shape
    dev, dt = "cuda", torch.bfloat16
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g, device=dev, dtype=dt) / hidden**0.5)
    w2 = (torch.randn(experts, hidden, inter, generator=g, device=dev, dtype=dt) / inter**0.5)
    xs = [torch.randn(tokens, hidden, generator=g, device=dev, dtype=dt) for _ in range(NUM_SETS)]
    logits = [torch.randn(tokens, experts, generator=g, device=dev, dtype=dt) for _ in range(NUM_SETS)]
    return {"w13": w13, "w2": w2, "xs": xs, "logits": logits}


def floor_us(inp: dict, shape: tuple[int, int, int, int], copy_bw: float) -> float:
    hidden, inter, experts, top_k = shape
    touched = sum(int(torch.unique(route(lg, top_k, True, torch.float32)[1]).numel()) for lg in inp["logits"])
    expert_bytes = 3 * hidden * inter * 2
    bytes_us = touched / NUM_SETS * expert_bytes / copy_bw * 1e6
    tokens = inp["xs"][0].shape[0]
    flops_us = 2 * tokens * top_k * 3 * hidden * inter / PEAK_BF16_FLOPS * 1e6
    return max(bytes_us, flops_us)


def bench_tokens(tokens: int, shape: tuple[int, int, int, int], copy_bw: float, g: torch.Generator) -> dict:
    hidden, inter, experts, top_k = shape
    inp = make_inputs(tokens, shape, g)
    w13, w2, xs, lgs = inp["w13"], inp["w2"], inp["xs"], inp["logits"]
    want = moe_forward_native(xs[0].float(), lgs[0].float(), w13.float(), w2.float(), top_k)
    err_fused = rel_error(fused_moe(xs[0], lgs[0], w13, w2, top_k), want)
    err_sparse = rel_error(moe_forward_native(xs[0], lgs[0], w13, w2, top_k), want)
    fused = time_graph(lambda i: fused_moe(xs[i], lgs[i], w13, w2, top_k), NUM_SETS)
    sparse = time_eager(lambda i: moe_forward_native(xs[i], lgs[i], w13, w2, top_k), NUM_SETS)
    dense = (time_graph(lambda i: moe_forward_dense(xs[i], lgs[i], w13, w2, top_k), NUM_SETS)
             if tokens <= 64 else float("nan"))
    floor = floor_us(inp, shape, copy_bw)
    cfg = choose_moe_launch(tokens * top_k, experts, xs[0].element_size(), descriptors_ok(xs[0], w13, w2))
    row = {"tokens": tokens, "fused_us": fused, "dense_graph_us": dense, "sparse_eager_us": sparse, "floor_us": floor,
           "fused_x_floor": fused / floor, "err_fused": err_fused, "err_sparse_bf16": err_sparse,
           "launch": vars(cfg)}
    print(f"| {tokens} | {fused:.1f} | {dense:.1f} | {sparse:.1f} | {floor:.1f} | {fused / floor:.2f} | "
          f"{err_fused:.1e} / {err_sparse:.1e} | {cfg.block_m}/{cfg.block_n_up}/{cfg.block_n_down}/{cfg.block_k}"
          f"{' tma' if cfg.tma else ''} |",
          flush=True)
    return row


def time_launch(inp: dict, top_k: int, launch: MoeLaunch) -> float:
    w13, w2, xs, lgs = inp["w13"], inp["w2"], inp["xs"], inp["logits"]
    return time_graph(lambda i: fused_moe(xs[i], lgs[i], w13, w2, top_k, launch=launch), NUM_SETS, reps=10)


SWEEPS = {  # tokens, then MoeLaunch candidates
    "decode": ((1, 4, 8), [MoeLaunch(16, n_up, n_down, k, 4, stages) for n_up, n_down, k, stages
                           in itertools.product((32, 64, 128), (16, 32, 64), (128, 256), (3, 4))]),
    "prefill": ((256, 2048), [MoeLaunch(m, n, n, k, warps, stages) for m, n, k, warps, stages
                              in itertools.product((64, 128), (64, 128), (64, 128), (4, 8), (3, 4))]),
    # prefill tiles past the first sweep: down tiles 256 wide, longer pipelines, block_k 32 / 128
    "wide": ((1024, 2048), [MoeLaunch(*t) for t in ((128, 128, 128, 64, 8, 3), (128, 128, 256, 64, 8, 3),
                                                    (128, 128, 256, 64, 8, 4), (128, 64, 256, 64, 8, 4),
                                                    (128, 128, 128, 64, 8, 4), (128, 128, 256, 32, 8, 5),
                                                    (64, 128, 256, 64, 4, 4), (128, 128, 128, 128, 8, 2),
                                                    (256, 64, 128, 64, 8, 3))]),
}


def time_route_align(inp: dict, top_k: int, block_m: int) -> float:
    """The routing and grouping step alone, as `fused_moe` runs it (`route_and_align`)."""
    lgs = inp["logits"]
    return time_graph(lambda i: route_and_align(lgs[i], top_k, True, torch.bfloat16, block_m), NUM_SETS, reps=10)


def sweep(kind: str, shape: tuple[int, int, int, int], g: torch.Generator) -> list[dict]:
    hidden, inter, experts, top_k = shape
    token_counts, candidates = SWEEPS[kind]
    rows = []
    for tokens in token_counts:
        inp = make_inputs(tokens, shape, g)
        results = []
        for launch in candidates:
            try:
                us = time_launch(inp, top_k, launch)
            except Exception as exc:  # e.g. out of shared memory for the largest tiles
                print(f"  {launch}: {type(exc).__name__}", file=sys.stderr)
                continue
            results.append((us, launch))
        results.sort(key=lambda r: r[0])
        default = choose_moe_launch(tokens * top_k, experts, 2, descriptors_ok(inp["xs"][0], inp["w13"], inp["w2"]))
        default_us = time_launch(inp, top_k, default)
        overhead = time_route_align(inp, top_k, default.block_m)
        print(f"sweep tokens={tokens}: default {default_us:.1f} us (route + align {overhead:.1f}); best: "
              + "; ".join(f"{us:.1f} {lc.block_m}/{lc.block_n_up}/{lc.block_n_down}/{lc.block_k}/w{lc.num_warps}"
                          f"/s{lc.num_stages}" for us, lc in results[:5]), flush=True)
        rows.append({"tokens": tokens, "default_us": default_us, "route_align_us": overhead,
                     "best": [{"us": us, **vars(lc)} for us, lc in results[:5]]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="mixtral", choices=sorted(SHAPES))
    ap.add_argument("--tokens", default="1,2,4,8,16,64,256,2048")
    ap.add_argument("--sweep", default="", help="comma list of launch sweeps to run: decode, prefill, wide")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_moe.py needs a CUDA GPU")
    shape = SHAPES[args.shape]
    g = torch.Generator(device="cuda").manual_seed(0)
    copy_bw = measure_copy_bw()
    print(f"{torch.cuda.get_device_name()}, copy bandwidth {copy_bw / 1e12:.2f} TB/s; shape {args.shape} "
          f"(hidden, inter, experts, top_k) = {shape}, bf16")
    print("| tokens | fused (graph) us | dense torch (graph) us | sparse torch (eager) us | floor us | fused x floor "
          "| rel err fused / sparse bf16 | block m/n_up/n_down/k |")
    print("|---|---|---|---|---|---|---|---|")
    with torch.no_grad():
        rows = [bench_tokens(int(t), shape, copy_bw, g) for t in args.tokens.split(",")]
        swept = [r for kind in filter(None, args.sweep.split(",")) for r in sweep(kind, shape, g)]
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "copy_bw": copy_bw,
                                               "shape": args.shape, "rows": rows, "sweep": swept}, indent=1))


if __name__ == "__main__":
    main()
