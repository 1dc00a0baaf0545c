"""Assembles the parts of an `EngineCore` from a `ServerConfig`, in one pass.

The config is resolved once: the "auto" values (`runner.resolve.resolve_config`), then the one
value that needs the loaded model (the KV budget a lowlat workspace takes), and the result is
logged once, before any part that reads the budget is built. Every part is then built once, in
dependency order, from that config; none is replaced afterwards (the tensor-parallel runner is
the wrapped runner from the start of the core's life; overlap is decided once).

    parts = EngineBuilder(config).build()      # what EngineCore(config) does
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lmserver.config import ServerConfig
from lmserver.engine.constrained import ConstrainedDecoding
from lmserver.engine.multimodal import MultimodalInputs
from lmserver.engine.speculative import SpecConfig, Speculator
from lmserver.forward.kv_pool import KVPool, make_req_to_token
from lmserver.io_struct import InvalidRequestError
from lmserver.models.config import ModelConfig
from lmserver.models.default_model import default_model_path
from lmserver.models.loader import DTYPES, load_model, read_model_config
from lmserver.runner.attention.registry import default_registry
from lmserver.runner.cuda_graph import maybe_decode_graph_runner
from lmserver.runner.draft_model import DraftModel
from lmserver.runner.eagle import EagleProposer, SharedTargetModules, eagle3_aux_layers
from lmserver.runner.host_kv import HostKVPool
from lmserver.runner.lowlat_hook import LowlatHook, warmup_batch_sizes
from lmserver.runner.model_runner import ModelRunner
from lmserver.runner.prefill_graph import maybe_prefill_graph_runner
from lmserver.runner.resolve import (
    SMALL_GPU_GRAPH_MAX_BS,
    engine_kv_pool_options,
    prefill_pacer,
    resolve_config,
    step_budget,
)
from lmserver.runner.tp_engine import TPContext, start_tensor_parallel
from lmserver.scheduler import KVManager, Scheduler
from radixcache import KVTransfer

logger = logging.getLogger(__name__)


@dataclass
class EngineParts:
    """Everything an `EngineCore` steps with, built from `config` (resolved, final, logged)."""

    model_path: str
    model_config: ModelConfig
    config: ServerConfig
    device: torch.device
    dtype: torch.dtype
    tokenizer: Any
    model: torch.nn.Module
    lowlat: LowlatHook | None
    tp: TPContext | None  # rank 0's handle when tp_size > 1
    kv_manager: KVManager
    kv_pool: KVPool
    host_kv: HostKVPool | None
    req_to_token: torch.Tensor
    runner: Any  # a ModelRunner, or the TP runner that broadcasts each decision to the followers
    mm: MultimodalInputs | None
    scheduler: Scheduler
    eos_token_ids: list[int]
    constrained: ConstrainedDecoding
    spec: Speculator | None
    overlap: bool  # the overlap schedule (CUDA, one rank, no speculative decoding)


def model_path_of(config: ServerConfig) -> str:
    """The model folder of `config`: the embedded default model's (converted once) when unset."""
    if config.model_path is None:
        return str(default_model_path())
    path = str(config.model_path)
    if not Path(path).is_dir():
        raise InvalidRequestError(f"model_path {path!r} is not a folder")
    return path


