"""A draft model's proposals with their k - 1 decode steps in one chain graph (lmserver.runner.draft_chain) on the CPU.

EagerGraph stands in for CUDA graphs (the same static buffers, padding rows and replay order). Oracle: HF
transformers' greedy continuation of each request's context on the same tiny random Llama (float64 copy), against
`DraftModel.propose` with chain graphs, with per-step decode graphs and eagerly; the draft KV cache is checked
after acceptance (the next proposal catches up from the kept prefix) and when requests are forgotten.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmserver.runner.cuda_graph import EAGER_GRAPHS_ENV, DecodeGraphRunner
from lmserver.runner.draft_chain import DraftChainGraphs
from lmserver.runner.draft_model import DraftModel

VOCAB = 97


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(5)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    path = tmp_path_factory.mktemp("draft") / "tiny"
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger logits than the default init: clear argmax margins
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def hf_model(draft_dir: Path) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(draft_dir), torch_dtype=torch.float64).eval()


def _hf_greedy(model: torch.nn.Module, context: list[int], k: int) -> list[int]:
    ids = list(context)
    with torch.no_grad():
        for _ in range(k):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(context):]


def _draft(path: Path, monkeypatch: pytest.MonkeyPatch, graph_max_bs: int, chain_steps: int, *,
           device: str = "cpu", num_slots: int = 600) -> DraftModel:
    """A float32 draft model of `path` (on the CPU: eager graphs, the torch_native backend; on CUDA: CUDA graphs,
    the triton backend)."""
    monkeypatch.setenv(EAGER_GRAPHS_ENV, "1")
    return DraftModel(str(path), target_vocab_size=VOCAB, dtype=torch.float32, device=torch.device(device),
                      context_length=256, max_requests=6, num_slots=num_slots,
                      attention_backend="triton" if device == "cuda" else "torch_native",
                      graph_max_bs=graph_max_bs, chain_steps=chain_steps)


# (decode graphs up to, chain steps): eager steps; one decode graph replay per step; proposals of 5 drafts whose one
# token to catch up on is the chain's first step (the steady state), all 5 drafts in one replay
MODES = [pytest.param(0, 0, id="eager"), pytest.param(4, 0, id="graphs"), pytest.param(4, 5, id="chain")]


@pytest.mark.parametrize(("graph_max_bs", "chain_steps"), MODES)
def test_proposals_equal_hf_greedy(draft_dir: Path, hf_model: torch.nn.Module, graph_max_bs: int, chain_steps: int,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Three fresh requests wanting 5 drafts (catch-up forwards of their prompts, then steps), partial acceptance,
    a proposal whose requests each have one token to catch up on (the chain: 5 steps, rows padded to 4), a
    proposal of mixed k (steps, never the chain), then every slot given back."""
    draft = _draft(draft_dir, monkeypatch, graph_max_bs, chain_steps)
    g = torch.Generator().manual_seed(3)
    contexts = {rid: torch.randint(0, VOCAB, (n,), generator=g).tolist() for rid, n in (("a", 7), ("b", 1), ("c", 12))}
    got = draft.propose(contexts, dict.fromkeys(contexts, 5))
    for rid, ctx in contexts.items():
        assert got[rid] == _hf_greedy(hf_model, ctx, 5), rid
    assert draft.num_chain_replays == 0  # prompts of several tokens to catch up on: a forward, then steps
    # the target accepted 2 of a's drafts then its own token, all of b's, none of c's (another token)
    contexts["a"] = [*contexts["a"], *got["a"][:2], (got["a"][2] + 1) % VOCAB]
    contexts["b"] = [*contexts["b"], *got["b"]]
    contexts["c"] = [*contexts["c"], (got["c"][0] + 1) % VOCAB]
    for rid, ctx in contexts.items():
        draft.accepted(rid, ctx)
    got = draft.propose(contexts, dict.fromkeys(contexts, 5))
    for rid, ctx in contexts.items():
        assert got[rid] == _hf_greedy(hf_model, ctx, 5), rid
    assert draft.num_chain_replays == (1 if chain_steps else 0)  # one new token each (b's: its 5th draft)
    for rid, ctx in contexts.items():
        draft.accepted(rid, [*ctx, *got[rid]])
        contexts[rid] = [*ctx, *got[rid]]
    ks = {"a": 5, "b": 2, "c": 3}
    got = draft.propose(contexts, ks)
    for rid, ctx in contexts.items():
        assert got[rid] == _hf_greedy(hf_model, ctx, ks[rid]), rid
    assert draft.num_chain_replays == (1 if chain_steps else 0)
    for rid in contexts:
        draft.forget(rid)
    draft.check_empty()


