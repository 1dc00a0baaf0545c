"""The nvidia plugin's MoE decode stack with FP8 experts and projections against bf16, on a CUDA GPU (issue 33).

A ``--layers``-layer Mixtral-8x7B-shaped stack (random bf16 weights; FP8 = the same weights quantized per output row
with ``lowlat.quantize_moe_layer_fp8``: qkv, o_proj and every expert's w13 / w2; the router stays bf16) in one CUDA
graph at each batch of ``--batches``, context ``--context``: microseconds per layer for bf16 weights + bf16 KV
(``bf16``), FP8 weights + bf16 KV (``fp8w``), FP8 weights + FP8 KV (``fp8w+kv``), each against its memory floor (the
attention weights, the experts the last layer's routing touched, and the KV read at ``--bandwidth-tbs``), and FP8's
speed-up over bf16 at each batch.

First, a correctness check: layer 0 of every stack against the reference MoE layer
(``lowlat.moe.reference_moe_decoder_layer``: the dequantized weights in float32, the same cache) at 1 and 8 rows on
fresh random inputs, relative L2 error at most ``--max-rel``, every output finite. A mismatch of ``bf16``, ``fp8w`` or
``fp8w+kv`` stops the run (exit 1); an optional stack (tilings, release points) that mismatches or fails is reported
as FAILED and left out of the timings. The optional stacks are timed at ``--option-batches`` only (1 and 8).

``--expert-configs``: FP8 expert kernel tiles to time as well (``up=VARIANT:BN:BK:WARPS:STAGES[:VEC]`` /
``down=...``, comma-separated; each up / down pair replaces ``moe_ops.EXPERT_TILES_FP8`` at every token count for one
``fp8w`` stack, checked like the others); ``--rows-at-one``: the ``fp8w`` stack also with the row-wise slot kernels at
one token (``rows`` 4 x 2048, vec 16 for gate-up, as the dense FP8 table's one-row entries) and the default above;
``--rows-f16``: the ``fp8w`` stack also with ``moe_ops.EXPERT_ROWS_F16`` (the token rows cast to scaled fp16 once);
``--route-chunks 256,512:256``: the ``bf16`` and ``fp8w`` stacks also with ``moe_ops.ROUTE_CHUNK`` at each value (the
router split over hidden / chunk programs; ``:SS_K`` also sets ``moe_ops.ROUTE_SS_K``);
``--pdl-releases``: the ``fp8w`` stack also with ``LaunchConfig.pdl_release`` forced to each
value (``early``: every kernel, the expert ones included, releases its dependent launch right after its wait;
``late``: after its main loop; the default ``auto`` picks by grid size); ``--profile``: the ``bf16`` and ``fp8w``
stacks' (and the optional ones') per-kernel marginal time per layer at the first batch (``kprof.py``).

    python benchmarks/lowlat/bench_moe_stack.py [--layers 8] [--batches 1,2,4,8] [--stacks bf16,fp8w,fp8w+kv]
        [--expert-configs up=mrow_f16s:64:128:4:4,down=mrow_f16s:64:256:4:3] [--json out.json]

Never collected by pytest.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
import kprof  # noqa: E402
from bench_layer import capture, rel, replay_us  # noqa: E402

from lowlat import (  # noqa: E402
    Coverage,
    KVCache,
    LayerShape,
    LowlatConfig,
    MoELayerWeights,
    MoEShape,
    quantize_moe_layer_fp8,
    reference_moe_decoder_layer,
)
from lowlat.build import BuildContext  # noqa: E402
from lowlat.guards import detect_setup  # noqa: E402
from lowlat.kernels import moe_ops  # noqa: E402
from lowlat.kernels.ops import GemvConfig  # noqa: E402
from lowlat.layer import FP8_DTYPE, rope_inv_freq  # noqa: E402
from lowlat.plugins import nvidia  # noqa: E402
from lowlat.reference import quantize_kv  # noqa: E402
from lowlat.testing import decode_meta  # noqa: E402

MIXTRAL = LayerShape(hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336)
MIXTRAL_MOE = MoEShape(8, 2, 14336)
BASE_STACKS = ("bf16", "fp8w", "fp8w+kv")  # a mismatch or error here stops the run (exit 1); others are dropped


def gpu_moe_layer(shape: LayerShape, moe: MoEShape, dev: torch.device) -> MoELayerWeights:
    """Random bf16 Mixtral-style layer weights on ``dev`` (router logits spread as a trained router's)."""
    bf16 = torch.bfloat16

    def lin(*size: int) -> torch.Tensor:
        return (torch.randn(*size, device=dev) * size[-1] ** -0.5).to(bf16)

    h, e, i = shape.hidden_size, moe.num_experts, moe.expert_intermediate_size
    return MoELayerWeights(
        input_norm=(1 + 0.1 * torch.randn(h, device=dev)).to(bf16), qkv=lin(shape.qkv_size, h), o_proj=lin(h, shape.q_size),
        post_norm=(1 + 0.1 * torch.randn(h, device=dev)).to(bf16), router=(lin(e, h).float() * 4).to(bf16),
        w13=lin(e, 2 * i, h), w2=lin(e, h, i), rope_inv_freq=rope_inv_freq(shape.head_dim, 1e6, dev),
    )


def build(weights: list[MoELayerWeights], shape: LayerShape, moe: MoEShape, dev: torch.device, max_b: int,
          max_ctx: int, kv_dtype: torch.dtype) -> Any:
    """The nvidia plugin's MoE stack over ``weights``, every batch up to ``max_b`` covered (no measured limit)."""
    setup = detect_setup("MixtralForCausalLM", "bfloat16", device="cuda", max_context=max_ctx)
    ctx = BuildContext(shape, (), dev, torch.bfloat16, kv_dtype, Coverage(max_tokens=max_b),
                       LowlatConfig(measured_coverage=False, pdl="auto"), setup, max_ctx, moe=moe,
                       moe_weights=tuple(weights))
    return nvidia.build(ctx)


Tiles = tuple[tuple[int, GemvConfig, GemvConfig], ...]  # moe_ops.EXPERT_TILES_FP8's layout


def gemv_config(spec: str) -> GemvConfig:
    """``VARIANT:BN:BK:WARPS:STAGES[:VEC]`` -> GemvConfig."""
    v, *nums = spec.split(":")
    n = [int(x) for x in nums]
    return GemvConfig(v, *n[:4], vec=n[4] if len(n) > 4 else 0)


def parse_expert_configs(text: str) -> list[Tiles]:
    """``up=SPEC,down=SPEC,...`` -> one tile table per (gate-up, down) pair, at every token count: each ``up`` with
    the next ``down`` (a missing side: the default's)."""
    ups: list[GemvConfig] = []
    downs: list[GemvConfig] = []
    for item in [t for t in text.split(",") if t]:
        side, spec = item.split("=")
        (ups if side == "up" else downs).append(gemv_config(spec))
    default = moe_ops.EXPERT_TILES_FP8[-1]
    return [((moe_ops.MAX_TOKENS, ups[k] if k < len(ups) else default[1], downs[k] if k < len(downs) else default[2]),)
            for k in range(max(len(ups), len(downs)))]


def tiles_label(tiles: Tiles) -> str:
    return " ".join(f"<={m}:{u.variant}:{u.block_n}x{u.block_k}/{u.num_warps}/{u.num_stages}"
                    f"{f'v{u.vec}' if u.vec else ''}+{d.variant}:{d.block_n}x{d.block_k}/{d.num_warps}/{d.num_stages}"
                    f"{f'v{d.vec}' if d.vec else ''}" for m, u, d in tiles)


ROWS_F16 = {"EXPERT_ROWS_F16": True}  # a stack's tiles entry: the defaults with moe_ops.EXPERT_ROWS_F16 on


class ExpertTiles:
    """The FP8 expert kernels' tiles (``moe_ops.EXPERT_TILES_FP8``), or a dict of other ``moe_ops`` settings (e.g.
    ``ROWS_F16``, ``{"ROUTE_CHUNK": 256}``) for one stack: set while its forward runs (and is
    captured), the defaults back after."""

    def __init__(self, tiles: Tiles | dict[str, Any] | None) -> None:
        self.tiles = tiles

    def __enter__(self) -> None:
        changes = self.tiles if isinstance(self.tiles, dict) else (
            {} if self.tiles is None else {"EXPERT_TILES_FP8": self.tiles})
        self.saved = {name: getattr(moe_ops, name) for name in changes}
        for name, value in changes.items():
            setattr(moe_ops, name, value)

    def __exit__(self, *exc: object) -> None:
        for name, value in self.saved.items():
            setattr(moe_ops, name, value)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--bandwidth-tbs", type=float, default=4.23)
    ap.add_argument("--stacks", default="bf16,fp8w,fp8w+kv", help="comma list of bf16, fp8w, fp8w+kv")
    ap.add_argument("--expert-configs", default="", help="FP8 expert tiles to time too (see the docstring)")
    ap.add_argument("--rows-at-one", action="store_true", help="the fp8w stack with row-wise slot kernels at 1 token")
    ap.add_argument("--rows-f16", action="store_true", help="the fp8w stack with moe_ops.EXPERT_ROWS_F16 on")
    ap.add_argument("--route-chunks", default="", help="comma list of CHUNK[:SS_K]: the bf16 and fp8w stacks with moe_ops.ROUTE_CHUNK")
    ap.add_argument("--pdl-releases", default="", help="comma list of early, late: the fp8w stack with that release")
    ap.add_argument("--option-batches", default="1,8", help="the batches the optional stacks are timed at")
    ap.add_argument("--max-rel", type=float, default=3e-2, help="the check's largest relative L2 error")
    ap.add_argument("--profile", action="store_true",
                    help="per-kernel marginal time of the bf16 and fp8w stacks at the first batch (kprof.py)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    t0 = time.time()
    dev, bf16, shape, moe, c = torch.device("cuda"), torch.bfloat16, MIXTRAL, MIXTRAL_MOE, args.context
    batches = [int(v) for v in args.batches.split(",")]
    option_batches = {int(v) for v in args.option_batches.split(",") if v}
    max_b = max(8, *batches)
    torch.manual_seed(0)
    dense = [gpu_moe_layer(shape, moe, dev) for _ in range(args.layers)]
    chosen = args.stacks.split(",")
    want_fp8 = (any(s.startswith("fp8") for s in chosen) or args.expert_configs or args.rows_at_one or args.rows_f16
                or args.pdl_releases or args.route_chunks)
    fp8 = [quantize_moe_layer_fp8(w) for w in dense] if want_fp8 else []
    slots = max_b * max(c, 1024) + 64
    # name -> (built stack, weights, KV dtype, FP8 expert tiles or None: the defaults)
    stacks: dict[str, tuple[Any, list[MoELayerWeights], torch.dtype, Tiles | dict[str, Any] | None]] = {}
    for name, weights, kv_dtype in (("bf16", dense, bf16), ("fp8w", fp8, bf16), ("fp8w+kv", fp8, FP8_DTYPE)):
        if name in chosen:
            stacks[name] = (build(weights, shape, moe, dev, max_b, max(c, 1024), kv_dtype), weights, kv_dtype, None)
    tables = parse_expert_configs(args.expert_configs)
    if args.rows_at_one:
        tables.append(((1, gemv_config("rows:4:2048:4:2:16"), gemv_config("rows:4:2048:4:2")),
                       *moe_ops.EXPERT_TILES_FP8))
    for k, tiles in enumerate(tables):
        print(f"fp8w#{k}: {tiles_label(tiles)}")
        stacks[f"fp8w#{k}"] = (build(fp8, shape, moe, dev, max_b, max(c, 1024), bf16), fp8, bf16, tiles)
    if args.rows_f16:
        stacks["fp8w rows16"] = (build(fp8, shape, moe, dev, max_b, max(c, 1024), bf16), fp8, bf16, ROWS_F16)
    for spec in [v for v in args.route_chunks.split(",") if v]:
        chunk, _, ss_k = spec.partition(":")
        route = {"ROUTE_CHUNK": int(chunk), **({"ROUTE_SS_K": int(ss_k)} if ss_k else {})}
        for name, weights in (("bf16", dense), ("fp8w", fp8)):
            stacks[f"{name} route{spec}"] = (build(weights, shape, moe, dev, max_b, max(c, 1024), bf16), weights, bf16,
                                             route)
    for release in [r for r in args.pdl_releases.split(",") if r]:
        bl = build(fp8, shape, moe, dev, max_b, max(c, 1024), bf16)
        bl.lc = replace(bl.lc, pdl_release=release)
        stacks[f"fp8w pdl={release}"] = (bl, fp8, bf16, None)
    print(f"device={torch.cuda.get_device_name()} layers={args.layers} build {time.time() - t0:.0f}s "
          f"(FP8 expert tiles: {tiles_label(moe_ops.EXPERT_TILES_FP8)})", flush=True)

    def caches(kv_dtype: torch.dtype, layers: int) -> list[KVCache]:
        out = []
        for _ in range(layers):
            k = torch.randn(slots, shape.num_kv_heads, shape.head_dim, device=dev)
            v = torch.randn(slots, shape.num_kv_heads, shape.head_dim, device=dev)
            if kv_dtype == FP8_DTYPE:
                out.append(KVCache(quantize_kv(k, 0.05, FP8_DTYPE), quantize_kv(v, 0.02, FP8_DTYPE), 0.05, 0.02))
            else:
                out.append(KVCache(k.to(bf16), v.to(bf16)))
        return out

    print(f"\ncheck, layer 0 against the reference MoE layer (rel. L2 error of the output; limit {args.max_rel:g})")
    failures = []
    for name, (bl, weights, kv_dtype, tiles) in stacks.items():
        for b, ctx_len in ((1, c), (8, 1000)):
            g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))  # fresh inputs per run
            torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
            meta = decode_meta([ctx_len] * b, slots, max(c, ctx_len), dev, generator=g)
            kv = caches(kv_dtype, 1)[0]
            kv_ref = KVCache(kv.k.clone(), kv.v.clone(), kv.k_scale, kv.v_scale)
            x = torch.randn(b, shape.hidden_size, generator=g).to(dev, bf16)
            bl.out.fill_(float("nan"))
            try:
                with ExpertTiles(tiles):
                    out = bl.forward(0, x, kv, meta)
            except Exception as exc:  # noqa: BLE001  (an optional stack's kernels: reported, the stack dropped)
                if name in BASE_STACKS:
                    raise
                print(f"  {name:16s} b={b}: ERROR {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                failures.append((name, b, float("nan")))
                break
            ref = reference_moe_decoder_layer(x, weights[0], kv_ref, meta, shape, moe)
            err = rel(out, ref) if bool(torch.isfinite(out).all()) else float("nan")
            ok = err <= args.max_rel  # NaN compares False
            print(f"  {name:16s} b={b} ctx={ctx_len}: out {err:.2e}  {'ok' if ok else 'MISMATCH'}", flush=True)
            if not ok:
                failures.append((name, b, err))
    if any(name in BASE_STACKS for name, _, _ in failures):
        print(f"\nFAILED: {failures}: no timings", flush=True)
        sys.exit(1)
    for name in {name for name, _, _ in failures}:  # an optional stack that failed: loudly dropped, the rest timed
        print(f"FAILED (dropped from the timings): {name}", flush=True)
        del stacks[name]

    expert_bytes = {n: 3 * shape.hidden_size * moe.expert_intermediate_size * (1 if w[0].fp8 else 2)
                    for n, (_, w, _, _) in stacks.items()}
    rows: list[dict[str, Any]] = []
    print(f"\nstack of {args.layers} MoE layers in one CUDA graph, ctx {c}: us per layer (floor: attention weights + "
          f"the experts the last layer routed to + KV at {args.bandwidth_tbs} TB/s)")
    for b in batches:
        meta = decode_meta([c] * b, slots, c, dev, generator=torch.Generator().manual_seed(b))
        x0 = torch.randn(b, shape.hidden_size, device=dev, dtype=bf16)
        per_batch: dict[str, float] = {}
        for name, (bl, weights, kv_dtype, tiles) in stacks.items():
            if name not in BASE_STACKS and b not in option_batches:
                continue
            kvs = caches(kv_dtype, args.layers)

            def run(bl: Any = bl, kvs: list[KVCache] = kvs, x0: torch.Tensor = x0, meta: Any = meta) -> None:
                x = x0
                for i in range(args.layers):
                    x = bl.forward(i, x, kvs[i], meta)

            try:
                with ExpertTiles(tiles):
                    graph = capture(run)
            except Exception as exc:  # noqa: BLE001  (an optional stack: reported, the others timed)
                if name in BASE_STACKS:
                    raise
                print(f"  b={b} {name:16s} ERROR {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                continue
            us = replay_us(graph, args.iters) / args.layers
            routed = int((bl.ws.bitmap != 0).sum())
            attn = (shape.qkv_size * shape.hidden_size + shape.hidden_size * shape.q_size) * weights[0].qkv.element_size()
            kv_bytes = b * c * shape.kv_size * 2 * (1 if kv_dtype == FP8_DTYPE else 2)
            floor = (attn + routed * expert_bytes[name] + kv_bytes) / (args.bandwidth_tbs * 1e6)
            per_batch[name] = us
            rows.append(dict(batch=b, stack=name, us=us, floor=floor, routed_experts=routed))
            vs = f"  {per_batch['bf16'] / us:4.2f}x bf16" if "bf16" in per_batch and name != "bf16" else ""
            print(f"  b={b} {name:16s} {us:7.1f} us  floor {floor:6.1f} ({routed} experts)  {floor / us:4.0%}{vs}",
                  flush=True)
            if args.profile and b == batches[0] and (name in ("bf16", "fp8w") or " " in name):
                print(f"  b={b} {name}: per-kernel (kprof, {args.layers} layers)\n"
                      + kprof.table(kprof.breakdown(graph.replay, reps=3), per=args.layers, unit="us per layer"),
                      flush=True)
            del graph, kvs
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