class EngineBuilder:
    """One `build()` of an engine's parts from `config` (see the module docstring)."""

    def __init__(self, config: ServerConfig) -> None:
        self.requested = config

    def build(self) -> EngineParts:
        requested = self.requested
        model_path = model_path_of(requested)
        mc = read_model_config(model_path)
        rc = resolve_config(requested, mc, model_path)
        device, dtype = torch.device(rc.device), DTYPES[rc.dtype]
        assert rc.context_length is not None and rc.max_total_tokens is not None  # resolved
        context_length: int = rc.context_length
        from transformers import AutoTokenizer  # lazy: importing the engine does not import transformers

        tokenizer = AutoTokenizer.from_pretrained(rc.tokenizer_path or model_path)
        lowlat = LowlatHook.start(rc.lowlat_plugins, mc, rc.dtype, rc.device, rc.tp_size, context_length,
                                  quantization=rc.quantization, kv_cache_dtype=rc.kv_cache_dtype)
        model = load_model(mc, model_path, load_format=rc.load_format, dtype=dtype, device=device,
                           max_positions=context_length, seed=rc.random_seed,
                           disable_fused_kernels=rc.disable_fused_kernels, quantization=rc.quantization,
                           quantize_lm_head=rc.quantize_lm_head)
        tp: TPContext | None = None
        draft_target: torch.nn.Module = model  # the modules an EAGLE head reads (its embedding and LM head)
        if rc.tp_size > 1 and rc.speculative_algorithm == "eagle":
            # NOTE: sharding replaces them by vocabulary shards whose forwards need every rank; the head runs on rank
            # 0 alone, over the full modules kept here (the ones it reads stay in memory: draft_memory counts them)
            draft_target = SharedTargetModules.of(model)
        if rc.tp_size > 1:  # shards the model: lowlat checks and builds on this rank's shard
            specs = lowlat.session.registry.specs() if lowlat is not None else ()
            tp = start_tensor_parallel(rc, mc, model_path, model, specs)
        try:
            if lowlat is not None:  # every rank agrees and takes the same workspace off its KV budget
                workspace = lowlat.after_load(model, device, dtype, tp.group if tp is not None else None)
                if workspace and requested.max_total_tokens is None:
                    rc = rc.replace(max_total_tokens=lowlat.kv_tokens(rc.max_total_tokens, workspace, mc, dtype))
            assert rc.max_total_tokens is not None and rc.max_running_requests is not None  # resolved
            assert rc.chunked_prefill_size is not None  # resolved
            # the config is final here: logged once, and every part below is built from it
            logger.info("lmserver engine config (resolved): %s", rc.to_dict())
            kv_manager = KVManager(rc.max_total_tokens, rc.page_size, rc.disable_radix_cache)
            if tp is not None:
                tp.share_num_slots(kv_manager.buffer_size)
            # NOTE: the TP followers build theirs with the same options (runner/tp_engine.py follower_main)
            kv_pool = KVPool(kv_manager.buffer_size, mc.num_hidden_layers,
                             tp.local_kv_heads if tp else mc.num_key_value_heads, mc.head_dim,
                             dtype, device, **engine_kv_pool_options(rc, model, lowlat))
            kv_pool.zero_padding(rc.page_size)
            host_kv = start_host_tier(rc, kv_pool, kv_manager, tp) if rc.enable_hierarchical_cache else None
        except BaseException:
            if tp is not None:  # the followers wait for the slot counts or a decision: tell them to stop instead
                tp.shutdown()
            raise
        req_to_token = make_req_to_token(rc.max_running_requests, context_length, device)
        runner = self._runner(rc, mc, model, kv_pool, req_to_token, device, lowlat, kv_manager.buffer_size)
        mm: MultimodalInputs | None = None  # images / videos (a model with a vision encoder)
        if MultimodalInputs.supported(model):  # NOTE: rank 0 encodes; TP followers get the rows with each decision
            mm = MultimodalInputs(model, device, dtype, rc.mm_encoder_cache_size)
            if not rc.disable_cuda_graph:
                mm.capture_encoder_graphs()
        scheduler = Scheduler(
            kv_manager,
            max_running_requests=rc.max_running_requests,
            max_prefill_tokens=rc.max_prefill_tokens,
            chunked_prefill_size=rc.chunked_prefill_size,
            schedule_policy=rc.schedule_policy,
            aging_rounds=rc.schedule_aging_rounds,
            enable_mixed_chunk=rc.enable_mixed_chunk,
            pacer=prefill_pacer(rc),
            admission=step_budget(rc),
        )
        eos = set(mc.eos_token_ids)
        if getattr(tokenizer, "eos_token_id", None) is not None:
            eos.add(int(tokenizer.eos_token_id))
        eos_token_ids = sorted(eos)
        constrained = ConstrainedDecoding(
            tokenizer, mc.vocab_size, eos_token_ids,
            disable_jump_forward=rc.disable_jump_forward, compile_timeout_s=rc.grammar_compile_timeout_s,
            jump_forward_min_tokens=rc.jump_forward_min_tokens, device=device,
            compile_workers=rc.grammar_compile_workers, max_pending_compiles=rc.grammar_max_pending,
            strict=rc.grammar_strict, max_grammar_length=rc.grammar_max_length,
        )
        spec = self._speculator(rc, mc, draft_target, device, dtype)
        return EngineParts(
            model_path=model_path, model_config=mc, config=rc, device=device, dtype=dtype, tokenizer=tokenizer,
            model=model, lowlat=lowlat, tp=tp, kv_manager=kv_manager, kv_pool=kv_pool, host_kv=host_kv,
            req_to_token=req_to_token, runner=tp.wrap_runner(runner) if tp is not None else runner, mm=mm,
            scheduler=scheduler, eos_token_ids=eos_token_ids, constrained=constrained, spec=spec,
            overlap=overlap_schedule(rc, tp is not None, spec is not None),
        )

    @staticmethod
    def _runner(rc: ServerConfig, mc: ModelConfig, model: torch.nn.Module, kv_pool: KVPool,
                req_to_token: torch.Tensor, device: torch.device, lowlat: LowlatHook | None,
                num_slots: int) -> ModelRunner:
        """The model runner with everything attached before its decode graphs are captured: hidden
        states kept for EAGLE, lowlat's dispatcher, cascade attention; then the graphs."""
        backend = default_registry().create(rc.attention_backend, kv_pool, req_to_token)
        runner = ModelRunner(model, kv_pool, req_to_token, backend, device)
        runner.keep_hidden = rc.speculative_algorithm == "eagle"
        if runner.keep_hidden and rc.speculative_draft_model_path:
            aux = eagle3_aux_layers(rc.speculative_draft_model_path, mc.num_hidden_layers)
            if aux is not None:  # an EAGLE-3 head reads the residual stream after three target layers (the
                # model's forward and the lowlat plugin path both leave them in model.model.aux_hidden)
                model.model.aux_layers = aux  # type: ignore[union-attr]
                runner.aux_hidden = True
        if lowlat is not None:
            lowlat.attach(model, kv_pool, req_to_token, num_slots, warmup_batch_sizes(rc.disable_cuda_graph, device.type))
            runner.lowlat = lowlat
        if not rc.disable_cascade_attention:  # NOTE: every TP rank does it here, before its graph capture
            runner.enable_cascade()
        runner.cuda_graph = maybe_decode_graph_runner(rc, runner, rc.tp_size)  # None on CPU
        runner.prefill_graph = maybe_prefill_graph_runner(rc, runner, rc.tp_size)  # None unless asked for
        return runner

    @staticmethod
    def _speculator(rc: ServerConfig, mc: ModelConfig, draft_target: torch.nn.Module, device: torch.device,
                    dtype: torch.dtype) -> Speculator | None:
        """Speculative decoding (engine/speculative.py) with its draft source, or None. `draft_target`: the target's
        modules an EAGLE head reads (the target itself, or its full embedding and LM head under tensor parallelism)."""
        if rc.speculative_algorithm is None:
            return None
        assert rc.context_length is not None and rc.max_running_requests is not None
        assert rc.max_total_tokens is not None
        spec_config = SpecConfig(rc.speculative_algorithm, rc.speculative_num_draft_tokens,
                                 rc.speculative_ngram_min_match, rc.speculative_ngram_max_match,
                                 rc.speculative_simulate_accept_length, rc.speculative_draft_model_path)
        draft: DraftModel | None = None
        draft_graph_max_bs = 0 if rc.disable_cuda_graph else min(rc.cuda_graph_max_bs or SMALL_GPU_GRAPH_MAX_BS,
                                                                  rc.max_running_requests)
        if spec_config.algorithm == "eagle":
            assert spec_config.draft_model_path is not None
            draft = EagleProposer(spec_config.draft_model_path, target=draft_target, target_config=mc,
                                  dtype=dtype, device=device, context_length=rc.context_length,
                                  max_requests=rc.max_running_requests, num_slots=rc.max_total_tokens,
                                  attention_backend=rc.attention_backend, load_format=rc.load_format,
                                  seed=rc.random_seed, graph_max_bs=draft_graph_max_bs,
                                  chain_steps=spec_config.num_draft_tokens - 1)
        elif spec_config.draft_model_path is not None:
            draft = DraftModel(spec_config.draft_model_path, target_vocab_size=mc.vocab_size, dtype=dtype,
                               device=device, context_length=rc.context_length,
                               max_requests=rc.max_running_requests, num_slots=rc.max_total_tokens,
                               attention_backend=rc.attention_backend, graph_max_bs=draft_graph_max_bs,
                               chain_steps=spec_config.num_draft_tokens, load_format=rc.load_format,
                               seed=rc.random_seed)
        return Speculator(spec_config, rc.context_length, draft)


