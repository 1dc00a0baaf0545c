"""Sampler and detokenizer units against naive references (no model)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmserver.engine.detokenizer import IncrementalDetokenizer, OutputText
from lmserver.io_struct import SamplingParams
from lmserver.runner.sampler import (
    SamplingInfo,
    _argmax_chunks,
    apply_penalties,
    changes_logits,
    chunked_argmax,
    greedy_argmax,
    sample,
    takes_argmax,
)


def _info(seed: int = 0, prompt: list[int] | None = None, out: list[int] | None = None, stop: list[int] | None = None,
          **params: object) -> SamplingInfo:
    return SamplingInfo(SamplingParams(**params), torch.Generator().manual_seed(seed), prompt or [], out or [], stop or [])  # type: ignore[arg-type]


def _reference_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """Naive: softmax(logits / T), keep top-k, then the smallest top-p set, then min-p; renormalize."""
    p = np.exp((logits - logits.max()) / temperature)
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.zeros_like(p, dtype=bool)
    total = 0.0
    for rank, tok in enumerate(order):
        if top_k > 0 and rank >= top_k:
            break
        if rank > 0 and total >= top_p:
            break
        if rank > 0 and p[tok] < min_p * p[order[0]]:
            break
        keep[tok] = True
        total += p[tok]
    q = np.where(keep, p, 0.0)
    return q / q.sum()


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p"),
    [(1.0, -1, 1.0, 0.0), (0.7, 3, 1.0, 0.0), (1.3, -1, 0.6, 0.0), (1.0, -1, 1.0, 0.2), (0.9, 4, 0.8, 0.05)],
)
def test_sampling_distribution_matches_reference(temperature: float, top_k: int, top_p: float, min_p: float) -> None:
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    n = 4000
    infos = [_info(seed=i, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p) for i in range(n)]
    tokens = sample(logits.repeat(n, 1), infos)
    freq = np.bincount(tokens, minlength=len(logits)) / n
    ref = _reference_probs(logits.numpy().astype(np.float64), temperature, top_k, top_p, min_p)
    assert set(np.nonzero(freq)[0]) <= set(np.nonzero(ref)[0]), "sampled a filtered-out token"
    assert np.abs(freq - ref).max() < 0.03


def test_greedy_and_seeded_rows_are_batch_invariant() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 100, generator=g)
    infos = [_info(seed=7, temperature=0.0)] + [_info(seed=s, temperature=1.0) for s in range(4)]
    batch = sample(logits, infos)
    assert batch[0] == int(logits[0].argmax())
    for i in range(1, 5):
        alone = sample(logits[i : i + 1], [_info(seed=i - 1, temperature=1.0)])
        assert alone[0] == batch[i]


def _naive_penalties(row: list[float], info: SamplingInfo) -> list[float]:
    """Oracle: one Python loop over the vocabulary per step, in the documented order (bias,
    repetition over prompt + output, frequency and presence over the output, the min-new-tokens
    stop mask, the grammar mask)."""
    p = info.params
    out = list(row)
    for tok in range(len(out)):
        out[tok] += (p.logit_bias or {}).get(tok, 0.0)
        if tok in info.prompt_ids or tok in info.output_ids:
            out[tok] = out[tok] / p.repetition_penalty if out[tok] > 0 else out[tok] * p.repetition_penalty
        count = sum(1 for t in info.output_ids if t == tok)
        out[tok] -= p.frequency_penalty * count + (p.presence_penalty if count else 0.0)
        if len(info.output_ids) < p.min_new_tokens and tok in info.stop_ids:
            out[tok] = float("-inf")
        if info.allowed_mask is not None and not bool(info.allowed_mask[tok]):
            out[tok] = float("-inf")
    return out


def test_penalties_match_naive_loops() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 30, generator=g)
    mask = torch.rand(30, generator=g) < 0.6
    infos = [
        _info(prompt=[1, 2, 3], out=[3, 4, 4, 5, 4], repetition_penalty=1.3, frequency_penalty=0.5,
              presence_penalty=0.25, logit_bias={7: 5.0, 8: -1.0, 3: 0.5}),
        _info(temperature=0.7),  # nothing applies: the row passes through
        _info(prompt=[9, 9], out=[10], stop=[11, 12], min_new_tokens=3, repetition_penalty=0.8, frequency_penalty=-0.3),
        _info(out=[6, 6, 7], stop=[6], min_new_tokens=4, presence_penalty=1.5),
    ]
    infos[3].allowed_mask = mask
    before = logits.clone()
    got = apply_penalties(logits, infos)
    assert torch.equal(logits, before), "the input must not be mutated"
    for i, info in enumerate(infos):
        ref = torch.tensor(_naive_penalties(logits[i].tolist(), info))
        torch.testing.assert_close(got[i], ref, msg=f"row {i}")
    assert torch.isinf(got[2, 11]) and torch.isinf(got[3, 6]) and torch.isinf(got[3][~mask]).all()
    assert apply_penalties(logits, [infos[1]] * 4) is logits  # no row changes: no copy


@settings(max_examples=60, deadline=None)
@given(temperature=st.sampled_from([0.0, 0.7]), bias=st.booleans(), penalty=st.sampled_from(["", "rep", "freq", "pres"]),
       min_new=st.integers(0, 3), outputs=st.integers(0, 3), stop=st.booleans(), mask=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_takes_argmax_exactly_when_the_row_is_its_raw_argmax(temperature: float, bias: bool, penalty: str, min_new: int,
                                                             outputs: int, stop: bool, mask: bool, seed: int) -> None:
    """`changes_logits` is True exactly when `apply_penalties` changes the row, and a row that
    `takes_argmax` samples the argmax of its raw logits (what the decode graphs compute)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, 20, generator=g)
    params: dict[str, object] = {"temperature": temperature, "min_new_tokens": min_new}
    if bias:
        params["logit_bias"] = {3: 4.0}
    params.update({"rep": {"repetition_penalty": 1.3}, "freq": {"frequency_penalty": 0.5},
                   "pres": {"presence_penalty": 0.5}, "": {}}[penalty])
    info = _info(seed, prompt=[1, 2], out=[2] * outputs, stop=[5] if stop else None, **params)
    if mask:
        info.allowed_mask = torch.rand(20, generator=g) < 0.5
        info.allowed_mask[0] = True
    processed = apply_penalties(logits, [info])
    assert changes_logits(info) == (processed is not logits)
    if takes_argmax(info):
        assert sample(processed, [info]) == [int(logits.argmax())]
    else:
        assert changes_logits(info) or temperature > 0