@pytest.fixture(scope="module")
def chained_and_stepped(draft_dir: Path) -> tuple[DraftModel, DraftModel]:
    """Two draft models on the same weights, with decode graphs of up to 4 rows: with chains of 5 steps, without."""
    with pytest.MonkeyPatch.context() as mp:
        return _draft(draft_dir, mp, 4, 5), _draft(draft_dir, mp, 4, 0)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(1, 20), min_size=1, max_size=4), seed=st.integers(0, 2**16),
       rounds=st.lists(st.lists(st.integers(0, 5), min_size=4, max_size=4), min_size=1, max_size=3))
def test_chain_equals_step_by_step(chained_and_stepped: tuple[DraftModel, DraftModel], lengths: list[int],
                                   seed: int, rounds: list[list[int]]) -> None:
    """Property: 1-4 requests of any context lengths, then rounds in which the target keeps `a` of each request's 5
    drafts (0-5) and adds a token of its own (a bonus token after all 5: two tokens to catch up on, no chain): the
    chained model's drafts equal the per-step decode graphs' drafts of a second draft model on the same weights,
    both keep the same tokens in their caches, and the chain ran exactly in the rounds of one new token each."""
    chained, stepped = chained_and_stepped
    g = torch.Generator().manual_seed(seed)
    contexts = {f"r{i}": torch.randint(0, VOCAB, (n,), generator=g).tolist() for i, n in enumerate(lengths)}
    k = dict.fromkeys(contexts, 5)
    before = chained.num_chain_replays
    got = chained.propose(contexts, k)
    assert got == stepped.propose(contexts, k)
    chains = before + all(n == 1 for n in lengths)  # one-token prompts: the chain from the first proposal
    assert chained.num_chain_replays == chains
    for kept in rounds:
        for i, rid in enumerate(contexts):
            own = (got[rid][kept[i]] + 1) % VOCAB if kept[i] < 5 else int(torch.randint(0, VOCAB, (1,), generator=g))
            contexts[rid] = [*contexts[rid], *got[rid][: kept[i]], own]
            chained.accepted(rid, contexts[rid])
            stepped.accepted(rid, contexts[rid])
        got = chained.propose(contexts, k)
        assert got == stepped.propose(contexts, k)
        chains += all(kept[i] < 5 for i in range(len(contexts)))
        assert chained.num_chain_replays == chains
    for rid in contexts:
        assert chained._reqs[rid].tokens == stepped._reqs[rid].tokens
        chained.forget(rid)
        stepped.forget(rid)
    chained.check_empty()
    stepped.check_empty()


