"""Speculative decoding (n-gram drafts) through the engine on the embedded SmolLM2 (CPU, float32).

The speculating engine has decode graphs (EagerGraph on the CPU), so verify steps that fit run
as graph replays of decode rows and the others as eager extend forwards. Oracle: the same engine
without speculation: greedy outputs token for token, finish reasons and
texts, for a batch mixing copy-heavy prompts (many accepted drafts), plain ones, a JSON Schema
request, a penalty request and a logprob request (constrained rows masked, penalties per row, logprobs from the
verify rows), stop strings,
length limits, radix hits and chunked prefill. KV accounting after every workload and after
an abort in the middle of a run.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from lmserver import Engine

PASSAGE = ("The committee met on Tuesday to review the budget. It approved the road repairs, delayed the "
           "library renovation, and asked the treasurer for a new estimate of the park maintenance costs.")
COPY = f"Repeat this text word for word.\nText: {PASSAGE}\nRepeated:"
EDIT = f"Rewrite the text, replacing Tuesday with Friday.\nText: {PASSAGE}\nRewritten:"
PLAIN = "List three fruits:"
SCHEMA = json.dumps({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                     "required": ["name", "age"]})


def _greedy(n: int = 40, **extra: Any) -> dict[str, Any]:
    return {"max_new_tokens": n, "temperature": 0.0, **extra}


DOC = '{"name": "Alice Smith", "age": 34, "city": "Paris"}'
COPY_JSON = f"Repeat this JSON exactly.\nJSON: {DOC}\nRepeated:"
DOC_REGEX = r'\{"name": "[A-Za-z ]+", "age": [0-9]+, "city": "[A-Za-z]+"\}'
FRUITS = "Repeat the list: apples, pears, plums, apples, pears, plums.\nList:"
FRUITS_EBNF = 'root ::= fruit ("," " " fruit)* "."\nfruit ::= "apples" | "pears" | "plums"'

WORKLOAD: list[tuple[str, dict[str, Any]]] = [
    (COPY, _greedy(32, ignore_eos=True)),
    (EDIT, _greedy(32)),
    (PLAIN, _greedy(12)),
    (COPY, _greedy(32, stop=["library"])),  # a stop string inside accepted drafts
    (EDIT, _greedy(7, ignore_eos=True)),  # a length limit inside accepted drafts
    ("Give a person as JSON:", _greedy(24, json_schema=SCHEMA)),
    (COPY, _greedy(12, frequency_penalty=0.5)),
]
# constrained copy tasks: their drafts cut to what the grammar takes, their verify rows masked (jump-forward on)
CONSTRAINED: list[tuple[str, dict[str, Any]]] = [
    (COPY_JSON, _greedy(40, regex=DOC_REGEX)),
    (COPY_JSON, _greedy(40, json_schema=json.dumps({
        "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                         "city": {"type": "string"}}, "required": ["name", "age", "city"]}))),
    (FRUITS, _greedy(24, regex=r"( ?[a-z]+,){2,8} ?[a-z]+\.")),
    (" " + FRUITS, _greedy(24, ebnf=FRUITS_EBNF)),
]


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[Engine, Engine]]:
    from lmserver.runner.cuda_graph import EAGER_GRAPHS_ENV

    # NOTE: a short context for both: eager graphs plan every replay for the full context (a graph's static bound)
    base = Engine(dtype="float32", max_total_tokens=6144, max_running_requests=16, context_length=512)
    # the speculating engine gets decode graphs (EagerGraph on CPU): verify steps of up to 16 rows replay them as
    # decode rows, larger ones run the eager extend forward, as on a GPU
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(EAGER_GRAPHS_ENV, "1")
        spec = Engine(dtype="float32", max_total_tokens=6144, max_running_requests=16, context_length=512,
                      speculative_algorithm="ngram",
                      speculative_num_draft_tokens=5)
    yield base, spec
    base.shutdown()
    spec.shutdown()


def _run(engine: Engine, workload: list[tuple[str, dict[str, Any]]], **kw: Any) -> list[dict[str, Any]]:
    outs = engine.generate([p for p, _ in workload], [s for _, s in workload], **kw)
    assert isinstance(outs, list)
    return outs


def _same(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    for x, y in zip(a, b, strict=True):
        assert x["output_ids"] == y["output_ids"]
        assert x["text"] == y["text"]
        assert x["meta_info"]["finish_reason"] == y["meta_info"]["finish_reason"]


def test_greedy_outputs_equal_without_speculation(engines: tuple[Engine, Engine]) -> None:
    base, spec = engines
    want = _run(base, WORKLOAD)
    got = _run(spec, WORKLOAD)
    _same(got, want)
    stats = spec.get_stats()
    assert stats["spec_accepted_tokens"] > 15 and stats["spec_accept_length"] > 1.5, stats
    graphs = spec.core.runner.cuda_graph
    assert graphs is not None and graphs.num_verify_replays > 0  # both verify paths ran
    assert stats["spec_verify_steps"] > graphs.num_verify_replays
    for eng in engines:
        eng.core.check_memory_invariant()
    # warm: the same prompts again are radix hits; speculation must not have cached rejected drafts
    again = _run(spec, WORKLOAD)
    _same(again, want)
    assert all(o["meta_info"]["cached_tokens"] > 0 for o in again)
    spec.core.check_memory_invariant()


def test_constrained_requests_draft_and_keep_greedy_outputs(engines: tuple[Engine, Engine]) -> None:
    """Regex, JSON Schema (with jump-forward) and EBNF requests draft: the plain engine's tokens, each output a match
    of its grammar, drafts accepted."""
    import re

    base, spec = engines
    want = _run(base, CONSTRAINED)
    before = spec.get_stats()
    got = _run(spec, CONSTRAINED)
    _same(got, want)
    after = spec.get_stats()
    assert after["spec_accepted_tokens"] - before["spec_accepted_tokens"] >= 10, after
    assert re.fullmatch(DOC_REGEX, got[0]["text"]) and json.loads(got[1]["text"])["city"] == "Paris"
    # sampled: rejection sampling over the masked rows; every output a match (a token off the grammar would abort)
    for seed in range(3):
        out = spec.generate(COPY_JSON, {"max_new_tokens": 40, "temperature": 0.8, "sampling_seed": seed,
                                        "regex": DOC_REGEX})
        assert re.fullmatch(DOC_REGEX, out["text"]), out
    spec.core.check_memory_invariant()


def test_penalized_biased_and_min_tokens_requests_draft_and_keep_greedy_outputs(
        engines: tuple[Engine, Engine]) -> None:
    """Logit bias, frequency / presence / repetition penalties and min_new_tokens apply to each verify row as the
    decode step of that row would (the output followed by the drafts before it): the plain engine's tokens, drafts
    accepted. Sampled with penalties: runs to its length, KV accounted."""
    base, spec = engines
    bias_id = int(spec.tokenizer.encode(" committee", add_special_tokens=False)[0])
    work = [(COPY, _greedy(32, frequency_penalty=0.3)), (COPY, _greedy(32, presence_penalty=0.4)),
            (EDIT, _greedy(32, repetition_penalty=1.15)), (COPY, _greedy(32, logit_bias={str(bias_id): 3.0})),
            (PLAIN, _greedy(24, min_new_tokens=20)),
            # a draft repeating an earlier draft of the same step ("gold silver gold silver" after the copied words):
            # the row after it must count it (a row counting the output alone takes the repeat: another text)
            ("Repeat exactly: red green blue pink gold silver gold silver\nRepeated:",
             _greedy(16, presence_penalty=2.0, frequency_penalty=2.0))]
    want = _run(base, work)
    before = spec.get_stats()["spec_accepted_tokens"]
    got = _run(spec, work)
    _same(got, want)
    assert spec.get_stats()["spec_accepted_tokens"] - before >= 20
    assert len(got[4]["output_ids"]) >= 20
    out = spec.generate(COPY, {"max_new_tokens": 24, "temperature": 0.8, "sampling_seed": 1, "ignore_eos": True,
                               "frequency_penalty": 0.5, "presence_penalty": 0.2})
    assert isinstance(out, dict) and len(out["output_ids"]) == 24
    spec.core.check_memory_invariant()


@pytest.mark.parametrize("params", [_greedy(24), _greedy(24, stop=["library"])])
def test_a_logprobs_request_drafts_and_its_logprobs_are_unchanged(engines: tuple[Engine, Engine],
                                                                   params: dict[str, Any]) -> None:
    """A request returning logprobs (and top logprobs) drafts; each emitted token's logprobs come from its verify row:
    the plain engine's tokens, logprobs and top logprobs, one entry per token (a stop string inside accepted drafts
    too). Streamed: the last chunk's (cumulative) entries are the same."""
    base, spec = engines
    kw = {"return_logprob": True, "top_logprobs_num": 2}
    want = base.generate(COPY, params, **kw)
    before = spec.get_stats()["spec_accepted_tokens"]
    got = spec.generate(COPY, params, **kw)
    assert spec.get_stats()["spec_accepted_tokens"] > before + 5  # this request's drafts were accepted
    assert isinstance(want, dict) and isinstance(got, dict)
    assert got["output_ids"] == want["output_ids"] and got["text"] == want["text"]
    meta, want_meta = got["meta_info"], want["meta_info"]
    assert len(meta["output_token_logprobs"]) == len(got["output_ids"]) == len(meta["output_top_logprobs"])
    # NOTE: verify rows run as decode-graph rows or an eager extend: float32 sums in another order than decode's
    for (lp, tok, _), (want_lp, want_tok, _) in zip(meta["output_token_logprobs"], want_meta["output_token_logprobs"],
                                                     strict=True):
        assert tok == want_tok and lp == pytest.approx(want_lp, abs=1e-4)
    for top, want_top in zip(meta["output_top_logprobs"], want_meta["output_top_logprobs"], strict=True):
        assert [t for _, t, _ in top] == [t for _, t, _ in want_top]
        assert [v for v, _, _ in top] == pytest.approx([v for v, _, _ in want_top], abs=1e-4)
    chunks = list(spec.generate(COPY, params, stream=True, **kw))
    assert [t for _, t, _ in chunks[-1]["meta_info"]["output_token_logprobs"]] == got["output_ids"]


