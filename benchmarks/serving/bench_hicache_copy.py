"""The host KV tier's copies alone: HostKVPool offload / load bandwidth per IO backend (issue 31).

Llama-3-8B's KV shape (32 layers, 8 KV heads, head_dim 128, bf16: 128 KiB per token) by default.
For each backend (`kernel`: GPU kernels through the pinned pool's device address; `direct`: one
DMA per run of consecutive host slots) and host-slot order (`runs`: one consecutive run;
`shuffled`: every slot its own run), times `offload` and `load` of `--tokens` tokens from issue to
completion, and, as the ceiling, one plain pinned <-> device copy of the same bytes. Prints GB/s
and tokens/s (the recompute rate to beat: ~32k tokens/s prefill of the 8B shape on an H200).

    python benchmarks/serving/bench_hicache_copy.py --tokens 512 2048 8192 --json $OUT/copy.json
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from lmserver.forward.kv_pool import KVPool
from lmserver.runner.host_kv import HostKVPool


def _time(fn: object, repeats: int) -> float:
    """Median seconds of `fn()` from issue to the device finishing it (each after a sync)."""
    out = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()  # type: ignore[operator]
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return float(np.median(out[1:]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    n_max = max(args.tokens)
    dev_slots = n_max + 1
    pool = KVPool(dev_slots, args.layers, args.kv_heads, args.head_dim, torch.bfloat16, "cuda")
    for c in (*pool.k_cache, *pool.v_cache):
        c.normal_()
    per_token = HostKVPool.bytes_per_slot(pool)
    rows = []
    pools = {b: HostKVPool(pool, 2 * n_max + 1, io_backend=b) for b in ("kernel", "direct")}
    rng = np.random.default_rng(0)
    for n in args.tokens:
        dev = rng.permutation(np.arange(1, dev_slots))[:n].astype(np.int64)
        nbytes = n * per_token
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        flat = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        ceil_d2h = _time(lambda p=pinned, f=flat: p.copy_(f, non_blocking=True), args.repeats)
        ceil_h2d = _time(lambda p=pinned, f=flat: f.copy_(p, non_blocking=True), args.repeats)
        rows.append({"backend": "plain copy (ceiling)", "order": "contiguous", "tokens": n,
                     "offload_GBps": nbytes / ceil_d2h / 1e9, "load_GBps": nbytes / ceil_h2d / 1e9})
        del pinned, flat
        for backend, host in pools.items():
            for order in ("runs", "shuffled"):
                hst = np.arange(1, n + 1, dtype=np.int64)
                if order == "shuffled":
                    hst = rng.permutation(np.arange(1, 2 * n_max + 1))[:n].astype(np.int64)
                t_off = _time(lambda h=host, d=dev, s=hst: h.offload(d, s), args.repeats)
                t_load = _time(lambda h=host, d=dev, s=hst: h.load(s, d), args.repeats)
                rows.append({"backend": backend, "order": order, "tokens": n,
                             "offload_GBps": nbytes / t_off / 1e9, "load_GBps": nbytes / t_load / 1e9})
    print(f"{'backend':22s} {'host slots':10s} {'tokens':>7s} {'offload GB/s':>13s} {'tok/s':>9s} "
          f"{'load GB/s':>10s} {'tok/s':>9s}")
    for r in rows:
        print(f"{r['backend']:22s} {r['order']:10s} {r['tokens']:7d} {r['offload_GBps']:13.1f} "
              f"{r['offload_GBps'] * 1e9 / per_token:9.0f} {r['load_GBps']:10.1f} {r['load_GBps'] * 1e9 / per_token:9.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "bytes_per_token": per_token, "rows": rows}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