def test_chain_refuses_what_it_cannot_replay(draft_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A chain of no steps, a run of another step count or of ragged rows: clear errors, nothing replayed."""
    draft = _draft(draft_dir, monkeypatch, 2, 0)
    graphs = draft.runner.cuda_graph
    assert isinstance(graphs, DecodeGraphRunner)
    with pytest.raises(ValueError, match="at least one step"):
        DraftChainGraphs(graphs, 0)
    chain = DraftChainGraphs(graphs, 2)
    chain.capture()
    assert sorted(chain.chains) == graphs.sizes == [1, 2]
    assert not chain.can_run(3, 2) and not chain.can_run(1, 3) and chain.can_run(2, 2)
    with pytest.raises(ValueError, match="a chain of 2 steps got 1"):
        chain.run([[]])
    with pytest.raises(ValueError, match="no chain graph serves"):
        chain.run([[], []])
    assert chain.num_replays == 0


def test_gpu_kv_budget_counts_the_draft_pool(draft_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A draft model keeps a KV pool of as many slots as the target's: on CUDA the target's KV budget shares each
    token with it and leaves its weights out (the draft's per-slot bytes and weights are those the built draft
    holds); an EAGLE-3 head's config is read as a Llama layer's; no draft, or an unreadable config: nothing."""
    from lmserver.config import ServerConfig
    from lmserver.forward.kv_pool import KVPool
    from lmserver.models.config import ModelConfig
    from lmserver.runner.resolve import draft_memory, estimate_weight_bytes, resolve_kv_tokens

    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (70 * gib, 80 * gib))  # 10 GiB in use
    cfg = ServerConfig(mem_fraction_static=0.5, context_length=256, speculative_algorithm="draft_model",
                       speculative_draft_model_path=str(draft_dir))
    draft = _draft(draft_dir, monkeypatch, 0, 0)
    pool = draft.runner.kv_pool
    held = sum(t[0].numel() * t.element_size() for t in (*pool.k_cache, *pool.v_cache))  # one slot, all layers
    target = ModelConfig.from_hf(json.loads((draft_dir / "config.json").read_text()))
    slot, weights = draft_memory(cfg, "float32", target)
    params = {id(t): t for t in (*draft.model.parameters(), *draft.model.buffers())}
    assert slot == held and weights == sum(t.numel() * t.element_size() for t in params.values())
    per_slot = KVPool.bytes_per_slot(target.num_hidden_layers, target.num_key_value_heads, target.head_dim,
                                     torch.bfloat16)
    target_weights = estimate_weight_bytes(target, "bfloat16", 256)
    slot, weights = draft_memory(cfg, "bfloat16", target)
    assert resolve_kv_tokens(cfg, target, "cuda", "bfloat16", 0, draft=(slot, weights)) == \
        (40 * gib - 10 * gib - target_weights - weights) // (per_slot + slot)
    eagle3 = tmp_path / "eagle3"
    eagle3.mkdir()
    raw = json.loads((draft_dir / "config.json").read_text())
    (eagle3 / "config.json").write_text(json.dumps(dict(raw, architectures=["LlamaForCausalLMEagle3"],
                                                        num_hidden_layers=1, draft_vocab_size=32)))
    slot3, _ = draft_memory(cfg.replace(speculative_algorithm="eagle", speculative_draft_model_path=str(eagle3)),
                            "bfloat16", target)
    assert slot3 == slot // raw["num_hidden_layers"]
    assert draft_memory(ServerConfig(), "bfloat16", target) == (0, 0)
    assert draft_memory(cfg.replace(speculative_draft_model_path=str(tmp_path / "missing")), "bfloat16", target) == (0, 0)


@pytest.mark.gpu
def test_cuda_chain_equals_step_by_step_and_hf(draft_dir: Path, hf_model: torch.nn.Module,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU (real CUDA graphs, float32, the triton attention backend): three requests through a fresh proposal,
    a steady-state one (the chain of 5 steps, rows padded to 4) and one more: the chained model's drafts equal a
    per-step model's and HF greedy's on the same weights; both give every slot back."""
    chained, stepped = (_draft(draft_dir, monkeypatch, 4, steps, device="cuda") for steps in (5, 0))
    g = torch.Generator().manual_seed(9)
    contexts = {rid: torch.randint(0, VOCAB, (n,), generator=g).tolist() for rid, n in (("a", 9), ("b", 2), ("c", 30))}
    k = dict.fromkeys(contexts, 5)
    for round_ in range(3):
        got = chained.propose(contexts, k)
        assert got == stepped.propose(contexts, k), round_
        for rid, ctx in contexts.items():
            assert got[rid] == _hf_greedy(hf_model, ctx, 5), (round_, rid)
            contexts[rid] = [*ctx, *got[rid][: 1 + round_], (got[rid][1 + round_] + 1) % VOCAB]
            chained.accepted(rid, contexts[rid])
            stepped.accepted(rid, contexts[rid])
    assert chained.num_chain_replays == 2
    for draft in (chained, stepped):
        for rid in contexts:
            draft.forget(rid)
        draft.check_empty()


def test_requests_share_the_slots_left(draft_dir: Path, hf_model: torch.nn.Module,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Two requests that each fit the draft cache alone but not together: the first drafts, the second gets none
    (instead of running out of slots mid-proposal); every slot comes back."""
    draft = _draft(draft_dir, monkeypatch, 0, 0, num_slots=12)
    contexts = {"a": [5, 6, 7, 8], "b": [9, 10, 11, 12]}  # 4 + 5 - 1 = 8 slots each
    got = draft.propose(contexts, dict.fromkeys(contexts, 5))
    assert list(got) == ["a"] and got["a"] == _hf_greedy(hf_model, contexts["a"], 5)
    for rid in contexts:
        draft.forget(rid)
    draft.check_empty()