@pytest.mark.slow
def test_chunked_prefill_and_pages(engines: tuple[Engine, Engine]) -> None:
    base, _ = engines
    want = _run(base, WORKLOAD[:3])
    with Engine(dtype="float32", max_total_tokens=6144, max_running_requests=8, chunked_prefill_size=16,
                page_size=4, speculative_algorithm="ngram") as eng:
        _same(_run(eng, WORKLOAD[:3]), want)
        eng.core.check_memory_invariant()


def test_sampling_runs_and_abort_frees_everything(engines: tuple[Engine, Engine]) -> None:
    _, spec = engines
    core = spec.core
    from lmserver.io_struct import GenerateReq, SamplingParams

    ids = list(spec.tokenizer(COPY)["input_ids"])
    for i in range(3):
        core.add_request(GenerateReq(f"s{i}", ids, SamplingParams(max_new_tokens=24, temperature=0.7, top_p=0.9,
                                                                   sampling_seed=i, ignore_eos=True)))
    steps = 0
    outs: dict[str, list[int]] = {}
    while core.has_work():
        for out in core.step():
            outs.setdefault(out.rid, []).extend(out.new_token_ids)
        steps += 1
        if steps == 6:
            core.abort_request("s1")
    assert len(outs["s0"]) == 24 and len(outs["s2"]) == 24
    assert all(0 <= t < core.vocab_size for t in outs["s0"])
    core.check_memory_invariant()


