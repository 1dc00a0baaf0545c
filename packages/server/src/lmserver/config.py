"""The one config object of lmserver. The CLI is generated from its fields (`help` metadata).

"auto" values are resolved once, by the engine at start-up, into a new object that is logged
once (see DESIGN.md principle 4). Fields are added here, never renamed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

REDACTED = "***"


def _opt(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass(frozen=True)
class ServerConfig:
    # Model
    model_path: str | None = _opt(None, "HF-style model folder; default: the embedded SmolLM2-135M-Instruct")
    tokenizer_path: str | None = _opt(None, "tokenizer folder; default: model_path")
    served_model_name: str | None = _opt(None, "model name reported by /v1/models; default: the model folder's name")
    strict_model_name: bool = _opt(False, "answer 404 to OpenAI requests naming another model (default: any name is "
                                          "served by this model, as SGLang does)")
    load_format: str = _opt("auto", "weights: auto (safetensors) or dummy (random, any config)", ("auto", "dummy"))
    dtype: str = _opt("auto", "auto: bfloat16 on GPU, float32 on CPU", ("auto", "float32", "bfloat16", "float16"))
    device: str = _opt("auto", "auto: cuda when available, else cpu", ("auto", "cuda", "cpu"))
    context_length: int | None = _opt(None, "max tokens per request (prompt + output); default: the model's")
    random_seed: int = _opt(0, "seed for dummy weights and default sampling")
    # Memory and scheduling
    mem_fraction_static: float | None = _opt(None, "fraction of GPU memory for weights + KV cache (auto: 0.85)")
    max_total_tokens: int | None = _opt(None, "KV-cache size in tokens (overrides mem_fraction_static)")
    max_running_requests: int | None = _opt(None, "max concurrently running requests (auto from KV size)")
    max_prefill_tokens: int = _opt(16384, "max new prompt tokens admitted per prefill batch")
    chunked_prefill_size: int | None = _opt(None, "prefill chunk size in tokens; -1 disables chunking; auto: 512 on "
                                                  "CPU (a long prompt never stalls running requests for long), 8192 "
                                                  "on CUDA")
    enable_mixed_chunk: bool = _opt(True, "while requests decode, prefill chunks ride in the same step as their "
                                          "decode rows (a long prompt never pauses running streams)")
    prefill_step_target_ms: float | None = _opt(None, "while requests decode, size each mixed step's prefill part so "
                                                      "the step takes about this long (their gap between two "
                                                      "tokens); 0: full chunks; auto: 60 on CUDA, 500 on CPU")
    decode_step_target_ms: float | None = _opt(None, "SLO admission: while requests decode, a waiting request is "
                                                     "admitted only while the predicted decode step stays within "
                                                     "this (their gap between two tokens, learned from measured "
                                                     "steps) and the prefill steps it costs are paid for by steps "
                                                     "below it (lmserver.scheduler.admission); new requests wait "
                                                     "instead; None or 0: off (then --decode-step-slowdown "
                                                     "applies)")
    decode_step_slowdown: float | None = _opt(None, "SLO admission by a relative target (when no "
                                                    "--decode-step-target-ms is set): a request that started with "
                                                    "nothing waiting keeps its decode step within this multiple "
                                                    "of the step of the batch it started in (the step fitted to "
                                                    "measured steps, a + b * rows); requests arriving while such "
                                                    "requests decode wait instead of slowing them more (requests "
                                                    "admitted from a backlog protect nothing: bursts and offline "
                                                    "batches run as memory allows); auto: 1.05 on CUDA, off on "
                                                    "CPU; 0: off")
    schedule_policy: str = _opt("lpm", "waiting-queue order", ("lpm", "dfs-weight", "fcfs"))
    schedule_aging_rounds: int = _opt(64, "a waiting request is served first after this many passed-over rounds")
    page_size: int = _opt(1, "KV-cache page size in tokens")
    disable_radix_cache: bool = _opt(False, "no prefix reuse (same code path, nothing cached)")
    enable_hierarchical_cache: bool = _opt(False, "host-memory KV tier (HiCache): KV evicted from the device pool "
                                                  "is copied to a pinned host pool and loaded back on a later "
                                                  "prefix match instead of being recomputed")
    host_kv_size_gb: float | None = _opt(None, "host KV pool size in GB per tensor-parallel rank for "
                                               "--enable-hierarchical-cache (auto: twice the device KV pool, at most "
                                               "half the free host memory)")
    hicache_write_policy: str = _opt("write_back", "host tier: write_back copies KV to the host when the device "
                                                   "evicts it; write_through copies each cached prefix at once",
                                     ("write_back", "write_through"))
    hicache_io_backend: str = _opt("auto", "host tier copies: kernel (GPU kernels read and write the pinned host pool "
                                           "through unified addressing), direct (one DMA per run of host slots), "
                                           "auto (kernel where the device can address the host pool)",
                                    ("auto", "kernel", "direct"))
    # Kernels and graphs
    attention_backend: str = _opt("auto", "attention kernels", ("auto", "torch_native", "triton", "triton_cudnn", "flashinfer"))
    disable_cuda_graph: bool = _opt(False, "run decode eagerly")
    enable_cuda_graph_extend: bool = _opt(True, "an extend of few new tokens (a short prompt, a radix hit's suffix, "
                                                "a small mixed step) replays a decode CUDA graph, one decode row "
                                                "per token, instead of running eagerly (--no-enable-cuda-graph-"
                                                "extend: eagerly)")
    cuda_graph_extend_max_reads: int | None = _opt(None, "graph extends: at most this many token reads per layer (the sum "
                                                         "over the extend's requests of new tokens x context); "
                                                         "longer extends run eagerly (auto: 32,768)")
    enable_cuda_graph_prefill: bool | None = _opt(None, "an extend of up to --cuda-graph-prefill-max-tokens new "
                                                         "tokens replays a CUDA graph captured for its padded token "
                                                         "count (a medium prompt's launches cost more host time than "
                                                         "its device work; triton attention backend); default: on "
                                                         "with CUDA and tp_size 1 (with tp_size > 1 when asked for)")
    cuda_graph_prefill_max_tokens: int | None = _opt(None, "prefill graphs: the largest token count captured "
                                                           "(auto: 2,048)")
    cuda_graph_prefill_max_requests: int | None = _opt(None, "prefill graphs: the most requests of one captured "
                                                             "extend (auto: 16, at most max_running_requests)")
    disable_cascade_attention: bool = _opt(False, "decode attention reads a KV prefix shared by several running "
                                                  "requests once per request, not once per group (cascade "
                                                  "attention off; triton backend)")
    disable_fused_kernels: bool = _opt(False, "run norms, RoPE and the MLP activation as plain torch ops instead of "
                                              "the fused Triton kernels (CUDA)")
    cuda_graph_max_bs: int | None = _opt(None, "largest decode batch captured in a CUDA graph (auto: 256 on GPUs "
                                                "with >= 64 GiB, else 32; at most max_running_requests)")
    enable_tp_cuda_graph: bool = _opt(True, "capture decode CUDA graphs on every rank under tensor parallelism "
                                            "(--no-enable-tp-cuda-graph: eager decode under TP)")
    enable_overlap_schedule: bool | None = _opt(None, "overlap the host work of a decode step (sampling results, "
                                                      "detokenizing, scheduling) with the device forward of the next "
                                                      "one; default: on with CUDA and tp_size 1")
    lowlat_plugins: str | None = _opt(None, "low-latency decode plugins (lowlat): off, auto, or require:<name>; "
                                            "a '+all-batches' suffix also runs the plugin at batches where it "
                                            "measured slower than the generic path, '+measured-only' leaves GPUs "
                                            "and shapes without a measured table to the generic path; default: "
                                            "auto+measured-only on a CUDA GPU (the plugin takes the batches its "
                                            "measured tables say it wins), off on the CPU")
    # Quantization (FP8, lmserver.models.quantization)
    quantization: str | None = _opt(None, "weights: fp8 quantizes an unquantized checkpoint to FP8 e4m3 when it "
                                          "loads (decoder projections, per-channel scales); an FP8 checkpoint "
                                          "(quantization_config fp8 or compressed-tensors) is read as FP8 without "
                                          "it; FP8 needs a CPU or a GPU of compute capability >= 8.9", ("fp8",))
    kv_cache_dtype: str = _opt("auto", "KV-cache storage: auto (the model's dtype) or fp8_e4m3 (float8_e4m3fn, half "
                                       "the bytes: twice the tokens; one K and one V scale per layer, 1.0 or the "
                                       "checkpoint's k_scale / v_scale)", ("auto", "fp8_e4m3"))
    quantize_lm_head: bool = _opt(False, "also make the LM head FP8 e4m3 (per-row scales, the decode GEMV reads half "
                                         "the bytes; TensorRT-LLM / ModelOpt's quantize_lm_head): changes the logits "
                                         "(accuracy: benchmarks/RESULTS.md, FP8 (issue 33)); needs FP8 weights "
                                         "(--quantization fp8 or an FP8 checkpoint); tied embeddings are untied, the "
                                         "embedding stays in the model dtype. A checkpoint whose lm_head is FP8 "
                                         "(e.g. GPTQ-rounded, benchmarks/fp8/gptq_fp8_checkpoint.py --lm-head) "
                                         "loads it as FP8 with or without this option, never re-rounded")
    # Constrained decoding
    disable_jump_forward: bool = _opt(False, "no jump-forward over forced grammar text")
    jump_forward_min_tokens: str = _opt("auto", "a jump-forward that needs an extend round of its own is made when "
                                                "its forced tokens exceed (this - 1) per running request; 1: always; "
                                                "auto: 1 on CPU, 8 on GPU (lmserver.engine.constrained.policy)")
    grammar_compile_timeout_s: float = _opt(30.0, "grammar compile timeout in seconds")
    grammar_compile_workers: int = _opt(-1, "grammar compile worker processes (started with the first grammar); -1: "
                                            "auto (a quarter of the CPU cores, 2 to 8); 0: "
                                           "threads of the engine process, which stall decoding (tests only)")
    grammar_max_pending: int = _opt(256, "distinct grammar compiles queued or running at once; a request needing "
                                         "one more is answered 503")
    grammar_strict: bool = _opt(False, "JSON Schema keywords cfsm can only over-approximate are a 400 by default "
                                       "(per request: sampling_params.json_schema_strict, OpenAI response_format "
                                       "json_schema.strict)")
    grammar_max_length: int = _opt(4 << 20, "longest regex or JSON Schema text accepted, in characters")
    # Tool calling and reasoning output (OpenAI chat API)
    tool_call_parser: str = _opt("auto", "format of the model's tool calls in /v1/chat/completions: auto (from the "
                                         "chat template; qwen/hermes <tool_call> for a template with no tool format, "
                                         "described to the model in the system message), llama3, qwen, mistral, "
                                         "none (tools are refused)", ("auto", "llama3", "qwen", "mistral", "none"))
    reasoning_parser: str = _opt("none", "split <think>...</think> into reasoning_content: none, qwen3 (the output "
                                         "opens <think>), deepseek-r1 (the template opens it)",
                                 ("none", "qwen3", "deepseek-r1"))
    # Speculative decoding
    speculative_algorithm: str | None = _opt(None, "draft tokens verified by the model in one forward, exactly (greedy "
                                                   "outputs unchanged, sampled ones distributed as the model's): ngram "
                                                   "(prompt lookup, no draft model), draft_model (a small model of the "
                                                   "same tokenizer, --speculative-draft-model-path) or eagle (an EAGLE "
                                                   "head reading the target's features, --speculative-draft-model-path)",
                                   ("ngram", "draft_model", "eagle"))
    speculative_draft_model_path: str | None = _opt(None, "draft_model: the draft model's folder (same vocabulary); "
                                                          "eagle: the EAGLE head's folder (published EAGLE layout)")
    speculative_num_draft_tokens: int = _opt(4, "most draft tokens per request and step")
    speculative_ngram_min_match: int = _opt(2, "ngram: shortest suffix looked up in the request's tokens")
    speculative_ngram_max_match: int = _opt(4, "ngram: longest suffix looked up (tried first)")
    speculative_simulate_accept_length: float | None = _opt(None, "benchmarks on random weights only: accept this "
                                                                  "many tokens per step on average whatever the "
                                                                  "logits (outputs are not the model's)")
    # Images and video (multimodal models)
    mm_encoder_cache_size: int = _opt(16384, "vision-encoder outputs kept for repeated images / videos, in embedding "
                                             "rows (a LLaVA-1.5 image is 576); 0: none kept")
    mm_max_image_pixels: int = _opt(25_000_000, "largest image accepted, in pixels (checked before decoding)")
    mm_max_video_frames: int = _opt(64, "most frames sampled from one video")
    mm_max_items: int = _opt(32, "most images + videos in one prompt")
    mm_fetch_timeout_s: float = _opt(10.0, "timeout of fetching one image / video URL, in seconds")
    mm_max_fetch_bytes: int = _opt(64 << 20, "largest image / video accepted (fetched, file or base64), in bytes")
    # Parallelism
    tp_size: int = _opt(1, "tensor-parallel ranks")
    dp_size: int = _opt(1, "data-parallel replicas behind the router")
    router_policy: str = _opt("cache_aware", "how the router picks a replica (dp_size > 1)",
                              ("cache_aware", "round_robin", "shortest_queue"))
    nnodes: int = _opt(1, "number of nodes")
    node_rank: int = _opt(0, "this node's rank")
    dist_init_addr: str | None = _opt(None, "torch.distributed rendezvous host:port for several nodes")
    # HTTP
    host: str = _opt("127.0.0.1", "HTTP host")
    port: int = _opt(30000, "HTTP port")
    # NOTE: a secret: hidden from repr and redacted by to_dict (config logs, /get_server_info)
    api_key: str | None = field(default=None, repr=False, metadata={
        "help": "bearer token required on every endpoint except /health", "choices": None})
    log_level: str = _opt("info", "log level", ("debug", "info", "warning", "error"))
    log_requests: bool = _opt(False, "log each request and its output")
    stream_interval: int = _opt(1, "stream a chunk every this many tokens")
    log_interval_s: float = _opt(10.0, "seconds between periodic stats log lines")
    step_trace: int = _opt(0, "keep the last N records of the running requests' gaps between two tokens (what "
                              "filled each: forwards, grammar admissions, added requests; engine/step_trace.py) "
                              "for /get_step_trace; 0: only the longest gaps (step_gaps_top in the stats)")
    # HTTP limits, streaming and shutdown (issue 32)
    max_request_bytes: int = _opt(32 << 20, "largest request body accepted, in bytes (a 413 otherwise, answered "
                                            "before the body is read; images travel as base64 in bodies)")
    incremental_streaming_output: bool = _opt(False, "native /generate streams: each chunk carries only the new text, "
                                                     "output_ids and output logprobs (SGLang's "
                                                     "--incremental-streaming-output); default: cumulative")
    shutdown_timeout_s: float = _opt(30.0, "on SIGTERM/SIGINT: stop admitting, let running requests finish for this "
                                           "many seconds, then end the rest with a 503 / an SSE error event")

    def replace(self, **changes: Any) -> ServerConfig:
        """A copy with `changes` applied (the config itself is frozen)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self, redact_secrets: bool = True) -> dict[str, Any]:
        """The fields as a dict; secrets (`api_key`) become "***" when set unless `redact_secrets` is False."""
        out = dataclasses.asdict(self)
        if redact_secrets and out.get("api_key") is not None:
            out["api_key"] = REDACTED
        return out


API_KEY_ENV = "LMSERVER_API_KEY"  # the API key, kept out of the process list (`--api-key` wins over it)
