"""Greedy sampling's argmax on a GPU: `torch.argmax` vs lmserver's chunked two-step argmax.

    python benchmarks/kernels/bench_argmax.py [--json PATH]

For each vocabulary (SmolLM2 49,152; Llama-3 128,256), batch and logits dtype: us per call (eager, 200 calls
between two CUDA events, so launch cost included, as in the engine's sampling step) and in a CUDA graph,
for `torch.argmax` and for `chunked_argmax` at several chunk counts (the engine's pick marked *). Every
variant is checked equal to `torch.argmax` on fresh random logits with planted ties first.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch

from lmserver.runner.sampler import _argmax_chunks, chunked_argmax


def timed(fn: Callable[[], torch.Tensor], eager: bool, iters: int = 200) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    if eager:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1e3 / iters
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(20):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / 200


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args()
    rows = []
    dev = torch.device("cuda")
    print(f"device={torch.cuda.get_device_name(dev)}")
    print(f"{'vocab':>7s} {'bs':>3s} {'dtype':>9s} {'variant':>14s} {'eager us':>9s} {'graph us':>9s}")
    for vocab in (49152, 128256):
        pick = _argmax_chunks(vocab)
        options = sorted({c for c in (pick, 96, 192, 256, 384, 501, 768, 1002, 2004) if vocab % c == 0 and vocab // c >= 32})
        for bs in (1, 8):
            for dtype in (torch.float32, torch.bfloat16):
                logits = torch.randn(bs, vocab, device=dev).to(dtype)
                tie = torch.randint(0, vocab, (bs, 2), device=dev)
                logits.scatter_(1, tie, 100.0)  # two maximal entries per row: the first must win
                ref = logits.argmax(dim=-1)
                variants = [("torch.argmax", lambda lg=logits: lg.argmax(dim=-1))]
                variants += [(f"{c} chunks" + ("*" if c == pick else ""), lambda lg=logits, c=c: chunked_argmax(lg, c))
                             for c in options]
                for name, fn in variants:
                    assert torch.equal(fn(), ref), name
                    eager, graph = timed(fn, True), timed(fn, False)
                    rows.append(dict(vocab=vocab, batch=bs, dtype=str(dtype)[6:], variant=name, eager_us=eager, graph_us=graph))
                    print(f"{vocab:7d} {bs:3d} {str(dtype)[6:]:>9s} {name:>14s} {eager:9.2f} {graph:9.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
