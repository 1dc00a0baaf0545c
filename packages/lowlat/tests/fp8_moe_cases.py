"""FP8 (e4m3) MoE cases of the nvidia plugin against float64 / the reference layer; run by test_kernels_interpret_fp8.py.

Not collected directly: a child pytest runs this file with TRITON_INTERPRET=1 on the CPU (tiny shapes, float32
activations), or without it on a CUDA machine (the same shapes plus a Mixtral-8x7B layer, bf16 activations). Every
case draws fresh random inputs. The expert kernels' oracle dequantizes the FP8 experts with their row scales and runs
each token's chosen experts in float64 (routing as the model routes, in its dtype); the stack's oracle is the
reference MoE layer (``lowlat.moe.reference_moe_decoder_layer``) on the same FP8 weights and cache.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from lowlat import Coverage, KVCache, LayerShape, LowlatConfig, MoEShape
from lowlat.build import BuildContext
from lowlat.errors import ShapeError, Unsupported
from lowlat.kernels import ops
from lowlat.kernels.moe_ops import MoEWorkspace, expert_configs, moe_mlp
from lowlat.layer import FP8_DTYPE, rope_inv_freq
from lowlat.moe import (
    MoELayerWeights,
    dequantized_experts,
    quantize_moe_layer_fp8,
    reference_moe_decoder_layer,
    route,
)
from lowlat.reference import quantize_kv, rms_norm
from lowlat.spec import Step
from lowlat.testing import decode_meta, fake_setup, random_kv, random_moe_layer

GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
DEVICE = torch.device("cuda" if GPU else "cpu")
DTYPE = torch.bfloat16 if GPU else torch.float32  # float32 on the interpreter (exact products), bf16 on a GPU
TOL = 2e-2 if GPU else 2e-5
SMALL = LayerShape(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=48)
MIXTRAL = LayerShape(hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336)
MIXTRAL_MOE = MoEShape(8, 2, 14336)
# (shape, moe) of the kernel cases: the small one everywhere, Mixtral-8x7B's layer on a GPU
CASES = [(SMALL, MoEShape(6, 2, 48)), *([(MIXTRAL, MIXTRAL_MOE)] if GPU else [])]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert not torch.isnan(a.float()).any(), "NaN in kernel output"
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12))


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed + int.from_bytes(os.urandom(2), "little"))  # fresh inputs per run


def fp8_moe_layer(shape: LayerShape, moe: MoEShape, g: torch.Generator, router_scale: float = 6.0) -> MoELayerWeights:
    """A random MoE layer with FP8 qkv, o_proj and experts (per-row float32 scales); norms and router in the
    activation dtype. Large shapes are drawn on the device (a CUDA generator seeded from ``g``)."""
    if shape.hidden_size <= 256:
        w = quantize_moe_layer_fp8(random_moe_layer(shape, moe, torch.float32, "cpu", generator=g,
                                                    router_scale=router_scale))
        moved = {f: getattr(w, f).to(DEVICE) for f in ("qkv", "o_proj", "w13", "w2", "qkv_scale", "o_proj_scale",
                                                       "w13_scale", "w2_scale", "rope_inv_freq")}
        return replace(w, input_norm=w.input_norm.to(DEVICE, DTYPE), post_norm=w.post_norm.to(DEVICE, DTYPE),
                       router=w.router.to(DEVICE, DTYPE), **moved)
    dg = torch.Generator(device=DEVICE).manual_seed(int(torch.randint(0, 2**31, (1,), generator=g)))
    h, e, i = shape.hidden_size, moe.num_experts, moe.expert_intermediate_size

    def lin(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=dg, device=DEVICE) / size[-1] ** 0.5

    dense = MoELayerWeights(
        input_norm=(1 + 0.1 * torch.randn(h, generator=dg, device=DEVICE)).to(DTYPE), qkv=lin(shape.qkv_size, h),
        o_proj=lin(h, shape.q_size), post_norm=(1 + 0.1 * torch.randn(h, generator=dg, device=DEVICE)).to(DTYPE),
        router=(lin(e, h) * router_scale).to(DTYPE), w13=lin(e, 2 * i, h), w2=lin(e, h, i),
        rope_inv_freq=rope_inv_freq(shape.head_dim, device=DEVICE),
    )
    return quantize_moe_layer_fp8(dense)


def _experts_f64(h: torch.Tensor, w: MoELayerWeights, moe: MoEShape, wts: torch.Tensor,
                 ids: torch.Tensor) -> torch.Tensor:
    """Each token's chosen experts in float64 on the dequantized weights, weighted: (T, hidden) float64."""
    hd = h.double()
    out = torch.zeros(h.shape[0], h.shape[1], dtype=torch.float64, device=h.device)
    for e in torch.unique(ids).tolist():
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        w13 = dequantized_experts(w.w13[e:e + 1], w.w13_scale[e:e + 1], torch.float64)[0]  # type: ignore[index]
        w2 = dequantized_experts(w.w2[e:e + 1], w.w2_scale[e:e + 1], torch.float64)[0]  # type: ignore[index]
        gate, up = (hd[tok] @ w13.T).split(moe.expert_intermediate_size, dim=-1)
        out.index_add_(0, tok, (F.silu(gate) * up) @ w2.T * wts[tok, slot, None].double())
    return out