@pytest.mark.slow
def test_simulated_acceptance_for_benchmarks() -> None:
    with Engine(dtype="float32", max_total_tokens=2048, max_running_requests=4, speculative_algorithm="ngram",
                speculative_num_draft_tokens=5, speculative_simulate_accept_length=3.5) as eng:
        outs = eng.generate([PLAIN, COPY], _greedy(29, ignore_eos=True))
        assert isinstance(outs, list) and all(o["meta_info"]["completion_tokens"] == 29 for o in outs)
        stats = eng.get_stats()
        assert 3.0 <= stats["spec_accept_length"] <= 3.6, stats  # 3.5 until the length limit caps the drafts
        eng.core.check_memory_invariant()


def test_bad_speculative_settings() -> None:
    from lmserver.engine.speculative import SpecConfig

    with pytest.raises(ValueError, match="not supported"):
        SpecConfig("medusa")
    with pytest.raises(ValueError, match="num_draft_tokens"):
        SpecConfig("ngram", num_draft_tokens=0)
    with pytest.raises(ValueError, match="min_match"):
        SpecConfig("ngram", ngram_min_match=3, ngram_max_match=2)
    with pytest.raises(ValueError, match="simulate_accept_length"):
        SpecConfig("ngram", num_draft_tokens=2, simulate_accept_length=3.5)
    with pytest.raises(ValueError, match="needed by"):
        SpecConfig("eagle")