def test_min_new_tokens_masks_stop_ids_until_reached() -> None:
    logits = torch.tensor([[0.0, 10.0, 1.0]])
    masked = apply_penalties(logits, [_info(out=[2], stop=[1], min_new_tokens=2)])
    assert masked[0, 1] == float("-inf")
    free = apply_penalties(logits, [_info(out=[2, 2], stop=[1], min_new_tokens=2)])
    assert free[0, 1] == 10.0


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    from lmserver.models.default_model import default_model_path

    return AutoTokenizer.from_pretrained(str(default_model_path()))


@pytest.mark.parametrize(
    "text",
    ["Hello, world! 你好，世界。 Ünïcödé ✓ 🙂🚀 done", "  leading spaces\n\ttabs and\r\nnewlines 😀😀 é", "日本語のテキスト🎌"],
)
def test_incremental_detokenization_is_exact(tokenizer, text: str) -> None:  # type: ignore[no-untyped-def]
    prompt = tokenizer("Say:")["input_ids"]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, prompt)
    pieces = [detok.add(t) for t in ids]
    pieces.append(detok.flush())
    assert all("\ufffd" not in p for p in pieces), "replacement character mid-stream"
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert sum(1 for p in pieces if p) < len(ids), "multi-byte characters were held back at least once"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(st.integers(0, 49151) | st.sampled_from([0, 1, 2, 3]), max_size=24),
       prompt=st.lists(st.integers(0, 49151), min_size=1, max_size=8), skip=st.booleans())
