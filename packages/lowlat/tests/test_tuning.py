"""Per-stage GEMV kernel choice: table lookup and the first-match-by-batch rule (no GPU needed)."""

from __future__ import annotations

import pytest

from lowlat import LayerShape
from lowlat.kernels.ops import GEMV_STAGES, GEMV_VARIANTS, GemvConfig, LaunchConfig
from lowlat.kernels.tuning import TABLES, tuned_table

LLAMA3_8B = LayerShape(hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336)


def test_first_entry_whose_max_batch_covers_the_batch_wins() -> None:
    small, large = GemvConfig("rows", 8, 1024, 8, 2), GemvConfig("dot", 32, 256, 4, 4)
    lc = LaunchConfig(gemv_block_n=16, gemv_block_k=128, qkv_block_p=8, tuned=(("down", 1, small), ("down", 16, large)))
    assert lc.gemv_config("down", 1) == small
    assert lc.gemv_config("down", 2) == large
    assert lc.gemv_config("down", 16) == large
    # past the table and for stages without entries: the LaunchConfig's own blocks, the dot kernel
    assert lc.gemv_config("down", 17) == GemvConfig("dot", 16, 128, lc.num_warps, lc.num_stages)
    assert lc.gemv_config("o_proj", 1) == GemvConfig("dot", 16, 128, lc.num_warps, lc.num_stages)
    assert lc.gemv_config("qkv", 1).block_n == 8  # qkv's block is its rotary pairs per tile


@pytest.mark.parametrize(("key", "entries"), list(TABLES.items()))
def test_tables_are_usable(key: tuple[str, tuple[int, ...]], entries: tuple) -> None:
    hidden, heads, kv_heads, head_dim, inter = key[1]
    shape = LayerShape(hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                       intermediate_size=inter)
    assert tuned_table(key[0], shape) == entries
    lc = LaunchConfig(tuned=entries)
    for stage in GEMV_STAGES:
        for batch in range(1, 17):  # the nvidia plugin's coverage: up to 16 decode rows
            assert any(name == stage and batch <= mb for name, mb, _ in entries), (stage, batch)
    for stage, _, cfg in entries:
        assert stage in GEMV_STAGES
        assert cfg.variant in GEMV_VARIANTS
        if stage == "qkv":
            assert (head_dim // 2) % cfg.block_n == 0
    assert lc.gemv_config("o_proj", 1) in [c for s, _, c in entries if s == "o_proj"]


def test_unknown_gpu_or_shape_gets_no_entries() -> None:
    assert tuned_table("Some Other GPU", LLAMA3_8B) == ()
    assert tuned_table("NVIDIA H200", LayerShape(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                                                 intermediate_size=96)) == ()


def test_qkv_blocks_that_do_not_divide_half_the_head_dim_are_reported() -> None:
    assert LaunchConfig(qkv_block_p=16).qkv_block_errors(LLAMA3_8B) == ()
    odd = LaunchConfig(qkv_block_p=16, tuned=(("qkv", 1, GemvConfig("dot", 128, 256, 4, 3)),))
    assert odd.qkv_block_errors(LLAMA3_8B) == ("head_dim 128 is not a multiple of 2 * 128",)


def test_pdl_release_point() -> None:
    auto = LaunchConfig(num_sms=132)
    assert auto.pdl_early(1) and auto.pdl_early(132)  # the whole grid is resident at once
    assert not auto.pdl_early(133)
    assert LaunchConfig(num_sms=132, pdl_release="early").pdl_early(10_000)
    assert not LaunchConfig(num_sms=132, pdl_release="late").pdl_early(1)
    with pytest.raises(ValueError, match="pdl_release"):
        LaunchConfig(pdl_release="sometimes")


def test_pdl_release_table_values_are_valid() -> None:
    from lowlat.kernels.ops import PDL_RELEASES
    from lowlat.kernels.tuning import PDL_RELEASE, tuned_pdl_release

    assert tuned_pdl_release("Some Other GPU", LLAMA3_8B) == "auto"
    for (gpu, key), release in PDL_RELEASE.items():
        assert release in PDL_RELEASES
        hidden, heads, kv_heads, head_dim, inter = key
        shape = LayerShape(hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                           intermediate_size=inter)
        assert tuned_pdl_release(gpu, shape) == release


def test_attention_block_by_batch() -> None:
    from lowlat.kernels.tuning import ATTENTION, tuned_attention

    lc = LaunchConfig(attn_block_n=64, attn_tuned=((1, 32), (16, 128)))
    assert [lc.attn_block(b) for b in (1, 2, 16, 17)] == [32, 128, 128, 64]
    assert LaunchConfig(attn_block_n=64).attn_block(1) == 64
    assert tuned_attention("Some Other GPU", LLAMA3_8B) == ()
    for entries in ATTENTION.values():
        assert all(block & (block - 1) == 0 for _, block in entries)  # powers of two (tl.arange)
        assert [mb for mb, _ in entries] == sorted(mb for mb, _ in entries)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"variant": "rows3"}, "variant"), ({"block_n": 48}, "block_n"), ({"block_k": 0}, "block_k"),
    ({"num_warps": 0}, "num_warps"), ({"programs": -1}, "programs")])
