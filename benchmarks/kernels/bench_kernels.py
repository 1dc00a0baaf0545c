"""Check and time every lmserver Triton kernel on a GPU against its torch-native path.

For each kernel: relative error vs the torch-native reference on fresh random inputs, the
median time of the Triton kernel and of the torch path (CUDA-graph replays timed with CUDA
events, inputs rotated so the working set exceeds L2), the speed-up, and for memory-bound
kernels the achieved bandwidth against the measured device copy bandwidth.

    python benchmarks/kernels/bench_kernels.py [--json PATH] [--markdown PATH] [--quick]

Needs CUDA (exits with a message otherwise). Never collected by pytest.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

COPY_BW_REFERENCE = 4.23e12  # B/s, the H200's device copy measured in DESIGN.md
L2_ROTATE_BYTES = 256 * 2**20  # rotate input sets until their total exceeds this


@dataclass
class Row:
    kernel: str
    shape: str
    rel_error: float
    triton_us: float
    torch_us: float
    speedup: float
    bytes_moved: int
    gbps: float
    pct_of_copy_bw: float
    note: str = ""


def time_graph(fn: Callable[[int], object], num_sets: int, reps: int = 25) -> float:
    """Median microseconds per call of fn(i), i cycling over input sets, from CUDA-graph replays
    (eager timing, printed as such, when the call cannot be captured)."""
    try:
        return _time_graph(fn, num_sets, reps)
    except Exception as exc:  # e.g. an op that syncs; fall back rather than lose the row
        print(f"  (graph capture failed: {type(exc).__name__}: {str(exc)[:120]}; timing eagerly)", file=sys.stderr)
        torch.cuda.synchronize()
        return time_eager(fn, num_sets)


def _time_graph(fn: Callable[[int], object], num_sets: int, reps: int) -> float:
    calls = max(num_sets, 20)
    for i in range(min(num_sets, 3)):
        fn(i)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(3):
            fn(i % num_sets)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i % num_sets)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def time_eager(fn: Callable[[int], object], num_sets: int, reps: int = 10) -> float:
    """Median microseconds per call without a graph (for paths that sync or cannot be captured)."""
    for i in range(3):
        fn(i % num_sets)
    torch.cuda.synchronize()
    times = []
    for r in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(r % num_sets)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def measure_copy_bw() -> float:
    src = torch.randn(2**30 // 2, dtype=torch.bfloat16, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    us = time_eager(lambda i: dst.copy_(src), 1, reps=20)
    return 2 * src.numel() * 2 / (us * 1e-6)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    d = out.double() - ref.double()
    return float("inf") if not torch.isfinite(d).all() else float(d.norm() / ref.double().norm().clamp_min(1e-30))


def sets_for(bytes_per_set: int, cap: int = 64) -> int:
    return max(1, min(cap, math.ceil(L2_ROTATE_BYTES / max(bytes_per_set, 1))))


def row(kernel: str, shape: str, err: float, t_us: float, ref_us: float, nbytes: int, copy_bw: float, note: str = "") -> Row:
    gbps = nbytes / (t_us * 1e-6) / 1e9
    r = Row(kernel, shape, err, t_us, ref_us, ref_us / t_us, nbytes, gbps, 100 * gbps * 1e9 / copy_bw, note)
    print(f"  {kernel} {shape}: err {err:.1e}, {t_us:.1f} us (torch {ref_us:.1f} us), {gbps:.0f} GB/s", flush=True)
    return r


# ---------------------------------------------------------------- attention


def decode_inputs(bs: int, ctx: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    slots = bs * ctx + 1
    perm = torch.randperm(slots - 1, device="cuda") + 1
    return {
        "q": torch.randn(bs, heads, dim, dtype=dtype, device="cuda"),
        "k_cache": torch.randn(slots, kv_heads, dim, dtype=dtype, device="cuda"),
        "v_cache": torch.randn(slots, kv_heads, dim, dtype=dtype, device="cuda"),
        "req_to_token": perm.view(bs, ctx).int(),
        "req_pool_indices": torch.arange(bs, device="cuda"),
        "seq_lens": torch.full((bs,), ctx, device="cuda", dtype=torch.int32),
    }


def torch_decode(inp: dict[str, torch.Tensor], scale: float) -> torch.Tensor:
    """The engine's torch-native decode path: gather the slots, SDPA with GQA."""
    slots = inp["req_to_token"][inp["req_pool_indices"]].long()  # (bs, ctx)
    k = inp["k_cache"][slots].transpose(1, 2)
    v = inp["v_cache"][slots].transpose(1, 2)
    out = torch.nn.functional.scaled_dot_product_attention(inp["q"].unsqueeze(2), k, v, scale=scale, enable_gqa=True)
    return out.squeeze(2)