def test_backend_decode_path_equals_transformers_decode(tokenizer, ids: list[int], prompt: list[int], skip: bool) -> None:  # type: ignore[no-untyped-def]
    """The detokenizer's direct `tokenizers` path (SmolLM2's fast tokenizer takes it) emits exactly the stream
    of the `tokenizer.decode` path, special tokens (ids 0-3) and broken UTF-8 byte tokens included."""
    from lmserver.engine.detokenizer import backend_decoder

    assert backend_decoder(tokenizer) is not None
    fast = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
    slow = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
    slow._backend = None  # the transformers path
    assert [fast.add(t) for t in ids] + [fast.flush()] == [slow.add(t) for t in ids] + [slow.flush()]
    assert backend_decoder(tokenizer).decode(ids, skip_special_tokens=skip) == tokenizer.decode(
        ids, skip_special_tokens=skip)


def test_backend_decode_path_only_for_plain_fast_tokenizers(tokenizer) -> None:  # type: ignore[no-untyped-def]
    from lmserver.engine.detokenizer import backend_decoder

    class PostProcessing(type(tokenizer)):  # type: ignore[misc]
        def _decode(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            return super()._decode(*args, **kwargs).upper()

    class Plain:
        def decode(self, ids: list[int], **kwargs: object) -> str:
            return "x" * len(ids)

    odd = copy.copy(tokenizer)
    odd.__class__ = PostProcessing
    assert backend_decoder(odd) is None
    assert backend_decoder(Plain()) is None
    spaced = copy.copy(tokenizer)
    spaced.clean_up_tokenization_spaces = True
    assert backend_decoder(spaced) is None


def test_stop_string_hold_back_and_trim() -> None:
    out = OutputText(stop=["STOP"], stop_regex=[])
    sent = []
    for piece in ["Hello S", "TO", "P and more"]:
        matched = out.append(piece)
        sent.append(out.take(final=matched is not None))
        if matched:
            break
    assert matched == "STOP"
    assert sent == ["Hello ", "", ""]
    assert out.text == "Hello "
    keep = OutputText(stop=["STOP"], stop_regex=[], no_stop_trim=True)
    keep.append("xxSTOPyy")
    assert keep.text == "xxSTOP"
    rx = OutputText(stop=[], stop_regex=[r"\d{3}"])
    assert rx.append("abc 12") is None
    assert rx.append("3 tail") == r"\d{3}"
    assert rx.take(final=True) == "abc "


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4), st.sampled_from([(12, 3), (64, 8), (96, 4), (60, 5), (7, 1)]), st.integers(0, 2**31 - 1),
       st.sampled_from(["float32", "bfloat16"]), st.integers(1, 4))
def test_chunked_argmax_matches_argmax_with_ties(rows: int, shape: tuple[int, int], seed: int, dtype: str,
                                                 levels: int) -> None:
    """Oracle: torch.argmax, ties to the first index. Few distinct values (levels) make ties common; -inf
    rows (a grammar mask) included."""
    vocab, chunks = shape
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, levels, (rows, vocab), generator=g).to(getattr(torch, dtype))
    logits[0, torch.rand(vocab, generator=g) < 0.5] = float("-inf")
    assert torch.equal(chunked_argmax(logits, chunks), logits.argmax(dim=-1))


def test_greedy_argmax_chunks_split_real_vocabularies() -> None:
    """The chunk count's documented rule, checked by search rather than restated: the largest divisor of the
    vocabulary up to 1024 that leaves chunks of at least 64 entries, or 1 when none is above 8."""
    for vocab in (128256, 49152, 65521, 32000, 151936, 64 * 9, 100):
        chunks = _argmax_chunks(vocab)
        fits = [c for c in range(9, 1025) if vocab % c == 0 and vocab // c >= 64]
        assert chunks == (max(fits) if fits else 1), vocab
    assert _argmax_chunks(65521) == 1  # a prime vocabulary: one plain argmax
    logits = torch.randn(3, 49152)
    assert torch.equal(greedy_argmax(logits), logits.argmax(dim=-1))  # the CPU path
    assert torch.equal(chunked_argmax(logits, _argmax_chunks(49152)), logits.argmax(dim=-1))
