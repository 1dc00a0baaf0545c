"""cfsm.torch: the vectorized bitmask kernel against its reference, and the plain callable."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import cfsm  # noqa: E402
from cfsm.testing import char_vocab  # noqa: E402
from cfsm.torch import (  # noqa: E402
    TokenIdsLogitsProcessor,
    apply_token_bitmask_,
    apply_token_bitmask_reference_,
)


def _devices() -> list[str]:
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize(("batch", "vocab", "words"), [(1, 5, 1), (3, 100, 4), (2, 70, 2), (4, 64, 2)])
def test_vectorized_equals_reference(device: str, batch: int, vocab: int, words: int) -> None:
    gen = torch.Generator().manual_seed(batch * 1000 + vocab)
    logits = torch.randn(batch, vocab, generator=gen)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (batch, words), generator=gen, dtype=torch.int64).to(torch.int32)
    ref = logits.clone()
    apply_token_bitmask_reference_(ref, bitmask)
    out = logits.clone().to(device)
    apply_token_bitmask_(out, bitmask.to(device))
    assert torch.equal(out.cpu(), ref)
    # indices: only the listed rows change
    ref2 = logits.clone()
    apply_token_bitmask_reference_(ref2, bitmask, indices=[batch - 1])
    out2 = logits.clone().to(device)
    apply_token_bitmask_(out2, bitmask.to(device), indices=[batch - 1])
    assert torch.equal(out2.cpu(), ref2)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_cpu_fast_path_dtypes_views_and_inference_mode(dtype: str) -> None:
    # the CPU path fills through numpy where it can (float32/16/64) and falls back for bfloat16
    gen = torch.Generator().manual_seed(7)
    big = torch.randn(3, 99, generator=gen).to(getattr(torch, dtype))
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 3), generator=gen, dtype=torch.int64).to(torch.int32)
    ref = big[:, :90].clone()
    apply_token_bitmask_reference_(ref, bitmask)
    view = big[:, :90]  # a strided view: writes must land in `big`
    with torch.inference_mode():
        apply_token_bitmask_(view, bitmask)
    assert torch.equal(big[:, :90], ref)
    assert torch.isfinite(big[:, 90:]).all()  # columns outside the view untouched


def test_one_dimensional_and_bit_layout() -> None:
    logits = torch.zeros(40)
    bitmask = torch.tensor([1 << 3, 1 << 1], dtype=torch.int32)  # tokens 3 and 33
    apply_token_bitmask_(logits, bitmask)
    assert torch.isfinite(logits).nonzero().flatten().tolist() == [3, 33]


@pytest.mark.gpu
def test_cuda_in_place() -> None:
    logits = torch.zeros(2, 64, device="cuda")
    bitmask = torch.tensor([[1, 0], [0, 1]], dtype=torch.int32, device="cuda")
    apply_token_bitmask_(logits, bitmask)
    assert torch.isfinite(logits).nonzero().tolist() == [[0, 0], [1, 32]]


def test_input_validation_messages() -> None:
    with pytest.raises(TypeError, match="Invalid bitmask dtype: expected torch.int32, got torch.int64"):
        apply_token_bitmask_(torch.zeros(2, 8), torch.zeros(2, 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="batch mismatch"):
        apply_token_bitmask_(torch.zeros(2, 8), torch.zeros(3, 1, dtype=torch.int32))


def test_token_ids_logits_processor_follows_the_grammar() -> None:
    vocab = char_vocab("abc")  # a=0 b=1 c=2 EOS=3
    index = cfsm.compile_regex("ab+c", vocab)
    proc = TokenIdsLogitsProcessor(index)
    generated: list[int] = []
    for _ in range(6):
        logits = torch.zeros(vocab.size)
        logits[1] = 5.0  # the model loves "b"
        logits[2] = 1.0
        out = proc(generated, logits)
        nxt = int(torch.argmax(out))
        generated.append(nxt)
        if nxt == 3:
            break
    assert generated == [0, 1, 1, 1, 1, 1]  # "a" forced first, then greedy keeps choosing "b"
    proc2 = TokenIdsLogitsProcessor(index)
    out = proc2([0, 1, 2], torch.zeros(vocab.size))
    assert torch.isfinite(out).nonzero().flatten().tolist() == [3]  # complete: EOS only
    out = proc2([0, 1], torch.zeros(vocab.size))  # shorter history: rolls back
    assert torch.isfinite(out).nonzero().flatten().tolist() == [1, 2]
