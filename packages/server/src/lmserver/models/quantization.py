"""FP8 weights: a checkpoint's `quantization_config` read into an `Fp8Spec`, FP8 checkpoints
loaded into `Fp8Linear` layers (weights and scales), bf16 / fp32 checkpoints quantized online.

Checkpoint layouts read (the scale tensor sits next to its weight, `<layer>.weight`):

- HF `quant_method: "fp8"` (DeepSeek-V3, Qwen3-FP8, AutoFP8): `weight_block_size` [128, 128]
  with `<layer>.weight_scale_inv` (ceil(N / 128), ceil(K / 128)) float32, the multiplier of its
  block despite the name; without a block size, a per-tensor `<layer>.weight_scale`.
- `quant_method: "compressed-tensors"` (llm-compressor) with float 8-bit weights:
  `<layer>.weight_scale` per tensor (one value), per channel (N, 1) or per block
  (`strategy: block`, `block_structure`).

A layer becomes FP8 when its checkpoint weight is float8_e4m3fn (so `ignore` /
`modules_to_not_convert` lists need no parsing); the fused q/k/v and gate/up layers take one
scale per shard. Static activation scales (`input_scale`) are read and ignored: activations are
quantized per token on the fly. KV-cache scales (`self_attn.k_scale` / `v_scale`) are kept on
the model (`FP8_KV_SCALES_ATTR`) for an FP8 KV cache.

MoE experts (`lmserver.layers.moe.MoE`, Mixtral's `block_sparse_moe.experts.E.w1/w2/w3.weight`)
become FP8 when their checkpoint weights are: per-tensor and per-channel scales are expanded to one
per weight row, block scales (`weight_block_size`, `strategy: block`) kept per block (the w1 and w3
blocks of one expert side by side: `intermediate_size` a multiple of the block's rows).

Online quantization (`--quantization fp8` of an unquantized checkpoint) quantizes the decoder's
q/k/v, o, gate/up and down projections per output channel and the MoE experts per row (absolute
max / 448); embeddings, the LM head, norms and the MoE router stay in the model dtype.

The LM head: FP8 when the checkpoint's `lm_head.weight` is (any layout above, as another linear
layer; refused when the config ties it to the embedding), or with `quantize_lm_head_`
(`--quantize-lm-head`, opt-in: it changes the logits) per row as the online projections; a tied
head is untied then (its own FP8 copy; the embedding keeps the model dtype).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lmserver.kernels.fp8_ref import FP8_DTYPE, expand_block_scale
from lmserver.layers.fp8_linear import Fp8Linear
from lmserver.layers.moe import MoE

__all__ = [
    "FP8_KV_SCALES_ATTR",
    "FP8_LINEAR_NAMES",
    "Fp8Spec",
    "QuantizationError",
    "checkpoint_lm_head_is_fp8",
    "fp8_linear_layers",
    "fp8_moe_layers",
    "describe_lm_head",
    "load_fp8_checkpoint",
    "quantize_linears_",
    "quantize_lm_head_",
    "quantize_moe_experts_",
    "read_fp8_spec",
    "replace_with_fp8_",
    "scan_fp8_modules",
    "use_fp8_path",
]

SUPPORTED_QUANT_METHODS = ("fp8", "compressed-tensors")
FP8_LINEAR_NAMES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # quantized online
FP8_KV_SCALES_ATTR = "fp8_kv_scales"  # model attribute: {layer_id: {"k": float, "v": float}}
ONLINE_GROUP_K: int | None = None  # online quantization: per output channel (see module docstring)
_SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale")
_IGNORED_SUFFIXES = (".input_scale", ".weight_zero_point", ".input_zero_point")
_KV_SCALE = re.compile(r".*layers\.(\d+)\.self_attn\.(?:(k_scale|v_scale|kv_scale)|(k_proj|v_proj)\.output_scale)$")


class QuantizationError(ValueError):
    """The checkpoint's quantization is unsupported, or its FP8 tensors are incomplete."""