def test_gemv_config_rejects_what_no_kernel_runs(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GemvConfig(**kwargs)


def test_persistent_table_entries_are_dot_tiles_on_a_known_grid() -> None:
    from lowlat.kernels.tuning import PERSISTENT, tuned_persistent

    assert tuned_persistent("Some Other GPU", LLAMA3_8B) is None  # the amd plugin then takes LaunchConfig's blocks
    for (gpu, key), cfg in PERSISTENT.items():
        hidden, heads, kv_heads, head_dim, inter = key
        shape = LayerShape(hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                           intermediate_size=inter)
        assert tuned_persistent(gpu, shape) == cfg
        assert cfg.variant == "dot"  # K2's GEMV tasks are tensor-core tiles
        assert min(hidden, heads * head_dim, inter) % cfg.block_n == 0 and cfg.programs >= 0


def test_fp8_moe_coverage_has_its_own_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """FP8 MoE stacks read FP8_MOE_WINS_UP_TO only: the model-dtype MoE entry says nothing of FP8 (0: no entry, which
    measured_only declines), and an entry added there once measured is what they get."""
    from lowlat import MoEShape
    from lowlat.kernels import tuning

    moe = MoEShape(8, 2, 14336)
    key = ("NVIDIA H200", tuning.shape_key(LLAMA3_8B), (8, 2, 14336))
    assert tuning.tuned_wins_up_to("NVIDIA H200", LLAMA3_8B, moe) == tuning.MOE_WINS_UP_TO[key]
    assert tuning.tuned_wins_up_to("NVIDIA H200", LLAMA3_8B, moe, fp8=True) == tuning.FP8_MOE_WINS_UP_TO.get(key, 0)
    monkeypatch.setitem(tuning.FP8_MOE_WINS_UP_TO, key, 3)
    assert tuning.tuned_wins_up_to("NVIDIA H200", LLAMA3_8B, moe, fp8=True) == 3
    assert tuning.tuned_wins_up_to("NVIDIA H200", LLAMA3_8B, moe) == tuning.MOE_WINS_UP_TO[key]
    assert tuning.tuned_wins_up_to("NVIDIA H200", LLAMA3_8B, fp8=True) == tuning.FP8_WINS_UP_TO[key[:2]]  # dense


def test_fp8_expert_tiles_by_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """The FP8 expert kernels' tiles on a GPU: the first EXPERT_TILES_FP8 entry whose max tokens covers the step's
    (every multi-row or rows: the kernels that read FP8); the interpreter's small blocks elsewhere. Pure."""
    import torch

    from lowlat.kernels import moe_ops

    cuda, lc = torch.device("cuda"), LaunchConfig()
    for tokens in (1, 8, moe_ops.MAX_TOKENS):
        up, down = moe_ops.expert_configs(cuda, lc, True, tokens)
        assert all(cfg.multi_row or cfg.row_wise for cfg in (up, down))
    assert moe_ops.expert_configs(cuda, lc, False, 1) == (moe_ops.EXPERT_GATE_UP, moe_ops.EXPERT_DOWN)
    rows, wide = GemvConfig("rows", 4, 2048, 4, 2, vec=16), GemvConfig("mrow_f16s", 64, 256, 4, 3)
    monkeypatch.setattr(moe_ops, "EXPERT_TILES_FP8", ((1, rows, rows), (moe_ops.MAX_TOKENS, wide, wide)))
    assert moe_ops.expert_configs(cuda, lc, True, 1) == (rows, rows)
    assert moe_ops.expert_configs(cuda, lc, True, 2) == (wide, wide)
    assert moe_ops.expert_configs(torch.device("cpu"), lc, True, 1)[0].variant == "mrow"


def test_verify_steps_take_their_own_attention_warps() -> None:
    # LaunchConfig.verify_attn_warps: steps of several rows per request (ForwardMeta.rows_per_request > 1, speculative
    # verify) launch the attention with their own warps (0: attn_warps'); the engine captures their graphs apart
    # only where the two launches differ (verify_launch_differs)
    lc = LaunchConfig(num_sms=132, verify_attn_warps=8)
    assert [lc.attention_warps(r) for r in (1, 2, 8)] == [0, 8, 8] and lc.verify_launch_differs
    both = LaunchConfig(num_sms=132, attn_warps=8)
    assert [both.attention_warps(r) for r in (1, 6)] == [8, 8] and not both.verify_launch_differs
    assert not LaunchConfig(num_sms=132, attn_warps=8, verify_attn_warps=8).verify_launch_differs
    assert not LaunchConfig().verify_launch_differs


def test_fp8_cache_attention_tables_name_known_shapes_and_valid_values() -> None:
    from lowlat.kernels.tuning import ATTN_F16, VERIFY_ATTN_WARPS, tuned_attn_f16, tuned_verify_attn_warps

    assert tuned_verify_attn_warps("Some Other GPU", LLAMA3_8B, True) == 0 and not tuned_attn_f16("Some Other GPU",
                                                                                                    LLAMA3_8B)
    for (gpu, key), warps in VERIFY_ATTN_WARPS.items():
        hidden, heads, kv_heads, head_dim, inter = key
        shape = LayerShape(hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                           intermediate_size=inter)
        assert warps in (1, 2, 4, 8, 16)
        # measured with FP8 weights and an FP8 cache only: other stacks keep their decode launch
        assert tuned_verify_attn_warps(gpu, shape, True) == warps and tuned_verify_attn_warps(gpu, shape, False) == 0
    for (gpu, key), on in ATTN_F16.items():
        hidden, heads, kv_heads, head_dim, inter = key
        shape = LayerShape(hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                           intermediate_size=inter)
        assert tuned_attn_f16(gpu, shape) is on
