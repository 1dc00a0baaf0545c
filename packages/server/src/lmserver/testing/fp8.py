"""FP8 checkpoints for tests, written from a float checkpoint folder (no download).

`write_fp8_layout_checkpoint(src, dst, layout)` writes `src`'s Llama decoder projections (and, on request, its
`lm_head`) as an FP8 checkpoint in one of the published layouts (`LAYOUTS`), and replaces those weights in `src`
by their dequantized values: both folders then hold the same model, so a test's oracle is `dst` loading as its
dequantized twin `src`. `compressed_tensors_config` is the `quantization_config` of the compressed-tensors ones.
`dequantized_twin` loads an FP8 folder with every FP8 linear layer dense in float32, and `greedy_by_full_prefills`
decodes a model greedily by one full prefill per token: the oracle of an FP8 engine's greedy tokens.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from lmserver.kernels.fp8_ref import FP8_DTYPE, dequantize_fp8, expand_block_scale, quantize_fp8
from lmserver.layers.fp8_linear import Fp8Linear, linear_to_dense
from lmserver.models.loader import load_model, read_model_config
from lmserver.runner.accuracy import window_logits, window_runner

# fp8-*: quant_method "fp8" (block: 2D block scales as `weight_scale_inv`, dynamic activations; tensor: one scale
# per tensor, static activation scales); ct-*: compressed-tensors float-quantized, per tensor, per output channel
# or per 2D block (`weight_scale`)
LAYOUTS = ("fp8-block", "fp8-tensor", "ct-tensor", "ct-channel", "ct-block")
LLAMA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BLOCK = 32  # the block layouts' block: small, so that tiny layers hold several (the published size is 128)


def compressed_tensors_config(strategy: str, ignore: tuple[str, ...] = ("lm_head",), **weights: Any,
                              ) -> dict[str, Any]:
    """`{"quantization_config": ...}` of a compressed-tensors FP8 checkpoint: one group of 8-bit float symmetric
    static weights with `strategy` over every Linear, except the modules in `ignore`; `weights` overrides or adds
    fields of the weights' scheme (e.g. `block_structure=[128, 128]`, or `num_bits=4` for a refusal)."""
    w = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False, **weights}
    return {"quantization_config": {"quant_method": "compressed-tensors", "format": "float-quantized",
                                    "config_groups": {"group_0": {"weights": w, "targets": ["Linear"]}},
                                    "ignore": list(ignore)}}


def _quantize(t: torch.Tensor, layout: str) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """(FP8 codes, the scale tensors by name suffix, the dequantized weight in `t`'s dtype) of weight `t`."""
    if layout in ("fp8-block", "ct-block"):
        _, s = quantize_fp8(t, BLOCK)  # (N, K/BLOCK) row scales: make them per BLOCK-row block
        s = s.view(-1, BLOCK, s.shape[1]).amax(dim=1)  # (N/BLOCK, K/BLOCK)
        full = expand_block_scale(s, t.shape[0], BLOCK).repeat_interleave(BLOCK, dim=1)  # (N, K)
        q = (t.float() / full).clamp(-448, 448).to(FP8_DTYPE)
        suffix = ".weight_scale_inv" if layout == "fp8-block" else ".weight_scale"
        return q, {suffix: s}, (q.float() * full).to(t.dtype)
    if layout in ("fp8-tensor", "ct-tensor"):
        s = t.float().abs().max() / 448
        q = (t.float() / s).to(FP8_DTYPE)
        scales = {".weight_scale": s.reshape(()) if layout == "fp8-tensor" else s.reshape(1),
                  ".input_scale": torch.ones(1)}  # static activation scales: read and ignored by the loader
        return q, scales, (q.float() * s).to(t.dtype)
    q, s = quantize_fp8(t)  # ct-channel: (N, 1)
    return q, {".weight_scale": s}, dequantize_fp8(q, s, t.shape[1]).to(t.dtype)


