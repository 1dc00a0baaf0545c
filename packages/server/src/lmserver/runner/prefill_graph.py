"""Prefill CUDA graphs: an extend of up to `max_tokens` new tokens replays a graph captured for its padded size.

Eagerly an extend launches ~11 kernels per layer from Python: on the H200 machine's host ~0.7-1.05 ms per layer, so
a prompt of 256-2,048 tokens of the 8B shape spent more time launching than computing (a 256-token FP8 prefill
34.0 ms of wall for 4.9 ms of device work; benchmarks/RESULTS.md "FP8 (issue 33)", tenth session). Short extends
already replay the decode graphs as decode rows (`DecodeGraphRunner.can_run_extend`), but each decode row reads its
whole context, so that path is bounded by rows x context; this one runs the extend attention kernel itself, which
shares every key block across a query tile.

A graph is captured per (token size, request size, has-prefix) at start-up (`PrefillGraphRunner.capture`), all in one
memory pool, over static input buffers:
- token sizes (`prefill_token_sizes`): multiples of 128 up to 1,024, of 256 up to 2,048, of 512 beyond, and
  `max_tokens`; an extend of T new tokens pads to the smallest size >= T;
- request sizes (`request_sizes`): 2 and `max_requests` + 1, an extend of R requests pads to the smallest >= R + 1:
  one request more than it has, the padding request;
- has-prefix: whether any request has cached tokens (the extend kernel for fresh prompts reads no cache; a host fact
  that picks the kernel, so each value is a graph of its own).

Padding (`pad_prefill`): the padding tokens after the real ones form the padding request (table row `pad_row`, no
prefix, positions 0.., KV written to PAD_SLOT, never a real token's slot), so every row of the padded forward is an
ordinary causal prefill of finite values (nothing reads an uninitialized attention output); the remaining request
slots extend nothing (no program of the attention kernel runs for them). The attention plan sees only upper bounds
on the host (every request's extend length = the token size, prefix lengths 0 or 1, `seq_lens_cpu` the table width)
and reads the real lengths on the device; a backend says it can plan so with `supports_extend_graph`.

A replay writes the request-to-token table eagerly (as an eager extend does), copies the padded inputs in one
host-to-device copy, replays, and computes the logits of the rows each item asks for from the graph's final-norm
hidden states (the LM head runs eagerly: its rows vary).

Images: for a multimodal model (one with `embed_tokens`, the input-embedding contract of docs/multimodal.md) every
key is captured a second time over a static input-embedding buffer; an extend with image rows writes the token
embeddings and the image rows there eagerly (`ModelRunner._input_embeds`), then replays that graph (the decoder
overwrites the buffer with its residual stream: it is rewritten before every replay).

On by default with CUDA and one rank (`runner.resolve.resolve_prefill_graphs`; `--no-enable-cuda-graph-prefill`:
eager); under tensor parallelism when asked for (`--enable-cuda-graph-prefill`): every rank captures the same keys at
the same start-up point and replays the key its copy of rank 0's decision implies (`graph_key` is pure), so the
collectives inside line up. With an EAGLE-3 head every graph also writes the target layers' residual stream the head
reads (`aux_out`). Not for a lowlat plugin's own extend path (lmserver gives plugins decode steps only).
"""

from __future__ import annotations

import bisect
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from lmserver.forward.batch import ForwardBatch, ForwardMode
from lmserver.runner.cuda_graph import (
    EAGER_GRAPHS_ENV,
    PAD_SLOT,
    PAD_TOKEN_ID,
    CudaGraphError,
    EagerGraph,
    Graph,
    PinnedStaging,
    TorchCudaGraph,
    checked_graph_factory,
)
from lmserver.runner.host_batch import host_batch
from lmserver.runner.host_tensors import pack_to_device
from lmserver.scheduler.scheduler import ForwardItem, ScheduleDecision

if TYPE_CHECKING:
    from lmserver.config import ServerConfig
    from lmserver.runner.model_runner import MMRows, ModelRunner

# (padded tokens, padded requests, has-prefix, embeds family)
GraphKey = tuple[int, int, bool, bool]

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_PREFILL_GRAPH_MAX_REQUESTS",
    "DEFAULT_PREFILL_GRAPH_MAX_TOKENS",
    "GraphKey",
    "PaddedPrefill",
    "PrefillGraphRunner",
    "maybe_prefill_graph_runner",
    "pad_prefill",
    "prefill_token_sizes",
    "request_sizes",
]

