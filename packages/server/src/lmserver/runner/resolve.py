"""Resolves the "auto" values of ServerConfig once (device, dtype, KV size, running requests,
attention backend, context length, prefill chunk size and pacing, FP8 weights and KV cache) into a new
ServerConfig, logged once by the engine."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from lmserver.config import ServerConfig
from lmserver.forward.kv_pool import KVPool
from lmserver.kernels.fp8_ref import FP8_DTYPE
from lmserver.layers.moe import MoE
from lmserver.models.config import ModelConfig
from lmserver.models.eagle import is_eagle3_config
from lmserver.models.loader import DTYPES
from lmserver.models.quantization import checkpoint_lm_head_is_fp8
from lmserver.runner.cuda_graph import SMALL_GPU_GRAPH_MAX_BS
from lmserver.scheduler.admission import AdmissionConfig, StepBudget
from lmserver.scheduler.pacer import PacerConfig, PrefillPacer

logger = logging.getLogger(__name__)

DEFAULT_MEM_FRACTION_STATIC = 0.85
CPU_KV_BUDGET_BYTES = 1 << 30  # CPU default: at most 1 GiB of KV cache
CPU_MAX_RUNNING_REQUESTS = 64
GPU_MAX_RUNNING_REQUESTS = 256
# Decode graphs: large-memory GPUs capture up to the default running batch (decode at 128-256 rows
# was eager and ~2x slower per step on the H200, benchmarks/RESULTS.md); smaller ones keep 32.
LARGE_GPU_BYTES = 64 << 30
LARGE_GPU_GRAPH_MAX_BS = 256  # smaller GPUs: cuda_graph.SMALL_GPU_GRAPH_MAX_BS
# Prefill chunks: one forward of 8,192 tokens takes minutes on a small CPU and stalls every running
# request meanwhile (issue 32); 512 keeps a CPU forward short. GPUs keep SGLang's 8,192.
CPU_CHUNKED_PREFILL_SIZE = 512
GPU_CHUNKED_PREFILL_SIZE = 8192
# Mixed steps (prefill chunks with the running requests' decode rows): the step duration the prefill
# pacer aims for, i.e. the running requests' gap between two tokens while prompts prefill (issue 32:
# <= 100 ms on the H200, <= 2 s on a small CPU; a fixed 8,192-token chunk of an 8B model took 220 ms).
GPU_PREFILL_STEP_TARGET_MS = 60.0
CPU_PREFILL_STEP_TARGET_MS = 500.0
# SLO admission, relative target (scheduler/admission.py): while requests that started calm decode, new
# ones join only as far as those keep 1 / 1.05 of the speed they started at (issue 27's storm: >= 0.9).
DECODE_STEP_SLOWDOWN = 1.05


class ConfigError(ValueError):
    """A config value is invalid for this machine or model."""


def resolve_device(config: ServerConfig) -> str:
    if config.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device='cuda' but no CUDA device is visible; use device='cpu' or 'auto'")
    return config.device


def resolve_dtype(config: ServerConfig, device: str) -> str:
    if config.dtype != "auto":
        if config.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {sorted(DTYPES)} or 'auto', got {config.dtype!r}")
        return config.dtype
    return "bfloat16" if device == "cuda" else "float32"


def estimate_weight_bytes(model_config: ModelConfig, dtype: str, max_positions: int, tp_size: int = 1,
                          quantization: str | None = None, quantize_lm_head: bool = False) -> int:
    """Bytes one rank's weights and buffers take in `dtype`: the model built on the meta device
    (no memory, no weights), counted; tied weights once. With `quantization` "fp8" the decoder
    projections and the MoE experts count one byte per weight plus their per-row float32 scales; with
    `quantize_lm_head` the LM head too (tied to the embedding: an FP8 copy next to it). Pure."""
    from lmserver.models.loader import _default_dtype
    from lmserver.models.registry import get_model_class

    with _default_dtype(DTYPES[dtype]), torch.device("meta"):
        model = get_model_class(model_config.architecture)(model_config, max_positions=max_positions)
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    total = sum(t.numel() * t.element_size() for t in tensors.values())

    def fp8_bytes(w: torch.Tensor) -> int:  # one byte per weight, one float32 scale per row (the last dim is K)
        return w.numel() + 4 * (w.numel() // w.shape[-1])

    if quantization == "fp8":
        from lmserver.models.quantization import FP8_LINEAR_NAMES

        quantized = [m.weight for name, m in model.named_modules()
                     if isinstance(m, torch.nn.Linear) and name.rpartition(".")[2] in FP8_LINEAR_NAMES]
        quantized += [w for m in model.modules() if isinstance(m, MoE) for w in (m.w13, m.w2)]  # (E, N, K)
        if quantize_lm_head and isinstance(getattr(model, "lm_head", None), torch.nn.Linear):
            head = model.lm_head.weight
            if model_config.tie_word_embeddings:  # untied: the embedding stays, the head is a new FP8 copy
                total += fp8_bytes(head)
            else:
                quantized.append(head)
        total -= sum(w.numel() * w.element_size() - fp8_bytes(w) for w in quantized)
    return total // max(tp_size, 1)


KV_CACHE_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn}


def kv_storage_dtype(kv_cache_dtype: str, dtype: str) -> torch.dtype:
    """The KV pool's storage dtype: `kv_cache_dtype` ("fp8_e4m3", or a model dtype name), the
    model's `dtype` for "auto". Pure."""
    if kv_cache_dtype == "auto":
        return DTYPES[dtype]
    if kv_cache_dtype in KV_CACHE_DTYPES:
        return KV_CACHE_DTYPES[kv_cache_dtype]
    if kv_cache_dtype == dtype:  # a resolved "auto"
        return DTYPES[dtype]
    raise ConfigError(f"kv_cache_dtype must be 'auto' or 'fp8_e4m3', got {kv_cache_dtype!r}")


