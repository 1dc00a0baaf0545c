"""MoE kernel and layer cases against the torch reference; run by test_kernels_interpret.py.

Not collected directly: a child pytest runs this file with TRITON_INTERPRET=1 on the CPU, or
without it on a CUDA machine.
"""

from __future__ import annotations

import os
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from lowlat import Coverage, KVCache, LayerShape, LowlatConfig
from lowlat.build import BuildContext
from lowlat.kernels import ops
from lowlat.kernels.moe_ops import ROWS_PER_TILE, MoEWorkspace, moe_mlp
from lowlat.moe import MoEShape, reference_moe, reference_moe_decoder_layer, route
from lowlat.reference import rms_norm
from lowlat.spec import Step
from lowlat.testing import decode_meta, fake_setup, random_kv, random_moe_layer

DEVICE = torch.device("cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu")
SHAPE = LayerShape(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96)
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert not torch.isnan(a.float()).any(), "NaN in kernel output"
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def _lc() -> ops.LaunchConfig:
    return ops.LaunchConfig.for_device(DEVICE, SHAPE, use_pdl=False)


# moe_ops.ROUTE_CHUNK: route_kernel, and route_split_kernel over 4 programs
@pytest.mark.parametrize("route_chunk", [0, 16], ids=["route_kernel", "route_split"])
@pytest.mark.parametrize(("dtype", "batch", "experts", "top_k"), [
    (torch.float32, 1, 6, 2),
    (torch.float32, 11, 2, 2),  # every token picks both experts: 11 rows, two tiles of <= 8 rows per expert
    (torch.float32, 9, 8, 1),
    (torch.bfloat16, 5, 8, 2),
    (torch.bfloat16, 16, 4, 3),
])
def test_moe_mlp_matches_reference(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, batch: int, experts: int,
                                   top_k: int, route_chunk: int) -> None:
    from lowlat.kernels import moe_ops

    monkeypatch.setattr(moe_ops, "ROUTE_CHUNK", route_chunk)
    g = torch.Generator().manual_seed(100 + batch)
    moe = MoEShape(experts, top_k, 48)
    # bf16: spread the router logits so rounding never flips a top-k choice between kernel and torch
    w = random_moe_layer(SHAPE, moe, dtype, DEVICE, generator=g, router_scale=1.0 if dtype == torch.float32 else 6.0)
    x1 = torch.randn(batch, SHAPE.hidden_size, generator=g).to(DEVICE, dtype)
    ws = MoEWorkspace.allocate(moe, SHAPE.hidden_size, 16, DEVICE, dtype)
    ws.y.fill_(float("nan"))  # rows a tile does not own stay poisoned; the combine must never read them
    ws.act.fill_(float("nan"))
    out = torch.full_like(x1, float("nan"))
    moe_mlp(x1, w.post_norm, w.router, w.w13, w.w2, out, moe, SHAPE.rms_eps, ws, _lc())
    h2 = rms_norm(x1, w.post_norm, SHAPE.rms_eps)
    want_w, want_ids = route(h2, w.router, top_k)
    # routing: same expert sets (any order among the k), same renormalized weights
    got_ids, order = ws.ids[:batch].long().sort(-1)
    ref_ids, ref_order = want_ids.sort(-1)
    assert torch.equal(got_ids, ref_ids)
    assert _rel(ws.wts[:batch].gather(1, order), want_w.gather(1, ref_order)) < TOL[dtype]
    # bitmaps: bit t of expert e set exactly when token t chose e
    onehot = torch.zeros(batch, experts, dtype=torch.int64, device=DEVICE).scatter_(1, want_ids, 1)
    bits = (onehot << torch.arange(batch, device=DEVICE)[:, None]).sum(0)
    assert ws.bitmap.long().tolist() == bits.tolist()
    if batch > ROWS_PER_TILE and experts == 2:
        assert ws.bitmap.tolist() == [(1 << batch) - 1] * 2
    ref = x1.float() + reference_moe(h2, w, moe)
    assert _rel(out, ref) < 3 * TOL[dtype]
    assert ws.route_count is not None and int(ws.route_count.item()) == 0  # set back by the last router program


