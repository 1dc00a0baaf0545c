"""Image prompts with tensor parallelism (gloo on CPU): rank 0 encodes each image and sends its rows with the decision;
with tp_size 2 a tiny random LLaVA (and LLaVA-NeXT) gives HF transformers' greedy tokens on the same folder, and tp_size
1's log-probabilities, for prompts of no image, one image and one image twice."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from packages.server.tests.test_mm_engine import MAX_NEW, _hf_greedy, _logprobs, _png, _prompt
from packages.server.tests.test_tensor_parallel import in_child

IMAGES = [(0, (40, 56)), (2, (90, 30))]


def _run_here(folder: str, paths: list[str], config: dict[str, Any]) -> list[dict[str, Any]]:
    from lmserver import Engine

    engine = Engine(folder, dtype="float32", device="cpu", max_total_tokens=8192, max_running_requests=8, **config)
    try:
        params = {"max_new_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True}
        outs = [engine.generate(_prompt(len(images)), params, image_data=images or None, return_logprob=True)
                for images in ([], paths[:1], [paths[1], paths[1]])]
        engine.core.check_memory_invariant()
        return outs  # type: ignore[return-value]
    finally:
        if engine.core.tp is not None:
            engine.core.tp.shutdown()
        engine.shutdown()


@pytest.mark.slow  # 27 s on 2 cores (three engines): in the slow tier, as integration_tests/test_tp_multimodal_server.py
@pytest.mark.parametrize("kind", ["llava", "llava_next"])
def test_image_prompts_with_tp2(tmp_path: Path, kind: str) -> None:
    import torch
    from transformers import (
        AutoConfig,
        AutoTokenizer,
        LlavaForConditionalGeneration,
        LlavaNextForConditionalGeneration,
    )

    from lmserver.testing.multimodal import make_tiny_llava_folder

    folder = make_tiny_llava_folder(tmp_path / kind, kind, seed=3)
    paths = []
    for seed, size in IMAGES:
        path = tmp_path / f"img{seed}.png"
        path.write_bytes(_png(seed, size))
        paths.append(str(path))
    tp2 = in_child(_run_here, str(folder), paths, {"tp_size": 2})
    tp1 = in_child(_run_here, str(folder), paths, {})
    arch = AutoConfig.from_pretrained(folder).architectures[0]
    cls = LlavaNextForConditionalGeneration if arch.startswith("LlavaNext") else LlavaForConditionalGeneration
    hf = cls.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer_only = SimpleNamespace(tokenizer=AutoTokenizer.from_pretrained(folder))  # all `_hf_greedy` reads
    for out2, out1, images in zip(tp2, tp1, ([], paths[:1], [paths[1], paths[1]]), strict=True):
        assert out2["output_ids"] == _hf_greedy(hf, folder, tokenizer_only, _prompt(len(images)), images)
        assert max(abs(a - b) for a, b in zip(_logprobs(out2), _logprobs(out1), strict=True)) < 1e-4