DEFAULT_PREFILL_GRAPH_MAX_TOKENS = 2048  # above it a prefill's device work hides its launches (4k: ~20 of ~61 ms)
DEFAULT_PREFILL_GRAPH_MAX_REQUESTS = 16

# rows of the static int64 buffer: per token (input ids, positions, KV slots), then per request (table rows,
# prefix lengths, extend lengths, first rows, lengths with the new tokens)
_TOKEN_ROWS, _REQUEST_ROWS = 3, 5


def prefill_token_sizes(max_tokens: int) -> list[int]:
    """The token counts captured: multiples of 128 up to 1,024, of 256 up to 2,048, of 512 beyond, up to `max_tokens`
    (always included). Pure; raises ValueError for max_tokens < 1."""
    if max_tokens < 1:
        raise ValueError(f"cuda_graph_prefill_max_tokens must be >= 1, got {max_tokens}")
    sizes = [*range(128, 1024, 128), *range(1024, 2048, 256), *range(2048, max_tokens, 512)]
    return [s for s in sizes if s < max_tokens] + [max_tokens]


def request_sizes(max_requests: int) -> list[int]:
    """The request counts captured, the padding request included: 2 and `max_requests` + 1. Pure; raises ValueError
    for max_requests < 1."""
    if max_requests < 1:
        raise ValueError(f"cuda_graph_prefill_max_requests must be >= 1, got {max_requests}")
    return sorted({2, max_requests + 1})


def _rows(buf: Any, tokens: int, requests: int) -> list[Any]:
    """The 8 rows of a padded extend's flat int64 layout in `buf` (a numpy array or a tensor, sliced alike): per token
    input ids, positions, KV slots; per request table rows, prefix lengths, extend lengths, first rows, lengths."""
    t_end = _TOKEN_ROWS * tokens
    return ([buf[i * tokens:(i + 1) * tokens] for i in range(_TOKEN_ROWS)]
            + [buf[t_end + i * requests:t_end + (i + 1) * requests] for i in range(_REQUEST_ROWS)])


def _smallest_fit(n: int, sizes: Sequence[int]) -> int | None:
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


@dataclass(frozen=True)
class PaddedPrefill:
    """Host arrays of one padded extend (plain data): `ints` (_TOKEN_ROWS x tokens then _REQUEST_ROWS x requests,
    flat, as the static buffer holds them), and the real extend's table writes and wanted logit rows."""

    tokens: int
    requests: int
    ints: np.ndarray  # (3 * tokens + 5 * requests,) int64
    table_index: np.ndarray  # (K,) flat req_to_token positions ...
    table_slots: np.ndarray  # (K,) ... and the slots written there
    logit_idx: np.ndarray  # (L,) rows whose logits the items ask for, in item order
    num_tokens: int  # the real new tokens (the first rows)


def pad_prefill(items: Sequence[ForwardItem], tokens: int, requests: int, pad_row: int,
                table_width: int) -> PaddedPrefill:
    """An extend's items padded to `tokens` rows and `requests` requests (see the module docstring: the padding
    tokens are the padding request's prompt, at table row `pad_row`, written to PAD_SLOT; the request slots after it
    extend nothing). Pure; raises CudaGraphError when the items do not fit."""
    h = host_batch(items, table_width)
    n, r = len(h.input_ids), len(items)
    if n > tokens or r + 1 > requests or n == 0:
        raise CudaGraphError(f"an extend of {n} tokens in {r} requests does not fit {tokens} tokens, {requests} "
                             f"requests (one of them the padding request)")
    pad = tokens - n
    ints = np.zeros(_TOKEN_ROWS * tokens + _REQUEST_ROWS * requests, dtype=np.int64)
    ids, pos, loc, rows, prefix, ext, starts, seq = _rows(ints, tokens, requests)
    ids[:n], pos[:n], loc[:n] = h.input_ids, h.positions, h.out_loc
    ids[n:], pos[n:], loc[n:] = PAD_TOKEN_ID, np.arange(pad), PAD_SLOT
    rows[:r], prefix[:r], ext[:r], starts[:r], seq[:r] = h.rows, h.prefix_lens, h.ext_lens, h.starts, h.seq_lens
    rows[r:], prefix[r:], starts[r:] = pad_row, 0, n
    ext[r], seq[r] = pad, pad  # the padding request; the slots after it: no tokens
    return PaddedPrefill(tokens, requests, ints, h.table_index, h.table_slots, h.logit_idx, n)


