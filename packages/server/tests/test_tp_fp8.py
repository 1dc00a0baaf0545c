"""FP8 with tensor parallelism (gloo on CPU): FP8 checkpoints in the published layouts, online `--quantization fp8`
of dense and MoE models, and an FP8 KV cache give with tp_size 2 the greedy tokens and log-probabilities of tp_size 1
(a shard's FP8 weights and scales are exact slices of the whole layer's); a block-scaled layer whose blocks do not
fall on the shards' boundaries, an FP8 LM head and explicit lowlat plugins are refused before anything loads (or,
for the blocks, before any rank shards). Each run in a fresh spawned process (test_tensor_parallel.in_child)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from packages.server.tests.test_tensor_parallel import (
    FAMILIES,
    TOKENIZER_FILES,
    _assert_same,
    _generate,
    _model_folder,
    _tiny_config,
)


def _float_folder(root: Path, **overrides: Any) -> Path:
    """A tiny random Llama checkpoint (safetensors, float32) with the embedded model's tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from lmserver.models.default_model import default_model_path

    cfg = _tiny_config(**overrides)
    torch.manual_seed(0)
    hf = LlamaConfig(**{k: v for k, v in cfg.items() if k != "architectures"})
    folder = root / "float"
    LlamaForCausalLM(hf).save_pretrained(str(folder), safe_serialization=True)
    for f in TOKENIZER_FILES:
        shutil.copy(default_model_path() / f, folder / f)
    return folder


def _fp8_folder(root: Path, layout: str, **overrides: Any) -> str:
    from lmserver.testing.fp8 import write_fp8_layout_checkpoint

    src = _float_folder(root, **overrides)
    dst = root / layout
    write_fp8_layout_checkpoint(src, dst, layout)
    for f in TOKENIZER_FILES:
        shutil.copy(src / f, dst / f)
    return str(dst)


# intermediate 128: down_proj's shards of 64 columns are whole 32-column scale blocks (testing.fp8.BLOCK)
# one layout in the default tier (block scales: the row-parallel shards take scale groups), the others slow
@pytest.mark.parametrize("layout", ["fp8-block", *(pytest.param(x, marks=pytest.mark.slow)
                                                   for x in ("ct-channel", "ct-tensor", "ct-block"))])
def test_fp8_checkpoint_tp2_equals_tp1(tmp_path: Path, layout: str) -> None:
    path = _fp8_folder(tmp_path, layout, intermediate_size=128)
    fp8 = {"load_format": "auto", "kv_cache_dtype": "fp8_e4m3"}
    _assert_same(_generate(path, **fp8), _generate(path, tp_size=2, **fp8))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama_gqa", "mixtral_moe"])
def test_online_fp8_tp2_equals_tp1(tmp_path: Path, family: str) -> None:
    # dummy weights quantized at load on every rank alike (per channel; experts per row), then sharded
    path = _model_folder(tmp_path, family, FAMILIES[family])
    _assert_same(_generate(path, quantization="fp8"), _generate(path, tp_size=2, quantization="fp8"))


def test_fp8_blocks_that_do_not_split_are_refused_before_sharding(tmp_path: Path) -> None:
    from lmserver.runner.distributed import TensorParallelError

    path = _fp8_folder(tmp_path, "fp8-block")  # intermediate 96: shards of 48 columns, blocks of 32
    with pytest.raises(TensorParallelError, match=r"down_proj: FP8 scales per 32 input columns .* shards of 48"):
        _generate(path, load_format="auto", tp_size=2)


def test_fp8_lm_head_and_explicit_lowlat_with_tp_are_refused(tmp_path: Path) -> None:
    from lmserver.config import ServerConfig
    from lmserver.models.loader import read_model_config
    from lmserver.runner.resolve import ConfigError, resolve_config

    path = _model_folder(tmp_path, "llama", FAMILIES["llama_gqa"])
    mc = read_model_config(path)
    base = ServerConfig(model_path=path, load_format="dummy", device="cpu", dtype="float32", tp_size=2,
                        quantization="fp8", max_total_tokens=1024)
    with pytest.raises(ConfigError, match="FP8 LM head .* tp_size > 1"):
        resolve_config(base.replace(quantize_lm_head=True), mc, path)
    with pytest.raises(ConfigError, match="lowlat plugins with FP8 weights and tp_size > 1"):
        resolve_config(base.replace(lowlat_plugins="auto"), mc, path)
    assert resolve_config(base, mc, path).lowlat_plugins == "off"
    config = json.loads((Path(path) / "config.json").read_text())
    assert "quantization_config" not in config  # online FP8: nothing written to the folder
