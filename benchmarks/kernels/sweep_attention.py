"""Launch-parameter sweep of the Triton attention kernels on a GPU (Llama-3-8B shape, bf16).

Decode: KV splits (half, equal, twice `choose_num_kv_splits`), BLOCK_N, warps, stages, for
bs 1/8/32 x context 512/4096. Extend: (BLOCK_M, BLOCK_N, warps, stages) for a 4096-token
prefill (each tile also as the backend launches a fresh prompt: `has_prefix=False`, no cache read) and chunks over
cached prefixes. Each variant is checked against the reference before it is timed (CUDA-graph
replays, median). Prints the best variant per shape and the default's time; the defaults in
`lmserver.kernels` are set from these results.

    python benchmarks/kernels/sweep_attention.py [--json PATH] [--budget-s 120]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_kernels import decode_inputs, rel_error, sets_for, time_graph  # noqa: E402


def sweep_decode(deadline: float) -> list[dict]:
    from lmserver.kernels.decode_attention import choose_num_kv_splits, decode_attention
    from lmserver.kernels.reference import decode_attention_ref

    heads, kv_heads, dim = 32, 8, 128
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = []
    for bs, ctx in ((1, 512), (1, 4096), (8, 512), (8, 4096), (32, 512), (32, 4096)):
        if time.time() > deadline:
            break
        nbytes = 2 * bs * ctx * kv_heads * dim * 2 + bs * ctx * 4
        n = sets_for(nbytes)
        sets = [decode_inputs(bs, ctx, heads, kv_heads, dim, torch.bfloat16) for _ in range(n)]
        s0 = sets[0]
        ref = decode_attention_ref(s0["q"], s0["k_cache"], s0["v_cache"], s0["req_to_token"], s0["req_pool_indices"],
                                   s0["seq_lens"], dim**-0.5)
        h = choose_num_kv_splits(bs, kv_heads, num_sms)
        rows = []
        for splits, block_n, warps, stages in itertools.product(
            sorted({max(1, h // 2), h, min(64, 2 * h)}), (32, 64, 128), (4, 8), (2, 3)
        ):
            p_out = torch.empty(bs, heads, splits, dim, dtype=torch.float32, device="cuda")
            p_lse = torch.empty(bs, heads, splits, dtype=torch.float32, device="cuda")
            outs = [torch.empty_like(s["q"]) for s in sets]

            def run(i: int, splits=splits, block_n=block_n, warps=warps, stages=stages, p_out=p_out, p_lse=p_lse,
                    outs=outs, sets=sets) -> None:
                s = sets[i]
                decode_attention(s["q"], s["k_cache"], s["v_cache"], s["req_to_token"], s["req_pool_indices"],
                                 s["seq_lens"], dim**-0.5, out=outs[i], num_kv_splits=splits, partial_out=p_out,
                                 partial_lse=p_lse, block_n=block_n, num_warps=warps, num_stages=stages)

            try:
                run(0)
                err = rel_error(outs[0], ref)
                us = time_graph(run, n) if err < 2e-2 else float("inf")
            except Exception as exc:  # a variant that does not compile (e.g. out of shared memory)
                err, us = float("nan"), float("inf")
                print(f"  variant failed: {type(exc).__name__}: {str(exc)[:100]}", file=sys.stderr)
            rows.append({"splits": splits, "block_n": block_n, "warps": warps, "stages": stages, "us": us, "err": err})
        default = next(r for r in rows if (r["splits"], r["block_n"], r["warps"], r["stages"]) == (h, 64, 4, 2))
        best = min(rows, key=lambda r: r["us"])
        gbps = nbytes / (best["us"] * 1e-6) / 1e9
        print(f"decode bs={bs} ctx={ctx}: default {default['us']:.1f} us; best {best['us']:.1f} us ({gbps:.0f} GB/s) "
              f"splits={best['splits']} block_n={best['block_n']} warps={best['warps']} stages={best['stages']}",
              flush=True)
        results.append({"kernel": "decode", "bs": bs, "ctx": ctx, "default": default, "best": best, "all": rows})
        del sets
        torch.cuda.empty_cache()
    return results


def sweep_extend(deadline: float) -> list[dict]:
    from lmserver.kernels.extend_attention import extend_attention
    from lmserver.kernels.reference import extend_attention_ref

    heads, kv_heads, dim = 32, 8, 128
    results = []
    for prefix, new in ((0, 4096), (3584, 512), (1024, 1024)):
        if time.time() > deadline:
            break
        total = prefix + new
        dt = torch.bfloat16
        perm = torch.randperm(total, device="cuda") + 1
        q = torch.randn(new, heads, dim, dtype=dt, device="cuda")
        k_ext, v_ext = (torch.randn(new, kv_heads, dim, dtype=dt, device="cuda") for _ in range(2))
        k_cache, v_cache = (torch.randn(total + 1, kv_heads, dim, dtype=dt, device="cuda") for _ in range(2))
        args = (q, k_ext, v_ext, k_cache, v_cache, perm.view(1, total).int(), torch.zeros(1, dtype=torch.int64, device="cuda"),
                torch.tensor([prefix], device="cuda"), torch.tensor([new], device="cuda"),
                torch.zeros(1, dtype=torch.int64, device="cuda"), dim**-0.5)
        ref = extend_attention_ref(*args)
        flops = 4 * heads * dim * (new * prefix + new * (new + 1) / 2)
        rows = []
        # a fresh prompt (no prefix) also with `has_prefix=False` (what the backend launches when no request of the
        # batch has a cached prefix: zero-length prefixes, the new tokens' K / V as the unread cache) next to it
        tiles = ((64, 64, 4, 3), (64, 32, 8, 2), (64, 64, 4, 2), (128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 3),
                 (64, 32, 4, 3), (128, 128, 8, 2), (128, 64, 4, 3))  # the first: extend_attention's default
        for (bm, bn, warps, stages), has_prefix in itertools.product(tiles, (True, False) if prefix == 0 else (True,)):
            out = torch.empty_like(q)
            kw = dict(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages, has_prefix=has_prefix)
            try:
                extend_attention(*args, new, out=out, **kw)
                err = rel_error(out, ref)
                us = time_graph(lambda i, out=out, args=args, new=new, kw=kw: extend_attention(*args, new, out=out, **kw),
                                1) if err < 2e-2 else float("inf")
            except Exception as exc:
                err, us = float("nan"), float("inf")
                print(f"  variant failed: {type(exc).__name__}: {str(exc)[:100]}", file=sys.stderr)
            rows.append({"block_m": bm, "block_n": bn, "warps": warps, "stages": stages, "has_prefix": has_prefix,
                         "us": us, "err": err, "tflops": flops / (us * 1e-6) / 1e12})
        best = min(rows, key=lambda r: r["us"])
        default = rows[0]
        no_loop = f"; has_prefix=False {rows[1]['us']:.1f} us" if prefix == 0 else ""
        print(f"extend prefix={prefix} new={new}: default {default['us']:.1f} us ({default['tflops']:.0f} TFLOP/s)"
              f"{no_loop}; best {best['us']:.1f} us ({best['tflops']:.0f} TFLOP/s) block_m={best['block_m']} "
              f"block_n={best['block_n']} warps={best['warps']} stages={best['stages']} "
              f"has_prefix={best['has_prefix']}", flush=True)
        results.append({"kernel": "extend", "prefix": prefix, "new": new, "default": default, "best": best, "all": rows})
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write all variants as JSON here")
    parser.add_argument("--budget-s", type=float, default=120.0, help="start no new shape after this many seconds")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("sweep_attention needs a CUDA device.")
        return 2
    torch.manual_seed(0)
    deadline = time.time() + args.budget_s
    results = sweep_extend(deadline) + sweep_decode(deadline)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