def _lc(shape: LayerShape) -> ops.LaunchConfig:
    return ops.LaunchConfig.for_device(DEVICE, shape, use_pdl=False, fp8=True)


def _run_mlp(w: MoELayerWeights, shape: LayerShape, moe: MoEShape, x1: torch.Tensor,
             cfgs: tuple[ops.GemvConfig, ops.GemvConfig] | None = None) -> tuple[torch.Tensor, MoEWorkspace]:
    ws = MoEWorkspace.allocate(moe, shape.hidden_size, 8, DEVICE, DTYPE, fp8=True)
    ws.y.fill_(float("nan"))  # rows a tile does not own stay poisoned; the combine must never read them
    ws.act.fill_(float("nan"))
    out = torch.full_like(x1, float("nan"))
    up, down = cfgs or (None, None)
    moe_mlp(x1, w.post_norm, w.router, w.w13, w.w2, out, moe, shape.rms_eps, ws, _lc(shape),
            w13_scale=w.w13_scale, w2_scale=w.w2_scale, up_cfg=up, down_cfg=down)
    return out, ws


def _check_mlp(w: MoELayerWeights, shape: LayerShape, moe: MoEShape, x1: torch.Tensor, out: torch.Tensor,
               ws: MoEWorkspace) -> torch.Tensor:
    """Routing as the model routes it, then the MoE output against float64; returns the reference activations' largest
    magnitude (what the expert kernels' rows held)."""
    t = x1.shape[0]
    h2 = rms_norm(x1, w.post_norm, shape.rms_eps)
    want_w, want_ids = route(h2, w.router, moe.top_k)
    got_ids, order = ws.ids[:t].long().sort(-1)
    ref_ids, ref_order = want_ids.sort(-1)
    assert torch.equal(got_ids, ref_ids)
    assert _rel(ws.wts[:t].gather(1, order), want_w.gather(1, ref_order)) < TOL
    ref = _experts_f64(h2, w, moe, want_w, want_ids)
    # the residual is small next to the MoE output (x1 * 0.05 in the callers): the check is on the experts' sum
    assert torch.isfinite(out).all()
    assert _rel(out, x1.double() + ref) < TOL
    return ref


@pytest.mark.parametrize("tokens", [1, pytest.param(2, marks=() if GPU else pytest.mark.slow), 5, 8])
@pytest.mark.parametrize(("shape", "moe"), CASES, ids=lambda v: f"h{v.hidden_size}" if isinstance(v, LayerShape)
                         else f"e{v.num_experts}")
