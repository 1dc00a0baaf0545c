"""Speculative decoding with tensor parallelism (gloo on CPU): with tp_size 2, EAGLE-1 / EAGLE-3 heads (drafting on
rank 0 over the whole embedding and LM head) and a draft model give the same greedy tokens as plain decoding with
tp_size 1, the heads the same drafts as with tp_size 1, n-gram verify steps (simulated acceptance) the same tokens as
with tp_size 1; verify steps did run, and every KV slot (the target's and the draft's) is given back. Each run in a
fresh spawned process (see test_tensor_parallel.in_child)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from packages.server.tests.test_tensor_parallel import _model_folder, _tiny_config, in_child

PROMPTS = ["one two three four one two three four one two three", "a b c a b c a b c a b", "The capital of France is"]
NEW_TOKENS = 24
TARGET = _tiny_config(num_hidden_layers=4)


def _run_here(model_path: str, config: dict[str, Any]) -> dict[str, Any]:
    from lmserver import Engine

    engine = Engine(model_path=model_path, load_format="dummy", dtype="float32", device="cpu", context_length=256,
                    max_total_tokens=2048, **config)
    proposals: list[list[list[int]]] = []  # each proposal's drafts, by request in order
    spec = engine.core.spec
    if spec is not None and spec.draft_model is not None:
        propose = spec.draft_model.propose

        def recorded(contexts: Any, k: Any) -> Any:
            drafts = propose(contexts, k)
            proposals.append(list(drafts.values()))
            return drafts

        spec.draft_model.propose = recorded  # type: ignore[method-assign]
    try:
        params = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
        outs = engine.generate(PROMPTS, params)
        engine.core.check_memory_invariant()
        if spec is not None and spec.draft_model is not None:
            spec.draft_model.check_empty()
        return {"output_ids": [o["output_ids"] for o in outs], "stats": engine.get_stats(), "proposals": proposals}
    finally:
        if engine.core.tp is not None:
            engine.core.tp.shutdown()
        engine.shutdown()


def _run(model_path: str, **config: Any) -> dict[str, Any]:
    return in_child(_run_here, model_path, config)  # type: ignore[no-any-return]


def _head_config(target: dict[str, Any]) -> dict[str, Any]:
    return dict(target, num_hidden_layers=1, intermediate_size=128, architectures=["LlamaForCausalLM"])


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[list[int]]]:
    """A tiny random Llama folder and its plain greedy outputs with tp_size 1."""
    path = _model_folder(tmp_path_factory.mktemp("tp_spec"), "llama", TARGET)
    return path, _run(path)["output_ids"]


def _check(got: dict[str, Any], want: list[list[int]], least_accept: float = 1.0) -> None:
    assert got["output_ids"] == want
    stats = got["stats"]
    assert stats["spec_verify_steps"] > 0 and stats["spec_draft_tokens"] > 0, stats
    assert stats["spec_accept_length"] >= least_accept, stats


@pytest.mark.slow
def test_ngram_verify_steps_with_tp2_equal_tp1(target: tuple[str, list[list[int]]]) -> None:
    # a random model's own tokens rarely repeat, so n-gram drafts would be rare: acceptance simulated (3 of 4 drafts
    # per step, whatever the logits; the tokens after them are the target's), the same on both sides
    path, _ = target
    spec = dict(speculative_algorithm="ngram", speculative_num_draft_tokens=4, speculative_simulate_accept_length=3.0)
    tp1, tp2 = _run(path, **spec), _run(path, tp_size=2, **spec)
    _check(tp2, tp1["output_ids"], least_accept=2.5)
    assert tp2["stats"]["spec_accepted_tokens"] == tp1["stats"]["spec_accepted_tokens"]


@pytest.mark.parametrize("kind", ["eagle", pytest.param("eagle3", marks=pytest.mark.slow)])
def test_an_eagle_head_with_tp2(target: tuple[str, list[list[int]]], tmp_path: Path, kind: str) -> None:
    """The head runs on rank 0 over full copies of the target's embedding and LM head (the target's own are
    vocabulary shards there); its drafts are verified by every rank's shard."""
    from lmserver.testing import write_eagle3_head, write_eagle_head

    path, want = target
    head = _head_config(TARGET)
    if kind == "eagle":
        write_eagle_head(tmp_path / kind, head)
    else:  # reads the residual stream after target layers 0, 1 and 3; the draft vocabulary is every other id
        write_eagle3_head(tmp_path / kind, dict(head, eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 3]}),
                          draft_vocab=4096)
    spec = dict(speculative_algorithm="eagle", speculative_draft_model_path=str(tmp_path / kind),
                speculative_num_draft_tokens=3)
    tp2 = _run(path, tp_size=2, **spec)
    _check(tp2, want)
    # the head reads the sharded target's features: it drafts exactly as over the whole target
    assert len(tp2["proposals"]) >= NEW_TOKENS // 4 and tp2["proposals"] == _run(path, **spec)["proposals"]


@pytest.mark.slow
def test_the_target_as_its_own_draft_model_with_tp2(target: tuple[str, list[list[int]]]) -> None:
    # the draft model (unsharded, on rank 0) is the target itself: nearly every draft is accepted
    path, want = target
    _check(_run(path, tp_size=2, speculative_algorithm="draft_model", speculative_draft_model_path=path,
                speculative_num_draft_tokens=4), want, least_accept=3.0)