def test_split_router_gives_the_one_program_routers_rows_and_routes(monkeypatch: pytest.MonkeyPatch) -> None:
    """``route_split_kernel`` (4 programs) against ``route_kernel``: the same normed rows, experts and bitmaps, the
    rows and weights within float32 summation order (the RMS's slices, the logits' splits), on two consecutive steps
    (the counter set back to 0)."""
    from lowlat.kernels import moe_ops

    g = torch.Generator().manual_seed(7)
    moe = MoEShape(8, 2, 48)
    w = random_moe_layer(SHAPE, moe, torch.float32, DEVICE, generator=g)
    results = []
    for chunk in (0, 16):
        monkeypatch.setattr(moe_ops, "ROUTE_CHUNK", chunk)
        ws = MoEWorkspace.allocate(moe, SHAPE.hidden_size, 16, DEVICE, torch.float32)
        for step in range(2):
            x1 = torch.randn(3, SHAPE.hidden_size, generator=torch.Generator().manual_seed(step)).to(DEVICE)
            out = torch.full_like(x1, float("nan"))
            moe_mlp(x1, w.post_norm, w.router, w.w13, w.w2, out, moe, SHAPE.rms_eps, ws, _lc())
            results.append((chunk, ws.hn[:3].clone(), ws.ids[:3].clone(), ws.wts[:3].clone(), ws.bitmap.clone(), out))
        assert ws.route_count is not None and int(ws.route_count.item()) == 0
    for one, split in zip(results[:2], results[2:], strict=True):
        assert torch.equal(one[2], split[2]) and torch.equal(one[4], split[4])
        assert torch.allclose(one[1], split[1], rtol=1e-6, atol=1e-7)
        assert torch.allclose(one[3], split[3], rtol=1e-5, atol=1e-6)
        assert _rel(split[5], one[5]) < 1e-5


# bfloat16 in the slow tier (test_moe_mlp_matches_reference covers the bfloat16 MoE MLP in the default one)
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.slow)])
def test_moe_layer_matches_reference_over_decode_steps(dtype: torch.dtype) -> None:
    """Two MoE layers through the nvidia plugin, four decode steps, KV writes included."""
    from lowlat.plugins.nvidia import build

    g = torch.Generator().manual_seed(21)
    moe = MoEShape(4, 2, 32)
    weights = [random_moe_layer(SHAPE, moe, dtype, DEVICE, generator=g, router_scale=6.0) for _ in range(2)]
    ctx = BuildContext(SHAPE, (), DEVICE, dtype, dtype, Coverage(max_tokens=8), LowlatConfig(),
                       fake_setup(vendor="cpu" if DEVICE.type == "cpu" else "nvidia", arch="MixtralForCausalLM"), 64,
                       moe=moe, moe_weights=tuple(weights))
    built = build(ctx)
    assert type(built).__name__ == "TritonMoEStack" and built.workspace_bytes > 0
    # the measured-coverage rule of the dense stack (LaunchConfig.wins_up_to: tuning.MOE_WINS_UP_TO on a GPU)
    built.lc = replace(built.lc, wins_up_to=2)
    assert [b for b in range(1, 10) if built.covers(Step.decode(b))] == [1, 2]
    built.lc = replace(built.lc, wins_up_to=0)
    assert [b for b in range(1, 10) if built.covers(Step.decode(b))] == list(range(1, 9))
    kv = [random_kv(SHAPE, 96, dtype, DEVICE, generator=g) for _ in weights]
    kv_ref = [KVCache(c.k.clone(), c.v.clone()) for c in kv]
    lens = [6, 1, 13]
    meta = decode_meta([n + 4 for n in lens], 96, 24, DEVICE, generator=g)
    for step in range(4):
        seq = torch.tensor([n + 1 + step for n in lens], dtype=torch.int32, device=DEVICE)
        rows = meta.req_pool_indices
        m = SimpleNamespace(**{f: getattr(meta, f) for f in ("req_to_token", "req_pool_indices", "max_seq_len")})
        step_meta = type(meta)(m.req_to_token, rows, seq, (seq - 1).long(), meta.req_to_token[rows, seq.long() - 1].long(),
                               max_seq_len=m.max_seq_len)
        x = torch.randn(3, SHAPE.hidden_size, generator=g).to(DEVICE, dtype)
        for layer in range(2):
            out = built.forward(layer, x, kv[layer], step_meta)
            ref = reference_moe_decoder_layer(x, weights[layer], kv_ref[layer], step_meta, SHAPE, moe)
            assert _rel(out, ref) < 3 * TOL[dtype], (step, layer)
            assert _rel(kv[layer].k, kv_ref[layer].k) < TOL[dtype] and _rel(kv[layer].v, kv_ref[layer].v) < TOL[dtype]
            x = out.clone()
