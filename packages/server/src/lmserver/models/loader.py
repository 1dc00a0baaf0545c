"""Loads a model: a HF folder (`config.json`, sharded `*.safetensors`) or random `dummy` weights.

The layer kernels are chosen here, once: lmserver's fused Triton kernels (add + RMSNorm, RoPE,
SiLU-and-mul) on CUDA in a dtype they take, plain torch ops otherwise or when disabled.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from lmserver.kernels.dispatch import KernelOps, select_kernels
from lmserver.models.config import ModelConfig
from lmserver.models.registry import get_model_class

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FUSED_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the Triton layer kernels take


class ModelLoadError(ValueError):
    """The model folder is missing files or its weights do not fit the config."""


def read_model_config(model_path: str | Path) -> ModelConfig:
    """Reads `config.json` (and `generation_config.json` for extra EOS ids) of a model folder."""
    folder = Path(model_path)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{folder} has no config.json; pass a Hugging Face model folder")
    hf = json.loads(config_file.read_text())
    gen_file = folder / "generation_config.json"
    if gen_file.is_file():
        gen_eos = json.loads(gen_file.read_text()).get("eos_token_id")
        ids = set(gen_eos if isinstance(gen_eos, list) else [] if gen_eos is None else [gen_eos])
        own = hf.get("eos_token_id")
        ids |= set(own if isinstance(own, list) else [] if own is None else [own])
        if ids:
            hf["eos_token_id"] = sorted(ids)
    return ModelConfig.from_hf(hf)


def iter_safetensors(model_path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, tensor) over every `*.safetensors` file of the folder (sharded or not)."""
    from safetensors import safe_open

    folder = Path(model_path)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder} has no *.safetensors files (use load_format='dummy' for random weights)")
    for file in files:
        with safe_open(str(folder / file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118  (safe_open is not a dict)
                yield name, handle.get_tensor(name)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


class _ZeroInsteadOfRandomInit(TorchFunctionMode):
    """While a model is built: a parameter's random initialization (nn.Linear's kaiming_uniform_, nn.Embedding's
    normal_) writes zeros instead. Every parameter is overwritten next, by the checkpoint or `init_dummy_weights`,
    and both check that they filled all of them; drawing random numbers first cost ~4 s per build of the embedded
    135M model on one CPU core. Thread-local (a torch function mode), active only inside `load_model`."""

    _RANDOM_FILLS = frozenset({
        torch.Tensor.uniform_, torch.Tensor.normal_, torch.nn.init.uniform_, torch.nn.init.normal_,
        torch.nn.init.trunc_normal_, torch.nn.init.kaiming_uniform_, torch.nn.init.kaiming_normal_,
        torch.nn.init.xavier_uniform_, torch.nn.init.xavier_normal_})

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if func in self._RANDOM_FILLS:
            with torch.no_grad():
                return (args[0] if args else kwargs["tensor"]).zero_()
        return func(*args, **(kwargs or {}))


def init_dummy_weights(model: torch.nn.Module, seed: int) -> None:
    """Fills every parameter with seeded random values (norm weights 1, norm biases 0); mutates `model`.

    Values are drawn where the parameter lives: CPU parameters from a CPU generator, CUDA ones
    on the GPU (seconds instead of minutes for an 8B model; other numbers than the CPU's).
    """
    gens: dict[torch.device, torch.Generator] = {}
    # NOTE: norms of any kind (a vision tower's LayerNorms too) get weight 1, bias 0
    norms = {
        f"{prefix}.{kind}" if prefix else kind
        for prefix, module in model.named_modules()
        if isinstance(module, (torch.nn.LayerNorm, torch.nn.GroupNorm)) or "norm" in type(module).__name__.lower()
        for kind in ("weight", "bias")
    }
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name in norms:
                param.fill_(1.0 if name.endswith("weight") else 0.0)
                continue
            device = param.device if param.device.type == "cuda" else torch.device("cpu")
            if device not in gens:
                gens[device] = torch.Generator(device).manual_seed(seed)
            values = torch.randn(param.shape, generator=gens[device], dtype=torch.float32, device=device) * 0.02
            param.copy_(values.to(param.dtype))


def select_layer_kernels(
    device: torch.device | str, dtype: torch.dtype, disable_fused_kernels: bool = False
) -> tuple[KernelOps | None, str]:
    """(the Triton layer kernels, why) on CUDA in a dtype they take; (None, why): torch ops."""
    if disable_fused_kernels:
        return None, "torch ops: fused kernels disabled (disable_fused_kernels)"
    if dtype not in FUSED_KERNEL_DTYPES:
        return None, f"torch ops: the fused kernels do not take {dtype}"
    ops = select_kernels(device)
    if ops.backend != "triton":
        return None, f"torch ops ({ops.reason})"
    return ops, f"fused layer kernels: {ops.reason}"


def _prepare_fp8_checkpoint(model: torch.nn.Module, model_path: str | Path | None, group_k: int | None,
                            weight_block: tuple[int, int] | None) -> None:
    """Makes the layers whose checkpoint weights are FP8 `Fp8Linear` and the MoE experts FP8 (empty, to be
    loaded; `weight_block`: the experts' scale blocks)."""
    from lmserver.models.quantization import QuantizationError, replace_with_fp8_, scan_fp8_modules

    if model_path is None:
        raise ModelLoadError("load_format='auto' needs a model_path")
    try:
        names = scan_fp8_modules(model, model_path)
    except QuantizationError as exc:
        raise ModelLoadError(str(exc)) from exc
    if not names:
        raise ModelLoadError(f"{model_path}: config.json declares FP8 quantization but no weight is float8_e4m3fn")
    replace_with_fp8_(model, names, group_k, quantize=False, weight_block=weight_block)


def load_model(
    config: ModelConfig,
    model_path: str | Path | None,
    *,
    load_format: str = "auto",
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    max_positions: int | None = None,
    seed: int = 0,
    disable_fused_kernels: bool = False,
    quantization: str | None = None,
    quantize_lm_head: bool = False,
) -> torch.nn.Module:
    """Builds the model for `config` on `device` in `dtype` and loads weights (or dummy ones).

    Its norms, RoPE and MLP activation run lmserver's fused Triton kernels on CUDA (see
    `select_layer_kernels`), the torch ops elsewhere or with `disable_fused_kernels`.
    FP8 weights (`lmserver.models.quantization`): an FP8 checkpoint (its `quantization_config`)
    loads into FP8 layers (MoE experts included); `quantization="fp8"` quantizes an unquantized one
    after loading (and random `dummy` weights): the decoder projections and the MoE experts.
    `quantize_lm_head` (FP8 weights only) makes the LM head FP8 too, per row (a tied head untied);
    a checkpoint's FP8 `lm_head.weight` loads as FP8 without it, and is kept as stored (never
    re-rounded) with it.
    """
    from lmserver.models.quantization import QuantizationError, read_fp8_spec

    try:
        fp8 = read_fp8_spec(config.hf_config, quantization)
    except QuantizationError as exc:
        raise ModelLoadError(str(exc)) from exc
    if quantize_lm_head and fp8 is None:
        raise ModelLoadError("quantize_lm_head needs FP8 weights: quantization='fp8' or an FP8 checkpoint")
    model_cls = get_model_class(config.architecture)
    with _default_dtype(dtype), torch.device(device), _ZeroInsteadOfRandomInit():
        model = model_cls(config, max_positions=max_positions)
    from_checkpoint = fp8 is not None and fp8.source == "checkpoint" and load_format == "auto"
    if from_checkpoint:
        assert fp8 is not None
        _prepare_fp8_checkpoint(model, model_path, fp8.group_k, fp8.weight_block)
    kernels, reason = select_layer_kernels(device, dtype, disable_fused_kernels)
    logger.info("model layers: %s", reason)
    model.use_kernels(kernels)
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    elif load_format == "auto":
        if model_path is None:
            raise ModelLoadError("load_format='auto' needs a model_path")
        try:
            if from_checkpoint:
                from lmserver.models.quantization import load_fp8_checkpoint

                assert fp8 is not None
                load_fp8_checkpoint(model, fp8, iter_safetensors(model_path))
            else:
                model.load_weights(iter_safetensors(model_path))
        except ValueError as exc:
            raise ModelLoadError(f"loading weights from {model_path}: {exc}") from exc
    else:
        raise ModelLoadError(f"unknown load_format {load_format!r}; use 'auto' or 'dummy'")
    if fp8 is not None:
        from lmserver.models.quantization import (
            describe_lm_head,
            quantize_linears_,
            quantize_lm_head_,
            quantize_moe_experts_,
            use_fp8_path,
        )

        if not from_checkpoint:
            quantize_linears_(model, fp8.group_k)
            quantize_moe_experts_(model)
        if quantize_lm_head:
            try:
                quantize_lm_head_(model)
            except QuantizationError as exc:
                raise ModelLoadError(str(exc)) from exc
        logger.info("model weights: %s; %s; %s", fp8.describe(), describe_lm_head(model), use_fp8_path(model, device))
    model.eval()
    return model  # type: ignore[no-any-return]
