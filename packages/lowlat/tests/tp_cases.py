"""The ``nvidia`` plugin under tensor parallelism against TP 1 and the torch reference; run by test_kernels_interpret.py.

Not collected directly: a child pytest runs this file with TRITON_INTERPRET=1 on the CPU, or without it on a CUDA
machine. Every rank builds the same whole layers from one seed, takes its shard (``lowlat.tp.shard_layer``, as
lmserver shards) and runs the plugin's sharded stack; rank 0 checks the output against the plugin at TP 1 and the
unsharded reference layer, every rank its KV heads against the reference's, and the ranks' outputs must be identical.

- ``test_simulated_peer_*``: one process, rank 0 the plugin, the peer ranks the reference layer on their shards in
  threads (``lowlat.tp.LocalGroup``): the single-device check (on a GPU: one device, a simulated peer).
- ``test_gloo_*`` / ``test_ranks_*``: one process per rank (torch.multiprocessing spawn, loopback rendezvous on a
  free port): gloo on the CPU, NCCL where the machine has a GPU per rank (skipped with fewer GPUs).
"""

from __future__ import annotations

import os
import socket
import threading
from dataclasses import replace
from typing import Any

import pytest
import torch

from lowlat import Coverage, KVCache, LayerShape, LowlatConfig, Registry, Session, Step
from lowlat.build import BuildContext
from lowlat.moe import MoEShape, reference_moe_decoder_layer
from lowlat.reference import reference_decoder_layer
from lowlat.testing import decode_meta, fake_setup, random_kv, random_layer, random_moe_layer
from lowlat.tp import (
    LocalGroup,
    Reducer,
    TorchReducer,
    kv_heads_of_rank,
    rank_moe_shape,
    rank_shape,
    shard_layer,
    shard_moe_layer,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu")
# 4 query heads on 2 KV heads: TP 2 splits both, TP 4 replicates each KV head on two ranks
FULL = LayerShape(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96)
MOE = MoEShape(4, 2, 48)
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
SEQ_LENS = [7, 30, 1]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert not torch.isnan(a.float()).any(), "NaN in kernel output"
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def _setup(tp: int, dtype: torch.dtype) -> Any:
    name = str(dtype).removeprefix("torch.")
    vendor = "cpu" if DEVICE.type == "cpu" else "nvidia"
    return fake_setup(vendor=vendor, tp_size=tp, dtype=name, kv_dtype=name)


def _build(shape: LayerShape, weights: list, dtype: torch.dtype, device: torch.device, tp: int = 1, rank: int = 0,
           reducer: Reducer | None = None, moe: MoEShape | None = None) -> Any:
    from lowlat.plugins.nvidia import build

    ctx = BuildContext(shape, () if moe else tuple(weights), device, dtype, dtype, Coverage(max_tokens=8), LowlatConfig(),
                       _setup(tp, dtype), 256, moe=moe, moe_weights=tuple(weights) if moe else (), tp_rank=rank,
                       reducer=reducer)
    return build(ctx)


def _to(obj: Any, device: torch.device) -> Any:
    from dataclasses import fields

    return replace(obj, **{f.name: getattr(obj, f.name).to(device) for f in fields(obj)
                           if isinstance(getattr(obj, f.name), torch.Tensor)})


def _inputs(dtype: torch.dtype, num_layers: int, moe: bool, seed: int) -> tuple[list, KVCache, Any, torch.Tensor]:
    """The whole layers, KV cache, decode metadata and input rows (CPU; the same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    if moe:  # bf16: spread the router logits so rounding never flips a top-k choice
        layers = [random_moe_layer(FULL, MOE, dtype, generator=g, router_scale=6.0) for _ in range(num_layers)]
    else:
        layers = [random_layer(FULL, dtype, generator=g) for _ in range(num_layers)]
    meta = decode_meta(SEQ_LENS, 64, 32, generator=g)
    kv = random_kv(FULL, 64, dtype, generator=g)
    x = torch.randn(len(SEQ_LENS), FULL.hidden_size, generator=g).to(dtype)
    return layers, kv, meta, x


def _shard_kv(kv: KVCache, rank: int, tp: int, device: torch.device) -> KVCache:
    heads = list(kv_heads_of_rank(FULL, rank, tp))
    return KVCache(kv.k[:, heads].contiguous().to(device), kv.v[:, heads].contiguous().to(device))


def _shards(layers: list, rank: int, tp: int, moe: bool, device: torch.device) -> list:
    if moe:
        return [_to(shard_moe_layer(w, FULL, MOE, rank, tp), device) for w in layers]
    return [_to(shard_layer(w, FULL, rank, tp), device) for w in layers]


def _run(built: Any, x: torch.Tensor, kv: KVCache, meta: Any, num_layers: int) -> torch.Tensor:
    for layer in range(num_layers):  # layer 1 reads layer 0's output buffer (the ping-pong buffers)
        x = built.forward(layer, x, kv, meta).clone()
    return x


def _reference(layers: list, kv: KVCache, meta: Any, x: torch.Tensor, moe: bool) -> torch.Tensor:
    for w in layers:
        x = reference_moe_decoder_layer(x, w, kv, meta, FULL, MOE) if moe else reference_decoder_layer(x, w, kv, meta, FULL)
    return x


def _check(out: torch.Tensor, kv_out: KVCache, rank: int, tp: int, dtype: torch.dtype, num_layers: int,
                 moe: bool, seed: int, device: torch.device) -> None:
    """``out`` (rank ``rank``'s output after ``num_layers`` layers) against the TP 1 plugin and the reference; the
    rank's KV heads against the reference's."""
    layers, kv, meta, x = _inputs(dtype, num_layers, moe, seed)
    kv_ref = KVCache(kv.k.clone(), kv.v.clone())
    want = _reference(layers, kv_ref, meta, x, moe)
    heads = list(kv_heads_of_rank(FULL, rank, tp))
    assert _rel(kv_out.k.cpu(), kv_ref.k[:, heads]) < TOL[dtype] and _rel(kv_out.v.cpu(), kv_ref.v[:, heads]) < TOL[dtype]
    assert _rel(out.cpu(), want) < 3 * TOL[dtype], (tp, rank, _rel(out.cpu(), want))
    if rank != 0:
        return
    full = [_to(w, device) for w in layers]
    tp1 = _build(FULL, full, dtype, device, moe=MOE if moe else None)
    one = _run(tp1, x.to(device), _to(kv, device), _to(meta, device), num_layers)
    assert _rel(out, one) < 3 * TOL[dtype], (tp, _rel(out, one))


# -- one process, simulated peers -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("tp", "dtype", "moe", "num_layers"), [
    (2, torch.float32, False, 2), (4, torch.bfloat16, False, 1),
    pytest.param(2, torch.float32, True, 2, marks=pytest.mark.slow)])
def test_simulated_peer_plugin_rank_matches_tp1_and_reference(tp: int, dtype: torch.dtype, moe: bool,
                                                               num_layers: int) -> None:
    """Rank 0 runs the plugin; ranks 1.. the reference layer on their shards in threads, summing through a
    ``LocalGroup``: rank 0's output equals the whole layer's (a peer that summed wrongly, or a shard taken
    differently from the reference's, would show)."""
    seed = 31 + tp
    layers, kv, meta, x = _inputs(dtype, num_layers, moe, seed)
    group = LocalGroup(tp)
    errors: list[BaseException] = []
    shape = rank_shape(FULL, tp)
    moe_shape = rank_moe_shape(MOE, tp) if moe else None

    def peer(rank: int) -> None:
        try:
            red = group.reducer(rank)  # the peers on rank 0's device: the sums add tensors of one device
            shards, kv_r, h, meta_r = _shards(layers, rank, tp, moe, DEVICE), _shard_kv(kv, rank, tp, DEVICE), x.to(DEVICE), _to(meta, DEVICE)
            for w in shards:
                if moe:  # the reference MoE layer has no all_reduce: the same sums by hand, in lmserver's order
                    from lowlat.moe import reference_moe
                    from lowlat.reference import attention_block, rms_norm

                    x1 = attention_block(h, w, kv_r, meta_r, shape, red.all_reduce)
                    part = reference_moe(rms_norm(x1, w.post_norm, shape.rms_eps), w, moe_shape).to(dtype)
                    h = (x1.float() + red.all_reduce(part).float()).to(dtype)
                else:
                    h = reference_decoder_layer(h, w, kv_r, meta_r, shape, red.all_reduce)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)
            group._barrier.abort()

    threads = [threading.Thread(target=peer, args=(r,), daemon=True) for r in range(1, tp)]
    for t in threads:
        t.start()
    built = _build(shape, _shards(layers, 0, tp, moe, DEVICE), dtype, DEVICE, tp, 0, group.reducer(0), moe_shape)
    kv0 = _shard_kv(kv, 0, tp, DEVICE)
    try:
        out = _run(built, x.to(DEVICE), kv0, _to(meta, DEVICE), num_layers)
    finally:
        for t in threads:
            t.join(timeout=120)
    assert not errors, errors
    _check(out, kv0, 0, tp, dtype, num_layers, moe, seed, DEVICE)


# -- one process per rank ---------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _init(rank: int, world: int, port: int) -> torch.device:
    import torch.distributed as dist

    torch.set_num_threads(1)
    if DEVICE.type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if DEVICE.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    return torch.device(DEVICE.type, rank) if DEVICE.type == "cuda" else DEVICE


def _sharded_worker(rank: int, world: int, port: int, dtype: torch.dtype, moe: bool, num_layers: int,
                    coverage: bool) -> None:
    """The sharded stack's output on every rank (``_check``), then with ``coverage`` the agreement cases
    (``_coverage_cases``) in the same processes (one spawn: most of a case's time is the ranks' imports)."""
    import torch.distributed as dist

    dev = _init(rank, world, port)
    try:
        seed = 57 + world
        layers, kv, meta, x = _inputs(dtype, num_layers, moe, seed)
        shape = rank_shape(FULL, world)
        built = _build(shape, _shards(layers, rank, world, moe, dev), dtype, dev, world, rank, TorchReducer(),
                       rank_moe_shape(MOE, world) if moe else None)
        kv_r = _shard_kv(kv, rank, world, dev)
        out = _run(built, x.to(dev), kv_r, _to(meta, dev), num_layers)
        outs = [torch.empty_like(out) for _ in range(world)]
        dist.all_gather(outs, out)
        assert all(torch.equal(o, out) for o in outs), "the ranks' residual streams differ"
        _check(out, kv_r, rank, world, dtype, num_layers, moe, seed, dev)
        if coverage:
            _coverage_cases(rank, world, dev)
    finally:
        dist.destroy_process_group()


def _spawn(fn: Any, world: int, *args: Any) -> None:
    import torch.multiprocessing as mp

    if DEVICE.type == "cuda" and torch.cuda.device_count() < world:
        pytest.skip(f"{world} ranks need {world} GPUs, this machine has {torch.cuda.device_count()}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(fn, args=(world, free_port(), *args), nprocs=world, join=True)


@pytest.mark.parametrize(("world", "dtype", "moe", "num_layers", "coverage"), [
    # every spawn case in the slow tier: the ranks' imports alone take 10-20 s on two loaded cores
    pytest.param(2, torch.float32, False, 2, True, marks=pytest.mark.slow),
    pytest.param(2, torch.bfloat16, True, 1, False, marks=pytest.mark.slow),
    pytest.param(4, torch.float32, False, 2, True, marks=pytest.mark.slow),
    pytest.param(4, torch.bfloat16, True, 1, False, marks=pytest.mark.slow),
])
def test_ranks_match_tp1_and_reference(world: int, dtype: torch.dtype, moe: bool, num_layers: int,
                                       coverage: bool) -> None:
    """Every rank's output equals the others', the TP 1 plugin's and the reference's; with ``coverage``, the ranks
    agree on the intersection of their coverage and fall back together (``_coverage_cases``)."""
    _spawn(_sharded_worker, world, dtype, moe, num_layers, coverage)


def _cpu_spec(coverage: Coverage) -> Any:
    """The nvidia plugin's spec with requirements a CPU set-up passes (the interpreter runs its kernels)."""
    from lowlat.plugins.nvidia import spec

    req = replace(spec.requirements, vendor=DEVICE.type if DEVICE.type == "cpu" else "nvidia", min_capability=None,
                  dtypes=("float32",), kv_dtypes=())
    return replace(spec, requirements=req, coverage=coverage)


def _session(rank: int, world: int, dev: torch.device, coverage: Coverage, bad_shard: bool) -> tuple[Session, list, Any]:
    from lowlat import TorchGroup

    layers, kv, meta, x = _inputs(torch.float32, 1, False, 71)
    shards = _shards(layers, rank, world, False, dev)
    if bad_shard:
        shards = [replace(w, qkv=w.qkv.to(torch.bfloat16)) for w in shards]  # this rank's build refuses it
    s = Session(LowlatConfig(), Registry([_cpu_spec(coverage)]))
    s.configure(replace(_setup(world, torch.float32), capability=None))
    s.loaded()
    s.check_model(None)
    s.agree(TorchGroup(device=DEVICE.type))  # NCCL: the agreement's tensors on the GPU
    s.build(rank_shape(FULL, world), shards, dev, torch.float32, reducer=TorchReducer())
    s.memory_measured()
    s.kv_sized(64)
    s.install()
    return s, shards, (kv, meta, x)


def _coverage_cases(rank: int, world: int, dev: torch.device) -> None:
    """Sessions over the ranks' group: rank 1 covers fewer rows (every rank falls back above them, and runs the plugin
    below), then rank 1's build refuses its shard (every rank falls back)."""
    # rank 1 covers 2 rows, the others 8: the agreed coverage is 2, on every rank
    cover = Coverage(frozenset(_cpu_spec(Coverage()).coverage.step_kinds), 2 if rank == 1 else 8, 1)
    s, _, (kv, meta, x) = _session(rank, world, dev, cover, bad_shard=False)
    assert s.select(Step.decode(3)) == "original" and s.select(Step.decode(2)) == "plugin", s.explain()
    # the step every rank takes on the plugin: run it (a collective) and check it against the reference
    meta2 = replace(meta, req_pool_indices=meta.req_pool_indices[:2], seq_lens=meta.seq_lens[:2],
                    positions=meta.positions[:2], out_cache_loc=meta.out_cache_loc[:2])
    kv_r = _shard_kv(kv, rank, world, dev)
    out = s.forward_layer("plugin", 0, x[:2].to(dev), kv_r, _to(meta2, dev), original=None)  # type: ignore[arg-type]
    layers, kv_full, _, _ = _inputs(torch.float32, 1, False, 71)
    want = reference_decoder_layer(x[:2], layers[0], kv_full, meta2, FULL)
    assert _rel(out.cpu(), want) < 3 * TOL[torch.float32]
    # rank 1's build refuses its shard: every rank falls back, each naming rank 1's reason
    off, _, _ = _session(rank, world, dev, Coverage(max_tokens=8), bad_shard=rank == 1)
    assert off.built is None and off.select(Step.decode(1)) == "original"
    assert "rank 1 build" in off.explain(), off.explain()