def bench_decode(copy_bw: float, quick: bool) -> list[Row]:
    from lmserver.kernels.decode_attention import choose_num_kv_splits, decode_attention
    from lmserver.kernels.reference import decode_attention_ref

    rows = []
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    configs = [(32, 8, 128, "Llama-3-8B"), (9, 3, 64, "SmolLM2-135M")]
    for heads, kv_heads, dim, name in configs:
        for bs in (1, 8, 32):
            for ctx in (512, 4096):
                if name.startswith("Smol") and quick and ctx == 512:
                    continue
                dtype = torch.bfloat16
                kv_bytes = 2 * bs * ctx * kv_heads * dim * 2
                nbytes = kv_bytes + bs * ctx * 4 + 2 * bs * heads * dim * 2
                n = sets_for(nbytes)
                sets = [decode_inputs(bs, ctx, heads, kv_heads, dim, dtype) for _ in range(n)]
                splits = choose_num_kv_splits(bs, kv_heads, num_sms)
                outs = [torch.empty_like(s["q"]) for s in sets]
                p_out = torch.empty(bs, heads, splits, dim, dtype=torch.float32, device="cuda")
                p_lse = torch.empty(bs, heads, splits, dtype=torch.float32, device="cuda")

                def run(i: int, sets=sets, outs=outs, p_out=p_out, p_lse=p_lse, splits=splits, dim=dim) -> None:
                    s = sets[i]
                    decode_attention(s["q"], s["k_cache"], s["v_cache"], s["req_to_token"], s["req_pool_indices"],
                                     s["seq_lens"], dim**-0.5, out=outs[i], num_kv_splits=splits,
                                     partial_out=p_out, partial_lse=p_lse)

                run(0)
                s0 = sets[0]
                ref = decode_attention_ref(s0["q"], s0["k_cache"], s0["v_cache"], s0["req_to_token"],
                                           s0["req_pool_indices"], s0["seq_lens"], dim**-0.5)
                err = rel_error(outs[0], ref)
                t = time_graph(run, n)
                t_ref = time_graph(lambda i, sets=sets, dim=dim: torch_decode(sets[i], dim**-0.5), n)
                rows.append(row("decode_attention", f"{name} bs={bs} ctx={ctx} splits={splits}", err, t, t_ref,
                                nbytes, copy_bw, "torch: gather + SDPA (GQA)"))
                del sets, outs
                torch.cuda.empty_cache()
    return rows


def bench_extend(copy_bw: float, quick: bool) -> list[Row]:
    return [_extend_case(prefix, new, copy_bw) for prefix, new in ((0, 4096), (3584, 512), (1024, 1024))]


