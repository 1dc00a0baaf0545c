"""EngineCore end to end on tiny random models of each family: greedy tokens equal HF `generate`.

Each model folder is a transformers-saved random model plus the SmolLM2 tokenizer, so the whole
engine path (scheduler, radix cache, chunked prefill, paging, batching, sampler) runs per family.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmserver import Engine
from lmserver.models.default_model import default_model_path

transformers = pytest.importorskip("transformers")

VOCAB = 49152
TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, eos_token_id=2, bos_token_id=1)


def _families() -> dict[str, tuple[type, type, dict]]:
    t = transformers
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 32, "rope_theta": 500000.0}
    return {
        "llama3": (t.LlamaConfig, t.LlamaForCausalLM, {"rope_scaling": llama3}),
        "qwen2": (t.Qwen2Config, t.Qwen2ForCausalLM, {}),
        "qwen3": (t.Qwen3Config, t.Qwen3ForCausalLM, {"head_dim": 16, "tie_word_embeddings": True}),
        "mixtral": (t.MixtralConfig, t.MixtralForCausalLM, {"num_local_experts": 4, "num_experts_per_tok": 2}),
    }


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    return transformers.AutoTokenizer.from_pretrained(str(default_model_path()))


@pytest.mark.parametrize("family", list(_families()))
def test_engine_greedy_equals_hf_generate(tmp_path: Path, tokenizer, family: str) -> None:  # type: ignore[no-untyped-def]
    config_cls, model_cls, extra = _families()[family]
    torch.manual_seed(0)
    model = model_cls(config_cls(**TINY, **extra)).eval()
    with torch.no_grad():  # larger weights than the default init, so greedy paths are not flat
        for p in model.parameters():
            p.mul_(8.0)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    prompts = [[5, 17, 300, 41, 9] * 6, [5, 17, 300, 41, 9] * 6 + [77, 78], [1000 + i for i in range(13)]]
    engine = Engine(str(tmp_path), dtype="float32", max_total_tokens=512, chunked_prefill_size=16, page_size=2)
    try:
        outs = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 10, "temperature": 0, "ignore_eos": True})
        assert isinstance(outs, list)
        for ids, out in zip(prompts, outs, strict=True):
            ref = model.generate(torch.tensor([ids]), max_new_tokens=10, min_new_tokens=10, do_sample=False)
            assert out["output_ids"] == ref[0, len(ids) :].tolist(), family
        assert outs[1]["meta_info"]["cached_tokens"] > 0 or outs[0]["meta_info"]["cached_tokens"] > 0
        engine.core.check_memory_invariant()
    finally:
        engine.shutdown()


def test_dummy_weights_run_any_config(tmp_path: Path, tokenizer) -> None:  # type: ignore[no-untyped-def]
    config = transformers.Qwen3Config(**TINY, head_dim=16)
    config.architectures = ["Qwen3ForCausalLM"]
    config.save_pretrained(tmp_path)  # no weights at all
    tokenizer.save_pretrained(tmp_path)
    engine = Engine(str(tmp_path), load_format="dummy", dtype="bfloat16", max_total_tokens=256)
    try:
        out = engine.generate(input_ids=[3, 4, 5], sampling_params={"max_new_tokens": 4, "ignore_eos": True})
        assert isinstance(out, dict) and out["meta_info"]["completion_tokens"] == 4
        assert engine.core.resolved_config.dtype == "bfloat16"
    finally:
        engine.shutdown()