def write_fp8_layout_checkpoint(src: Path, dst: Path, layout: str, *, lm_head: bool = False,
                                tie_word_embeddings: bool | None = None,
                                kv_scales: tuple[float, float] | None = None, drop: str | None = None) -> None:
    """Writes folder `dst` (created; it must not exist): `src`'s `model.safetensors` with every decoder projection
    (`LLAMA_LINEARS`) as FP8 in `layout` (one of `LAYOUTS`) and `config.json` with its `quantization_config`.

    Mutates `src`: its `model.safetensors` gets the dequantized values of the weights quantized (so `src` is `dst`'s
    dequantized twin). `lm_head`: `lm_head.weight` in FP8 too (compressed-tensors: `ignore` empty; a tied `src` has
    no such tensor, so nothing changes). `tie_word_embeddings`: the value `dst`'s config.json says (None: `src`'s).
    `kv_scales`: layer 0's `self_attn.k_scale` and `v_scale` tensors written (as compressed-tensors does).
    `drop`: a tensor name left out of `dst` (a broken checkpoint)."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown FP8 layout {layout!r}; one of {', '.join(LAYOUTS)}")
    state = load_file(str(src / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        projection = name.endswith(".weight") and name.split(".")[-2] in LLAMA_LINEARS
        if not (projection or (lm_head and name == "lm_head.weight")):
            out[name] = t
            continue
        q, scales, dequantized = _quantize(t, layout)
        base = name.removesuffix(".weight")
        out.update({base + suffix: s for suffix, s in scales.items()})
        out[name], state[name] = q, dequantized
    if kv_scales is not None:
        out["model.layers.0.self_attn.k_scale"] = torch.tensor(kv_scales[0])
        out["model.layers.0.self_attn.v_scale"] = torch.tensor(kv_scales[1])
    if drop is not None:
        del out[drop]
    dst.mkdir()
    save_file(out, str(dst / "model.safetensors"))
    save_file(state, str(src / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    ignore = () if lm_head else ("lm_head",)
    config["quantization_config"] = {
        "fp8-block": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                      "weight_block_size": [BLOCK, BLOCK]},
        "fp8-tensor": {"quant_method": "fp8", "activation_scheme": "static"},
        "ct-tensor": compressed_tensors_config("tensor", ignore)["quantization_config"],
        "ct-channel": compressed_tensors_config("channel", ignore)["quantization_config"],
        "ct-block": compressed_tensors_config("block", ignore, block_structure=[BLOCK, BLOCK])["quantization_config"],
    }[layout]
    if tie_word_embeddings is not None:
        config["tie_word_embeddings"] = tie_word_embeddings
    (dst / "config.json").write_text(json.dumps(config))


def dequantized_twin(folder: str | Path, max_positions: int, **load_kwargs: Any) -> tuple[nn.Module, list[str]]:
    """`folder`'s model loaded in float32 (`load_model` with `load_kwargs`, e.g. `quantization="fp8"`), then every
    `Fp8Linear` (an FP8 LM head included) replaced by a plain float32 linear holding its dequantized values; with
    the names of the modules it replaced (those the load made FP8)."""
    twin = load_model(read_model_config(folder), folder, dtype=torch.float32, max_positions=max_positions,
                      **load_kwargs)
    names = [n for n, m in twin.named_modules() if isinstance(m, Fp8Linear)]
    for name in names:
        parent, _, attr = name.rpartition(".")
        owner: Any = twin.get_submodule(parent) if parent else twin
        setattr(owner, attr, linear_to_dense(getattr(owner, attr), torch.float32))
    return twin, names


def greedy_by_full_prefills(model: nn.Module, prompts: Sequence[Sequence[int]], new: int) -> list[list[int]]:
    """The `new` greedy tokens after each prompt, each one the argmax of a full prefill of the sequence so far (no
    decode step, no paging, no CUDA graph): the reference an engine's greedy decoding is held to."""
    runner = window_runner(model, max(map(len, prompts)) + new)  # each prefill rewrites its slots from position 0
    outs: list[list[int]] = []
    for ids in prompts:
        seq = list(ids)
        for _ in range(new):
            seq.append(int(window_logits(runner, seq)[-1].argmax()))
        outs.append(seq[len(ids):])
    return outs
