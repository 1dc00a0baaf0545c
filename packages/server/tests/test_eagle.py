"""EAGLE heads (lmserver.models.eagle, lmserver.runner.eagle) on the CPU.

A head written by the test in the published EAGLE layout (safetensors `fc.weight`,
`layers.0.*` without `input_layernorm`) over a tiny random target. Oracle: a float64 torch
implementation of EAGLE's draft chain written here from the published architecture (fc over
[token embedding, feature], one Llama layer without its input norm, no final norm, the target's
LM head), against the proposer's greedy drafts; loading errors for a head of another width.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmserver.models.config import ModelConfig
from lmserver.models.loader import load_model
from lmserver.runner.draft_model import DraftModelError
from lmserver.runner.eagle import EagleProposer
from lmserver.testing import write_eagle_head

TARGET = dict(architectures=["LlamaForCausalLM"], vocab_size=101, hidden_size=64, intermediate_size=96,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
              rms_norm_eps=1e-5, rope_theta=10000.0)
HEAD = dict(TARGET, num_hidden_layers=1, intermediate_size=80)


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """HF Llama rotary embedding (rotate_half form) of x (T, heads, d) at positions pos (T,)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.double()[:, None] * inv[None, :]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[:, None], torch.cat([ang.sin(), ang.sin()], -1)[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _naive_drafts(w: dict[str, torch.Tensor], embed: torch.Tensor, lm_head: torch.Tensor, config: dict,
                  tokens: list[int], feats: torch.Tensor, k: int) -> list[int]:
    """EAGLE's chain in float64: position p reads (tokens[p + 1], feats[p]); then its own guesses."""
    w = {n: t.double() for n, t in w.items()}
    embed, lm_head = embed.double(), lm_head.double()
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    d = config["hidden_size"] // heads
    eps = config["rms_norm_eps"]

    def layer(x: torch.Tensor) -> torch.Tensor:  # x (T, hidden) at positions 0..T-1, causal
        t = x.shape[0]
        pos = torch.arange(t)
        q = _rope((x @ w["layers.0.self_attn.q_proj.weight"].T).view(t, heads, d), pos, config["rope_theta"])
        kk = _rope((x @ w["layers.0.self_attn.k_proj.weight"].T).view(t, kv, d), pos, config["rope_theta"])
        v = (x @ w["layers.0.self_attn.v_proj.weight"].T).view(t, kv, d)
        kk, v = kk.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
        scores = torch.einsum("qhd,khd->hqk", q, kk) / d**0.5
        scores = scores.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool), 1), float("-inf"))
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(t, heads * d)
        h2 = x + attn @ w["layers.0.self_attn.o_proj.weight"].T
        n = h2 * torch.rsqrt(h2.pow(2).mean(-1, keepdim=True) + eps) * w["layers.0.post_attention_layernorm.weight"]
        mlp = (torch.nn.functional.silu(n @ w["layers.0.mlp.gate_proj.weight"].T) * (n @ w["layers.0.mlp.up_proj.weight"].T))
        return h2 + mlp @ w["layers.0.mlp.down_proj.weight"].T

    inputs = [torch.cat([embed[tokens[p + 1]], feats[p].double()]) for p in range(len(feats))]
    drafts: list[int] = []
    for _ in range(k):
        x = torch.stack(inputs) @ w["fc.weight"].T
        out = layer(x)[-1]
        drafts.append(int((out @ lm_head.T).argmax()))
        inputs.append(torch.cat([embed[drafts[-1]], out]))
    return drafts


def _target() -> torch.nn.Module:
    return load_model(ModelConfig.from_hf(TARGET), None, load_format="dummy", dtype=torch.float32, device="cpu",
                      max_positions=128, seed=3)


def _proposer(path: Path, target: torch.nn.Module, graph_max_bs: int = 0, chain_steps: int = 0,
              num_slots: int = 200) -> EagleProposer:
    return EagleProposer(str(path), target=target, target_config=ModelConfig.from_hf(TARGET), dtype=torch.float32,
                         device=torch.device("cpu"), context_length=128, max_requests=4, num_slots=num_slots,
                         attention_backend="torch_native", graph_max_bs=graph_max_bs, chain_steps=chain_steps)