@dataclass(frozen=True)
class Fp8Spec:
    """How a model's FP8 weights come: `source` "checkpoint" (quant_method `method`) or
    "online"; `weight_block` (rows, columns) of block scales, None for per-tensor / channel."""

    source: str
    method: str
    weight_block: tuple[int, int] | None = None

    @property
    def group_k(self) -> int | None:
        """Columns per scale group of the `Fp8Linear` layers (None: per channel)."""
        if self.weight_block is not None:
            return self.weight_block[1]
        return ONLINE_GROUP_K if self.source == "online" else None

    def describe(self) -> str:
        scales = (f"{self.weight_block[0]}x{self.weight_block[1]} block scales" if self.weight_block
                  else "per-channel scales" if self.source == "online" else "per-tensor / per-channel scales")
        origin = "online quantization" if self.source == "online" else f"checkpoint ({self.method})"
        return f"FP8 e4m3 weights, {scales}, {origin}"


def _block(value: Any, where: str) -> tuple[int, int]:
    if not (isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, int) and v > 0 for v in value)):
        raise QuantizationError(f"{where} must be two positive integers, got {value!r}")
    return int(value[0]), int(value[1])


def _compressed_tensors_spec(qc: dict[str, Any]) -> Fp8Spec:
    fmt = qc.get("format")
    if fmt not in (None, "float-quantized", "naive-quantized"):
        raise QuantizationError(f"compressed-tensors format {fmt!r} is not supported; lmserver reads FP8 weights "
                                "stored as float8_e4m3fn ('float-quantized')")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise QuantizationError("compressed-tensors quantization_config has no config_groups")
    blocks: set[tuple[int, int] | None] = set()
    for gname, group in groups.items():
        w = (group or {}).get("weights") or {}
        if w.get("type") != "float" or int(w.get("num_bits", 0)) != 8:
            raise QuantizationError(
                f"compressed-tensors group {gname!r} quantizes weights to {w.get('num_bits')}-bit {w.get('type')}; "
                "lmserver reads only 8-bit float (FP8 e4m3) weights")
        strategy = w.get("strategy", "tensor")
        if strategy in ("tensor", "channel"):
            blocks.add(None)
        elif strategy == "block":
            blocks.add(_block(w.get("block_structure"), f"config_groups.{gname}.weights.block_structure"))
        else:
            raise QuantizationError(f"compressed-tensors weight strategy {strategy!r} (group {gname!r}) is not "
                                    "supported; use tensor, channel or block")
        if w.get("dynamic"):
            raise QuantizationError(f"compressed-tensors group {gname!r} has dynamic weight scales; FP8 checkpoints "
                                    "need static weight scales")
    if len(blocks) != 1:
        raise QuantizationError(f"compressed-tensors groups mix weight scale layouts {sorted(map(str, blocks))}")
    return Fp8Spec("checkpoint", "compressed-tensors", blocks.pop())


def read_fp8_spec(hf_config: dict[str, Any], requested: str | None) -> Fp8Spec | None:
    """The FP8 spec of a model: from its `quantization_config` (any `requested`), online for
    `requested` "fp8" without one, None otherwise. Raises QuantizationError for an unknown
    `quant_method` or a non-FP8 scheme, and for an unknown `requested` value."""
    if requested not in (None, "fp8"):
        raise QuantizationError(f"quantization {requested!r} is not supported; use 'fp8'")
    qc = hf_config.get("quantization_config")
    if qc is None and isinstance(hf_config.get("text_config"), dict):
        qc = hf_config["text_config"].get("quantization_config")
    if qc is None:
        return Fp8Spec("online", "online") if requested == "fp8" else None
    method = qc.get("quant_method")
    if method == "fp8":
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise QuantizationError(f"quantization_config fmt {fmt!r} is not supported; lmserver reads FP8 e4m3")
        block = qc.get("weight_block_size")
        return Fp8Spec("checkpoint", "fp8", None if block is None else _block(block, "weight_block_size"))
    if method == "compressed-tensors":
        return _compressed_tensors_spec(qc)
    raise QuantizationError(
        f"the checkpoint's quantization_config has quant_method {method!r}, which lmserver does not support; "
        f"supported: {', '.join(SUPPORTED_QUANT_METHODS)} (FP8 e4m3 weights)")


def fp8_linear_layers(model: nn.Module) -> dict[str, Fp8Linear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, Fp8Linear)}


