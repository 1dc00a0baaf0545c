"""Prometheus metrics of the server, in a registry owned by one `ServerMetrics` object."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from lmserver.edge.tokenizer_manager import GenState

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5)


class ServerMetrics:
    """Request counters and latency histograms (updated by the tokenizer manager) and gauges
    mirrored from the core's periodic stats. `render()` gives the exposition text."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("lmserver_requests", "finished requests", ["finish_reason"], registry=r)
        self.http_requests = Counter("lmserver_http_requests", "HTTP requests answered", ["path", "status"],
                                     registry=r)
        self.prompt_tokens = Counter("lmserver_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("lmserver_generation_tokens", "generated tokens", registry=r)
        self.cached_tokens = Counter("lmserver_cached_tokens", "prompt tokens served from the cache", registry=r)
        self.running = Gauge("lmserver_num_running_reqs", "running requests in the core", registry=r)
        self.waiting = Gauge("lmserver_num_waiting_reqs", "waiting requests in the core", registry=r)
        self.kv_usage = Gauge("lmserver_token_usage", "fraction of the KV cache in use", registry=r)
        self.cache_hit_rate = Gauge("lmserver_cache_hit_rate", "prompt tokens served from the cache / prompt tokens",
                                    registry=r)
        self.spec_accept_length = Gauge("lmserver_spec_accept_length",
                                        "speculative decoding: tokens emitted per verified request step", registry=r)
        self.spec_accept_rate = Gauge("lmserver_spec_accept_rate",
                                      "speculative decoding: accepted draft tokens / draft tokens", registry=r)
        self.mm_encoder_cache_hit_rate = Gauge("lmserver_mm_encoder_cache_hit_rate",
                                               "vision-encoder cache hits / lookups", registry=r)
        self.mm_radix_hit_rate = Gauge("lmserver_mm_radix_hit_rate",
                                       "image / video tokens served from the radix cache / such tokens", registry=r)
        # the host KV tier (--enable-hierarchical-cache); cumulative counts mirrored from the core
        self.hicache = {
            key: Gauge(f"lmserver_{key}", doc, registry=r) for key, doc in (
                ("hicache_host_hits", "prefix matches that loaded KV back from the host tier"),
                ("hicache_loaded_tokens", "tokens of KV loaded back from the host tier"),
                ("hicache_offloaded_tokens", "tokens of KV copied from the device to the host tier"),
                ("hicache_dropped_tokens", "tokens of KV evicted from the device without a host copy"),
                ("hicache_host_used_slots", "host KV pool slots holding cached KV"),
                ("hicache_host_usage", "fraction of the host KV pool holding cached KV"),
            )
        }
        self.ttft = Histogram("lmserver_time_to_first_token_seconds", "time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("lmserver_time_per_output_token_seconds", "time per output token after the first",
                              buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("lmserver_e2e_request_latency_seconds", "end-to-end request latency",
                             buckets=_LATENCY_BUCKETS, registry=r)

    def observe_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_aborted(self) -> None:
        """A request that ended before finishing (client disconnect)."""
        self.requests.labels(finish_reason="abort").inc()

    def observe_finished(self, state: GenState) -> None:
        reason = (state.finish_reason or {}).get("type", "unknown")
        self.requests.labels(finish_reason=str(reason)).inc()
        self.prompt_tokens.inc(state.prompt_tokens)
        self.generation_tokens.inc(state.completion_tokens)
        self.cached_tokens.inc(state.cached_tokens)
        self.e2e.observe(state.e2e_latency)
        if state.first_token_time is not None and state.finish_time is not None and state.completion_tokens > 1:
            self.tpot.observe((state.finish_time - state.first_token_time) / (state.completion_tokens - 1))

    def update_core_stats(self, stats: dict[str, Any]) -> None:
        """Mirrors the core's `get_stats()` keys that exist (missing keys leave a gauge as is)."""
        stats = {"token_usage": stats.get("kv_usage"), **stats}
        for key, gauge in (("num_running_reqs", self.running), ("num_waiting_reqs", self.waiting),
                           ("token_usage", self.kv_usage), ("cache_hit_rate", self.cache_hit_rate),
                           ("spec_accept_length", self.spec_accept_length), ("spec_accept_rate", self.spec_accept_rate),
                           ("mm_encoder_cache_hit_rate", self.mm_encoder_cache_hit_rate),
                           ("mm_radix_hit_rate", self.mm_radix_hit_rate)):
            value = stats.get(key)
            if isinstance(value, (int, float)):
                gauge.set(value)
        for key, gauge in self.hicache.items():
            value = stats.get(key)
            if isinstance(value, (int, float)):
                gauge.set(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)
