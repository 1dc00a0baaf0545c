"""The built-in plugins as the framework sees them: entry points, guards, check_model, build errors."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lowlat import LayerShape, LowlatConfig, LowlatError, Registry, Session, Step, Unsupported
from lowlat.kernels import ops
from lowlat.kernels._jit import next_pow2, pdl_available
from lowlat.testing import fake_setup, random_layer


def test_entry_points_give_both_plugins() -> None:
    reg = Registry.from_entry_points()
    assert {"nvidia", "amd"} <= set(reg.names())
    nv, amd = reg.get("nvidia"), reg.get("amd")
    assert nv.requirements.vendor == "nvidia" and amd.requirements.vendor == "amd"
    assert "LlamaForCausalLM" in nv.archs and nv.coverage.why_not(Step.decode(8)) is None


def test_vendor_decides_the_plugin() -> None:
    for vendor, kw, want in [
        ("nvidia", {"capability": (9, 0)}, "nvidia"),
        ("amd", {"capability": None, "amd_arch": "gfx942"}, "amd"),
        ("cpu", {"capability": None}, None),
    ]:
        s = Session(LowlatConfig(), Registry.from_entry_points())
        s.configure(fake_setup(vendor=vendor, **kw))
        s.loaded()
        chosen = s.check_model(SimpleNamespace(config=SimpleNamespace(attention_bias=False)))
        assert (chosen.name if chosen else None) == want, vendor


def test_check_model_rejects_bias_and_shared_experts() -> None:
    s = Session(LowlatConfig(), Registry.from_entry_points())
    s.configure(fake_setup())
    s.loaded()
    model = SimpleNamespace(config=SimpleNamespace(attention_bias=True, num_local_experts=8, n_shared_experts=1))
    assert s.check_model(model) is None
    assert len(s.verdicts["nvidia"].reasons) == 2


def test_moe_model_picks_nvidia_and_amd_refuses_it() -> None:
    moe_cfg = SimpleNamespace(config=SimpleNamespace(attention_bias=False, num_local_experts=8))
    s = Session(LowlatConfig(), Registry.from_entry_points())
    s.configure(fake_setup(arch="MixtralForCausalLM"))
    s.loaded()
    chosen = s.check_model(moe_cfg)
    assert chosen is not None and chosen.name == "nvidia"
    from lowlat.plugins.amd import check_model as amd_check

    assert any("mixture-of-experts" in r for r in amd_check(moe_cfg))


def test_build_refuses_odd_head_dim_with_unsupported() -> None:
    from lowlat.build import BuildContext
    from lowlat.plugins.nvidia import build
    from lowlat.spec import Coverage

    shape = LayerShape(hidden_size=48, num_heads=2, num_kv_heads=1, head_dim=24, intermediate_size=32)
    ctx = BuildContext(shape, (random_layer(shape),), torch.device("cpu"), torch.float32, torch.float32,
                       Coverage(), LowlatConfig(), fake_setup(vendor="cpu"), 64)
    with pytest.raises(Unsupported, match="power-of-two head_dim"):
        build(ctx)


def _small_stack(config: LowlatConfig) -> tuple[LayerShape, Any]:
    """A tiny CPU layer shape and the BuildContext of one random layer of it (agreed coverage: 8 tokens)."""
    from lowlat.build import BuildContext
    from lowlat.spec import Coverage

    shape = LayerShape(hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=32)
    return shape, BuildContext(shape, (random_layer(shape),), torch.device("cpu"), torch.float32, torch.float32,
                               Coverage(max_tokens=8), config, fake_setup(vendor="cpu"), 64)


@pytest.mark.parametrize(("wins_up_to", "measured", "largest"), [(0, True, 8), (1, True, 1), (4, True, 4), (1, False, 8)])
def test_stack_declines_batches_above_its_measured_win(wins_up_to: int, measured: bool, largest: int) -> None:
    """LaunchConfig.wins_up_to (tuning.WINS_UP_TO) caps the decode batches the built stack takes (the agreed
    coverage here: 8) unless LowlatConfig.measured_coverage is off; extend steps are never covered."""
    from lowlat.plugins._stack import TritonLayerStack
    from lowlat.spec import StepKind

    shape, ctx = _small_stack(LowlatConfig(measured_coverage=measured))
    lc = ops.LaunchConfig.for_device(torch.device("cpu"), shape, False)
    stack = TritonLayerStack("nvidia", ctx, replace(lc, wins_up_to=wins_up_to))
    assert [b for b in range(1, 17) if stack.covers(Step.decode(b))] == list(range(1, largest + 1))
    assert not stack.covers(Step(StepKind.EXTEND, 1, 4, 4))
    # verify rows count like decode rows; at most MAX_VERIFY_ROWS per request
    assert [n for n in range(1, 17) if stack.covers(Step.verify(n, 1))] == list(range(1, largest + 1))
    assert stack.covers(Step.verify(min(largest, 8), min(largest, 8))) and not stack.covers(Step.verify(16, 9))
    # a measured verify limit (0: none) replaces the decode one for verify steps, unless coverage is unmeasured
    for verify_limit, want in ((0, 0), (2, 2)):
        vstack = TritonLayerStack("nvidia", ctx, replace(lc, wins_up_to=wins_up_to, verify_wins_up_to=verify_limit))
        got = [n for n in range(1, 17) if vstack.covers(Step.verify(n, 1))]
        assert got == list(range(1, (want if measured else largest) + 1))
        assert [b for b in range(1, 17) if vstack.covers(Step.decode(b))] == list(range(1, largest + 1))


@pytest.mark.parametrize(("wins_up_to", "largest"), [(0, 0), (4, 4)])
def test_measured_only_declines_shapes_without_a_measurement(wins_up_to: int, largest: int) -> None:
    """LowlatConfig.measured_only (a server's GPU default): no measured entry (wins_up_to 0), no step; a measured
    limit applies as with measured coverage."""
    from lowlat.plugins._stack import TritonLayerStack

    shape, ctx = _small_stack(LowlatConfig(measured_only=True))
    lc = ops.LaunchConfig.for_device(torch.device("cpu"), shape, False)
    stack = TritonLayerStack("nvidia", ctx, replace(lc, wins_up_to=wins_up_to))
    assert [b for b in range(1, 17) if stack.covers(Step.decode(b))] == list(range(1, largest + 1))
    assert [n for n in range(1, 17) if stack.covers(Step.verify(n, 1))] == list(range(1, largest + 1))


def test_plugins_refuse_an_unmeasured_shape_at_build_when_measured_only() -> None:
    """Refused at build (explain() says why; no workspace, the KV pool keeps its own layout) rather than built and
    never used; without measured_only the same shape builds."""
    from lowlat.plugins.nvidia import build


    with pytest.raises(Unsupported, match="no measured table"):
        build(_small_stack(LowlatConfig(measured_only=True))[1])
    assert build(_small_stack(LowlatConfig())[1]).covers(Step.decode(1))
    from lowlat.plugins import amd

    with pytest.raises(Unsupported, match="no measured table"):
        amd.build(_small_stack(LowlatConfig(measured_only=True))[1])


def test_nvidia_covers_verify_steps_and_amd_does_not() -> None:
    from lowlat.kernels.ops import MAX_VERIFY_ROWS
    from lowlat.plugins import amd, nvidia

    assert nvidia.spec.coverage.why_not(Step.verify(8, 6)) is None
    assert nvidia.spec.coverage.why_not(Step.verify(16, MAX_VERIFY_ROWS + 1)) is not None
    assert "speculative" not in nvidia.spec.requirements.forbidden_features
    assert amd.spec.coverage.why_not(Step.verify(8, 6)) == "step kind verify not covered"
    with pytest.raises(ValueError, match="max_query_len"):
        Step.verify(4, 5)


def test_measured_win_tables_are_well_formed_and_looked_up_by_their_own_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    from lowlat.kernels import tuning
    from lowlat.kernels.tuning import MOE_WINS_UP_TO, WINS_UP_TO, tuned_wins_up_to
    from lowlat.moe import MoEShape

    llama = LayerShape(hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336)
    assert tuned_wins_up_to("Some Other GPU", shape=llama) == 0
    assert all(limit >= 1 for limit in (*WINS_UP_TO.values(), *MOE_WINS_UP_TO.values()))
    for (gpu, key), limit in WINS_UP_TO.items():  # every entry is what its own GPU and shape get
        assert tuned_wins_up_to(gpu, LayerShape(*key)) == limit
    for (gpu, key, (experts, top_k, inter)), limit in MOE_WINS_UP_TO.items():
        assert tuned_wins_up_to(gpu, LayerShape(*key), MoEShape(experts, top_k, inter)) == limit
    # a Mixtral layer's attention half has the dense key: the MoE stack's limit is its own, and an MoE shape
    # without an entry has no limit even where the dense key has one (tables of our own, not the measured ones)
    key = tuning.shape_key(llama)
    monkeypatch.setattr(tuning, "WINS_UP_TO", {("GPU X", key): 8})
    monkeypatch.setattr(tuning, "MOE_WINS_UP_TO", {("GPU X", key, (8, 2, 14336)): 1})
    assert tuning.tuned_wins_up_to("GPU X", llama) == 8
    assert tuning.tuned_wins_up_to("GPU X", llama, MoEShape(8, 2, 14336)) == 1
    assert tuning.tuned_wins_up_to("GPU X", llama, MoEShape(8, 1, 14336)) == 0
    assert tuning.tuned_wins_up_to("GPU Y", llama, MoEShape(8, 2, 14336)) == 0


def test_fp8_weights_have_their_own_measured_limits_else_the_bf16_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    from lowlat.kernels import tuning

    for (gpu, key), limit in tuning.FP8_WINS_UP_TO.items():
        assert tuning.tuned_wins_up_to(gpu, LayerShape(*key), fp8=True) == limit
    for (gpu, key), rows in tuning.FP8_VERIFY_WINS_UP_TO.items():
        assert tuning.tuned_verify_wins_up_to(gpu, LayerShape(*key), fp8=True) == rows
    llama = LayerShape(hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336)
    key = tuning.shape_key(llama)
    monkeypatch.setattr(tuning, "WINS_UP_TO", {("GPU X", key): 8, ("GPU Y", key): 4})
    monkeypatch.setattr(tuning, "FP8_WINS_UP_TO", {("GPU X", key): 1})
    monkeypatch.setattr(tuning, "VERIFY_WINS_UP_TO", {("GPU X", key): 16})
    monkeypatch.setattr(tuning, "FP8_VERIFY_WINS_UP_TO", {("GPU X", key): 0})
    assert [tuning.tuned_wins_up_to("GPU X", llama, fp8=f) for f in (False, True)] == [8, 1]
    assert [tuning.tuned_wins_up_to("GPU Y", llama, fp8=f) for f in (False, True)] == [4, 4]  # no FP8 entry
    assert [tuning.tuned_verify_wins_up_to("GPU X", llama, fp8=f) for f in (False, True)] == [16, 0]
    assert tuning.tuned_verify_wins_up_to("GPU Y", llama, fp8=True) is None  # the decode limit applies


def test_cpu_launch_without_interpreter_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    shape = LayerShape(hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=32)
    x = torch.randn(1, 32)
    with pytest.raises(LowlatError, match="TRITON_INTERPRET=1"):
        ops.gemv_residual(x, torch.randn(32, 32), x, x.clone(), ops.LaunchConfig.for_device(torch.device("cpu"), shape, False))


def test_launch_helpers() -> None:
    assert [next_pow2(n) for n in (1, 2, 3, 8, 9)] == [1, 2, 4, 8, 16]
    assert isinstance(pdl_available(), bool)
    shape = LayerShape(hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336)
    lc = ops.LaunchConfig(num_sms=132)
    assert ops.num_splits(1, shape, 4096, lc, 16) == 16
    assert ops.num_splits(8, shape, 4096, lc, 16) == 5
    assert ops.num_splits(1, shape, 10, lc, 16) == 1