def test_fp8_moe_mlp_matches_float64(shape: LayerShape, moe: MoEShape, tokens: int) -> None:
    """Route + FP8 expert gate-up / down (weight-stationary kernels, per-row scales) + combine, top-2, 1-8 tokens,
    against float64 on the dequantized experts; the workspace's unowned rows NaN-poisoned."""
    g = _gen(31 + tokens)
    w = fp8_moe_layer(shape, moe, g)
    x1 = (torch.randn(tokens, shape.hidden_size, generator=g) * 0.05).to(DEVICE, DTYPE)
    out, ws = _run_mlp(w, shape, moe, x1)
    _check_mlp(w, shape, moe, x1, out, ws)


@pytest.mark.parametrize(("shape", "moe"), CASES, ids=lambda v: f"h{v.hidden_size}" if isinstance(v, LayerShape)
                         else f"e{v.num_experts}")
def test_fp8_moe_mlp_keeps_large_activations(shape: LayerShape, moe: MoEShape) -> None:
    """Both expert kernels' rows beyond fp16's 65,504 (a bf16 model's large activations, ~1e5 to ~8e5): the normed
    stream through a large norm weight (gate-up's rows; the router and w13's scales compensate so routing and the
    SiLU stay ordinary), and the activations through large gate / up sums (down's rows): every output finite and as
    accurate as at ordinary magnitudes (on a GPU the fp16 MMA with the rows scaled by 2^-4, ``mrow_f16s``)."""
    g = _gen(41)
    gamma = 1e5  # the normed rows up to ~5e5 (fp16 with the 2^-4 scaling holds ~1.05e6)
    w = fp8_moe_layer(shape, moe, g)
    w = replace(w, post_norm=(w.post_norm.float() * gamma).to(DTYPE), router=(w.router.float() / gamma).to(DTYPE),
                w13_scale=w.w13_scale * (200.0 / gamma))  # type: ignore[operator]
    x1 = (torch.randn(5, shape.hidden_size, generator=g) * 0.05).to(DEVICE, DTYPE)
    out, ws = _run_mlp(w, shape, moe, x1)
    hn = ws.hn[:5].double()
    assert float(hn.abs().max()) > 65504.0  # gate-up's rows: what fp16 alone cannot hold
    ref = _check_mlp(w, shape, moe, x1, out, ws)
    h2 = rms_norm(x1, w.post_norm, shape.rms_eps)
    _, ids = route(h2, w.router, moe.top_k)
    act_max = 0.0
    for t, e in {(row, int(col)) for row in range(5) for col in ids[row]}:  # every token's chosen experts' activations
        w13 = dequantized_experts(w.w13[e:e + 1], w.w13_scale[e:e + 1], torch.float64)[0]  # type: ignore[index]
        gate, up = (h2[t].double() @ w13.T).split(moe.expert_intermediate_size, dim=-1)
        act_max = max(act_max, float((F.silu(gate) * up).abs().max()))
    assert 65504.0 < act_max < 1.0e6  # down's rows: large, within the scaled fp16 range
    assert float(ref.abs().max()) > 1e3


# the row-wise slot kernels (a ``rows`` expert config): plain activation loads and loads in the tile's shape (vec 16)
SLOT_CFGS = {"rows": ops.GemvConfig("rows", 4, 32 if not GPU else 2048, 4, 2),
             "rows16": ops.GemvConfig("rows", 4, 32 if not GPU else 2048, 4, 2, vec=16)}


# on the interpreter rows at 1 token and rows16 at 3 by default, the other two in the slow tier (the same oracle)
SLOT_CASES = [pytest.param(shape, moe, variant, tokens, id=f"h{shape.hidden_size}-{variant}-{tokens}",
                           marks=pytest.mark.slow if not GPU and (variant == "rows") != (tokens == 1) else ())
              for shape, moe in CASES for variant in sorted(SLOT_CFGS) for tokens in (1, 3)]


@pytest.mark.parametrize(("shape", "moe", "variant", "tokens"), SLOT_CASES)
def test_fp8_moe_mlp_row_wise_slot_kernels_match_float64(shape: LayerShape, moe: MoEShape, variant: str,
                                                         tokens: int) -> None:
    """The FP8 experts through the row-wise slot kernels (one program per token and choice; at 3 tokens experts
    shared by two tokens, each token its own row) against float64 on the dequantized experts."""
    g = _gen(47 + tokens)
    w = fp8_moe_layer(shape, moe, g)
    x1 = (torch.randn(tokens, shape.hidden_size, generator=g) * 0.05).to(DEVICE, DTYPE)
    out, ws = _run_mlp(w, shape, moe, x1, (SLOT_CFGS[variant], SLOT_CFGS[variant]))
    _check_mlp(w, shape, moe, x1, out, ws)