def fp8_moe_layers(model: nn.Module) -> dict[str, MoE]:
    """`model`'s expert MLPs whose experts are FP8."""
    return {name: m for name, m in model.named_modules() if isinstance(m, MoE) and m.is_fp8}


_EXPERT_PARAMS = ("w13", "w2")


def _expert_param(modules: dict[str, nn.Module], target: str) -> tuple[str, MoE] | None:
    """(MoE module name, module) when `target` names a MoE's w13 / w2 parameter."""
    module, _, attr = target.rpartition(".")
    moe = modules.get(module)
    return (module, moe) if isinstance(moe, MoE) and attr in _EXPERT_PARAMS else None


def _safetensors_files(folder: Path) -> list[Path]:
    import json

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return [folder / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return sorted(folder.glob("*.safetensors"))


_FP8_HEADER_DTYPES = ("F8_E4M3", "float8_e4m3fn")  # float8_e4m3fn as safetensors headers name it


def _header_dtypes(folder: Path) -> Iterator[tuple[str, str]]:
    """(tensor name, dtype) of every tensor of the checkpoint folder, read from the safetensors headers (no tensor
    loaded)."""
    from safetensors import safe_open

    for file in _safetensors_files(folder):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118  (safe_open is not a dict)
                yield name, handle.get_slice(name).get_dtype()


def checkpoint_lm_head_is_fp8(model_path: str | Path) -> bool:
    """Whether the checkpoint folder stores an FP8 (float8_e4m3fn) `lm_head.weight` (a folder without safetensors
    files: False). The loader serves such a head as FP8 with or without `quantize_lm_head`, so the weight-bytes
    estimate counts it so too."""
    folder = Path(model_path)
    if not folder.is_dir():
        return False
    return next((dtype in _FP8_HEADER_DTYPES for name, dtype in _header_dtypes(folder)
                 if name.endswith("lm_head.weight")), False)


def scan_fp8_modules(model: nn.Module, model_path: str | Path) -> set[str]:
    """Names of `model`'s modules whose checkpoint weights are float8_e4m3fn (read from the
    safetensors headers, no tensor loaded): `nn.Linear`s and MoE expert MLPs (`MoE`). Raises
    QuantizationError when one maps to anything else (lmserver has no FP8 path for it)."""
    names: set[str] = set()
    map_weight: Any = model.map_weight
    modules = dict(model.named_modules())
    for name, dtype in _header_dtypes(Path(model_path)):
        if dtype not in _FP8_HEADER_DTYPES:
            continue
        mapped = map_weight(name)
        if mapped is None:
            tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
            if name.endswith("lm_head.weight") and tied:
                raise QuantizationError(
                    f"checkpoint tensor {name!r} is FP8 but config.json ties the LM head to the embedding "
                    "(tie_word_embeddings), which lmserver keeps in the model dtype; set "
                    "tie_word_embeddings false to serve the checkpoint's FP8 LM head, or store it unquantized")
            continue
        target = mapped[0]
        if (expert := _expert_param(modules, target)) is not None:
            if not mapped[1]:
                raise QuantizationError(
                    f"checkpoint tensor {name!r} holds every expert in FP8 in one tensor; lmserver reads FP8 "
                    "experts one per tensor (block_sparse_moe.experts.E.w1/w2/w3.weight with their scales)")
            names.add(expert[0])
            continue
        module = target.removesuffix(".weight")
        if not target.endswith(".weight") or not isinstance(modules.get(module), nn.Linear):
            raise QuantizationError(
                f"checkpoint tensor {name!r} is FP8 but maps to {target!r}, which lmserver cannot hold "
                "in FP8 (FP8 weights are supported for linear layers and MoE experts)")
        names.add(module)
    return names


def replace_with_fp8_(model: nn.Module, names: Iterable[str], group_k: int | None,
                      quantize: bool, weight_block: tuple[int, int] | None = None) -> None:
    """Replaces the `nn.Linear` modules `names` of `model` by `Fp8Linear`: quantized from their
    weights (`quantize`), or empty for a checkpoint to fill; the `MoE` modules among `names` get
    FP8 experts (quantized per row, or empty with `weight_block` scale blocks). Mutates `model`."""
    for name in sorted(names):
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, attr)
        if isinstance(old, MoE):
            if quantize:
                old.quantize_fp8_()
            else:
                old.use_fp8_(weight_block)
            continue
        assert isinstance(old, nn.Linear), name
        if quantize:
            new = Fp8Linear.from_linear(old, group_k)
        else:
            new = Fp8Linear(old.in_features, old.out_features, old.bias is not None, group_k,
                            old.weight.dtype, old.weight.device)
        setattr(parent, attr, new)


