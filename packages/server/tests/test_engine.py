"""End to end: EngineCore and Engine on the embedded SmolLM2-135M-Instruct (CPU, float32).

Oracles: HF transformers `generate` and forward logits on the same converted folder, the
tokenizer's full decode, and runs of the same engine under other configs. The KV memory
invariant is checked after every workload.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import pytest
import torch

from lmserver import Engine
from lmserver.engine.core import EngineCore
from lmserver.io_struct import GenerateReq, InvalidRequestError, SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time",
    "List three colors:",
    "1, 2, 3, 4,",
    "The quick brown fox",
    "Water boils at",
    "My favourite food is",
]


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    eng = Engine(dtype="float32", max_total_tokens=4096, max_running_requests=16)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def hf_model(engine: Engine):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(engine.model_path, dtype=torch.float32).eval()


def _greedy(max_new: int = 16, **extra: object) -> dict[str, object]:
    return {"max_new_tokens": max_new, "temperature": 0.0, **extra}


def _idle_check(engine: Engine) -> None:
    assert not engine.core.has_work()
    engine.core.check_memory_invariant()


def test_greedy_equals_hf_generate(engine: Engine, hf_model) -> None:  # type: ignore[no-untyped-def]
    outs = engine.generate(PROMPTS, _greedy(32))
    assert isinstance(outs, list)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = engine.tokenizer(prompt, return_tensors="pt").input_ids
        ref = hf_model.generate(ids, max_new_tokens=32, do_sample=False)[0, ids.shape[1] :].tolist()
        assert out["output_ids"] == ref, prompt
        assert out["text"] == engine.tokenizer.decode(ref, skip_special_tokens=True)
    _idle_check(engine)


def test_chat_answer_is_correct(engine: Engine) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    out = engine.generate(prompt, _greedy(20))
    assert isinstance(out, dict)
    assert "Paris" in out["text"]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}
    _idle_check(engine)


def test_prefix_cache_hit_is_reported_and_does_not_change_output(engine: Engine) -> None:
    engine.flush_cache()
    first = engine.generate("The capital of France is", _greedy(8))
    again = engine.generate("The capital of France is", _greedy(8))
    assert isinstance(first, dict) and isinstance(again, dict)
    assert first["meta_info"]["cached_tokens"] == 0
    assert again["meta_info"]["cached_tokens"] == first["meta_info"]["prompt_tokens"] - 1
    assert again["output_ids"] == first["output_ids"]
    assert engine.get_stats()["cache_hit_rate"] > 0
    _idle_check(engine)


def test_prefill_forwards_and_their_time_are_counted_apart_from_decode(engine: Engine) -> None:
    """One request of n new tokens: one extend forward, n - 1 decode forwards; only the extend is timed."""
    engine.flush_cache()
    before = engine.get_stats()
    start = time.perf_counter()
    out = engine.generate("Water boils at", {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True})
    wall = time.perf_counter() - start
    after = engine.get_stats()
    assert isinstance(out, dict) and len(out["output_ids"]) == 6
    assert after["forwards"] - before["forwards"] == 6
    assert after["extend_forwards"] - before["extend_forwards"] == 1
    assert 0.0 < after["extend_time_s"] - before["extend_time_s"] < wall
    _idle_check(engine)


def test_streaming_deltas_concatenate_to_the_full_decode(engine: Engine) -> None:
    params = {"max_new_tokens": 40, "temperature": 1.0, "sampling_seed": 11, "ignore_eos": True}
    prompt = "Write a line mixing emoji and Chinese: 你好 🙂"
    chunks = list(engine.generate(prompt, params, stream=True))  # type: ignore[arg-type]
    texts = [c["text"] for c in chunks]
    for before, after in zip(texts, texts[1:], strict=False):
        assert after.startswith(before), "streamed text must only grow"
    final = chunks[-1]
    assert final["meta_info"]["finish_reason"]["type"] == "length"
    assert final["text"] == engine.tokenizer.decode(final["output_ids"], skip_special_tokens=True)
    assert not any("\ufffd" in t for t in texts[:-1]) or "\ufffd" in final["text"]
    whole = engine.generate(prompt, params)
    assert isinstance(whole, dict) and whole["output_ids"] == final["output_ids"]
    _idle_check(engine)


def test_stop_string_across_a_token_boundary(engine: Engine) -> None:
    base = engine.generate("Once upon a time", _greedy(24, ignore_eos=True))
    assert isinstance(base, dict)
    ids = base["output_ids"]
    tok = engine.tokenizer
    # a stop string made of the end of token 5 and the start of token 6
    left = tok.decode(ids[:6], skip_special_tokens=True)
    right = tok.decode(ids[:7], skip_special_tokens=True)
    stop = left[-2:] + right[len(left) : len(left) + 2]
    assert len(stop) == 4 and stop in base["text"]
    cut = base["text"].find(stop)
    out = engine.generate("Once upon a time", _greedy(24, ignore_eos=True, stop=[stop]))
    assert isinstance(out, dict)
    assert out["text"] == base["text"][:cut]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    streamed = list(engine.generate("Once upon a time", _greedy(24, ignore_eos=True, stop=[stop]), stream=True))  # type: ignore[arg-type]
    assert streamed[-1]["text"] == base["text"][:cut]
    kept = engine.generate("Once upon a time", _greedy(24, ignore_eos=True, stop=[stop], no_stop_trim=True))
    assert isinstance(kept, dict) and kept["text"] == base["text"][: cut + len(stop)]
    rx = engine.generate("Once upon a time", _greedy(24, ignore_eos=True, stop_regex=[re.escape(stop[:2]) + "."]))
    assert isinstance(rx, dict) and rx["meta_info"]["finish_reason"]["type"] == "stop"
    _idle_check(engine)


def test_stop_token_ids_min_new_tokens_and_logit_bias(engine: Engine) -> None:
    base = engine.generate("1, 2, 3, 4,", _greedy(12, ignore_eos=True))
    assert isinstance(base, dict)
    target = base["output_ids"][3]
    first = base["output_ids"].index(target)
    out = engine.generate("1, 2, 3, 4,", _greedy(12, ignore_eos=True, stop_token_ids=[target]))
    assert isinstance(out, dict)
    assert out["output_ids"] == base["output_ids"][: first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": target}
    longer = engine.generate("1, 2, 3, 4,", _greedy(12, ignore_eos=True, stop_token_ids=[target], min_new_tokens=first + 2))
    assert isinstance(longer, dict) and len(longer["output_ids"]) > first + 1
    biased = engine.generate("1, 2, 3, 4,", _greedy(5, ignore_eos=True, logit_bias={"42": 100.0}))
    assert isinstance(biased, dict) and biased["output_ids"] == [42] * 5
    _idle_check(engine)


def test_seeds_are_reproducible_and_batch_invariant(engine: Engine) -> None:
    p = {"max_new_tokens": 16, "temperature": 0.9, "top_p": 0.95, "sampling_seed": 1234}
    a = engine.generate("Tell me a story", p)
    b = engine.generate(["Tell me a story", "Another prompt here"], [p, {**p, "sampling_seed": 5}])
    c = engine.generate("Tell me a story", {**p, "sampling_seed": 99})
    assert isinstance(a, dict) and isinstance(b, list) and isinstance(c, dict)
    assert a["output_ids"] == b[0]["output_ids"]
    assert a["output_ids"] != c["output_ids"]
    _idle_check(engine)


def test_n_samples_share_the_prompt_through_the_cache(engine: Engine) -> None:
    engine.flush_cache()
    messages = [{"role": "user", "content": "Name a fruit."}]
    prompt = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    outs = engine.generate(prompt, {"max_new_tokens": 8, "temperature": 1.0, "n": 3, "sampling_seed": 3})
    assert isinstance(outs, list) and len(outs) == 3
    cached = sorted(o["meta_info"]["cached_tokens"] for o in outs)
    assert cached[0] == 0 and cached[1] > 30
    assert len({tuple(o["output_ids"]) for o in outs}) > 1
    _idle_check(engine)


def test_logprobs_match_a_direct_forward(engine: Engine, hf_model) -> None:  # type: ignore[no-untyped-def]
    prompt = "The quick brown fox jumps over"
    out = engine.generate(prompt, _greedy(6), return_logprob=True, logprob_start_len=0, top_logprobs_num=3,
                          return_text_in_logprobs=True)
    assert isinstance(out, dict)
    meta = out["meta_info"]
    ids = engine.tokenizer(prompt)["input_ids"]
    full = ids + out["output_ids"]
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([full])).logits[0].float(), dim=-1)
    inp = meta["input_token_logprobs"]
    assert [t for _, t, _ in inp] == ids and inp[0][0] is None
    for pos in range(1, len(ids)):
        assert abs(inp[pos][0] - ref[pos - 1, ids[pos]].item()) < 1e-3
    outp = meta["output_token_logprobs"]
    assert [t for _, t, _ in outp] == out["output_ids"]
    for k, (lp, tok, text) in enumerate(outp):
        assert abs(lp - ref[len(ids) - 1 + k, tok].item()) < 1e-3
        assert text == engine.tokenizer.decode([tok])
    top = meta["output_top_logprobs"][0]
    assert [t for _, t, _ in top] == ref[len(ids) - 1].topk(3).indices.tolist()
    # select()-style scoring: max_new_tokens 0 and input logprobs from a later position
    score = engine.generate(prompt, {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=3)
    assert isinstance(score, dict)
    assert score["text"] == "" and score["meta_info"]["completion_tokens"] == 0
    assert [t for _, t, _ in score["meta_info"]["input_token_logprobs"]] == ids[3:]
    assert abs(score["meta_info"]["input_token_logprobs"][0][0] - ref[2, ids[3]].item()) < 1e-3
    _idle_check(engine)


def test_abort_at_each_stage_and_bad_input(engine: Engine) -> None:
    core = engine.core
    mk = lambda rid, text, n=30: GenerateReq(rid, engine.tokenizer(text)["input_ids"], SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True))  # noqa: E731
    core.add_request(mk("run", "Once upon a time"))
    core.add_request(mk("keep", "Water boils at", 5))
    outputs = core.step() + core.step() + core.step()
    core.add_request(mk("wait", "Never admitted"))
    core.abort_request("run")
    core.abort_request("wait")
    core.abort_request("unknown-id")
    while core.has_work():
        outputs += core.step()
    final = {o.rid: o for o in outputs if o.finished}
    assert final["run"].finish_reason["type"] == "abort"  # type: ignore[index]
    assert final["wait"].finish_reason["type"] == "abort"  # type: ignore[index]
    assert final["keep"].completion_tokens == 5
    core.check_memory_invariant()
    with pytest.raises(InvalidRequestError, match="context length"):
        core.add_request(GenerateReq("long", [1] * (core.context_length + 1), SamplingParams()))
    with pytest.raises(InvalidRequestError, match="vocabulary|input_ids"):
        core.add_request(GenerateReq("oov", [core.vocab_size + 5], SamplingParams()))
    with pytest.raises(InvalidRequestError):
        engine.generate("x", {"temperature": -1})
    assert not core.has_work()


@pytest.mark.parametrize(
    "config",
    [
        {"chunked_prefill_size": 8, "page_size": 4},
        # mixed steps are the default: the prefill-first path without them
        {"disable_radix_cache": True, "enable_mixed_chunk": False, "chunked_prefill_size": 16},
        # retraction under memory pressure: the scheduler's own tests in the fast tier, the engine's here
        pytest.param({"max_total_tokens": 160, "max_running_requests": 8, "schedule_policy": "fcfs"},
                     marks=pytest.mark.slow),
    ],
    ids=["chunked-paged", "nocache-serial", "tiny-kv-retraction"],
)
def test_other_configs_give_the_same_greedy_tokens(engine: Engine, config: dict[str, object]) -> None:
    prompts = [p + " and then" * 3 for p in PROMPTS[:6]]
    ref = engine.generate(prompts, _greedy(20, ignore_eos=True))
    settings = {"dtype": "float32", "max_total_tokens": 4096, **config}
    other = Engine(**settings)  # type: ignore[arg-type]
    try:
        got = other.generate(prompts, _greedy(20, ignore_eos=True))
        assert isinstance(ref, list) and isinstance(got, list)
        assert [o["output_ids"] for o in got] == [o["output_ids"] for o in ref]
        if config.get("max_total_tokens") == 160:
            assert other.get_stats()["num_retractions"] > 0
        _idle_check(other)
    finally:
        other.shutdown()


def test_core_contract_attributes(engine: Engine) -> None:
    core: EngineCore = engine.core
    assert core.vocab_size == 49152 and core.context_length == 4096
    assert core.resolved_config.device == "cpu" and core.resolved_config.attention_backend == "torch_native"
    stats = core.get_stats()
    for key in ("num_running_reqs", "num_waiting_reqs", "kv_usage", "cache_hit_rate", "gen_throughput", "prompt_tokens"):
        assert key in stats
    assert core.flush_cache() is True


def test_readme_example() -> None:
    from pathlib import Path

    from lmserver.testing import run_readme_section

    namespace = run_readme_section(Path(__file__).parents[1] / "README.md", "## Offline engine")
    out = namespace["out"]
    assert isinstance(out, dict) and out["meta_info"]["completion_tokens"] == 8
    assert len(namespace["outs"]) == 4  # type: ignore[arg-type]


def test_async_generate_and_async_stream(engine: Engine) -> None:
    import asyncio

    async def go() -> tuple[object, list[dict[str, object]]]:
        one = await engine.async_generate("Water boils at", _greedy(6))
        stream = await engine.async_generate("Water boils at", _greedy(6), stream=True)
        chunks = [c async for c in stream]  # type: ignore[union-attr]
        return one, chunks

    one, chunks = asyncio.run(go())
    assert isinstance(one, dict)
    assert chunks[-1]["output_ids"] == one["output_ids"]
    assert chunks[-1]["text"] == one["text"]
    _idle_check(engine)