F16S = ops.GemvConfig("mrow_f16s", 16 if not GPU else 64, 32 if not GPU else 256, 4, 3)


@pytest.mark.parametrize("large", [False, True], ids=["ordinary", "large"])
def test_fp8_moe_mlp_with_the_rows_cast_to_fp16_once(monkeypatch: pytest.MonkeyPatch, large: bool) -> None:
    """``moe_ops.EXPERT_ROWS_F16``: the router stores the normed rows, the gate-up epilogue the activations, times 2^-4
    in fp16 once; the expert kernels' fp16 MMA on them, sums times 16. Against float64 on the dequantized experts
    (within fp16's rounding of the rows: 2^-11), ordinary rows and rows of ~1e5-8e5 (both stages) alike."""
    from lowlat.kernels import moe_ops

    monkeypatch.setattr(moe_ops, "EXPERT_ROWS_F16", True)
    shape, moe = CASES[-1]
    g = _gen(61)
    w = fp8_moe_layer(shape, moe, g)
    if large:  # as test_fp8_moe_mlp_keeps_large_activations
        w = replace(w, post_norm=(w.post_norm.float() * 1e5).to(DTYPE), router=(w.router.float() / 1e5).to(DTYPE),
                    w13_scale=w.w13_scale * (200.0 / 1e5))  # type: ignore[operator]
    x1 = (torch.randn(3, shape.hidden_size, generator=g) * 0.05).to(DEVICE, DTYPE)
    ws = MoEWorkspace.allocate(moe, shape.hidden_size, 8, DEVICE, DTYPE, fp8=True)
    assert moe_ops.rows_f16(True, F16S, F16S, ws) and not moe_ops.rows_f16(False, F16S, F16S, ws)
    out = torch.full_like(x1, float("nan"))
    moe_mlp(x1, w.post_norm, w.router, w.w13, w.w2, out, moe, shape.rms_eps, ws, _lc(shape), w13_scale=w.w13_scale,
            w2_scale=w.w2_scale, up_cfg=F16S, down_cfg=F16S)
    # fp16 holds a bf16 value times 2^-4 exactly, but for fp16 subnormals (rows below ~1e-3: 2^-24 steps)
    assert ws.hn16 is not None and torch.allclose(ws.hn16[:3].double() * 16, ws.hn[:3].double(), rtol=2**-10, atol=1e-6)
    if large:
        assert float(ws.hn[:3].abs().max()) > 65504.0 and torch.isfinite(ws.hn16[:3]).all()
    h2 = rms_norm(x1, w.post_norm, shape.rms_eps)
    want_w, want_ids = route(h2, w.router, moe.top_k)
    ref = _experts_f64(h2, w, moe, want_w, want_ids)
    assert torch.isfinite(out).all()
    assert _rel(out, x1.double() + ref) < max(TOL, 2e-3)


def test_fp8_moe_mlp_refuses_partial_fp8_and_dot_configs() -> None:
    """FP8 w13 without its scales, or FP8 experts with a ``dot`` expert config: a ShapeError, no launch."""
    g = _gen(43)
    shape, moe = SMALL, MoEShape(4, 2, 48)
    w = fp8_moe_layer(shape, moe, g)
    x1 = torch.randn(2, shape.hidden_size, generator=g).to(DEVICE, DTYPE)
    ws = MoEWorkspace.allocate(moe, shape.hidden_size, 8, DEVICE, DTYPE)
    out = torch.empty_like(x1)
    with pytest.raises(ShapeError, match="per-row scales"):
        moe_mlp(x1, w.post_norm, w.router, w.w13, w.w2, out, moe, shape.rms_eps, ws, _lc(shape), w13_scale=w.w13_scale)
    dot = ops.GemvConfig("dot", 16, 32)
    with pytest.raises(ShapeError, match="multi-row or rows"):
        moe_mlp(x1, w.post_norm, w.router, w.w13, w.w2, out, moe, shape.rms_eps, ws, _lc(shape),
                w13_scale=w.w13_scale, w2_scale=w.w2_scale, up_cfg=dot)
    up, down = expert_configs(DEVICE, _lc(shape), fp8=True)
    assert up.multi_row and down.multi_row


