"""Our model implementations vs HF transformers on tiny random configs (float32, <= 1e-4).

Each family is built by transformers with random weights, saved as a HF folder, loaded by
lmserver's loader, and run through the real KV pool + torch_native attention: a full prefill,
then a chunked prefill plus decode steps, all compared with HF's full-sequence logits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmserver.forward.kv_pool import KVPool, make_req_to_token
from lmserver.models.loader import ModelLoadError, load_model, read_model_config
from lmserver.runner.attention.torch_native import TorchNativeBackend
from lmserver.runner.model_runner import ModelRunner
from lmserver.scheduler import ForwardItem, ScheduleDecision

transformers = pytest.importorskip("transformers")

COMMON = dict(
    vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64,
)
LLAMA3_ROPE = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16, "rope_theta": 500000.0,
}


def _configs() -> dict[str, tuple[type, type, dict]]:
    t = transformers
    return {
        "llama": (t.LlamaConfig, t.LlamaForCausalLM, {}),
        "llama-tied": (t.LlamaConfig, t.LlamaForCausalLM, {"tie_word_embeddings": True}),
        "llama3-rope": (t.LlamaConfig, t.LlamaForCausalLM, {"rope_scaling": LLAMA3_ROPE}),
        "llama-linear-rope": (t.LlamaConfig, t.LlamaForCausalLM, {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
        "mistral": (t.MistralConfig, t.MistralForCausalLM, {"sliding_window": None}),
        "qwen2": (t.Qwen2Config, t.Qwen2ForCausalLM, {}),
        "qwen3": (t.Qwen3Config, t.Qwen3ForCausalLM, {"head_dim": 16}),
        "mixtral": (t.MixtralConfig, t.MixtralForCausalLM, {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}),
    }


def _hf_folder(tmp_path: Path, family: str) -> tuple[Path, torch.nn.Module]:
    config_cls, model_cls, extra = _configs()[family]
    torch.manual_seed(0)
    config = config_cls(**COMMON, **extra)
    model = model_cls(config).eval()
    with torch.no_grad():  # non-trivial biases and norms so every weight matters
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(0.0, 0.5).add_(1.0 if "norm" in name else 0.0)
    folder = tmp_path / family
    model.save_pretrained(folder)
    return folder, model


def _item(row: int, prefix: int, ids: list[int], slots: list[int], all_logits: bool) -> ForwardItem:
    n = len(ids)
    return ForwardItem(
        rid="r", req_pool_idx=row, prefix_len=prefix, token_ids=ids, out_slots=slots[prefix : prefix + n],
        table_start=prefix, table_slots=slots[prefix : prefix + n],
        logit_offsets=list(range(n)) if all_logits else [n - 1], completes_prefill=True,
    )


def _runner(folder: Path) -> tuple[ModelRunner, int]:
    config = read_model_config(folder)
    model = load_model(config, folder, dtype=torch.float32, max_positions=64)
    pool = KVPool(128, config.num_hidden_layers, config.num_key_value_heads, config.head_dim, torch.float32, "cpu")
    table = make_req_to_token(4, 64, "cpu")
    backend = TorchNativeBackend(pool, table)
    return ModelRunner(model, pool, table, backend, torch.device("cpu")), config.vocab_size


@pytest.mark.parametrize("family", list(_configs()))
def test_logits_match_hf(tmp_path: Path, family: str) -> None:
    folder, hf = _hf_folder(tmp_path, family)
    runner, vocab = _runner(folder)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (40,), generator=g).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()  # (40, vocab)
    slots = list(range(1, 41))
    # full prefill, logits for every position
    full = runner.forward(ScheduleDecision("extend", [_item(0, 0, ids, slots, True)]))
    torch.testing.assert_close(full, ref, atol=1e-4, rtol=0)
    # chunked prefill (17 + 13 tokens) then 10 decode steps in another table row and slots
    slots2 = list(range(60, 100))
    got = [runner.forward(ScheduleDecision("extend", [_item(1, 0, ids[:17], slots2, True)]))]
    got.append(runner.forward(ScheduleDecision("extend", [_item(1, 17, ids[17:30], slots2, True)])))
    for pos in range(30, 40):
        item = _item(1, pos, [ids[pos]], slots2, False)
        got.append(runner.forward(ScheduleDecision("decode", [item])))
    torch.testing.assert_close(torch.cat(got), ref, atol=1e-4, rtol=0)


def test_batched_decode_of_different_lengths_matches_hf(tmp_path: Path) -> None:
    folder, hf = _hf_folder(tmp_path, "qwen3")
    runner, vocab = _runner(folder)
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (5, 12, 9)]
    slot_sets = [list(range(1 + 20 * i, 1 + 20 * i + len(s))) for i, s in enumerate(seqs)]
    prefill = [_item(i, 0, s[:-1], slot_sets[i], False) for i, s in enumerate(seqs)]
    runner.forward(ScheduleDecision("extend", prefill))
    decode = [_item(i, len(s) - 1, [s[-1]], slot_sets[i], False) for i, s in enumerate(seqs)]
    got = runner.forward(ScheduleDecision("decode", decode))
    with torch.no_grad():
        ref = torch.stack([hf(torch.tensor([s])).logits[0, -1] for s in seqs])
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_dtypes_load_and_stay_close(tmp_path: Path, dtype: torch.dtype) -> None:
    folder, hf = _hf_folder(tmp_path, "llama")
    config = read_model_config(folder)
    model = load_model(config, folder, dtype=dtype, max_positions=64)
    assert all(p.dtype == dtype for p in model.parameters())
    pool = KVPool(64, config.num_hidden_layers, config.num_key_value_heads, config.head_dim, dtype, "cpu")
    table = make_req_to_token(1, 64, "cpu")
    runner = ModelRunner(model, pool, table, TorchNativeBackend(pool, table), torch.device("cpu"))
    ids = list(range(3, 23))
    got = runner.forward(ScheduleDecision("extend", [_item(0, 0, ids, list(range(1, 21)), True)]))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert got.dtype == torch.float32
    assert (got - ref).abs().max().item() < 0.1


def test_dummy_weights_are_seeded(tmp_path: Path) -> None:
    folder, _ = _hf_folder(tmp_path, "mixtral")
    config = read_model_config(folder)
    a = load_model(config, None, load_format="dummy", seed=3)
    b = load_model(config, None, load_format="dummy", seed=3)
    c = load_model(config, None, load_format="dummy", seed=4)
    pa, pb, pc = (dict(m.named_parameters()) for m in (a, b, c))
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert not torch.equal(pa["model.layers.0.mlp.w13"], pc["model.layers.0.mlp.w13"])


def test_sharded_safetensors_and_bad_checkpoints(tmp_path: Path) -> None:
    folder, hf = _hf_folder(tmp_path, "qwen2")
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    runner, _ = _runner(sharded)
    ref_runner, _ = _runner(folder)
    ids = [5, 6, 7, 8]
    a = runner.forward(ScheduleDecision("extend", [_item(0, 0, ids, [1, 2, 3, 4], True)]))
    b = ref_runner.forward(ScheduleDecision("extend", [_item(0, 0, ids, [1, 2, 3, 4], True)]))
    assert torch.equal(a, b)
    # a missing tensor is reported, not silently left random
    from safetensors.torch import load_file, save_file

    state = load_file(str(folder / "model.safetensors"))
    del state["model.layers.1.self_attn.k_proj.weight"]
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="not \\(fully\\) loaded"):
        _runner(folder)


def test_batched_extend_with_cached_prefixes_matches_hf(tmp_path: Path) -> None:
    """Several requests in one EXTEND forward (one padded SDPA), with and without a cached prefix."""
    folder, hf = _hf_folder(tmp_path, "llama3-rope")
    runner, vocab = _runner(folder)
    g = torch.Generator().manual_seed(3)
    a, b, c = (torch.randint(0, vocab, (n,), generator=g).tolist() for n in (14, 12, 10))
    sa, sb, sc = list(range(1, 15)), list(range(20, 32)), list(range(40, 50))
    runner.forward(ScheduleDecision("extend", [_item(0, 0, a[:8], sa, False), _item(2, 0, c[:6], sc, False)]))
    items = [_item(0, 8, a[8:], sa, True), _item(1, 0, b, sb, True), _item(2, 6, c[6:], sc, True)]
    got = runner.forward(ScheduleDecision("extend", items))
    with torch.no_grad():
        ref = torch.cat([hf(torch.tensor([a])).logits[0, 8:], hf(torch.tensor([b])).logits[0],
                         hf(torch.tensor([c])).logits[0, 6:]])
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
