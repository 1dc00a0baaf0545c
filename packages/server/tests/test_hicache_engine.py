"""The host KV tier on the CPU: a device pool too small for the conversations' histories and a
large host pool give the greedy outputs of a device pool large enough to never evict, with host
hits (KV loaded back, not recomputed); and the host pool's copies by slot ids."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from lmserver.engine.offline import Engine
from lmserver.forward.kv_pool import KVPool
from lmserver.io_struct import GenerateReq, SamplingParams
from lmserver.runner.host_kv import HostKVPool

_GREEDY = {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True}
_TURNS = ["Tell me about the moon.", " And the sun?", " Which is larger?"]
_CONVERSATIONS = 3


def _chat(engine: Engine) -> list[list[int]]:
    """`_CONVERSATIONS` chats of `_TURNS` turns, one request at a time, round-robin (the other
    chats push each history out of a small device pool before its next turn)."""
    tok = engine.tokenizer
    histories = [tok.encode(f"Conversation {c}: you are a helpful assistant number {c}.") for c in range(_CONVERSATIONS)]
    outputs: list[list[int]] = []
    for turn in _TURNS:
        for c in range(_CONVERSATIONS):
            histories[c] = histories[c] + tok.encode(turn, add_special_tokens=False)
            out = engine.generate(input_ids=histories[c], sampling_params=_GREEDY)
            assert isinstance(out, dict)
            histories[c] = histories[c] + out["output_ids"]
            outputs.append(out["output_ids"])
    return outputs


def _run(chat: Callable[[Engine], list[list[int]]] | None = None, max_running_requests: int = 2,
         **config: Any) -> tuple[list[list[int]], dict[str, Any]]:
    """`chat` (default `_chat`) on an engine of `config`: its outputs and stats, memory invariant checked."""
    engine = Engine(dtype="float32", max_running_requests=max_running_requests, chunked_prefill_size=-1, **config)
    try:
        outs = (chat or _chat)(engine)
        engine.core.check_memory_invariant()
        return outs, engine.core.get_stats()
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def large_pool_run() -> tuple[list[list[int]], dict[str, Any]]:
    """The reference: a device pool that never evicts."""
    return _run(max_total_tokens=4096)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_small_device_pool_with_host_tier_matches_a_large_pool(
    policy: str, large_pool_run: tuple[list[list[int]], dict[str, Any]]
) -> None:
    want, big = large_pool_run
    assert big.get("hicache_host_hits") is None
    got, stats = _run(max_total_tokens=64, enable_hierarchical_cache=True, host_kv_size_gb=0.05,
                      hicache_write_policy=policy)
    assert got == want
    assert stats["hicache_host_hits"] > 0 and stats["hicache_loaded_tokens"] > 0, stats
    assert stats["hicache_offloaded_tokens"] > 0 and stats["hicache_dropped_tokens"] == 0
    # every turn after the first reuses its whole history: the large pool's hits, some from the host
    assert stats["cached_tokens"] == big["cached_tokens"], (stats, big)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_host_pool_copies_rows_by_slot_ids(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(0)
    pool = KVPool(16, 3, 2, 4, torch.bfloat16, device)
    for layer in range(3):
        pool.k_cache[layer].copy_(torch.randn(16, 2, 4))
        pool.v_cache[layer].copy_(torch.randn(16, 2, 4))
    want_k = [c.clone() for c in pool.k_cache]
    want_v = [c.clone() for c in pool.v_cache]
    host = HostKVPool(pool, 10)
    dev = np.array([3, 7, 1, 12], dtype=np.int64)
    hst = np.array([9, 2, 5, 4], dtype=np.int64)
    host.offload(dev, hst)
    for layer in range(3):  # wipe the device rows, then bring them back elsewhere
        pool.k_cache[layer][dev] = 0
        pool.v_cache[layer][dev] = 0
    back = np.array([14, 2, 6, 8], dtype=np.int64)
    host.load(hst, back)
    # NOTE: no synchronize: reads on the current stream come after the side stream's load
    got_k = [pool.k_cache[layer][back].clone() for layer in range(3)]
    got_v = [pool.v_cache[layer][back].clone() for layer in range(3)]
    for layer in range(3):
        assert torch.equal(got_k[layer], want_k[layer][dev])
        assert torch.equal(got_v[layer], want_v[layer][dev])
    assert (host.offloaded_tokens, host.loaded_tokens) == (4, 4)


_TEXTS = ["The committee approved the road repairs and delayed the library renovation until spring.",
          "Rivers carry water from the mountains to the sea, shaping valleys over many years.",
          "The baker opens at six, sells bread until noon, and closes the shop on Sundays."]


def _copy_chat(engine: Engine) -> list[list[int]]:
    """Chats of two turns, each asking to repeat a text (a copy task: n-gram drafts find the continuations), one
    request at a time, round-robin (the other chats push a history out of a small device pool before its next turn)."""
    tok = engine.tokenizer
    histories = [tok.encode(f"Conversation {c}: repeat each text word for word.") for c in range(_CONVERSATIONS)]
    outputs: list[list[int]] = []
    for turn in range(2):
        for c in range(_CONVERSATIONS):
            prompt = f"\nText: {_TEXTS[(c + turn) % len(_TEXTS)]}\nRepeated:"
            histories[c] = histories[c] + tok.encode(prompt, add_special_tokens=False)
            out = engine.generate(input_ids=histories[c], sampling_params=dict(_GREEDY, max_new_tokens=20))
            assert isinstance(out, dict)
            histories[c] = histories[c] + out["output_ids"]
            outputs.append(out["output_ids"])
    return outputs


@pytest.fixture(scope="module")
def large_pool_copy_run() -> tuple[list[list[int]], dict[str, Any]]:
    return _run(_copy_chat, max_total_tokens=4096)


@pytest.mark.parametrize("algorithm", ["ngram", pytest.param("eagle", marks=pytest.mark.slow),
                                       pytest.param("draft_model", marks=pytest.mark.slow)])
def test_host_tier_with_speculative_decoding_matches_a_large_pool(
    algorithm: str, large_pool_copy_run: tuple[list[list[int]], dict[str, Any]], tmp_path: Any
) -> None:
    """Speculation on a small device pool with the host tier: the drafts' KV is taken and the rejected part freed
    through the same KV manager whose evictions feed the tier; the greedy outputs of a large pool without
    speculation, with host hits and verify steps (an EAGLE head's features for a prefix loaded from the host are
    missing, as for any cached prefix: only its acceptance can suffer; a draft model keeps its own KV)."""
    from lmserver.models.default_model import default_model_path
    from lmserver.testing import write_eagle_head

    want, big = large_pool_copy_run
    spec: dict[str, Any] = {"speculative_algorithm": algorithm, "speculative_num_draft_tokens": 4}
    if algorithm == "eagle":
        from lmserver.models.loader import read_model_config

        cfg = read_model_config(str(default_model_path())).hf_config
        head = dict(architectures=["LlamaForCausalLM"], vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
                    intermediate_size=256, num_hidden_layers=1, num_attention_heads=cfg["num_attention_heads"],
                    num_key_value_heads=cfg["num_key_value_heads"], max_position_embeddings=2048,
                    rms_norm_eps=cfg.get("rms_norm_eps", 1e-5), rope_theta=cfg.get("rope_theta", 10000.0))
        write_eagle_head(tmp_path / "head", head)
        spec["speculative_draft_model_path"] = str(tmp_path / "head")
    elif algorithm == "draft_model":  # the target itself: nearly every draft accepted
        spec["speculative_draft_model_path"] = str(default_model_path())
    got, stats = _run(_copy_chat, max_total_tokens=160, enable_hierarchical_cache=True, host_kv_size_gb=0.05, **spec)
    assert got == want
    assert stats["hicache_host_hits"] > 0 and stats["hicache_loaded_tokens"] > 0, stats
    assert stats["spec_verify_steps"] > 0 and stats["spec_draft_tokens"] > 0, stats
    assert stats["cached_tokens"] == big["cached_tokens"], (stats, big)


def test_host_tier_flags_are_checked() -> None:
    with pytest.raises(ValueError, match="host-kv-size-gb"):
        Engine(dtype="float32", max_total_tokens=256, enable_hierarchical_cache=True, host_kv_size_gb=-1.0)
    with pytest.raises(ValueError, match="free memory"):
        Engine(dtype="float32", max_total_tokens=256, enable_hierarchical_cache=True,
               host_kv_size_gb=HostKVPool.available_host_bytes() / 1e9)
    with pytest.raises(ValueError, match="radix cache"):
        Engine(dtype="float32", max_total_tokens=256, enable_hierarchical_cache=True, disable_radix_cache=True)


def _concurrent_chat(engine: Engine) -> list[list[int]]:
    """The chats of `_chat`, each turn of every chat submitted at once (they run side by side:
    admissions in one round load host KV while the others' loads and offloads are in flight)."""
    tok, core = engine.tokenizer, engine.core
    histories = [tok.encode(f"Conversation {c}: you are a helpful assistant number {c}.") for c in range(_CONVERSATIONS)]
    outputs: list[list[int]] = []
    params = SamplingParams.from_dict(_GREEDY)
    for t, turn in enumerate(_TURNS):
        got: dict[str, list[int]] = {}
        for c in range(_CONVERSATIONS):
            histories[c] = histories[c] + tok.encode(turn, add_special_tokens=False)
            core.add_request(GenerateReq(f"c{c}t{t}", list(histories[c]), params))
            got[f"c{c}t{t}"] = []
        while core.has_work():
            for out in core.step():
                got[out.rid].extend(out.new_token_ids)
        for c in range(_CONVERSATIONS):
            histories[c] = histories[c] + got[f"c{c}t{t}"]
            outputs.append(got[f"c{c}t{t}"])
    return outputs


@pytest.mark.slow
def test_concurrent_chats_with_host_tier_match_a_large_pool() -> None:
    want, big = _run(_concurrent_chat, _CONVERSATIONS, max_total_tokens=4096)
    got, stats = _run(_concurrent_chat, _CONVERSATIONS, max_total_tokens=96, enable_hierarchical_cache=True,
                      host_kv_size_gb=0.05)
    assert got == want
    assert stats["hicache_host_hits"] > 0 and stats["hicache_dropped_tokens"] == 0, stats
    assert stats["cached_tokens"] == big["cached_tokens"], (stats, big)


def _chat_in_child(model_path: str, config: dict[str, Any]) -> tuple[list[list[int]], dict[str, Any]]:
    """`_chat` on a tiny random model's engine of `config` (run by `in_child`): outputs and stats, invariant checked."""
    engine = Engine(model_path=model_path, load_format="dummy", dtype="float32", device="cpu", context_length=256,
                    max_running_requests=2, chunked_prefill_size=-1, **config)
    try:
        outs = _chat(engine)
        engine.core.check_memory_invariant()
        return outs, engine.core.get_stats()
    finally:
        if engine.core.tp is not None:
            engine.core.tp.shutdown()
        engine.shutdown()


def test_host_tier_with_tp2_matches_a_large_pool(tmp_path: Any) -> None:
    """Tensor parallelism (tp_size 2, gloo): each rank's host pool holds its KV heads; rank 0's copies reach the
    follower with the next decision. A small device pool with the tier gives the greedy outputs of a large pool with
    tp_size 1, with host hits (the follower's heads loaded back too, or its half of the attention would differ)."""
    from packages.server.tests.test_tensor_parallel import _model_folder, _tiny_config, in_child

    path = _model_folder(tmp_path, "llama", _tiny_config())
    want, big = in_child(_chat_in_child, path, {"max_total_tokens": 4096})
    got, stats = in_child(_chat_in_child, path, {"max_total_tokens": 64, "enable_hierarchical_cache": True,
                                                  "host_kv_size_gb": 0.01, "tp_size": 2})
    assert got == want
    assert stats["hicache_host_hits"] > 0 and stats["hicache_loaded_tokens"] > 0, stats
    assert stats["cached_tokens"] == big["cached_tokens"], (stats, big)