def _decoder_layer_index(name: str) -> int | None:
    found = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
    return int(found.group(1)) if found else None


def quantize_linears_(model: nn.Module, group_k: int | None, keep_layers: Collection[int] = ()) -> list[str]:
    """Online FP8: the decoder projections (`FP8_LINEAR_NAMES`) become `Fp8Linear`; returns their
    names. Decoder layers whose index is in `keep_layers` (negative: counted from the last, -1 the
    last layer) keep the model dtype. Mutates `model`."""
    config: Any = getattr(model, "config", None)
    num_layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    kept = {i + num_layers if i < 0 else i for i in keep_layers}
    names = [name for name, m in model.named_modules()
             if isinstance(m, nn.Linear) and name.rpartition(".")[2] in FP8_LINEAR_NAMES
             and _decoder_layer_index(name) not in kept]
    replace_with_fp8_(model, names, group_k, quantize=True)
    return names


def quantize_lm_head_(model: nn.Module) -> bool:
    """`model.lm_head` becomes an `Fp8Linear` with one float32 scale per vocabulary row (absolute max / 448, the
    online projections' layout), quantized from its weights; a head tied to the embedding is untied: the FP8 copy
    is the head's own, the embedding keeps its parameter and dtype. Returns False when the head is FP8 already (an
    FP8 checkpoint's). Mutates `model`; raises QuantizationError for a head that is not a linear layer."""
    head = getattr(model, "lm_head", None)
    if isinstance(head, Fp8Linear):
        return False
    if not isinstance(head, nn.Linear):
        raise QuantizationError(f"the LM head of {type(model).__name__} is {type(head).__name__}, not a linear layer; "
                                "it cannot be FP8")
    # NOTE: from_linear copies the (possibly shared) weight; model.lm_head then no longer aliases the embedding
    model.lm_head = Fp8Linear.from_linear(head, None)
    return True


def describe_lm_head(model: nn.Module) -> str:
    """The LM head's storage, for the start-up log line: FP8 (with its scales) or the model dtype."""
    head = getattr(model, "lm_head", None)
    if isinstance(head, Fp8Linear):
        scales = "per-row scales" if head.group_k == head.in_features else f"scales per {head.group_k} columns"
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        weight = getattr(embed, "weight", None)
        untied = f", embedding {str(weight.dtype).removeprefix('torch.')}" if isinstance(weight, torch.Tensor) else ""
        return f"LM head FP8 e4m3 ({scales}{untied})"
    weight = getattr(head, "weight", None)
    return f"LM head {str(weight.dtype).removeprefix('torch.')}" if isinstance(weight, torch.Tensor) else "LM head"


def quantize_moe_experts_(model: nn.Module, keep_layers: Collection[int] = ()) -> list[str]:
    """Online FP8 of the MoE experts: every `MoE` module's w13 / w2 quantized per row (absolute max / 448; the
    router stays in the model dtype); returns the modules' names. `keep_layers` as in `quantize_linears_`.
    Mutates `model`."""
    config: Any = getattr(model, "config", None)
    num_layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    kept = {i + num_layers if i < 0 else i for i in keep_layers}
    names = [name for name, m in model.named_modules()
             if isinstance(m, MoE) and not m.is_fp8 and _decoder_layer_index(name + ".") not in kept]
    replace_with_fp8_(model, names, None, quantize=True)
    return names