def test_model_dtype_experts_through_the_weight_stationary_kernels() -> None:
    """The weight-stationary expert kernels with model-dtype experts (``HAS_SCALE`` off; a multi-row config, as a
    benchmark sweeps them) against the reference MoE MLP."""
    from lowlat.moe import reference_moe

    g = _gen(45)
    shape, moe = SMALL, MoEShape(4, 2, 48)
    w = random_moe_layer(shape, moe, DTYPE, DEVICE, generator=g, router_scale=6.0)
    x1 = (torch.randn(3, shape.hidden_size, generator=g) * 0.05).to(DEVICE, DTYPE)
    ws = MoEWorkspace.allocate(moe, shape.hidden_size, 8, DEVICE, DTYPE)
    out = torch.full_like(x1, float("nan"))
    cfg = ops.GemvConfig("mrow", 16 if not GPU else 32, 32 if not GPU else 64)
    moe_mlp(x1, w.post_norm, w.router, w.w13, w.w2, out, moe, shape.rms_eps, ws, _lc(shape), up_cfg=cfg, down_cfg=cfg)
    ref = x1.float() + reference_moe(rms_norm(x1, w.post_norm, shape.rms_eps), w, moe)
    assert _rel(out, ref) < 3 * TOL


def _fp8_kv(shape: LayerShape, slots: int, g: torch.Generator, k_scale: float, v_scale: float) -> KVCache:
    kv = random_kv(shape, slots, torch.float32, "cpu", generator=g)
    return KVCache(quantize_kv(kv.k * 3, k_scale, FP8_DTYPE).to(DEVICE), quantize_kv(kv.v, v_scale, FP8_DTYPE).to(DEVICE),
                   k_scale, v_scale)


def _build(shape: LayerShape, moe: MoEShape, weights: list[MoELayerWeights], kv_dtype: torch.dtype,
           config: LowlatConfig | None = None):  # type: ignore[no-untyped-def]
    from lowlat.plugins.nvidia import build

    ctx = BuildContext(shape, (), DEVICE, DTYPE, kv_dtype, Coverage(max_tokens=8), config or LowlatConfig(),
                       fake_setup(vendor="cpu" if not GPU else "nvidia", arch="MixtralForCausalLM"), 2048, moe=moe,
                       moe_weights=tuple(weights))
    return build(ctx)


# the model-dtype cache in the interpreter's slow tier (the FP8-cache case checks the same oracle in the default one)
STACK_CASES = [pytest.param(SMALL, MoEShape(4, 2, 32), 3, kv, id=f"h64-3-{kv}",
                            marks=pytest.mark.slow if kv == "kv-model-dtype" and not GPU else ())
               for kv in ("kv-model-dtype", "kv-fp8")]
if GPU:  # Mixtral-8x7B's layer at one and eight rows, FP8 cache (the served configuration)
    STACK_CASES += [pytest.param(MIXTRAL, MIXTRAL_MOE, rows, "kv-fp8", id=f"mixtral-{rows}") for rows in (1, 8)]


