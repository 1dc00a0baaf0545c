"""Tensor parallelism without kernels: shards, the in-process reducer, and the refusals (reasons) of the plugins.

The sharded kernels run in tp_cases.py (interpreter / GPU). Here: every rank's reference layer on its shard
(``lowlat.tp.shard_layer``), summed through ``LocalGroup`` threads, equals the whole layer, for split and replicated
KV heads and FP8 row scales; splits that do not divide, and builds that cannot sum, are refused with the reason.
"""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch

from lowlat import (
    Coverage,
    KVCache,
    LayerShape,
    LowlatConfig,
    Unsupported,
    quantize_layer_fp8,
    reference_decoder_layer,
)
from lowlat.build import BuildContext
from lowlat.guards import spec_failures
from lowlat.layer import FP8_DTYPE
from lowlat.testing import decode_meta, fake_setup, random_kv, random_layer
from lowlat.tp import FnReducer, LocalGroup, kv_heads_of_rank, rank_shape, shard_layer, split_errors

GQA = LayerShape(hidden_size=64, num_heads=8, num_kv_heads=2, head_dim=16, intermediate_size=96)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def _sharded_reference(shape: LayerShape, w, kv: KVCache, meta, x: torch.Tensor, tp: int):  # type: ignore[no-untyped-def]
    """Every rank's (output, KV shard) of the reference layer on its shard, summed through a LocalGroup."""
    group = LocalGroup(tp)
    results: dict[int, tuple[torch.Tensor, KVCache]] = {}
    errors: list[BaseException] = []

    def rank_fn(rank: int) -> None:
        try:
            heads = list(kv_heads_of_rank(shape, rank, tp))
            kv_r = KVCache(kv.k[:, heads].clone(), kv.v[:, heads].clone())
            out = reference_decoder_layer(x, shard_layer(w, shape, rank, tp), kv_r, meta, rank_shape(shape, tp),
                                          group.reducer(rank).all_reduce)
            results[rank] = (out, kv_r)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)
            group._barrier.abort()

    threads = [threading.Thread(target=rank_fn, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    return results


@pytest.mark.parametrize("tp", [1, 2, 4, 8])  # 8: each of the 2 KV heads held by 4 ranks, one query head per rank
@pytest.mark.parametrize("fp8", [False, True])
def test_shards_summed_over_ranks_equal_the_whole_layer(tp: int, fp8: bool) -> None:
    g = torch.Generator().manual_seed(3 + tp)
    w = random_layer(GQA, torch.float32, generator=g)
    if fp8:
        w = quantize_layer_fp8(w)
    meta = decode_meta([5, 12, 1], 48, 16, generator=g)
    kv = random_kv(GQA, 48, torch.float32, generator=g)
    x = torch.randn(3, GQA.hidden_size, generator=g)
    kv_ref = KVCache(kv.k.clone(), kv.v.clone())
    want = reference_decoder_layer(x, w, kv_ref, meta, GQA)
    results = _sharded_reference(GQA, w, kv, meta, x, tp)
    for rank, (out, kv_r) in results.items():
        assert torch.equal(out, results[0][0])  # the ranks sum in one order: one residual stream
        assert _rel(out, want) < 1e-5, (rank, _rel(out, want))
        heads = list(kv_heads_of_rank(GQA, rank, tp))
        assert torch.equal(kv_r.k, kv_ref.k[:, heads]) and torch.equal(kv_r.v, kv_ref.v[:, heads])


def test_shards_partition_the_whole_weights() -> None:
    """Query heads, gate / up features and o_proj / down columns: each held by exactly one rank; FP8 row scales go
    with their rows (o_proj's and down's are whole)."""
    w = quantize_layer_fp8(random_layer(GQA, torch.float32, generator=torch.Generator().manual_seed(5)))
    shards = [shard_layer(w, GQA, r, 4) for r in range(4)]
    assert all(s.qkv.dtype == FP8_DTYPE for s in shards)
    q = GQA.q_size // 4
    assert torch.equal(torch.cat([s.qkv[:q].float() for s in shards]), w.qkv[:GQA.q_size].float())
    assert torch.equal(torch.cat([s.o_proj.float() for s in shards], 1), w.o_proj.float())
    assert torch.equal(torch.cat([s.down.float() for s in shards], 1), w.down.float())
    inter = GQA.intermediate_size
    gates = torch.cat([s.gate_up[: inter // 4].float() for s in shards])
    assert torch.equal(gates, w.gate_up[:inter].float())
    assert torch.equal(torch.cat([s.gate_up_scale[inter // 4:] for s in shards]), w.gate_up_scale[inter:])
    assert all(torch.equal(s.down_scale, w.down_scale) and torch.equal(s.o_proj_scale, w.o_proj_scale) for s in shards)
    for s in shards:
        s.validate(rank_shape(GQA, 4))


@pytest.mark.parametrize(("shape", "tp", "needle"), [
    (GQA, 3, "num_heads 8 is not divisible by tp_size 3"),
    (LayerShape(64, 12, 4, 16, 96), 3, "num_kv_heads 4 and tp_size 3 must divide one another"),
    (LayerShape(64, 8, 2, 16, 100), 8, "intermediate_size 100 is not divisible by tp_size 8"),
])
def test_a_split_that_does_not_divide_is_refused_with_the_reason(shape: LayerShape, tp: int, needle: str) -> None:
    assert any(needle in r for r in split_errors(shape, tp))
    with pytest.raises(Unsupported, match=needle):
        shard_layer(random_layer(shape), shape, 0, tp)
    assert split_errors(GQA, 2) == ()


def test_the_nvidia_guard_takes_tp_2_4_8_and_names_other_sizes() -> None:
    from lowlat.plugins.amd import spec as amd
    from lowlat.plugins.nvidia import spec

    for tp in (1, 2, 4, 8):
        assert spec_failures(spec, fake_setup(tp_size=tp)) == ()
    assert spec_failures(spec, fake_setup(tp_size=3)) == ("needs TP size in [1, 2, 4, 8], server uses 3",)
    assert any("TP size" in r for r in spec_failures(amd, fake_setup(vendor="amd", amd_arch="gfx942", tp_size=2)))


def _ctx(tp: int, **kw: object) -> BuildContext:
    shape = rank_shape(GQA, tp)
    w = shard_layer(random_layer(GQA, torch.float32), GQA, 0, tp)
    return BuildContext(shape, (w,), torch.device("cpu"), torch.float32, torch.float32, Coverage(max_tokens=4),
                        LowlatConfig(amd_mode="staged"), fake_setup(vendor="cpu", tp_size=tp), 256, **kw)  # type: ignore[arg-type]


def test_a_sharded_build_needs_a_reducer_of_its_tp_size() -> None:
    from lowlat.plugins.amd import build as amd_build
    from lowlat.plugins.nvidia import build

    with pytest.raises(Unsupported, match="TP 2 needs BuildContext.all_reduce or reducer"):
        build(_ctx(2))
    with pytest.raises(Unsupported, match="the reducer spans 4 ranks, the set-up TP 2"):
        build(_ctx(2, reducer=LocalGroup(4).reducer(0)))
    with pytest.raises(Unsupported, match="TP 2: this stack's kernels run unsharded layers only"):
        amd_build(_ctx(2, all_reduce=lambda t: t))
    built = build(_ctx(2, all_reduce=lambda t: t))  # a runner's own sum (lmserver's TP group)
    assert isinstance(built.reducer, FnReducer) and built.reducer.world_size == 2
    assert build(replace(_ctx(2), setup=fake_setup(vendor="cpu"), weights=(random_layer(rank_shape(GQA, 2)),))).reducer is None
