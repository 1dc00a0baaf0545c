"""The torch reference layer against HF transformers' Llama, and its decode path against its extend path."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lowlat import ForwardMeta, KVCache, LayerShape, LayerWeights, reference_decoder_layer
from lowlat.testing import (
    FakeGroup,
    FakeWorld,
    TinyModel,
    decode_meta,
    model_forward,
    random_kv,
    random_layer,
)

SHAPE = LayerShape(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96)


def _hf_model(model: TinyModel) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=model.embed.shape[0],
        hidden_size=SHAPE.hidden_size,
        intermediate_size=SHAPE.intermediate_size,
        num_hidden_layers=len(model.layers),
        num_attention_heads=SHAPE.num_heads,
        num_key_value_heads=SHAPE.num_kv_heads,
        head_dim=SHAPE.head_dim,
        rms_norm_eps=SHAPE.rms_eps,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        max_position_embeddings=256,
    )
    cfg._attn_implementation = "eager"
    hf = transformers.LlamaForCausalLM(cfg).eval()
    q, kv = SHAPE.q_size, SHAPE.kv_size
    with torch.no_grad():
        hf.model.embed_tokens.weight.copy_(model.embed)
        hf.model.norm.weight.copy_(model.final_norm)
        hf.lm_head.weight.copy_(model.lm_head)
        for layer, w in zip(hf.model.layers, model.layers, strict=True):
            layer.input_layernorm.weight.copy_(w.input_norm)
            layer.post_attention_layernorm.weight.copy_(w.post_norm)
            layer.self_attn.q_proj.weight.copy_(w.qkv[:q])
            layer.self_attn.k_proj.weight.copy_(w.qkv[q : q + kv])
            layer.self_attn.v_proj.weight.copy_(w.qkv[q + kv :])
            layer.self_attn.o_proj.weight.copy_(w.o_proj)
            layer.mlp.gate_proj.weight.copy_(w.gate_up[: SHAPE.intermediate_size])
            layer.mlp.up_proj.weight.copy_(w.gate_up[SHAPE.intermediate_size :])
            layer.mlp.down_proj.weight.copy_(w.down)
    return hf


def test_prefill_and_decode_logits_match_transformers() -> None:
    model = TinyModel.random(SHAPE, num_layers=2, vocab=97, seed=1)
    hf = _hf_model(model)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 97, (n,), generator=g) for n in (5, 9)]
    num_slots, max_context = 64, 16
    kvs = [random_kv(SHAPE, num_slots, torch.float32, generator=g) for _ in model.layers]
    slots = torch.randperm(num_slots, generator=g)[: 2 * max_context].view(2, max_context)
    table = torch.cat([slots, torch.zeros(1, max_context, dtype=torch.int64)]).to(torch.int32)
    rows = torch.tensor([1, 0])  # request r lives in table row rows[r]
    table[rows] = slots.to(torch.int32)
    lens = torch.tensor([5, 9], dtype=torch.int32)
    meta = ForwardMeta(
        table, rows, lens, torch.cat([torch.arange(5), torch.arange(9)]),
        torch.cat([slots[0, :5], slots[1, :9]]), extend_lens=lens, max_seq_len=max_context,
    )
    ours = model_forward(model, torch.cat(prompts), kvs, meta)
    with torch.no_grad():
        theirs = torch.cat([hf(p[None]).logits[0] for p in prompts])
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    # one decode step through the graph-safe decode path
    nxt = ours[[4, 13]].argmax(-1)
    lens2 = lens + 1
    pos = (lens2 - 1).long()
    meta2 = ForwardMeta(table, rows, lens2, pos, slots[torch.arange(2), pos], max_seq_len=max_context)
    ours2 = model_forward(model, nxt, kvs, meta2)
    with torch.no_grad():
        theirs2 = torch.stack([hf(torch.cat([p, t[None]])[None]).logits[0, -1] for p, t in zip(prompts, nxt, strict=True)])
    torch.testing.assert_close(ours2, theirs2, rtol=1e-4, atol=1e-4)


def test_decode_path_equals_extend_path_and_writes_only_new_slots() -> None:
    g = torch.Generator().manual_seed(3)
    w = random_layer(SHAPE, generator=g)
    meta = decode_meta([3, 11, 1, 7], num_slots=40, max_context=12, generator=g)
    kv_a = random_kv(SHAPE, 40, torch.float32, generator=g)
    kv_b = KVCache(kv_a.k.clone(), kv_a.v.clone())
    before = KVCache(kv_a.k.clone(), kv_a.v.clone())
    x = torch.randn(4, SHAPE.hidden_size, generator=g)
    out_a = reference_decoder_layer(x, w, kv_a, meta, SHAPE)
    ext = ForwardMeta(meta.req_to_token, meta.req_pool_indices, meta.seq_lens, meta.positions, meta.out_cache_loc,
                      extend_lens=torch.ones(4, dtype=torch.int32), max_seq_len=meta.max_seq_len)
    out_b = reference_decoder_layer(x, w, kv_b, ext, SHAPE)
    torch.testing.assert_close(out_a, out_b, rtol=1e-5, atol=1e-5)
    changed = (kv_a.k != before.k).any(-1).any(-1).nonzero().flatten().sort().values
    assert torch.equal(changed, meta.out_cache_loc.sort().values)



def _shard(w: LayerWeights, rank: int, size: int) -> LayerWeights:
    """Rank ``rank``'s shard of ``w``: heads and intermediate features split as a TP runner does."""
    d, hq, hk, n = SHAPE.head_dim, SHAPE.num_heads // size, SHAPE.num_kv_heads // size, SHAPE.intermediate_size // size
    q0, k0, v0 = rank * hq * d, SHAPE.q_size + rank * hk * d, SHAPE.q_size + SHAPE.kv_size + rank * hk * d
    i0, inter = rank * n, SHAPE.intermediate_size
    return LayerWeights(
        input_norm=w.input_norm,
        qkv=torch.cat([w.qkv[q0 : q0 + hq * d], w.qkv[k0 : k0 + hk * d], w.qkv[v0 : v0 + hk * d]]),
        o_proj=w.o_proj[:, q0 : q0 + hq * d].contiguous(),
        post_norm=w.post_norm,
        gate_up=torch.cat([w.gate_up[i0 : i0 + n], w.gate_up[inter + i0 : inter + i0 + n]]),
        down=w.down[:, i0 : i0 + n].contiguous(),
        rope_inv_freq=w.rope_inv_freq,
    )