@pytest.mark.parametrize(("shape", "moe", "rows", "kv_kind"), STACK_CASES)
def test_fp8_moe_stack_matches_reference_over_decode_steps(shape: LayerShape, moe: MoEShape, rows: int,
                                                           kv_kind: str) -> None:
    """Two FP8 MoE layers through the built nvidia plugin (FP8 qkv / o_proj on the dense stack's kernels, FP8 experts),
    two decode steps (KV writes included), against the reference MoE layer on the same weights and caches."""
    g = _gen(51 + rows)
    weights = [fp8_moe_layer(shape, moe, g) for _ in range(2)]
    kv_fp8 = kv_kind == "kv-fp8"
    built = _build(shape, moe, weights, FP8_DTYPE if kv_fp8 else DTYPE)
    assert type(built).__name__ == "TritonMoEStack" and built.lc.fp8
    slots = 1100 * rows if GPU else 96
    lens = [int(v) for v in torch.randint(1, 1000 if GPU else 20, (rows,), generator=g)]
    meta = decode_meta([n + 3 for n in lens], slots, 1024 if GPU else 32, DEVICE, generator=g)
    kv = [_fp8_kv(shape, slots, g, 0.06, 0.04) if kv_fp8 else random_kv(shape, slots, DTYPE, DEVICE, generator=g)
          for _ in weights]
    kv_ref = [KVCache(c.k.clone(), c.v.clone(), c.k_scale, c.v_scale) for c in kv]
    for step in range(2):
        seq = torch.tensor([n + 1 + step for n in lens], dtype=torch.int32, device=DEVICE)
        rows_idx = meta.req_pool_indices
        step_meta = type(meta)(meta.req_to_token, rows_idx, seq, (seq - 1).long(),
                               meta.req_to_token[rows_idx, seq.long() - 1].long(), max_seq_len=meta.max_seq_len)
        x = torch.randn(rows, shape.hidden_size, generator=g).to(DEVICE, DTYPE)
        for layer in range(2):
            out = built.forward(layer, x, kv[layer], step_meta)
            ref = reference_moe_decoder_layer(x, weights[layer], kv_ref[layer], step_meta, shape, moe)
            assert _rel(out, ref) < 3 * TOL, (step, layer)
            loc = step_meta.out_cache_loc.long()
            tol = 4e-2 if kv_fp8 else TOL
            assert _rel(kv[layer].k[loc].float(), kv_ref[layer].k[loc].float()) < tol
            assert _rel(kv[layer].v[loc].float(), kv_ref[layer].v[loc].float()) < tol
            x = out.clone()


def test_fp8_moe_stack_refuses_mixed_layers_and_a_model_dtype_launch_config() -> None:
    """FP8 in some layers only, or FP8 weights with a model-dtype LaunchConfig: Unsupported with the reason."""
    from lowlat.plugins._moe_stack import TritonMoEStack

    g = _gen(53)
    shape, moe = SMALL, MoEShape(4, 2, 32)
    fp8 = fp8_moe_layer(shape, moe, g)
    dense = random_moe_layer(shape, moe, DTYPE, DEVICE, generator=g)
    with pytest.raises(Unsupported, match="every layer or none"):
        _build(shape, moe, [fp8, dense], DTYPE)
    ctx = BuildContext(shape, (), DEVICE, DTYPE, DTYPE, Coverage(max_tokens=8), LowlatConfig(),
                       fake_setup(vendor="cpu" if not GPU else "nvidia", arch="MixtralForCausalLM"), 64, moe=moe,
                       moe_weights=(fp8,))
    with pytest.raises(Unsupported, match="LaunchConfig.fp8=False"):
        TritonMoEStack("nvidia", ctx, ops.LaunchConfig.for_device(DEVICE, shape, use_pdl=False))
    with pytest.raises(Unsupported, match="w13_scale"):
        _build(shape, moe, [replace(fp8, w13_scale=fp8.w13_scale[:, :-1].contiguous())], DTYPE)  # type: ignore[index]


def test_fp8_moe_stack_is_declined_without_a_measurement_under_measured_only() -> None:
    """LowlatConfig.measured_only with no FP8 MoE entry (tuning.FP8_MOE_WINS_UP_TO; on the interpreter no table at
    all): refused at build with the table named; plain ``auto`` builds it."""
    g = _gen(55)
    shape, moe = SMALL, MoEShape(4, 2, 32)
    w = fp8_moe_layer(shape, moe, g)
    with pytest.raises(Unsupported, match="FP8_MOE_WINS_UP_TO"):
        _build(shape, moe, [w], DTYPE, LowlatConfig(measured_only=True))
    assert _build(shape, moe, [w], DTYPE).covers(Step.decode(1))