def test_readme_example() -> None:
    from pathlib import Path

    from lmserver.testing import run_readme_section

    namespace = run_readme_section(Path(__file__).parents[1] / "README.md", "## Speculative decoding")
    out = namespace["out"]
    assert isinstance(out, dict) and out["meta_info"]["completion_tokens"] > 0


def _tiny_draft(path: Any, vocab: int) -> str:
    """A tiny random Llama with `vocab` tokens: a poor but valid draft model."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    LlamaForCausalLM(config).save_pretrained(str(path))
    return str(path)


@pytest.mark.slow  # model drafts in the slow tier (an EAGLE chain against float64: test_eagle)
def test_draft_models_keep_greedy_outputs(engines: tuple[Engine, Engine], tmp_path: Any) -> None:
    """The target itself as its draft (nearly every draft accepted) and a tiny random draft (few
    accepted): outputs equal plain decoding; the draft's KV is all given back."""
    base, _ = engines
    workload = [WORKLOAD[0], WORKLOAD[2], WORKLOAD[6]]  # copy, plain, a penalty request (never drafts)
    want = _run(base, workload)
    vocab = base.core.vocab_size
    from lmserver.runner.cuda_graph import EAGER_GRAPHS_ENV

    for draft, least, graphs in ((base.model_path, 2.5, False), (_tiny_draft(tmp_path / "tiny", vocab), 1.0, True)):
        with pytest.MonkeyPatch.context() as mp:  # the tiny draft's steps (and the target's) replay decode graphs
            if graphs:
                mp.setenv(EAGER_GRAPHS_ENV, "1")
            eng = Engine(dtype="float32", max_total_tokens=6144, max_running_requests=8, context_length=512,
                         speculative_algorithm="draft_model", speculative_draft_model_path=draft,
                         speculative_num_draft_tokens=4, cuda_graph_max_bs=4)
        with eng:
            assert eng.core.spec is not None and eng.core.spec.draft_model is not None
            assert (eng.core.spec.draft_model.runner.cuda_graph is not None) == graphs
            _same(_run(eng, workload), want)
            stats = eng.get_stats()
            assert stats["spec_accept_length"] >= least, stats
            # with graphs, proposals of 4 drafts for every request replay one chain graph of 3 steps
            assert (stats["spec_draft_chain_replays"] > 0) == graphs, stats
            eng.core.check_memory_invariant()
            assert eng.core.spec is not None and eng.core.spec.draft_model is not None
            eng.core.spec.draft_model.check_empty()


@pytest.mark.slow  # 60 s on 2 cores; the head's drafts against a float64 chain: test_eagle
@pytest.mark.slow  # a model draft
def test_constrained_rows_are_masked_where_the_model_would_leave_the_grammar(engines: tuple[Engine, Engine]) -> None:
    """The target itself as its draft proposes its own unconstrained tokens; grammars that disagree with them (a
    list asked with commas, written with semicolons; the JSON copy with one key renamed) cut the drafts at the first
    token they reject, and the verify row there must be masked to give the grammar's token: the plain engine's."""
    base, _ = engines
    work = [(FRUITS, _greedy(24, regex=r"( ?[a-z]+;){2,8} ?[a-z]+\.")),
            (COPY_JSON, _greedy(40, regex=DOC_REGEX.replace('"city"', '"town"')))]
    want = _run(base, work)
    with Engine(dtype="float32", max_total_tokens=6144, max_running_requests=8, context_length=512,
                speculative_algorithm="draft_model", speculative_draft_model_path=base.model_path,
                speculative_num_draft_tokens=4) as eng:
        got = _run(eng, work)
        _same(got, want)
        assert '"town"' in got[1]["text"]
        assert eng.get_stats()["spec_accepted_tokens"] >= 10
        eng.core.check_memory_invariant()