# (decode graphs up to, chain steps): eager head steps; each step a decode graph replay; the k - 1 steps of a
# proposal of k = 4 in one chain replay (the features carried between steps inside the graph)
GRAPH_MODES = [pytest.param(0, 0, id="eager"), pytest.param(4, 0, id="graphs"), pytest.param(4, 3, id="chain")]


@pytest.mark.parametrize(("graph_max_bs", "chain_steps"), GRAPH_MODES)
def test_drafts_equal_the_float64_eagle_chain(tmp_path: Path, graph_max_bs: int, chain_steps: int,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Eager head steps, head steps replaying decode graphs (EagerGraph on the CPU: the static
    feature buffer, padding rows), and chain graphs against the float64 chain."""
    from lmserver.runner.cuda_graph import EAGER_GRAPHS_ENV

    monkeypatch.setenv(EAGER_GRAPHS_ENV, "1")
    target = _target()
    weights = write_eagle_head(tmp_path / "head", HEAD)
    eagle = _proposer(tmp_path / "head", target, graph_max_bs, chain_steps)
    assert (eagle.runner.cuda_graph is not None) == (graph_max_bs > 0)
    g = torch.Generator().manual_seed(7)
    embed, lm_head = target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach()  # type: ignore[union-attr]
    for rid, n, k in (("a", 9, 4), ("b", 3, 2)):
        tokens = torch.randint(0, 101, (n + 1,), generator=g).tolist()
        feats = torch.randn(n, 64, generator=g)
        eagle.observe(rid, 0, feats[:5])  # in two forwards, like a chunked prefill
        eagle.observe(rid, 5, feats[5:])
        got = eagle.propose({rid: tokens}, {rid: k})[rid]
        assert got == _naive_drafts(weights, embed, lm_head, HEAD, tokens, feats, k)
    # a proposal keeps only the observed tokens' KV; the next one catches up from there
    tokens_a2 = [*tokens, 5, 6]
    eagle.observe("b", 3, torch.randn(2, 64, generator=g))
    assert len(eagle.propose({"b": tokens_a2}, {"b": 3})["b"]) == 3
    for rid in ("a", "b"):
        eagle.forget(rid)
    # three requests in one proposal (head steps of 3 rows, a padded graph of 4), each as its own chain
    seqs = {rid: (torch.randint(0, 101, (n + 1,), generator=g).tolist(), torch.randn(n, 64, generator=g))
            for rid, n in (("c", 4), ("d", 7), ("e", 2))}
    for rid, (_, feats) in seqs.items():
        eagle.observe(rid, 0, feats)
    got_all = eagle.propose({rid: t for rid, (t, _) in seqs.items()}, {"c": 3, "d": 3, "e": 2})
    for rid, (tokens, feats) in seqs.items():
        assert got_all[rid] == _naive_drafts(weights, embed, lm_head, HEAD, tokens, feats, len(got_all[rid])), rid
    for rid in seqs:
        eagle.forget(rid)
    # three requests wanting 4 drafts each: one chain replay of 3 steps in the graph of 4 rows (chain mode)
    seqs = {rid: (torch.randint(0, 101, (n + 1,), generator=g).tolist(), torch.randn(n, 64, generator=g))
            for rid, n in (("f", 5), ("g", 2), ("h", 8))}
    for rid, (_, feats) in seqs.items():
        eagle.observe(rid, 0, feats)
    chains = eagle.num_chain_replays
    got_all = eagle.propose({rid: t for rid, (t, _) in seqs.items()}, dict.fromkeys(seqs, 4))
    for rid, (tokens, feats) in seqs.items():
        assert got_all[rid] == _naive_drafts(weights, embed, lm_head, HEAD, tokens, feats, 4), rid
    assert eagle.num_chain_replays == chains + (1 if chain_steps else 0)
    for rid in seqs:
        eagle.forget(rid)
    eagle.check_empty()
    if graph_max_bs:
        assert eagle.runner.cuda_graph is not None and eagle.runner.cuda_graph.num_replays >= 4
    # chain mode: the single-request k = 4 proposal and the three-request one above (k = 2 or mixed k: steps)
    assert eagle.num_chain_replays == (2 if chain_steps else 0)


def test_a_recomputed_position_restarts_the_request(tmp_path: Path) -> None:
    target = _target()
    weights = write_eagle_head(tmp_path / "head", HEAD)
    eagle = _proposer(tmp_path / "head", target)
    g = torch.Generator().manual_seed(8)
    tokens = torch.randint(0, 101, (8,), generator=g).tolist()
    eagle.observe("r", 0, torch.randn(7, 64, generator=g))
    eagle.propose({"r": tokens}, {"r": 2})
    feats = torch.randn(7, 64, generator=g)  # a retraction: the target prefills again from 0
    eagle.observe("r", 0, feats)
    embed, lm_head = target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach()  # type: ignore[union-attr]
    assert eagle.propose({"r": tokens}, {"r": 3})["r"] == _naive_drafts(weights, embed, lm_head, HEAD, tokens, feats, 3)
    assert eagle.propose({"r": tokens}, {"r": 3}) == {}  # nothing new observed: no drafts
    eagle.forget("r")
    eagle.check_empty()


def test_a_head_of_another_width_or_an_incomplete_checkpoint_is_refused(tmp_path: Path) -> None:
    target = _target()
    write_eagle_head(tmp_path / "wide", dict(HEAD, hidden_size=128, num_attention_heads=8))
    with pytest.raises(DraftModelError, match="hidden_size 128"):
        _proposer(tmp_path / "wide", target)
    tensors = write_eagle_head(tmp_path / "partial", HEAD)
    from safetensors.torch import save_file

    del tensors["layers.0.mlp.down_proj.weight"]
    save_file(tensors, str(tmp_path / "partial" / "model.safetensors"))
    with pytest.raises(DraftModelError, match="not .fully. loaded"):
        _proposer(tmp_path / "partial", target)


# --- EAGLE-3 -------------------------------------------------------------------------------------

def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _naive_eagle3(w: dict[str, torch.Tensor], embed: torch.Tensor, config: dict, tokens: list[int],
                  aux: torch.Tensor, k: int) -> list[int]:
    """EAGLE-3's chain in float64: position p reads (tokens[p + 1], fc(aux[p])); then its own pre-norm
    outputs; logits over the draft vocabulary, mapped to target ids by d2t."""
    w = {n: t.double() if t.is_floating_point() else t for n, t in w.items()}
    embed = embed.double()
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    d = config["hidden_size"] // heads
    eps = config["rms_norm_eps"]
    pre = "midlayer."

    def layer(toks: list[int], feats: torch.Tensor) -> torch.Tensor:
        t = len(toks)
        pos = torch.arange(t)
        x = torch.cat([_rms(embed[toks], w[pre + "input_layernorm.weight"], eps),
                       _rms(feats, w[pre + "hidden_norm.weight"], eps)], -1)
        q = _rope((x @ w[pre + "self_attn.q_proj.weight"].T).view(t, heads, d), pos, config["rope_theta"])
        kk = _rope((x @ w[pre + "self_attn.k_proj.weight"].T).view(t, kv, d), pos, config["rope_theta"])
        v = (x @ w[pre + "self_attn.v_proj.weight"].T).view(t, kv, d)
        kk, v = kk.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
        scores = torch.einsum("qhd,khd->hqk", q, kk) / d**0.5
        scores = scores.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool), 1), float("-inf"))
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(t, heads * d)
        h2 = feats + attn @ w[pre + "self_attn.o_proj.weight"].T
        n = _rms(h2, w[pre + "post_attention_layernorm.weight"], eps)
        mlp = torch.nn.functional.silu(n @ w[pre + "mlp.gate_proj.weight"].T) * (n @ w[pre + "mlp.up_proj.weight"].T)
        return h2 + mlp @ w[pre + "mlp.down_proj.weight"].T

    toks = [tokens[p + 1] for p in range(len(aux))]
    feats = aux.double() @ w["fc.weight"].T
    drafts: list[int] = []
    for _ in range(k):
        out = layer(toks, feats)[-1]
        draft = int((_rms(out, w["norm.weight"], eps) @ w["lm_head.weight"].T).argmax())
        drafts.append(draft + int(w["d2t"][draft]))
        toks.append(drafts[-1])
        feats = torch.cat([feats, out[None]])
    return drafts


@pytest.mark.parametrize(("graph_max_bs", "chain_steps"), GRAPH_MODES)
def test_eagle3_drafts_equal_the_float64_chain(tmp_path: Path, graph_max_bs: int, chain_steps: int,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from lmserver.runner.cuda_graph import EAGER_GRAPHS_ENV
    from lmserver.testing import write_eagle3_head

    monkeypatch.setenv(EAGER_GRAPHS_ENV, "1")
    target = _target()
    head3 = dict(HEAD, eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 1]})  # a 2-layer target
    weights = write_eagle3_head(tmp_path / "head3", head3, draft_vocab=50)
    eagle = _proposer(tmp_path / "head3", target, graph_max_bs, chain_steps)
    assert type(eagle.head).__name__ == "Eagle3Head"
    g = torch.Generator().manual_seed(11)
    embed = target.model.embed_tokens.weight.detach()  # type: ignore[union-attr]
    seqs = {rid: (torch.randint(0, 101, (n + 1,), generator=g).tolist(), torch.randn(n, 3 * 64, generator=g))
            for rid, n in (("x", 6), ("y", 3))}
    for rid, (_, aux) in seqs.items():
        eagle.observe(rid, 0, aux)
    # chain mode: both want 4 drafts (one chain replay, the rows padded to 2); else mixed k
    got = eagle.propose({rid: t for rid, (t, _) in seqs.items()}, {"x": 4, "y": 4 if chain_steps else 3})
    for rid, (tokens, aux) in seqs.items():
        want = _naive_eagle3(weights, embed, HEAD, tokens, aux, len(got[rid]))
        assert got[rid] == want and all(t % 2 == 0 for t in got[rid]), rid  # draft ids map to even target ids
    assert eagle.num_chain_replays == (1 if chain_steps else 0)
    for rid in seqs:
        eagle.forget(rid)
    eagle.check_empty()


def test_the_target_exposes_the_residual_stream_after_its_aux_layers() -> None:
    """aux_hidden (T, 2 * hidden) for aux layers (0, 1) of a 2-layer target: the final norm of the last
    slice is the model's output; the first slice is what a copy cut after layer 0 ends with."""
    from lmserver.forward.batch import ForwardBatch, ForwardMode
    from lmserver.layers.norm import RMSNorm

    target = _target()
    inner = target.model  # type: ignore[union-attr]
    inner.aux_layers = (0, 1)

    from lmserver.forward.kv_pool import KVPool, make_req_to_token
    from lmserver.runner.attention.registry import default_registry
    from lmserver.runner.model_runner import ModelRunner
    from lmserver.scheduler import ForwardItem, ScheduleDecision

    cfg = ModelConfig.from_hf(TARGET)
    pool = KVPool(64, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, torch.float32, "cpu")
    table = make_req_to_token(2, 32, "cpu")
    runner = ModelRunner(target, pool, table, default_registry().create("torch_native", pool, table), torch.device("cpu"))
    runner.keep_hidden = runner.aux_hidden = True
    ids = [5, 9, 2, 7, 1]
    item = ForwardItem(rid="a", req_pool_idx=0, prefix_len=0, token_ids=ids, out_slots=list(range(1, 6)),
                       table_start=0, table_slots=list(range(1, 6)), logit_offsets=[4], completes_prefill=True)
    logits = runner.forward(ScheduleDecision("extend", [item]))
    aux = runner.last_hidden
    assert aux is not None and aux.shape == (5, 128)
    norm: RMSNorm = inner.norm
    final = norm(aux[:, 64:].clone())
    torch.testing.assert_close(target.compute_logits(final)[4:5], logits, atol=1e-5, rtol=1e-5)  # type: ignore[operator]
    # the stream after layer 0: run layer 0 alone on the same tokens
    inner.aux_layers = ()
    layer1 = inner.layers[1]
    del inner.layers[1]
    try:
        batch_logits = runner.forward(ScheduleDecision("extend", [item]))
        first = norm(aux[:, :64].clone())
        torch.testing.assert_close(target.compute_logits(first)[4:5], batch_logits, atol=1e-5, rtol=1e-5)  # type: ignore[operator]
    finally:
        inner.layers.append(layer1)
    assert ForwardBatch and ForwardMode  # imported for the reader: the forward above is an EXTEND batch


def test_requests_share_the_slots_left(tmp_path: Path) -> None:
    """Two requests that each fit the head's cache alone but not together: the first drafts, the second gets none
    (instead of running out of slots mid-proposal); every slot comes back."""
    target = _target()
    write_eagle_head(tmp_path / "head", HEAD)
    eagle = _proposer(tmp_path / "head", target, num_slots=12)
    g = torch.Generator().manual_seed(5)
    contexts = {rid: torch.randint(0, 101, (6,), generator=g).tolist() for rid in ("a", "b")}
    for rid in contexts:
        eagle.observe(rid, 0, torch.randn(5, 64, generator=g))  # 5 positions + 4 steps = 9 slots each
    got = eagle.propose(contexts, dict.fromkeys(contexts, 5))
    assert list(got) == ["a"] and len(got["a"]) == 5
    for rid in contexts:
        eagle.forget(rid)
    eagle.check_empty()


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "eagle-bin"])
def test_the_kv_budget_counts_the_heads_own_weights(tmp_path: Path, kind: str) -> None:
    """`resolve.draft_memory` of an EAGLE head: the bytes of the built head's own parameters and buffers (float32 here),
    not the target's embedding and LM head it shares (a whole Llama model of the head's config counted them, and
    missed an EAGLE-3 head's wider fc and attention input and its own LM head); a head of another width counts as that
    whole model (the loader refuses it later). A `pytorch_model.bin` head counts an embedding and an fc bias of its
    own (its names would need the whole file read): the safe side."""
    from lmserver.config import ServerConfig
    from lmserver.runner.resolve import draft_memory, estimate_weight_bytes
    from lmserver.testing import write_eagle3_head

    target = _target()
    path = tmp_path / kind
    if kind != "eagle3":
        write_eagle_head(path, HEAD)
        if kind == "eagle-bin":
            from safetensors.torch import load_file

            for f in list(path.glob("*.safetensors")):
                torch.save(load_file(f), path / "pytorch_model.bin")
                f.unlink()
    else:
        write_eagle3_head(path, dict(HEAD, eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 1]}), draft_vocab=50)
    head = _proposer(path, target).head
    own = {id(p): p for _, p in head.head_parameters()} | {id(b): b for b in head.buffers()}
    cfg = ServerConfig(context_length=128, speculative_algorithm="eagle", speculative_draft_model_path=str(path))
    _, weights = draft_memory(cfg, "float32", ModelConfig.from_hf(TARGET))
    extra = (101 * 64 + 64) * 4 if kind == "eagle-bin" else 0  # the assumed embedding (vocab x hidden) and fc bias
    assert weights == sum(t.numel() * t.element_size() for t in own.values()) + extra
    whole = estimate_weight_bytes(ModelConfig.from_hf(dict(HEAD, architectures=["LlamaForCausalLM"])), "float32", 128)
    if kind == "eagle":
        assert weights < whole  # the shared embedding / LM head are not counted
    # with tensor parallelism rank 0 keeps the target modules the head reads whole (the target's are shards there):
    # the embedding (vocab x hidden) unless the head has its own, the LM head for an EAGLE-1/2 head
    shared = (0 if kind == "eagle-bin" else 101 * 64) + (0 if kind == "eagle3" else 101 * 64)
    assert draft_memory(cfg.replace(tp_size=2), "float32", ModelConfig.from_hf(TARGET))[1] == weights + shared * 4
    wide = ModelConfig.from_hf(dict(TARGET, hidden_size=128))
    assert draft_memory(cfg, "float32", wide)[1] == estimate_weight_bytes(
        ModelConfig.from_hf(dict(HEAD, architectures=["LlamaForCausalLM"])), "float32", 128)