def _expert_scale_rows(moe: MoE, which: str, index: tuple[int | slice, ...], tensor: torch.Tensor, name: str) -> int:
    """Writes a checkpoint scale of one expert's w1 / w3 / w2 into `moe`'s scales (layout: `lmserver.layers.moe`);
    returns the weight rows it covers. Raises QuantizationError for a shape that fits neither layout."""
    w = moe.w13 if which == "w13" else moe.w2
    scale = moe.w13_scale if which == "w13" else moe.w2_scale
    assert scale is not None
    _, n_all, k = w.shape
    e = index[0]
    rows = index[1] if len(index) > 1 and isinstance(index[1], slice) else slice(0, n_all)
    n = rows.stop - rows.start
    s = tensor.float()
    block = moe.scale_block
    if block is None:
        if s.numel() == 1:  # per tensor
            scale[e, rows] = s.reshape(())
            return n
        if s.numel() == n and (s.dim() == 1 or (s.dim() == 2 and s.shape[1] == 1)):  # per channel
            scale[e, rows] = s.reshape(n)
            return n
        raise QuantizationError(f"scale {name!r} has shape {tuple(s.shape)}, which fits neither a per-tensor nor a "
                                f"per-channel ({n}, 1) scale of its expert weight ({n} rows)")
    bn, bk = block
    if rows.start % bn:
        raise QuantizationError(
            f"scale {name!r}: block-scaled FP8 experts need intermediate_size ({rows.start}) to be a multiple of the "
            f"scale block's {bn} rows (the w1 and w3 blocks of one expert are held side by side)")
    nb, kb = -(-n // bn), -(-k // bk)
    r0 = rows.start // bn
    if s.numel() == 1:
        scale[e, r0:r0 + nb] = s.reshape(())
    elif tuple(s.shape) == (nb, kb):
        scale[e, r0:r0 + nb] = s
    else:
        raise QuantizationError(f"scale {name!r} has shape {tuple(s.shape)}, which fits neither a per-tensor nor a "
                                f"{bn}x{bk} block scale ({nb}, {kb}) of its expert weight ({n} x {k})")
    return n


def _scale_rows(scale: torch.Tensor, rows: int, layer: Fp8Linear, spec: Fp8Spec, name: str) -> torch.Tensor:
    """A checkpoint scale -> (rows, groups) float32 in the `Fp8Linear` layout."""
    groups = layer.weight_scale.shape[1]
    s = scale.float()
    if s.numel() == 1:  # per tensor
        return s.reshape(1, 1).expand(rows, groups)
    if s.dim() in (1, 2) and s.shape[0] == rows and (s.dim() == 1 or s.shape[1] == 1):  # per channel
        return s.reshape(rows, 1).expand(rows, groups)
    if spec.weight_block is not None and s.dim() == 2:
        bn, _ = spec.weight_block
        if s.shape == (-(-rows // bn), groups):
            return expand_block_scale(s, rows, bn)
    raise QuantizationError(
        f"scale {name!r} has shape {tuple(s.shape)}, which fits neither a per-tensor, per-channel ({rows}, 1) nor "
        f"a block scale ({-(-rows // spec.weight_block[0]) if spec.weight_block else '?'}, {groups}) of its weight "
        f"({rows} rows); quantization_config: {spec.describe()}")


def load_fp8_checkpoint(model: nn.Module, spec: Fp8Spec, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Loads an FP8 checkpoint into `model` (its FP8 layers already `Fp8Linear`): weights through
    the model's own loader, scales into the layers' `weight_scale`, KV-cache scales onto the
    model. Raises QuantizationError for missing scale tensors or FP8 / unquantized shards mixed
    in one layer. Mutates `model`."""
    layers = fp8_linear_layers(model)
    modules = dict(model.named_modules())
    moes = fp8_moe_layers(model)
    map_weight: Any = model.map_weight
    filled: dict[str, int] = {}
    kv_scales: dict[int, dict[str, float]] = {}

    def expert_of(weight_name: str) -> tuple[str, MoE, tuple[int | slice, ...]] | None:
        """(target parameter, its FP8 MoE, index) when `weight_name` maps to FP8 experts."""
        mapped = map_weight(weight_name)
        found = None if mapped is None else _expert_param(modules, mapped[0])
        if found is None or found[0] not in moes:
            return None
        return mapped[0], found[1], mapped[1]

    def target_of(weight_name: str) -> tuple[str, Fp8Linear | None, slice | None]:
        mapped = map_weight(weight_name)
        if mapped is None:
            return "", None, None
        target, index = mapped
        module = target.removesuffix(".weight")
        rows = index[0] if index and isinstance(index[0], slice) else None
        return module, layers.get(module), rows

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if kv := _KV_SCALE.match(name):
                which = kv.group(2) or ("k_scale" if kv.group(3) == "k_proj" else "v_scale")
                entry = kv_scales.setdefault(int(kv.group(1)), {})
                for key in ("k", "v") if which == "kv_scale" else (which[0],):
                    entry[key] = float(tensor.float().max())
                continue
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            suffix = next((s for s in _SCALE_SUFFIXES if name.endswith(s)), None)
            if suffix is not None and (expert := expert_of(name.removesuffix(suffix) + ".weight")) is not None:
                target, moe, index = expert
                rows_done = _expert_scale_rows(moe, target.rpartition(".")[2], index, tensor, name)
                filled[target] = filled.get(target, 0) + rows_done
                continue
            if suffix is not None:
                module, layer, rows = target_of(name.removesuffix(suffix) + ".weight")
                if layer is None:
                    raise QuantizationError(f"checkpoint scale {name!r} belongs to {module or name!r}, whose weight "
                                            "is not FP8 in the checkpoint")
                rows = rows or slice(0, layer.out_features)
                n = rows.stop - rows.start
                layer.weight_scale[rows] = _scale_rows(tensor, n, layer, spec, name)
                filled[module] = filled.get(module, 0) + n
                continue
            if name.endswith(".weight") and (expert := expert_of(name)) is not None and tensor.dtype != FP8_DTYPE:
                raise QuantizationError(f"checkpoint tensor {name!r} is {tensor.dtype} but other experts of "
                                        f"{expert[0]!r} are FP8; lmserver needs every expert weight of a layer in FP8")
            if name.endswith(".weight"):
                module, layer, _ = target_of(name)
                if layer is not None and tensor.dtype != FP8_DTYPE:
                    raise QuantizationError(f"checkpoint tensor {name!r} is {tensor.dtype} but other shards of "
                                            f"{module!r} are FP8; lmserver needs all shards of a fused layer in FP8")
            yield name, tensor

    model.load_weights(tensors())  # type: ignore[operator]
    missing = [f"{name} ({filled.get(name, 0)} of {layer.out_features} rows)"
               for name, layer in layers.items() if filled.get(name, 0) < layer.out_features]
    for name, moe in moes.items():
        for which in _EXPERT_PARAMS:
            rows = getattr(moe, which).shape[0] * getattr(moe, which).shape[1]  # every expert's rows
            if filled.get(f"{name}.{which}", 0) < rows:
                missing.append(f"{name}.{which} ({filled.get(f'{name}.{which}', 0)} of {rows} expert rows)")
    if missing:
        raise QuantizationError(
            "missing scale tensors: an FP8 checkpoint needs a weight_scale or weight_scale_inv tensor next to each "
            f"FP8 weight; no (or partial) scales for {', '.join(missing[:4])}"
            + (f" and {len(missing) - 4} more layers" if len(missing) > 4 else ""))
    setattr(model, FP8_KV_SCALES_ATTR, kv_scales)


def use_fp8_path(model: nn.Module, device: torch.device | str) -> str:
    """Chooses every `Fp8Linear`'s path once: the Triton GEMV (+ _scaled_mm) on CUDA when Triton
    imports, the dequantizing torch path otherwise; returns why. Mutates the layers."""
    layers = fp8_linear_layers(model)
    moes = fp8_moe_layers(model)
    path, why = "torch", "dequantizing torch path (CPU reference)"
    if torch.device(device).type == "cuda":
        try:
            import lmserver.kernels.fp8_gemv  # noqa: F401
        except ImportError as exc:
            why = f"dequantizing torch path: the Triton FP8 GEMV does not import ({exc}); install triton"
        else:
            path, why = "triton", "Triton FP8 GEMV for <= 16 rows, torch._scaled_mm / dequantize above"
    for layer in layers.values():
        layer.use_path(path)
    experts = ""
    if moes:
        fused = all(m.kernels is not None and m.kernels.fused_moe is not None for m in moes.values())
        experts = (f"; {len(moes)} FP8 expert MLPs: "
                   + ("fused Triton MoE (FP8 tiles widened to fp16; per-row scales above 16 pairs per expert: W8A8, "
                      "rows quantized per token)" if fused else "dequantizing torch paths"))
    return f"{len(layers)} FP8 linear layers: {why}{experts}"