class PrefillGraphRunner:
    """Captured extend forwards over static input buffers (see the module docstring). Owns the buffers and graphs;
    mutates the model runner's KV pool and req_to_token on every `forward` (like `ModelRunner.forward`)."""

    def __init__(self, runner: ModelRunner, max_tokens: int = DEFAULT_PREFILL_GRAPH_MAX_TOKENS,
                 max_requests: int = DEFAULT_PREFILL_GRAPH_MAX_REQUESTS, pad_row: int = 0,
                 graph_factory: Callable[[object], Graph] | None = None) -> None:
        self.runner = runner
        self.token_sizes = prefill_token_sizes(max_tokens)
        self.request_sizes = request_sizes(max_requests)
        self.table_width = runner.req_to_token.shape[1]
        self.graph_factory = checked_graph_factory(runner, pad_row, graph_factory)
        self.pad_row = pad_row
        self.device = runner.device
        if not getattr(runner.attn_backend, "supports_extend_graph", False):
            raise CudaGraphError(f"the {getattr(runner.attn_backend, 'name', '?')!r} attention backend cannot plan an "
                                 f"extend inside a captured graph")
        size = _TOKEN_ROWS * self.token_sizes[-1] + _REQUEST_ROWS * self.request_sizes[-1]
        self.ints = torch.zeros(size, dtype=torch.int64, device=self.device)
        # a multimodal model's input embeddings (token rows with image rows written over them), read by the graphs of
        # the embeds family; None: no such family
        embed = getattr(runner.model, "embed_tokens", None)
        self.embeds: torch.Tensor | None = None
        if callable(embed) and not isinstance(embed, torch.nn.Module):
            with torch.no_grad():
                probe = embed(torch.zeros(1, dtype=torch.int64, device=self.device))
            self.embeds = torch.zeros(self.token_sizes[-1], probe.shape[-1], dtype=probe.dtype, device=self.device)
        self._staging = PinnedStaging((size,), self.device)
        # EAGLE-3: the residual stream after the head's target layers (tokens, layers * hidden), written by every graph
        # (a view of it is `runner.last_hidden` after a replay, as the decode graphs' `hidden_out`); None: not kept
        self.aux_out = runner.kept_hidden_buffer(self.token_sizes[-1]) if runner.aux_hidden else None
        # (tokens, requests, has_prefix, embeds) -> graph, and its final-norm hidden states (tokens, hidden)
        self.graphs: dict[GraphKey, Graph] = {}
        self.outputs: dict[GraphKey, torch.Tensor] = {}
        self.num_replays = 0
        self.num_image_replays = 0  # those of the embeds family

    def _static_batch(self, tokens: int, requests: int, has_prefix: bool) -> ForwardBatch:
        ids, pos, loc, rows, prefix, ext, starts, seq = _rows(self.ints, tokens, requests)
        return ForwardBatch(
            mode=ForwardMode.EXTEND, batch_size=requests, input_ids=ids, positions=pos, out_cache_loc=loc,
            req_pool_indices=rows, seq_lens=seq,
            # NOTE: upper bounds, not the lengths: a plan must not freeze a forward's host values
            seq_lens_cpu=[self.table_width] * requests,
            attn_backend=self.runner.attn_backend,
            extend_prefix_lens=prefix, extend_seq_lens=ext, extend_start_loc=starts,
            extend_prefix_lens_cpu=[int(has_prefix)] * requests, extend_seq_lens_cpu=[tokens] * requests,
        )

    def step_fn(self, key: GraphKey) -> Callable[[], torch.Tensor]:
        """One extend forward of the static buffers (what a graph records): attention plan, every layer (from the
        input-embedding buffer for the embeds family); returns the (tokens, hidden) final-norm hidden states."""
        tokens, requests, has_prefix, embeds = key
        batch = self._static_batch(tokens, requests, has_prefix)
        runner = self.runner
        inputs = self.embeds[:tokens] if embeds and self.embeds is not None else None
        aux_out = self.aux_out[:tokens] if self.aux_out is not None else None

        def fn() -> torch.Tensor:
            runner.attn_backend.plan(batch)
            if inputs is not None:
                hidden = runner.model(batch.input_ids, batch.positions, batch, input_embeds=inputs)
            else:
                hidden = runner.model(batch.input_ids, batch.positions, batch)
            if aux_out is not None:
                aux_out.copy_(runner.model.model.aux_hidden)  # type: ignore[union-attr, arg-type]
            return hidden  # type: ignore[no-any-return]

        return fn

    def _warmup_inputs(self, tokens: int, requests: int) -> None:
        """A capture's inputs: all `tokens` rows the padding request's (PAD_SLOT, positions 0..), their embeddings."""
        ids, pos, loc, rows, prefix, ext, starts, seq = _rows(self.ints, tokens, requests)
        ids.fill_(PAD_TOKEN_ID)
        pos.copy_(torch.arange(tokens, device=self.device))
        loc.fill_(PAD_SLOT)
        rows.fill_(self.pad_row)
        prefix.zero_()
        starts.zero_()
        ext.zero_()
        ext[0] = tokens
        seq.copy_(ext)
        if self.embeds is not None:
            self.embeds[:tokens].copy_(self.runner.model.embed_tokens(ids))  # type: ignore[operator]

    @torch.inference_mode()
    def capture(self) -> None:
        """Warms up and captures every (tokens, requests, has-prefix, embeds family) key, largest first; mutates self
        and PAD_SLOT."""
        pool = torch.cuda.graph_pool_handle() if self.graph_factory is TorchCudaGraph else None
        families = (False, True) if self.embeds is not None else (False,)
        for tokens in reversed(self.token_sizes):
            for requests in reversed(self.request_sizes):
                for has_prefix in (True, False):
                    for embeds in families:
                        key = (tokens, requests, has_prefix, embeds)
                        fn = self.step_fn(key)
                        for _ in range(2):  # NOTE: compiles kernels and allocates scratch outside the capture
                            self._warmup_inputs(tokens, requests)  # (the embeds family's buffer is overwritten)
                            fn()
                        self._warmup_inputs(tokens, requests)
                        if self.device.type == "cuda":
                            torch.cuda.synchronize(self.device)
                        graph = self.graph_factory(pool)
                        self.outputs[key], self.graphs[key] = graph.capture(fn), graph
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def graph_key(self, decision: ScheduleDecision, with_images: bool = False) -> GraphKey | None:
        """The captured graph that runs `decision`, or None: an extend of 1..max tokens in at most max_requests
        requests; `with_images` (image rows to write over the embeddings): the embeds family's graph, where there is
        one; an item with image spans but no rows to write runs eagerly. Pure."""
        items = decision.items
        if decision.mode != "extend" or not items or not self.graphs:
            return None
        if with_images and self.embeds is None:
            return None
        tokens = 0
        has_prefix = False
        for item in items:
            if item.mm_spans and not with_images:
                return None
            tokens += len(item.token_ids)
            has_prefix = has_prefix or item.prefix_len > 0
        padded_tokens = _smallest_fit(tokens, self.token_sizes) if tokens else None
        padded_requests = _smallest_fit(len(items) + 1, self.request_sizes)
        if padded_tokens is None or padded_requests is None:
            return None
        return padded_tokens, padded_requests, has_prefix, with_images

    @torch.inference_mode()
    def forward(self, decision: ScheduleDecision, key: GraphKey, mm_rows: Sequence[MMRows] = ()) -> torch.Tensor:
        """Replays the graph `key` (`graph_key(decision, bool(mm_rows))`; `mm_rows`: the image rows of
        `ModelRunner.forward`, written over the token embeddings); returns float32 logits (num_logit_rows, vocab) in
        item order, as `ModelRunner.forward`. Mutates req_to_token, the KV pool and the static buffers."""
        tokens, requests, _, _ = key
        runner = self.runner
        items = decision.items
        if runner.prefix_planner is not None:  # NOTE: every table write is mirrored, as an eager extend's
            for item in items:
                runner.prefix_planner.record(item.req_pool_idx, item.table_start, item.table_slots)
        step = pad_prefill(items, tokens, requests, self.pad_row, self.table_width)
        t_index, t_slots, logit_idx = pack_to_device([step.table_index, step.table_slots, step.logit_idx],
                                                     torch.int64, self.device)
        if len(step.table_index):
            runner.req_to_token.view(-1).index_copy_(0, t_index, t_slots.to(torch.int32))

        def fill(host: np.ndarray) -> None:
            host[: len(step.ints)] = step.ints

        self._staging.send(fill, self.ints, len(step.ints))  # one copy of the padded inputs
        if mm_rows:
            assert self.embeds is not None
            starts = _rows(step.ints, tokens, requests)[6].tolist()
            self.embeds[:tokens].copy_(runner._input_embeds(self.ints[:tokens], starts, mm_rows))
            self.num_image_replays += 1
        self.graphs[key].replay()
        self.num_replays += 1
        hidden = self.outputs[key][: step.num_tokens]
        if runner.keep_hidden:  # NOTE: a view the next replay overwrites, as the decode graphs' `hidden_out`
            runner.last_hidden = self.aux_out[: step.num_tokens] if self.aux_out is not None else hidden
        return runner.model.compute_logits(hidden[logit_idx])  # type: ignore[operator, no-any-return]