def _extend_case(prefix: int, new: int, copy_bw: float) -> Row:
    from lmserver.kernels.extend_attention import extend_attention
    from lmserver.kernels.reference import extend_attention_ref

    heads, kv_heads, dim = 32, 8, 128
    total = prefix + new
    slots = total + 1
    perm = torch.randperm(slots - 1, device="cuda") + 1
    dt = torch.bfloat16
    q = torch.randn(new, heads, dim, dtype=dt, device="cuda")
    k_ext = torch.randn(new, kv_heads, dim, dtype=dt, device="cuda")
    v_ext = torch.randn(new, kv_heads, dim, dtype=dt, device="cuda")
    k_cache = torch.randn(slots, kv_heads, dim, dtype=dt, device="cuda")
    v_cache = torch.randn(slots, kv_heads, dim, dtype=dt, device="cuda")
    r2t = perm.view(1, total).int()
    rpi = torch.zeros(1, dtype=torch.int64, device="cuda")
    pl = torch.tensor([prefix], device="cuda")
    el = torch.tensor([new], device="cuda")
    sl = torch.zeros(1, dtype=torch.int64, device="cuda")
    args = (q, k_ext, v_ext, k_cache, v_cache, r2t, rpi, pl, el, sl, dim**-0.5)
    out = extend_attention(*args, new)
    err = rel_error(out, extend_attention_ref(*args))
    t = time_graph(lambda i: extend_attention(*args, new, out=out), 1)
    idx = r2t[0, :prefix].long()
    mask = torch.arange(total, device="cuda")[None, :] <= (prefix + torch.arange(new, device="cuda"))[:, None]

    def torch_path(i: int) -> torch.Tensor:
        k = torch.cat([k_cache[idx], k_ext]).transpose(0, 1)
        v = torch.cat([v_cache[idx], v_ext]).transpose(0, 1)
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k, v, attn_mask=None if prefix == 0 else mask, is_causal=prefix == 0,
            scale=dim**-0.5, enable_gqa=True)

    t_ref = time_graph(torch_path, 1)
    attended = new * prefix + new * (new + 1) / 2
    flops = 4 * heads * dim * attended
    r = row("extend_attention", f"Llama-3-8B prefix={prefix} new={new}", err, t, t_ref, 0, copy_bw,
            f"{flops / (t * 1e-6) / 1e12:.0f} TFLOP/s (torch SDPA {flops / (t_ref * 1e-6) / 1e12:.0f})")
    r.gbps = r.pct_of_copy_bw = float("nan")
    return r


# ---------------------------------------------------------------- elementwise


