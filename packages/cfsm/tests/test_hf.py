"""cfsm.hf: vocabularies from real tokenizers, and constrained generate() with SmolLM2."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
import regex

pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

import cfsm  # noqa: E402
from cfsm.hf import LogitsProcessor, make_encoder, vocabulary_from_hf  # noqa: E402

TEXTS = ['{"name": "Zoë", "age": 31}', "naïve café ☕ 😀 \t\n  spaces", "日本語のテキスト", "x = [1, 2.5e-3]"]


def test_byte_level_vocabulary_round_trips_smollm2(smollm2_tokenizer: Any) -> None:
    vocab = vocabulary_from_hf(smollm2_tokenizer)
    assert vocab.size == 49152 and vocab.eos_token_ids == (smollm2_tokenizer.eos_token_id,)
    for text in TEXTS:
        ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
        assert vocab.decode(ids) == text.encode()
    im_start = smollm2_tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert vocab.token_bytes(im_start) == b"" and im_start in vocab.special_token_ids


def _sentencepiece_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁", "a", "c", "e", "h", "t", "at", "th", "▁c", "▁t", "▁cat", "▁th", "▁the"]:
        vocab[piece] = len(vocab)
    merges = [("a", "t"), ("t", "h"), ("▁", "c"), ("▁", "t"), ("▁c", "at"), ("▁t", "h"), ("▁th", "e")]
    model = models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True)
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_sentencepiece_byte_fallback_vocabulary() -> None:
    tok = _sentencepiece_tokenizer()
    vocab = vocabulary_from_hf(tok)
    assert vocab.token_bytes(tok.convert_tokens_to_ids("<0x41>")) == b"A"
    assert vocab.token_bytes(tok.convert_tokens_to_ids("▁cat")) == b" cat"
    assert vocab.eos_token_ids == (2,) and vocab.token_bytes(1) == b""
    ids = tok.encode("the cat é", add_special_tokens=False)
    assert vocab.decode(ids) == " the cat é".encode()  # sentencepiece adds the leading space
    index = cfsm.compile_regex(r" the [a-z]+ é", vocab)
    guide = cfsm.Guide(index)
    guide.advance_many(ids)
    assert guide.can_stop()


def _generate(model: Any, tokenizer: Any, index: cfsm.Index, prompt: str, max_new_tokens: int) -> str:
    import torch
    from transformers import LogitsProcessorList

    messages = [{"role": "user", "content": prompt}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = tokenizer(text, return_tensors="pt")
    processor = LogitsProcessor(index)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                             logits_processor=LogitsProcessorList([processor]),
                             pad_token_id=tokenizer.eos_token_id)
    new = out[0, inputs["input_ids"].shape[1]:].tolist()
    assert all(g.is_finished() or g.can_stop() or len(new) == max_new_tokens for g in processor.guides)
    return tokenizer.decode(new, skip_special_tokens=True)


def test_constrained_generation_with_smollm2(smollm2_model: Any, smollm2_tokenizer: Any) -> None:
    vocab = vocabulary_from_hf(smollm2_tokenizer)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "population": {"type": "integer", "minimum": 0, "maximum": 99999999}},
              "required": ["city", "population"], "additionalProperties": False}
    index = cfsm.compile_json_schema(schema, vocab, cfsm.CfsmConfig(whitespace_pattern=" ?"))
    out = _generate(smollm2_model, smollm2_tokenizer, index, "Give the capital of France and its population as JSON.", 32)
    jsonschema.validate(json.loads(out), schema)
    pattern = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
    out = _generate(smollm2_model, smollm2_tokenizer, cfsm.compile_regex(pattern, vocab),
                    "On what date did the Apollo 11 landing happen? Answer as YYYY-MM-DD.", 12)
    assert regex.fullmatch(pattern, out), out


def test_jump_forward_with_the_real_tokenizer(smollm2_tokenizer: Any) -> None:
    vocab = vocabulary_from_hf(smollm2_tokenizer)
    index = cfsm.compile_regex(r'\{"name": "[A-Za-z]+", "age": [0-9]+\}', vocab)
    guide = cfsm.Guide(index)
    encode = make_encoder(smollm2_tokenizer)
    tokens: list[int] = []
    forced = guide.jump_forward()
    assert forced == '{"name": "'
    plan = cfsm.plan_jump_forward(tokens, forced, vocab, encode)
    guide.apply_jump(plan)
    tokens = list(plan.token_ids)
    bob = encode("Bob")
    guide.advance_many(bob)
    tokens += bob
    guide.advance(encode('"')[0])
    tokens += encode('"')
    forced = guide.jump_forward()
    assert forced == ', "age": '
    plan = cfsm.plan_jump_forward(tokens, forced, vocab, encode)
    guide.apply_jump(plan)
    tokens = tokens[: len(tokens) - plan.num_rollback] + list(plan.token_ids)
    text = '{"name": "Bob", "age": '
    assert vocab.decode(tokens) == text.encode()
    assert tokens == encode(text)  # the canonical tokenization, as if generated in one go


def test_logits_processor_follows_rows_and_restarts_on_a_new_generate() -> None:
    import torch

    from cfsm.testing import char_vocab

    vocab = char_vocab("ab")  # a=0 b=1 EOS=2
    processor = LogitsProcessor(cfsm.compile_regex("ab|ba", vocab))
    prompt = torch.tensor([[7, 7], [7, 7]])
    scores = processor(prompt, torch.zeros(2, 3))
    assert torch.isfinite(scores).tolist() == [[True, True, False], [True, True, False]]
    step = torch.cat([prompt, torch.tensor([[0], [1]])], dim=1)  # row 0 wrote "a", row 1 "b"
    scores = processor(step, torch.zeros(2, 3))
    assert torch.isfinite(scores).tolist() == [[False, True, False], [True, False, False]]
    again = processor(prompt[:1], torch.zeros(1, 3))  # a new generate() with one row
    assert torch.isfinite(again).tolist() == [[True, True, False]]