def resolve_fp8(config: ServerConfig, model_config: ModelConfig, device: str,
                dtype: str) -> tuple[str | None, str, str]:
    """(quantization, kv_cache_dtype, lowlat_plugins) resolved: "fp8" for an FP8 checkpoint or
    `--quantization fp8`, else None; "auto" KV becomes the model dtype's name; lowlat plugins as
    asked (the set-up names FP8 weights and KV: a plugin that reads neither is refused with that
    reason, the nvidia plugin takes both). Raises ConfigError before anything loads for an
    unknown quant_method or non-FP8 scheme, FP8 on a GPU without FP8 (compute capability < 8.9,
    named), `quantize_lm_head` without FP8 weights or with tensor parallelism, and explicit lowlat plugins with FP8 and
    tensor parallelism (their default is off there)."""
    from lmserver.layers.fp8_linear import fp8_unsupported_reason
    from lmserver.models.quantization import QuantizationError, read_fp8_spec

    try:
        spec = read_fp8_spec(model_config.hf_config, config.quantization)
    except QuantizationError as exc:
        raise ConfigError(str(exc)) from exc
    kv = config.kv_cache_dtype
    kv_storage_dtype(kv, dtype)  # validates
    kv = dtype if kv == "auto" else kv
    quant = "fp8" if spec is not None else None
    if config.quantize_lm_head and quant is None:
        raise ConfigError("--quantize-lm-head makes the LM head FP8 next to FP8 decoder weights; this model has none: "
                          "add --quantization fp8 (online FP8 of an unquantized checkpoint) or serve an FP8 checkpoint")
    weights = "FP8 weights and an FP8 LM head" if config.quantize_lm_head else "FP8 weights"
    wants = [what for what, on in ((weights, quant is not None), ("an FP8 KV cache", kv == "fp8_e4m3")) if on]
    if wants:
        what = " and ".join(wants)
        why = fp8_unsupported_reason(device)
        if why is not None:
            raise ConfigError(f"{what} requested ({spec.describe() if spec else 'kv_cache_dtype fp8_e4m3'}): {why}; "
                              "run without --quantization / --kv-cache-dtype fp8_e4m3 or use an FP8-capable GPU")
        if config.tp_size > 1 and config.quantize_lm_head:
            raise ConfigError("an FP8 LM head (--quantize-lm-head) with tp_size > 1 is not supported: the vocabulary "
                              "shards hold model-dtype heads; drop --quantize-lm-head or use tp_size 1")
    lowlat = resolve_lowlat_plugins(config.lowlat_plugins, device)
    if wants and config.tp_size > 1 and lowlat != "off":
        if config.lowlat_plugins is not None:
            raise ConfigError(f"the lowlat plugins with {' and '.join(wants)} and tp_size > 1 are not supported yet "
                              "(not run on several GPUs); use --lowlat-plugins off")
        logger.info("lowlat plugins off by default: FP8 with tp_size > 1")
        lowlat = "off"
    return quant, kv, lowlat


