"""The batch mask of lmserver.engine.constrained through both paths: torch ops (CPU logits) and the
Triton kernel of lmserver.kernels.bitmask (CUDA logits), here under Triton's interpreter.

Oracle: the torch path (itself checked against `Guide.advance` in test_constrained_unit.py);
the kernel path must give bit-identical masked logits, unconstrained rows untouched, in one
phase and in two (`prepare`, then `apply`; a grammar that moved in between is refilled). The
interpreter needs TRITON_INTERPRET=1 before triton is imported, so the cases run in a child.
"""

from __future__ import annotations

import os

import pytest
import torch

from lmserver.kernels.testing import pytest_under_interpreter

pytest.importorskip("triton")

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _cases() -> list[tuple[list[int | None], torch.dtype]]:
    # rows: index of a grammar, or None for an unconstrained request
    return [([0, None, 1, None, 0], torch.float32), ([1], torch.float32), ([None, 2, 2], torch.float16),
            ([0, 1, 2, 0, 1, 2, None], torch.float32)]


@pytest.mark.skipif(not INTERPRET, reason="runs in the TRITON_INTERPRET=1 child")
def test_interpret_kernel_path_equals_torch_path() -> None:
    import cfsm
    from cfsm.testing import tiny_vocab
    from lmserver.engine.constrained import BatchMasker, ReqGrammar

    vocab = tiny_vocab()  # 140 tokens: the last mask word is partial
    byte_token = {t: i for i, t in enumerate(vocab.tokens) if len(t) == 1 and i not in vocab.special_token_ids}

    def encode(text: str) -> list[int]:
        return [byte_token[bytes([b])] for b in text.encode()]

    grammars = [ReqGrammar(cfsm.compile_regex(p, vocab), encode)
                for p in (r'\{"name":"[a-c]+"\}', "(true|false|12)", r"[0-9]{2,4}")]
    grammars[1].accept(encode("1")[0])  # a state with one allowed token
    gen = torch.Generator().manual_seed(0)
    for rows, dtype in _cases():
        batch = [None if r is None else grammars[r] for r in rows]
        logits = torch.randn(len(rows), vocab.size, generator=gen).to(dtype)
        ref = BatchMasker(vocab.size).apply(logits.clone(), batch)
        got = BatchMasker(vocab.size, kernel_on_cpu=True).apply(logits.clone(), batch)
        assert torch.equal(got, ref), (rows, dtype)
        # two phases: prepared while the forward would run, then applied
        masker = BatchMasker(vocab.size, kernel_on_cpu=True)
        masker.prepare(batch, "cpu")
        assert torch.equal(masker.apply(logits.clone(), batch), ref), (rows, dtype)
        assert (masker.num_prepared_used, masker.num_stale_rows) == (1, 0)
        for i, r in enumerate(rows):
            if r is None:
                assert torch.equal(got[i], logits[i])
            else:
                assert torch.isinf(got[i]).any() and torch.isfinite(got[i]).any()
    # a grammar that moves between prepare and apply (a sampled token): its row is refilled
    g = ReqGrammar(cfsm.compile_regex(r"[0-9]{2,4}", vocab), encode)
    batch = [None, g, grammars[0]]
    logits = torch.randn(3, vocab.size, generator=gen)
    masker = BatchMasker(vocab.size, kernel_on_cpu=True)
    masker.prepare(batch, "cpu")
    assert g.accept(encode("7")[0])
    got = masker.apply(logits.clone(), batch)
    assert torch.equal(got, BatchMasker(vocab.size).apply(logits.clone(), batch))
    assert (masker.num_prepared_used, masker.num_stale_rows) == (0, 1)


@pytest.mark.skipif(INTERPRET, reason="the parent of the interpreter child")
def test_mask_paths_under_interpreter() -> None:
    proc = pytest_under_interpreter(__file__, select="interpret_kernel_path", timeout_s=300)
    summary = proc.stdout[-3000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, summary
    assert "1 passed" in proc.stdout, summary
