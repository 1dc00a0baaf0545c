"""FP8 MoE layer weights: validation, online quantization, the dequantized reference, TP shards (torch only)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lowlat import LayerShape, MoEShape, quantize_moe_layer_fp8
from lowlat.errors import ShapeError
from lowlat.layer import FP8_DTYPE
from lowlat.moe import MoELayerWeights, dequantized_experts, reference_moe
from lowlat.reference import rms_norm
from lowlat.testing import random_moe_layer
from lowlat.tp import shard_moe_layer

SHAPE = LayerShape(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=48)
MOE = MoEShape(4, 2, 48)


def _fp8(seed: int = 0) -> tuple[MoELayerWeights, MoELayerWeights]:
    dense = random_moe_layer(SHAPE, MOE, torch.float32, generator=torch.Generator().manual_seed(seed), router_scale=6.0)
    return dense, quantize_moe_layer_fp8(dense)


def test_quantized_layer_is_fp8_with_per_row_scales_and_dequantizes_close() -> None:
    dense, w = _fp8()
    w.validate(SHAPE, MOE)
    assert w.fp8 and not dense.fp8
    assert w.w13.dtype == w.w2.dtype == w.qkv.dtype == w.o_proj.dtype == FP8_DTYPE
    assert w.router.dtype == torch.float32 and torch.equal(w.router, dense.router)  # the router stays as it was
    assert w.w13_scale.shape == (4, 96) and w.w2_scale.shape == (4, 64)  # type: ignore[union-attr]
    # each expert row's absolute maximum maps to 448 (its scale), and the round trip is within e4m3's step (2^-4)
    amax = dense.w13.abs().amax(-1)
    assert torch.allclose(w.w13_scale * 448.0, amax, rtol=1e-6)  # type: ignore[operator]
    for name, scale in (("w13", w.w13_scale), ("w2", w.w2_scale)):
        back = dequantized_experts(getattr(w, name), scale, torch.float64)
        err = (back - getattr(dense, name).double()).abs() / getattr(dense, name).double().abs().clamp_min(1e-3)
        assert float(err.max()) <= 2**-4, name
    assert dequantized_experts(dense.w13, None, torch.float64) is dense.w13


def test_reference_moe_of_the_fp8_layer_is_the_dense_reference_on_dequantized_experts() -> None:
    """The FP8 reference equals the model-dtype reference run on the dequantized experts (float64: exactly the same
    sums), and differs from the unquantized layer by the quantization error only."""
    dense, w = _fp8(1)
    h = rms_norm(torch.randn(5, 64, generator=torch.Generator().manual_seed(2)), dense.post_norm, SHAPE.rms_eps)
    deq = replace(w, w13=dequantized_experts(w.w13, w.w13_scale, torch.float64), w13_scale=None,
                  w2=dequantized_experts(w.w2, w.w2_scale, torch.float64), w2_scale=None)
    got = reference_moe(h.double(), w, MOE)
    assert got.dtype == torch.float64
    assert torch.allclose(got, reference_moe(h.double(), deq, MOE), rtol=1e-12, atol=1e-12)
    full = reference_moe(h.double(), dense, MOE)
    assert float((got - full).norm() / full.norm()) < 0.1  # e4m3: 3 mantissa bits, a step of up to 2^-4 per weight


@pytest.mark.parametrize(("change", "match"), [
    (lambda w: replace(w, w13_scale=None), "w13_scale must be float32"),
    (lambda w: replace(w, w2_scale=w.w2_scale.double()), "w2_scale must be float32"),
    (lambda w: replace(w, w13_scale=w.w13_scale[:, :-1]), r"w13_scale must be float32 \(4, 96\)"),
    (lambda w: replace(w, qkv=w.qkv.float(), qkv_scale=None), "qkv is torch.float32: FP8 weights need"),
    (lambda w: replace(w, router=w.router.to(FP8_DTYPE)), "router must stay in the model dtype"),
])
def test_validation_names_the_bad_fp8_field(change, match: str) -> None:  # type: ignore[no-untyped-def]
    _, w = _fp8()
    with pytest.raises(ShapeError, match=match):
        change(w).validate(SHAPE, MOE)


def test_model_dtype_layer_with_a_stray_scale_is_refused() -> None:
    dense, w = _fp8()
    with pytest.raises(ShapeError, match="w2_scale is for FP8 weights"):
        replace(dense, w2_scale=w.w2_scale).validate(SHAPE, MOE)


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_shards_of_an_fp8_layer_are_the_shards_of_its_dequantized_experts(tp: int) -> None:
    """Each rank's FP8 shard (w13 rows with their scales, w2 columns with the whole rows' scales) dequantizes to the
    rank's shard of the dequantized layer."""
    _, w = _fp8(3)
    deq = replace(w, w13=dequantized_experts(w.w13, w.w13_scale, torch.float64), w13_scale=None,
                  w2=dequantized_experts(w.w2, w.w2_scale, torch.float64), w2_scale=None)
    for rank in range(tp):
        part, want = shard_moe_layer(w, SHAPE, MOE, rank, tp), shard_moe_layer(deq, SHAPE, MOE, rank, tp)
        assert torch.equal(dequantized_experts(part.w13, part.w13_scale, torch.float64), want.w13)
        assert torch.equal(dequantized_experts(part.w2, part.w2_scale, torch.float64), want.w2)