def overlap_schedule(rc: ServerConfig, tensor_parallel: bool, speculative: bool) -> bool:
    """Whether the overlap schedule runs: asked for, one rank (followers mirror host decisions),
    no speculative decoding (a step's drafts need its tokens); says why when it is turned off."""
    if not rc.enable_overlap_schedule:
        return False
    if tensor_parallel:
        logger.warning("overlap schedule: off with tp_size=%d (followers mirror host decisions)", rc.tp_size)
        return False
    if speculative:
        logger.info("overlap schedule: off with speculative decoding (a step's drafts need its tokens)")
        return False
    return True


def start_host_tier(rc: ServerConfig, kv_pool: KVPool, kv_manager: KVManager, tp: TPContext | None = None
                    ) -> HostKVPool:
    """The host KV pool (`--host-kv-size-gb` per rank, auto twice the device pool) behind the radix cache (radixcache's
    HierarchicalCache); with tensor parallelism each rank holds its KV heads' share of every host slot and rank 0's
    copies are mirrored to the followers (`tp.mirror_host_kv`). Refuses what it does not cover."""
    per_slot = HostKVPool.bytes_per_slot(kv_pool)
    node_ranks = rc.tp_size // rc.nnodes  # the ranks of this machine each hold a host pool of this size
    free_bytes = HostKVPool.available_host_bytes() // node_ranks
    if rc.host_kv_size_gb is None:  # twice the device pool, at most half the free host memory
        host_slots = min(2 * kv_manager.num_slots, free_bytes // 2 // per_slot)
    elif rc.host_kv_size_gb > 0:
        host_slots = int(rc.host_kv_size_gb * 1e9) // per_slot
        if host_slots * per_slot > 0.9 * free_bytes:
            raise ValueError(f"--host-kv-size-gb {rc.host_kv_size_gb} is more than 90% of the host's free memory "
                             f"({free_bytes / 1e9:.1f} GB{f' per rank of {node_ranks}' if node_ranks > 1 else ''}); "
                             "ask for less")
    else:
        raise ValueError(f"--host-kv-size-gb must be > 0, got {rc.host_kv_size_gb}")
    host_slots -= host_slots % rc.page_size
    host = HostKVPool(kv_pool, host_slots + rc.page_size, io_backend=rc.hicache_io_backend)  # + padding page
    transfer: KVTransfer = host if tp is None else tp.mirror_host_kv(host)
    kv_manager.enable_host_tier(host_slots, transfer, rc.hicache_write_policy)  # type: ignore[arg-type]
    logger.info("hierarchical cache: host KV pool of %d tokens (%.2f GB%s, %s, io %s)", host_slots,
                host_slots * per_slot / 1e9, " per rank" if tp is not None else "", rc.hicache_write_policy,
                host.io_backend)
    return host