def _draft_config(config: ServerConfig) -> dict[str, Any] | None:
    """The speculative draft's config.json (a draft model or an EAGLE head), or None: no draft, or a missing or
    unreadable file (the draft loader's error to raise, later)."""
    if config.speculative_algorithm not in ("draft_model", "eagle") or not config.speculative_draft_model_path:
        return None
    try:
        raw = json.loads((Path(config.speculative_draft_model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def draft_memory(config: ServerConfig, dtype: str, target: ModelConfig) -> tuple[int, int]:
    """(bytes per KV slot, weight bytes) of the speculative draft: a draft model or an EAGLE head keeps a KV pool of
    its own with as many slots as the target's (`runner.draft_model`), in the model dtype; (0, 0) without a draft.
    A draft model's weights are estimated from its config as a whole model; an EAGLE head's are its own parameters
    and buffers, not the embedding and LM head it shares with `target` but with tensor parallelism (rank 0 keeps them
    whole for the head: `runner.eagle.eagle_head_bytes`; a head the target cannot use counts as a whole Llama model
    here, the loader's error comes later)."""
    raw = _draft_config(config)
    if raw is None:
        return 0, 0
    try:
        mc = ModelConfig.from_hf(dict(raw, architectures=["LlamaForCausalLM"]) if is_eagle3_config(raw) else raw)
    except ValueError:  # NOTE: the draft loader names what is wrong with it
        return 0, 0
    per_slot = KVPool.bytes_per_slot(mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim, DTYPES[dtype])
    positions = min(config.context_length or mc.max_position_embeddings, mc.max_position_embeddings)
    if config.speculative_algorithm == "eagle":
        from lmserver.runner.draft_model import DraftModelError
        from lmserver.runner.eagle import eagle_head_bytes

        assert config.speculative_draft_model_path is not None  # _draft_config read its config.json
        try:
            return per_slot, eagle_head_bytes(config.speculative_draft_model_path, target, DTYPES[dtype], positions,
                                              config.load_format, config.tp_size)
        except DraftModelError:
            pass
    return per_slot, estimate_weight_bytes(mc, dtype, positions)


def resolve_prefill_graphs(requested: bool | None, device: str, tp_size: int) -> bool:
    """`--enable-cuda-graph-prefill` as given, else on with CUDA and tp_size 1 (measured on the H200: prompts of
    128-1,024 tokens 1.6-6x faster than eagerly, benchmarks/RESULTS.md "FP8 (issue 33)"; under tensor parallelism
    they are captured on every rank when asked for, not yet run on several GPUs). Pure."""
    if requested is not None:
        return requested
    return device == "cuda" and tp_size == 1


def resolve_lowlat_plugins(value: str | None, device: str) -> str:
    """`--lowlat-plugins` as given, else the default: `auto+measured-only` on a CUDA (or ROCm) GPU, where each plugin
    serves only the batches its measured tables say it wins on this GPU and layer shape (none without a table:
    `lowlat.LowlatConfig.measured_only`, `measured_coverage`), `off` elsewhere (the
    bundled plugins run on GPUs only; an explicit `auto` on the CPU logs their reasons). Pure."""
    if value is not None:
        return value
    return "auto+measured-only" if device.startswith("cuda") else "off"


# The issue asks `auto` to pick flashinfer when it imports on CUDA; the backend has not run on a
# GPU yet, so `auto` keeps triton. Set once test_attention_flashinfer's GPU test passed on an H200.
AUTO_PREFERS_FLASHINFER = False


def resolve_attention_backend(requested: str, device: str) -> str:
    """The attention backend for `requested` on `device`. auto: on CUDA flashinfer (when it
    imports and AUTO_PREFERS_FLASHINFER), else triton (when it imports), else torch_native.
    Any other value is returned as is (the registry's `create` names a missing package)."""
    if requested != "auto":
        return requested
    if device != "cuda":
        return "torch_native"
    from lmserver.runner.attention.registry import default_registry

    names = default_registry().names()
    if AUTO_PREFERS_FLASHINFER and "flashinfer" in names:
        return "flashinfer"
    return "triton" if "triton" in names else "torch_native"


def resolve_cuda_graph_max_bs(requested: int | None, device: str, gpu_bytes: int, max_running: int) -> int:
    """The largest decode batch to capture: `requested`, else 256 on a CUDA device with at least
    LARGE_GPU_BYTES of memory and 32 otherwise; never above `max_running`. Pure."""
    if requested is not None:
        if requested < 1:
            raise ConfigError(f"cuda_graph_max_bs must be >= 1, got {requested}")
        return min(requested, max_running)
    large = device == "cuda" and gpu_bytes >= LARGE_GPU_BYTES
    return min(LARGE_GPU_GRAPH_MAX_BS if large else SMALL_GPU_GRAPH_MAX_BS, max_running)


def resolve_chunked_prefill_size(requested: int | None, device: str) -> int:
    """The prefill chunk size: `requested` (-1: no chunking), else 512 tokens on a CPU and 8192
    on CUDA. Pure."""
    if requested is not None:
        if requested == 0 or requested < -1:
            raise ConfigError(f"chunked_prefill_size must be -1 (no chunking) or >= 1, got {requested}")
        return requested
    return GPU_CHUNKED_PREFILL_SIZE if device == "cuda" else CPU_CHUNKED_PREFILL_SIZE


def resolve_prefill_step_target_ms(requested: float | None, device: str) -> float:
    """The mixed-step duration the prefill pacer aims for (0: no pacing). Pure."""
    if requested is not None:
        if not requested >= 0 or requested == float("inf"):
            raise ConfigError(f"prefill_step_target_ms must be a finite number >= 0, got {requested}")
        return requested
    return GPU_PREFILL_STEP_TARGET_MS if device == "cuda" else CPU_PREFILL_STEP_TARGET_MS


def prefill_pacer(rc: ServerConfig) -> PrefillPacer | None:
    """The pacer of mixed steps for a resolved config (None without mixed steps or a target):
    at most one prefill chunk (or the prefill budget), starting at 1/4 of it and never below 1/8
    (where the decode rows alone overrun the target, prompts still prefill at a useful rate)."""
    target_ms = rc.prefill_step_target_ms or 0.0
    if not rc.enable_mixed_chunk or target_ms <= 0:
        return None
    chunk = rc.chunked_prefill_size or -1
    most = min(chunk, rc.max_prefill_tokens) if chunk > 0 else rc.max_prefill_tokens
    most = max(most, 1)
    return PrefillPacer(PacerConfig(target_s=target_ms / 1000.0, min_tokens=max(1, most // 8),
                                    max_tokens=most, start_tokens=max(1, most // 4)))


def resolve_decode_step_target_ms(requested: float | None) -> float | None:
    """The SLO admission's absolute decode step target (None: off; 0 means off too). Pure."""
    if requested is None or requested == 0:
        return None
    if not requested > 0 or requested == float("inf"):
        raise ConfigError(f"decode_step_target_ms must be a finite number > 0 (0 or unset: off), got {requested}")
    return float(requested)


def resolve_decode_step_slowdown(requested: float | None, device: str) -> float:
    """The SLO admission's relative target (0: off): `requested`, else DECODE_STEP_SLOWDOWN on
    CUDA and off on a CPU (its step times are too noisy to limit by, and tests stay timing-free).
    Pure."""
    if requested is None:
        return DECODE_STEP_SLOWDOWN if device == "cuda" else 0.0
    if requested == 0:
        return 0.0
    if not requested > 1.0 or requested == float("inf"):
        raise ConfigError(f"decode_step_slowdown must be a finite number > 1 (0: off), got {requested}")
    return float(requested)


def step_budget(rc: ServerConfig) -> StepBudget | None:
    """The SLO admission of a resolved config (None: off): the absolute target where one is set,
    else the relative one; its admitting steps bounded by the pacer's mixed-step target where
    there is one."""
    most = rc.prefill_step_target_ms or 0.0
    max_step_s = most / 1000.0 if most > 0 else float("inf")
    if rc.decode_step_target_ms is not None:
        return StepBudget(AdmissionConfig(target_s=rc.decode_step_target_ms / 1000.0, max_step_s=max_step_s))
    if rc.decode_step_slowdown:
        return StepBudget(AdmissionConfig(slowdown=rc.decode_step_slowdown, max_step_s=max_step_s))
    return None


def resolve_kv_tokens(
    config: ServerConfig, model_config: ModelConfig, device: str, dtype: str, weight_bytes: int,
    fp8_lm_head: bool = False, draft: tuple[int, int] = (0, 0),
) -> int:
    """KV-cache size in tokens: max_total_tokens, else a memory budget. On CUDA the budget is
    `mem_fraction_static` of the GPU's memory less what is in use and the weights to come
    (`weight_bytes`, estimated from the config when 0, the LM head in FP8 with `quantize_lm_head` or
    `fp8_lm_head`: the checkpoint stores it so), shared per token with a speculative draft's own KV pool (`draft`:
    its bytes per slot and weight bytes, `draft_memory`)."""
    per_slot = KVPool.bytes_per_slot(
        model_config.num_hidden_layers, model_config.num_key_value_heads, model_config.head_dim,
        kv_storage_dtype(config.kv_cache_dtype, dtype),
    )
    draft_slot, draft_weights = draft
    if config.max_total_tokens is not None:
        if config.max_total_tokens < 16:
            raise ConfigError("max_total_tokens must be >= 16")
        return int(config.max_total_tokens)
    if device == "cuda":
        fraction = config.mem_fraction_static or DEFAULT_MEM_FRACTION_STATIC
        if not 0.0 < fraction < 1.0:
            raise ConfigError(f"mem_fraction_static must be in (0, 1), got {fraction}")
        if weight_bytes == 0:
            positions = config.context_length or model_config.max_position_embeddings
            weight_bytes = estimate_weight_bytes(model_config, dtype, positions, config.tp_size,
                                                 config.quantization, config.quantize_lm_head or fp8_lm_head)
        free, total = torch.cuda.mem_get_info()
        budget = int(total * fraction) - (total - free) - weight_bytes - draft_weights
        if budget <= per_slot * 16:
            raise ConfigError(
                f"not enough GPU memory for the KV cache (budget {budget / 2**30:.2f} GiB at "
                f"mem_fraction_static={fraction}); raise mem_fraction_static or use a smaller model"
            )
        logger.info(
            "KV cache budget: %.2f GiB = %.2f x %.2f GiB total - %.2f GiB in use - %.2f GiB weights%s",
            budget / 2**30, fraction, total / 2**30, (total - free) / 2**30, weight_bytes / 2**30,
            f" - {draft_weights / 2**30:.2f} GiB draft weights; the draft's KV {draft_slot} bytes per token"
            if draft_slot else "",
        )
        return budget // (per_slot + draft_slot)  # NOTE: with tp_size > 1 a rank holds fewer KV heads: conservative
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        avail = CPU_KV_BUDGET_BYTES * 4
    budget = min(CPU_KV_BUDGET_BYTES, avail // 4)
    return max(budget // per_slot, 1024)


def resolve_config(
    config: ServerConfig, model_config: ModelConfig, model_path: str, weight_bytes: int = 0
) -> ServerConfig:
    """A new ServerConfig with every "auto"/None engine value filled in."""
    device = resolve_device(config)
    dtype = resolve_dtype(config, device)
    quantization, kv_cache_dtype, lowlat = resolve_fp8(config, model_config, device, dtype)
    config = config.replace(quantization=quantization, kv_cache_dtype=kv_cache_dtype, lowlat_plugins=lowlat)
    fp8_head = quantization == "fp8" and checkpoint_lm_head_is_fp8(model_path)
    if fp8_head and config.tp_size > 1:
        raise ConfigError(f"{model_path} stores its LM head in FP8; tensor parallelism shards model-dtype LM heads "
                          "only: use tp_size 1")
    fp8_head = fp8_head and device == "cuda" and weight_bytes == 0
    draft = draft_memory(config, dtype, model_config) if device == "cuda" else (0, 0)
    kv_tokens = resolve_kv_tokens(config, model_config, device, dtype, weight_bytes, fp8_head, draft)
    kv_tokens -= kv_tokens % config.page_size
    context = config.context_length or model_config.max_position_embeddings
    if context < 2:
        raise ConfigError("context_length must be >= 2")
    # NOTE: a lone request must always fit in the KV cache, so retraction can always make progress
    context = min(context, kv_tokens)
    running = config.max_running_requests
    if running is None:
        running = GPU_MAX_RUNNING_REQUESTS if device == "cuda" else CPU_MAX_RUNNING_REQUESTS
        running = max(1, min(running, kv_tokens // 16))
    gpu_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory if device == "cuda" else 0
    graph_max_bs = resolve_cuda_graph_max_bs(config.cuda_graph_max_bs, device, gpu_bytes, running)
    if config.cuda_graph_extend_max_reads is not None and config.cuda_graph_extend_max_reads < 1:
        # checked here too, not only where graphs are built: a bad value fails on a machine without graphs as well
        raise ConfigError(f"cuda_graph_extend_max_reads must be >= 1, got {config.cuda_graph_extend_max_reads}")
    for name in ("cuda_graph_prefill_max_tokens", "cuda_graph_prefill_max_requests"):
        if getattr(config, name) is not None and getattr(config, name) < 1:
            raise ConfigError(f"{name} must be >= 1, got {getattr(config, name)}")
    backend = resolve_attention_backend(config.attention_backend, device)
    overlap = config.enable_overlap_schedule
    if overlap is None:  # NOTE: measured on the H200 (benchmarks/RESULTS.md); no gain on CPUs, off under TP
        overlap = device == "cuda" and config.tp_size == 1
    return config.replace(
        enable_overlap_schedule=overlap,
        enable_cuda_graph_prefill=resolve_prefill_graphs(config.enable_cuda_graph_prefill, device, config.tp_size),
        chunked_prefill_size=resolve_chunked_prefill_size(config.chunked_prefill_size, device),
        prefill_step_target_ms=resolve_prefill_step_target_ms(config.prefill_step_target_ms, device),
        decode_step_target_ms=resolve_decode_step_target_ms(config.decode_step_target_ms),
        decode_step_slowdown=resolve_decode_step_slowdown(config.decode_step_slowdown, device),
        model_path=model_path,
        device=device,
        dtype=dtype,
        max_total_tokens=kv_tokens,
        context_length=context,
        max_running_requests=running,
        cuda_graph_max_bs=graph_max_bs,
        attention_backend=backend,
        mem_fraction_static=config.mem_fraction_static or (DEFAULT_MEM_FRACTION_STATIC if device == "cuda" else None),
    )


def engine_kv_pool_options(config: ServerConfig, model: torch.nn.Module, lowlat: Any = None) -> dict[str, Any]:
    """KVPool keyword arguments of an engine's KV pool from its resolved `config`: rank 0's and every
    tensor-parallel follower's alike (each with its own `model` and `LowlatHook` or None). An FP8
    cache stores K in the Hadamard basis unless a lowlat plugin serves decode steps: the plugins
    write and read K unrotated (forward/kv_pool.py), and every path of every rank must see one basis."""
    plugin = lowlat.session.selected if lowlat is not None else None
    return kv_cache_options(config.kv_cache_dtype, model, rotate_k=plugin is None)


def kv_cache_options(kv_cache_dtype: str, model: torch.nn.Module | None = None,
                     rotate_k: bool = True) -> dict[str, Any]:
    """KVPool keyword arguments of a resolved `kv_cache_dtype` ("fp8_e4m3" or the model dtype's
    name): the FP8 storage dtype, K in the Hadamard basis (`KVPool` `rotate_k`: off when a reader that
    does not rotate q writes or reads the cache, i.e. a lowlat plugin) and the checkpoint's per-layer
    scales (`model`'s `fp8_kv_scales`, 1.0 where absent); nothing for a model-dtype cache."""
    if kv_cache_dtype != "fp8_e4m3":
        return {}
    from lmserver.models.quantization import FP8_KV_SCALES_ATTR

    scales: dict[int, dict[str, float]] = getattr(model, FP8_KV_SCALES_ATTR, None) or {}
    if not scales:
        return {"kv_cache_dtype": FP8_DTYPE, "rotate_k": rotate_k}
    layers = 1 + max(scales)
    config = getattr(model, "config", None)
    layers = max(layers, int(getattr(config, "num_hidden_layers", layers)))
    return {
        "kv_cache_dtype": FP8_DTYPE,
        "rotate_k": rotate_k,
        "k_scales": [scales.get(i, {}).get("k", 1.0) for i in range(layers)],
        "v_scales": [scales.get(i, {}).get("v", 1.0) for i in range(layers)],
    }