def bench_elementwise(copy_bw: float, quick: bool) -> list[Row]:
    from lmserver.kernels import reference as R
    from lmserver.kernels.activation import silu_and_mul
    from lmserver.kernels.bitmask import apply_token_bitmask_inplace
    from lmserver.kernels.norm import fused_add_rmsnorm, rmsnorm
    from lmserver.kernels.rope import apply_rope_inplace

    rows: list[Row] = []
    dt = torch.bfloat16
    for tokens in (1, 32, 4096):
        hidden = 4096
        nb = 3 * tokens * hidden * 2 * 2  # read x, residual; write both (weight negligible)
        n = sets_for(nb)
        xs = [torch.randn(tokens, hidden, dtype=dt, device="cuda") for _ in range(n)]
        rs = [torch.randn(tokens, hidden, dtype=dt, device="cuda") for _ in range(n)]
        w = torch.rand(hidden, dtype=dt, device="cuda") + 0.5
        want_x, want_r = R.fused_add_rmsnorm_ref(xs[0], rs[0], w, 1e-5)
        x0, r0 = xs[0].clone(), rs[0].clone()
        fused_add_rmsnorm(x0, r0, w, 1e-5)
        err = max(rel_error(x0, want_x), rel_error(r0, want_r))
        t = time_graph(lambda i, xs=xs, rs=rs, w=w: fused_add_rmsnorm(xs[i], rs[i], w, 1e-5), n)
        t_ref = time_graph(lambda i, xs=xs, rs=rs, w=w: R.fused_add_rmsnorm_ref(xs[i], rs[i], w, 1e-5), n)
        rows.append(row("fused_add_rmsnorm", f"T={tokens} hidden={hidden}", err, t, t_ref, 4 * tokens * hidden * 2, copy_bw))
        outs = [torch.empty_like(x) for x in xs]
        err = rel_error(rmsnorm(xs[0], w, 1e-5), R.rmsnorm_ref(xs[0], w, 1e-5))
        t = time_graph(lambda i, xs=xs, outs=outs, w=w: rmsnorm(xs[i], w, 1e-5, out=outs[i]), n)
        t_ref = time_graph(lambda i, xs=xs, w=w: R.rmsnorm_ref(xs[i], w, 1e-5), n)
        rows.append(row("rmsnorm", f"T={tokens} hidden={hidden}", err, t, t_ref, 2 * tokens * hidden * 2, copy_bw))
        del xs, rs, outs

        inter = 14336
        nb = 3 * tokens * inter * 2
        n = sets_for(nb)
        gus = [torch.randn(tokens, 2 * inter, dtype=dt, device="cuda") for _ in range(n)]
        outs = [torch.empty(tokens, inter, dtype=dt, device="cuda") for _ in range(n)]
        err = rel_error(silu_and_mul(gus[0]), R.silu_and_mul_ref(gus[0]))
        t = time_graph(lambda i, gus=gus, outs=outs: silu_and_mul(gus[i], out=outs[i]), n)
        t_ref = time_graph(lambda i, gus=gus: R.silu_and_mul_ref(gus[i]), n)
        rows.append(row("silu_and_mul", f"T={tokens} inter={inter}", err, t, t_ref, nb, copy_bw))
        del gus, outs

        heads, kv_heads, dim = 32, 8, 128
        nb = 2 * tokens * (heads + kv_heads) * dim * 2 + tokens * dim * 4
        n = sets_for(nb)
        cache = torch.randn(8192, dim, device="cuda")
        pos = [torch.randint(0, 8192, (tokens,), device="cuda") for _ in range(n)]
        qs = [torch.randn(tokens, heads, dim, dtype=dt, device="cuda") for _ in range(n)]
        ks = [torch.randn(tokens, kv_heads, dim, dtype=dt, device="cuda") for _ in range(n)]
        wq, wk = R.rope_ref(pos[0], qs[0], ks[0], cache)
        q0, k0 = qs[0].clone(), ks[0].clone()
        apply_rope_inplace(pos[0], q0, k0, cache)
        err = max(rel_error(q0, wq), rel_error(k0, wk))
        t = time_graph(lambda i, pos=pos, qs=qs, ks=ks, cache=cache: apply_rope_inplace(pos[i], qs[i], ks[i], cache), n)
        t_ref = time_graph(lambda i, pos=pos, qs=qs, ks=ks, cache=cache: R.rope_ref(pos[i], qs[i], ks[i], cache), n)
        rows.append(row("rope (in place)", f"T={tokens} 32/8 heads x 128", err, t, t_ref, nb, copy_bw))
        del qs, ks

        rows.append(_store_kv_case(tokens, copy_bw))
        torch.cuda.empty_cache()

    vocab = 128256
    for bs in (1, 32):
        words = -(-vocab // 32)
        nb = 2 * bs * vocab * 4 + bs * words * 4
        n = sets_for(nb)
        logits = [torch.randn(bs, vocab, device="cuda") for _ in range(n)]
        masks = [torch.randint(-(2**31), 2**31 - 1, (bs, words), device="cuda", dtype=torch.int64).int() for _ in range(n)]
        want = R.apply_token_bitmask_ref(logits[0], masks[0])
        l0 = logits[0].clone()
        apply_token_bitmask_inplace(l0, masks[0])
        err = 0.0 if torch.equal(l0, want) else float("inf")
        t = time_graph(lambda i, logits=logits, masks=masks: apply_token_bitmask_inplace(logits[i], masks[i]), n)
        t_ref = time_graph(lambda i, logits=logits, masks=masks: R.apply_token_bitmask_ref(logits[i], masks[i]), n)
        rows.append(row("apply_token_bitmask", f"bs={bs} vocab={vocab}", err, t, t_ref, nb, copy_bw, "err: 0 = identical"))
    return rows


def _store_kv_case(tokens: int, copy_bw: float) -> Row:
    from lmserver.kernels import reference as R
    from lmserver.kernels.kv_store import store_kv

    dt, kv_heads, dim = torch.bfloat16, 8, 128
    nb = 2 * 2 * tokens * kv_heads * dim * 2
    n = sets_for(nb)
    slots = max(65536, tokens * n + 1)
    k_cache = torch.randn(slots, kv_heads, dim, dtype=dt, device="cuda")
    v_cache = torch.randn(slots, kv_heads, dim, dtype=dt, device="cuda")
    perm = torch.randperm(slots - 1, device="cuda") + 1
    locs = [perm[i * tokens : (i + 1) * tokens] for i in range(n)]
    kk = [torch.randn(tokens, kv_heads, dim, dtype=dt, device="cuda") for _ in range(n)]
    vv = [torch.randn(tokens, kv_heads, dim, dtype=dt, device="cuda") for _ in range(n)]
    store_kv(kk[0], vv[0], k_cache, v_cache, locs[0])
    err = rel_error(k_cache[locs[0]], kk[0]) + rel_error(v_cache[locs[0]], vv[0])
    t = time_graph(lambda i: store_kv(kk[i], vv[i], k_cache, v_cache, locs[i]), n)
    t_ref = time_graph(lambda i: R.store_kv_ref(kk[i], vv[i], k_cache, v_cache, locs[i]), n)
    return row("store_kv", f"T={tokens} 8 kv heads x 128", err, t, t_ref, nb, copy_bw)


def bench_sampling(copy_bw: float, quick: bool) -> list[Row]:
    from lmserver.kernels.reference import top_k_top_p_min_p_probs_ref
    from lmserver.kernels.sampling import top_k_top_p_min_p_probs

    rows = []
    vocab = 128256
    for bs in (1, 8, 32):
        for label, k, p, mp in (("top_k=50 top_p=0.9", 50, 0.9, 0.0), ("top_k=50", 50, 1.0, 0.0),
                                ("top_p=0.95 min_p=0.05", 0, 0.95, 0.05), ("no filter", 0, 1.0, 0.0)):
            # the host knows which filters the batch uses (SamplingParams), as a sampler would
            need = {"need_top_k": k > 0, "need_top_p": p < 1.0}
            logits = torch.randn(bs, vocab, device="cuda") * 3
            params = (torch.full((bs,), 0.8, device="cuda"), torch.full((bs,), k, device="cuda", dtype=torch.int32),
                      torch.full((bs,), p, device="cuda"), torch.full((bs,), mp, device="cuda"))
            out = torch.empty(bs, vocab, device="cuda")
            top_k_top_p_min_p_probs(logits, *params, out=out, **need)
            want = top_k_top_p_min_p_probs_ref(logits, *params)
            err = rel_error(out, want)
            t = time_graph(lambda i, logits=logits, params=params, out=out, need=need: top_k_top_p_min_p_probs(
                logits, *params, out=out, **need), 1)
            t_ref = time_graph(lambda i, logits=logits, params=params: top_k_top_p_min_p_probs_ref(logits, *params), 1)
            rows.append(row("top_k_top_p_min_p_probs", f"bs={bs} vocab={vocab} {label}", err, t, t_ref,
                            2 * bs * vocab * 4, copy_bw, "torch: softmax + sort + cumsum"))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the rows as JSON here")
    parser.add_argument("--markdown", help="write the table as Markdown here")
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    parser.add_argument("--only", default="decode,extend,elementwise,sampling", help="comma-separated groups")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_kernels needs a CUDA device; the CPU checks are the tests (TRITON_INTERPRET=1).")
        return 2
    import triton

    torch.manual_seed(0)
    copy_bw = measure_copy_bw()
    dev = torch.cuda.get_device_name()
    print(f"# {dev}, torch {torch.__version__}, triton {triton.__version__}; "
          f"copy bandwidth measured {copy_bw / 1e12:.2f} TB/s (reference {COPY_BW_REFERENCE / 1e12:.2f})")
    groups = {"decode": bench_decode, "extend": bench_extend, "elementwise": bench_elementwise, "sampling": bench_sampling}
    rows: list[Row] = []
    for name in args.only.split(","):
        try:
            rows += groups[name](copy_bw, args.quick)
        except Exception as exc:  # keep the other groups' numbers when one fails on the device
            print(f"group {name} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    header = ("| kernel | shape | rel err | triton us | torch us | speed-up | GB/s | % of measured copy BW "
              f"| % of {COPY_BW_REFERENCE / 1e12:.2f} TB/s | note |")
    lines = [header, "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        bw = ("–", "–", "–") if math.isnan(r.gbps) else (
            f"{r.gbps:.0f}", f"{r.pct_of_copy_bw:.0f}%", f"{100 * r.gbps * 1e9 / COPY_BW_REFERENCE:.0f}%")
        lines.append(f"| {r.kernel} | {r.shape} | {r.rel_error:.1e} | {r.triton_us:.1f} | {r.torch_us:.1f} | "
                     f"{r.speedup:.1f}x | {bw[0]} | {bw[1]} | {bw[2]} | {r.note} |")
    table = "\n".join(lines)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": dev, "copy_bw": copy_bw, "rows": [asdict(r) for r in rows]}, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table + "\n")
    print(table)
    bad = [r for r in rows if not r.rel_error < (2e-2 if r.kernel != "top_k_top_p_min_p_probs" else 1e-3)]
    if bad:
        print(f"ACCURACY FAILURES: {[(r.kernel, r.shape, r.rel_error) for r in bad]}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
