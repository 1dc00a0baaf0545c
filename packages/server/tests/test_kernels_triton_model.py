"""A tiny random Llama through the real model runner with the `triton` attention backend:
logits vs Hugging Face transformers (full prefill, chunked prefill over a cached prefix, decode
steps, a batched decode of different lengths) and greedy tokens identical to `torch_native`.

Runs on CUDA (`gpu`) and on the CPU in the TRITON_INTERPRET=1 child (test_kernels_interpret.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from lmserver.forward.kv_pool import KVPool, make_req_to_token
from lmserver.kernels.testing import kernel_devices
from lmserver.models.loader import load_model, read_model_config
from lmserver.runner.attention.torch_native import TorchNativeBackend
from lmserver.runner.model_runner import ModelRunner
from lmserver.scheduler import ForwardItem, ScheduleDecision

transformers = pytest.importorskip("transformers")

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = kernel_devices()

# head_dim 16 (the smallest tl.dot size on a GPU), GQA group 3 like SmolLM2.
CONFIG = dict(
    vocab_size=128, hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=6,
    num_key_value_heads=2, max_position_embeddings=128,
)


def _folder(tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval()
    with torch.no_grad():  # non-trivial norms so every weight matters
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.5)
    hf.save_pretrained(tmp_path / "tiny-llama")
    return tmp_path / "tiny-llama", hf


def _runner(folder: Path, backend: str, device: str) -> ModelRunner:
    from lmserver.runner.attention.triton_backend import TritonBackend

    config = read_model_config(folder)
    model = load_model(config, folder, dtype=torch.float32, device=device, max_positions=128)
    pool = KVPool(256, config.num_hidden_layers, config.num_key_value_heads, config.head_dim, torch.float32, device)
    table = make_req_to_token(4, 128, device)
    cls = TritonBackend if backend == "triton" else TorchNativeBackend
    return ModelRunner(model, pool, table, cls(pool, table), torch.device(device))


def _item(row: int, prefix: int, ids: list[int], slots: list[int], all_logits: bool) -> ForwardItem:
    n = len(ids)
    return ForwardItem(
        rid=f"r{row}", req_pool_idx=row, prefix_len=prefix, token_ids=ids, out_slots=slots[prefix : prefix + n],
        table_start=prefix, table_slots=slots[prefix : prefix + n],
        logit_offsets=list(range(n)) if all_logits else [n - 1], completes_prefill=True,
    )


@pytest.mark.parametrize("device", DEVICES)
def test_triton_backend_logits_match_hugging_face(tmp_path: Path, device: str) -> None:
    folder, hf = _folder(tmp_path)
    runner = _runner(folder, "triton", device)
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()  # (40, vocab)
    full = runner.forward(ScheduleDecision("extend", [_item(0, 0, ids, list(range(1, 41)), True)]))
    torch.testing.assert_close(full.cpu(), ref, atol=1e-4, rtol=0)
    # chunked prefill (17 + 13 tokens, the second over a cached prefix) then decode steps
    slots = list(range(60, 100))
    got = [runner.forward(ScheduleDecision("extend", [_item(1, 0, ids[:17], slots, True)]))]
    got.append(runner.forward(ScheduleDecision("extend", [_item(1, 17, ids[17:30], slots, True)])))
    for pos in range(30, 40):
        got.append(runner.forward(ScheduleDecision("decode", [_item(1, pos, [ids[pos]], slots, False)])))
    torch.testing.assert_close(torch.cat(got).cpu(), ref, atol=1e-4, rtol=0)
    # a batched decode of different lengths
    seqs = [ids[:5], ids[:12], ids[3:12]]
    sets = [list(range(110 + 20 * i, 110 + 20 * i + len(s))) for i, s in enumerate(seqs)]
    runner.forward(ScheduleDecision("extend", [_item(i, 0, s[:-1], sets[i], False) for i, s in enumerate(seqs)]))
    got_b = runner.forward(ScheduleDecision("decode", [_item(i, len(s) - 1, [s[-1]], sets[i], False)
                                                        for i, s in enumerate(seqs)]))
    with torch.no_grad():
        ref_b = torch.stack([hf(torch.tensor([s])).logits[0, -1] for s in seqs])
    torch.testing.assert_close(got_b.cpu(), ref_b, atol=1e-4, rtol=0)


@pytest.mark.parametrize("device", kernel_devices(slow_on_cpu=True))  # the HF logits case stays in the default tier
def test_greedy_tokens_identical_to_torch_native(tmp_path: Path, device: str) -> None:
    folder, _ = _folder(tmp_path)
    prompts = [[5, 17, 99, 3, 42, 8, 61], [7, 7, 120, 1], [33] * 20]
    steps = 8 if device == "cpu" else 32
    tokens: dict[str, list[list[int]]] = {}
    for backend in ("torch_native", "triton"):
        runner = _runner(folder, backend, device)
        seqs = [list(p) for p in prompts]
        sets = [list(range(1 + 60 * i, 1 + 60 * i + len(p) + steps)) for i, p in enumerate(prompts)]
        logits = runner.forward(ScheduleDecision("extend", [_item(i, 0, s, sets[i], False) for i, s in enumerate(seqs)]))
        for _ in range(steps):
            for s, nxt in zip(seqs, logits.argmax(-1).tolist(), strict=True):
                s.append(nxt)
            logits = runner.forward(ScheduleDecision("decode", [_item(i, len(s) - 1, [s[-1]], sets[i], False)
                                                                 for i, s in enumerate(seqs)]))
        tokens[backend] = seqs
    assert tokens["triton"] == tokens["torch_native"]