@pytest.mark.slow  # 60 s on 2 cores; the head's drafts against a float64 chain: test_eagle
def test_an_eagle_head_keeps_greedy_outputs(engines: tuple[Engine, Engine], tmp_path: Any) -> None:
    """Random EAGLE-1 and EAGLE-3 heads (published layouts, written here) over the embedded model, with decode graphs
    (EagerGraph on CPU: the graph path hands the head the target's hidden states too): outputs equal plain
    decoding, the head's KV is all given back."""
    from lmserver.runner.cuda_graph import EAGER_GRAPHS_ENV
    from lmserver.testing import write_eagle3_head, write_eagle_head

    base, _ = engines
    hf = base.core.model_config.hf_config
    head = dict(architectures=["LlamaForCausalLM"], vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
                intermediate_size=256, num_hidden_layers=1, num_attention_heads=hf["num_attention_heads"],
                num_key_value_heads=hf["num_key_value_heads"], max_position_embeddings=2048,
                rms_norm_eps=hf.get("rms_norm_eps", 1e-5), rope_theta=hf.get("rope_theta", 10000.0))
    write_eagle_head(tmp_path / "eagle", head)
    write_eagle3_head(tmp_path / "eagle3", head, draft_vocab=4096)  # reads target layers 1, 14, 26 (the default)
    workload = [WORKLOAD[0], WORKLOAD[2], WORKLOAD[6]]
    want = _run(base, workload)
    for folder in ("eagle", "eagle3"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(EAGER_GRAPHS_ENV, "1")
            eng = Engine(dtype="float32", max_total_tokens=6144, max_running_requests=8, context_length=512,
                         speculative_algorithm="eagle",
                         speculative_draft_model_path=str(tmp_path / folder), speculative_num_draft_tokens=3,
                         cuda_graph_max_bs=4)
        with eng:
            assert eng.core.runner.aux_hidden == (folder == "eagle3")
            _same(_run(eng, workload), want)
            stats = eng.get_stats()
            assert stats["spec_draft_tokens"] > 0 and stats["cuda_graph_verify_replays"] > 0, stats
            assert stats["spec_draft_chain_replays"] > 0, stats  # proposals of 3 drafts: a chain of 2 steps
            eng.core.check_memory_invariant()
            assert eng.core.spec is not None and eng.core.spec.draft_model is not None
            eng.core.spec.draft_model.check_empty()


def test_a_draft_model_of_another_vocabulary_is_refused(tmp_path: Any) -> None:
    from lmserver.runner.draft_model import DraftModelError

    path = _tiny_draft(tmp_path / "other", 1000)
    with pytest.raises(DraftModelError, match="vocabulary"):
        Engine(dtype="float32", max_total_tokens=1024, speculative_algorithm="draft_model",
               speculative_draft_model_path=path)


@pytest.mark.slow
def test_drafts_stop_at_the_context_length(engines: tuple[Engine, Engine]) -> None:
    """A request whose answer runs into the context length: drafts never pass it, the output equals
    plain decoding's."""
    base, _ = engines
    n_prompt = len(base.tokenizer(COPY)["input_ids"])
    params = {"temperature": 0.0, "ignore_eos": True}  # max_new_tokens clipped to the room left
    with Engine(dtype="float32", max_total_tokens=2048, context_length=n_prompt + 9) as plain, \
            Engine(dtype="float32", max_total_tokens=2048, context_length=n_prompt + 9,
                   speculative_algorithm="ngram", speculative_num_draft_tokens=8) as spec:
        want, got = plain.generate(COPY, params), spec.generate(COPY, params)
        assert isinstance(want, dict) and isinstance(got, dict)
        assert got["output_ids"] == want["output_ids"] and len(got["output_ids"]) == 9
        spec.core.check_memory_invariant()