def test_sharded_layer_with_all_reduce_equals_the_full_layer() -> None:
    g = torch.Generator().manual_seed(3)
    w = random_layer(SHAPE, generator=g)
    kv = random_kv(SHAPE, 64, torch.float32, generator=g)
    meta = decode_meta([5, 9, 1], 64, 16, generator=g)
    x = torch.randn(3, SHAPE.hidden_size, generator=g)
    size = 2
    local = dataclasses.replace(
        SHAPE, num_heads=SHAPE.num_heads // size, num_kv_heads=SHAPE.num_kv_heads // size,
        intermediate_size=SHAPE.intermediate_size // size,
    )
    kvs = [KVCache(kv.k[:, r : r + 1].clone(), kv.v[:, r : r + 1].clone()) for r in range(size)]
    want = reference_decoder_layer(x, w, kv, meta, SHAPE)

    def rank(group: FakeGroup) -> torch.Tensor:
        def all_reduce(t: torch.Tensor) -> torch.Tensor:
            return t.copy_(torch.stack(group.all_gather_object(t.clone())).sum(0))

        return reference_decoder_layer(x, _shard(w, group.rank, size), kvs[group.rank], meta, local, all_reduce)

    out = FakeWorld(size).run(rank)
    assert torch.equal(out[0], out[1])
    torch.testing.assert_close(out[0], want, rtol=1e-5, atol=1e-5)
    without = reference_decoder_layer(x, _shard(w, 0, size), KVCache(kvs[0].k.clone(), kvs[0].v.clone()), meta, local)
    assert not torch.allclose(without, want, atol=1e-3)  # the sums are what makes the shard exact
    for r in range(size):  # each rank wrote its own KV head
        assert torch.equal(kvs[r].k, kv.k[:, r : r + 1]) and torch.equal(kvs[r].v, kv.v[:, r : r + 1])