def maybe_prefill_graph_runner(config: ServerConfig, runner: ModelRunner, tp_size: int = 1) -> PrefillGraphRunner | None:
    """Captures prefill graphs for a resolved config with `enable_cuda_graph_prefill`, or returns None (logged): off,
    graphs off, no CUDA device (the CPU tests' `EagerGraph` hook apart), a backend that cannot plan an extend inside a
    graph. A capture that fails (a kernel that syncs with the host) is logged and leaves prefill graphs off on one
    rank; under tensor parallelism it raises (`CudaGraphError`): every rank calls this at the same point of its
    start-up with the same config and captures the same keys in the same order, their collectives inside the
    captures, so one rank cannot drop out alone."""
    if not config.enable_cuda_graph_prefill:
        return None
    eager = os.environ.get(EAGER_GRAPHS_ENV) == "1"
    if config.disable_cuda_graph or runner.device.type != "cuda" and not eager:
        logger.info("prefill CUDA graphs: off (no CUDA graphs on this engine)")
        return None
    if not getattr(runner.attn_backend, "supports_extend_graph", False):
        logger.warning("prefill CUDA graphs: off (the %r attention backend plans extends on the host)",
                       getattr(runner.attn_backend, "name", type(runner.attn_backend).__name__))
        return None
    max_tokens = config.cuda_graph_prefill_max_tokens or DEFAULT_PREFILL_GRAPH_MAX_TOKENS
    max_requests = min(config.cuda_graph_prefill_max_requests or DEFAULT_PREFILL_GRAPH_MAX_REQUESTS,
                       config.max_running_requests or DEFAULT_PREFILL_GRAPH_MAX_REQUESTS)
    graphs = PrefillGraphRunner(runner, max_tokens, max_requests,
                                graph_factory=EagerGraph if runner.device.type != "cuda" else None)
    started = time.monotonic()
    cuda = runner.device.type == "cuda"
    reserved = torch.cuda.memory_reserved(runner.device) if cuda else 0
    try:
        graphs.capture()
    except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
        if tp_size > 1:
            raise CudaGraphError(f"prefill CUDA graphs: the capture failed under tensor parallelism ({exc}); start "
                                 "with --no-enable-cuda-graph-prefill") from exc
        logger.warning("prefill CUDA graphs: off, the capture failed (%s)", str(exc).splitlines()[0][:200])
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
        return None
    # NOTE: the graphs' memory pool and static buffers come out of what --mem-fraction-static leaves beside the KV pool
    pool = f", {(torch.cuda.memory_reserved(runner.device) - reserved) / 2**20:.0f} MiB more reserved" if cuda else ""
    logger.info("prefill CUDA graphs: captured token sizes %s x request sizes %s (the padding request included)%s "
                "in %.1f s%s", graphs.token_sizes, graphs.request_sizes,
                ", with and without image rows" if graphs.embeds is not None else "", time.monotonic() - started, pool)
    return graphs
