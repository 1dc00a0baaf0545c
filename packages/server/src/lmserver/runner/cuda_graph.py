"""Decode CUDA graphs: one graph per captured batch size, replayed with new inputs.

At start-up `DecodeGraphRunner.capture()` records, for each size of `capture_batch_sizes(max_bs)`
(largest first, all in one memory pool), the whole decode forward (attention `plan`, every layer,
the LM head, the greedy argmax of the logits) over static input buffers. A decode batch of `bs`
requests is padded to the smallest captured size >= bs: padding rows read token 0 at position 0
with length 1 from a padding table row and write their K/V to padding slot 0 (never a real
token's slot). Each step then copies the padded inputs into the static buffers in one copy and
replays the graph, whose first kernel writes the lengths and each row's new slot into the
request-to-token table (the attention metadata is updated in place): a few host operations
instead of one launch per kernel. A step whose rows are all greedy reads the graph's argmax
(`forward_greedy`) instead of copying the logits out and reducing them again.

With cascade attention on (`runner.prefix_planner`), every size >= 2 is captured a second time
with the backend's cascade metadata of that size (all zero at capture: no group); a step whose
rows share enough KV prefix writes that metadata (only when the grouping changed) and replays
the cascade graph, any other step the plain one.

A speculative verify step (each request's last token and drafts, every row's logits) replays the
decode graph of as many rows (`verify_rows`, `forward_verify`): row j of a request is a decode row
at its own position over the request's table row, so the causal verify forward is exactly a
decode forward of those rows. Only where a lowlat plugin takes another path for verify rows
than for decode rows of a size (its measured coverage) is a verify graph of that size captured
as well (`verify_rows`, the most rows per request), into the same logits.

A short extend (a prompt of few tokens, a radix hit's suffix, a small mixed step) replays the decode graph of its
padded row count the same way when `extend_max_reads` > 0 (`--enable-cuda-graph-extend`; `can_run_extend`,
`forward_extend`): one decode row per new token. Eagerly, its forward launches ~11 kernels per layer from Python,
~0.4-1.1 ms of host time per layer on the H200 machine (a 64-token prefill of the 8B shape: 12-38 ms of wall for ~4
ms of device work). Each row reads its whole context (no query tile shares the reads), so rows x context is
bounded (`extend_max_reads`); longer extends run eagerly. With a lowlat plugin, sizes whose several rows per request
take another path or launch than their decode rows get a verify graph as well (`verify_graph_rows`); one new token per
request is a decode step and replays the decode graph.

Contract for attention backends (`triton` and `torch_native` meet it): a DECODE `plan` may read
host values only from `batch_size` and `seq_lens_cpu`, and the static batch gives
`seq_lens_cpu` as an upper bound (the table width), so per-step lengths are read on the device
from `seq_lens`; any scratch buffer is allocated by the warm-up forward, before the capture.

`EagerGraph` stands in for a CUDA graph (capture runs the forward, replay re-runs it into the
same output tensor): it lets the CPU tests check padding and the static buffers.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from lmserver.forward.batch import ForwardBatch, ForwardMode
from lmserver.runner.host_tensors import to_device
from lmserver.scheduler.scheduler import ForwardItem, ScheduleDecision
from lowlat.spec import StepKind

if TYPE_CHECKING:
    from lmserver.config import ServerConfig
    from lmserver.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# The largest decode batch captured where a config does not say (a GPU under runner.resolve.LARGE_GPU_BYTES).
SMALL_GPU_GRAPH_MAX_BS = 32

__all__ = [
    "CudaGraphError",
    "DecodeGraphRunner",
    "EagerGraph",
    "PaddedDecode",
    "PinnedStaging",
    "capture_batch_sizes",
    "checked_graph_factory",
    "draft_graph_runner",
    "maybe_decode_graph_runner",
    "pad_decode",
    "pad_verify",
    "padded_batch_size",
    "verify_rows",
]

PAD_TOKEN_ID = 0
PAD_SLOT = 0  # the padding KV slot (never handed out by the allocator)


class CudaGraphError(RuntimeError):
    """Decode CUDA graphs cannot be built or run for this configuration."""


# An extend replayed as decode rows reads each row's whole context: 32,768 token reads per layer is 134 MB of a bf16
# 8B-shaped KV cache (~28 us at the H200's bandwidth), against ~0.4-1.1 ms of host time per layer eagerly
EXTEND_MAX_READS = 32768


def capture_batch_sizes(max_bs: int) -> list[int]:
    """The decode batch sizes to capture: 1, 2, 4, 8, then every multiple of 8, up to `max_bs`
    (always included). Pure; raises ValueError for max_bs < 1."""
    if max_bs < 1:
        raise ValueError(f"cuda_graph_max_bs must be >= 1, got {max_bs}")
    sizes = [s for s in (1, 2, 4) if s < max_bs] + list(range(8, max_bs, 8))
    return [*sizes, max_bs]


def padded_batch_size(bs: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size >= bs (sizes sorted ascending), or None when bs is larger
    than all of them or < 1. Pure."""
    if bs < 1:
        return None
    i = bisect.bisect_left(sizes, bs)
    return sizes[i] if i < len(sizes) else None


@dataclass(frozen=True)
class PaddedDecode:
    """Host arrays of one padded decode step (plain data)."""

    # 5 rows of padded_bs: input_ids, positions, out_cache_loc, req_pool_indices, seq_lens (lengths including the
    # new token; 1 for padding rows). The graph writes each real row's new slot into req_to_token itself.
    ints: list[list[int]]
    table: list[list[int]]  # 3 rows (table row, column, slot): req_to_token entries before the new token, if any
    logit_rows: list[int]  # batch rows whose logits the caller wants, in item order

    @property
    def seq_lens(self) -> list[int]:
        return self.ints[4]


def pad_decode(items: Sequence[ForwardItem], padded_bs: int, pad_row: int) -> PaddedDecode:
    """Pads a decode step's items (one new token each) to `padded_bs` rows. Pure.

    Padding rows: token PAD_TOKEN_ID at position 0, KV written to PAD_SLOT, table row `pad_row`,
    length 1. Raises CudaGraphError when an item has not exactly one token, when its table
    writes do not end with its new token's slot at its position, or when padded_bs is too small.
    """
    bs = len(items)
    if padded_bs < bs:
        raise CudaGraphError(f"padded batch size {padded_bs} < batch size {bs}")
    pad = padded_bs - bs
    ids, pos, loc, rows, lens = [], [], [], [], []
    t_rows: list[int] = []
    t_cols: list[int] = []
    t_vals: list[int] = []
    logit_rows: list[int] = []
    for i, item in enumerate(items):
        if len(item.token_ids) != 1 or len(item.out_slots) != 1:
            raise CudaGraphError(f"a decode item must have exactly one new token, {item.rid!r} has {len(item.token_ids)}")
        k = len(item.table_slots)
        if k == 0 or item.table_start + k - 1 != item.prefix_len or item.table_slots[-1] != item.out_slots[0]:
            raise CudaGraphError(f"decode item {item.rid!r}: its table writes must end with its new slot at position "
                                 f"{item.prefix_len} (start {item.table_start}, {k} slots)")
        ids.append(item.token_ids[0])
        pos.append(item.prefix_len)
        loc.append(item.out_slots[0])
        rows.append(item.req_pool_idx)
        lens.append(item.prefix_len + 1)
        if k > 1:  # NOTE: rare (a table row behind its KV); the graph writes the last entry
            t_rows.extend([item.req_pool_idx] * (k - 1))
            t_cols.extend(range(item.table_start, item.prefix_len))
            t_vals.extend(item.table_slots[:-1])
        logit_rows.extend([i] * len(item.logit_offsets))
    return PaddedDecode(
        ints=[
            ids + [PAD_TOKEN_ID] * pad,
            pos + [0] * pad,
            loc + [PAD_SLOT] * pad,
            rows + [pad_row] * pad,
            lens + [1] * pad,
        ],
        table=[t_rows, t_cols, t_vals],
        logit_rows=logit_rows,
    )


def verify_rows(items: Sequence[ForwardItem]) -> list[ForwardItem]:
    """A verify step's items (speculative decoding: each request's last token and drafts as new
    tokens, every row's logits wanted) as decode rows, one per new token, in the same order. Pure.

    Row j of a request at prefix p is a decode row of its table row at position p + j: it writes
    its own slot there and attends over the first p + j + 1 slots, which are the prefix, the rows
    before it (their K/V are stored before any row attends, in every layer) and itself. So the
    causal verify forward is exactly a decode forward of these rows, and runs in a decode graph.
    Table writes before the first new token (a table row behind its KV) stay with row 0.
    Raises CudaGraphError when an item's slots or table writes do not match its new tokens."""
    rows: list[ForwardItem] = []
    for item in items:
        n, p = len(item.token_ids), item.prefix_len
        if n == 0 or len(item.out_slots) != n or item.table_start > p or item.table_start + len(item.table_slots) != p + n:
            raise CudaGraphError(f"verify item {item.rid!r}: {n} tokens, {len(item.out_slots)} slots, table writes "
                                 f"[{item.table_start}, {item.table_start + len(item.table_slots)}) at prefix {p}")
        head = p - item.table_start + 1  # the table writes up to and including row 0's slot
        for j in range(n):
            start, slots = (item.table_start, item.table_slots[:head]) if j == 0 else (p + j, [item.out_slots[j]])
            rows.append(dataclasses.replace(
                item, prefix_len=p + j, token_ids=[item.token_ids[j]], out_slots=[item.out_slots[j]],
                table_start=start, table_slots=slots, logit_offsets=[0], completes_prefill=False))
    return rows


def fits_decode_rows(item: ForwardItem) -> bool:
    """Whether `pad_verify` can lay `item`'s new tokens out as decode rows: at least one token, a slot for each, and
    table writes from at most its prefix length that end with exactly those slots. Pure."""
    n, p, start = len(item.token_ids), item.prefix_len, item.table_start
    return (n > 0 and len(item.out_slots) == n and start <= p and start + len(item.table_slots) == p + n
            and item.table_slots[p - start:] == item.out_slots)


def pad_verify(items: Sequence[ForwardItem], padded_bs: int, pad_row: int) -> PaddedDecode:
    """`pad_decode(verify_rows(items), padded_bs, pad_row)` built straight from a verify step's items (no
    per-row items): row j of a request at prefix p is token j at position p + j, its slot, its table row,
    length p + j + 1; table writes before the first new token go with the step. Pure.

    Raises CudaGraphError when an item's slots or table writes do not match its new tokens (the table
    writes must end with the new tokens' slots), or when padded_bs is too small."""
    ids: list[int] = []
    pos: list[int] = []
    loc: list[int] = []
    rows: list[int] = []
    t_rows: list[int] = []
    t_cols: list[int] = []
    t_vals: list[int] = []
    for item in items:
        n, p, start = len(item.token_ids), item.prefix_len, item.table_start
        if not fits_decode_rows(item):
            raise CudaGraphError(f"verify item {item.rid!r}: {n} tokens, {len(item.out_slots)} slots, table writes "
                                 f"[{start}, {start + len(item.table_slots)}) at prefix {p}")
        ids.extend(item.token_ids)
        pos.extend(range(p, p + n))
        loc.extend(item.out_slots)
        rows.extend([item.req_pool_idx] * n)
        if start < p:  # NOTE: rare (a table row behind its KV); the graph writes each row's own slot
            t_rows.extend([item.req_pool_idx] * (p - start))
            t_cols.extend(range(start, p))
            t_vals.extend(item.table_slots[: p - start])
    bs = len(ids)
    if padded_bs < bs:
        raise CudaGraphError(f"padded batch size {padded_bs} < batch size {bs}")
    pad = padded_bs - bs
    return PaddedDecode(
        ints=[ids + [PAD_TOKEN_ID] * pad, pos + [0] * pad, loc + [PAD_SLOT] * pad, rows + [pad_row] * pad,
              [q + 1 for q in pos] + [1] * pad],
        table=[t_rows, t_cols, t_vals],
        logit_rows=list(range(bs)),
    )


class PinnedStaging:
    """Two pinned host buffers of `shape` (int64) used in turn for a graph runner's one host-to-device input copy per
    forward: a forward fills one while the other's copy may still be queued (`send` waits for the copy of two forwards
    ago, done long before in practice). Plain tensors on a CPU."""

    def __init__(self, shape: tuple[int, ...], device: torch.device) -> None:
        cuda = device.type == "cuda"
        self._buffers = [torch.zeros(shape, dtype=torch.int64, pin_memory=cuda) for _ in range(2)]
        self._copied = [torch.cuda.Event() for _ in range(2)] if cuda else []  # each buffer's last copy
        self._turn = 0

    def send(self, fill: Callable[[np.ndarray], None], dst: torch.Tensor, count: int | None = None) -> None:
        """`fill` writes the next buffer (as numpy: lists convert straight into the pinned memory), then its first
        `count` elements (all: None) go to `dst`'s in one asynchronous copy. A prefix of a 1-D buffer or the whole
        of one is contiguous; a 2-D slice would go through a pageable temporary and a scatter kernel."""
        turn, self._turn = self._turn, 1 - self._turn
        if self._copied:
            self._copied[turn].synchronize()
        host = self._buffers[turn]
        fill(host.numpy())
        if count is None:
            dst.copy_(host, non_blocking=True)
        else:
            dst[:count].copy_(host[:count], non_blocking=True)
        if self._copied:
            self._copied[turn].record()


def checked_graph_factory(runner: ModelRunner, pad_row: int,
                          graph_factory: Callable[[object], Graph] | None) -> Callable[[object], Graph]:
    """A graph runner's graph factory (`TorchCudaGraph` unless given), after checking that `pad_row` is a table row
    and that real graphs get a CUDA device; raises CudaGraphError. Pure."""
    table_rows = runner.req_to_token.shape[0]
    if not 0 <= pad_row < table_rows:
        raise CudaGraphError(f"pad_row {pad_row} is outside req_to_token's {table_rows} rows")
    if graph_factory is None and runner.device.type != "cuda":
        raise CudaGraphError(f"CUDA graphs need a CUDA device, got {runner.device}; use --disable-cuda-graph")
    return graph_factory or TorchCudaGraph


class Graph(Protocol):
    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor: ...
    def replay(self) -> None: ...


class TorchCudaGraph:
    """A `torch.cuda.CUDAGraph` captured into a memory pool shared by all decode graphs."""

    def __init__(self, pool: object) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Records `fn`'s kernels (they do not run); returns its static output tensor."""
        with torch.cuda.graph(self.graph, pool=self.pool):  # type: ignore[arg-type]
            out = fn()
        return out

    def replay(self) -> None:
        self.graph.replay()


class EagerGraph:
    """CPU stand-in for a CUDA graph: `capture` runs `fn` and keeps its output tensor; `replay`
    runs `fn` again and copies the result into that same tensor (a replay's static output)."""

    def __init__(self, pool: object = None) -> None:
        self.fn: Callable[[], torch.Tensor] | None = None
        self.out: torch.Tensor | None = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        self.fn = fn
        self.out = fn()
        return self.out

    def replay(self) -> None:
        assert self.fn is not None and self.out is not None, "replay before capture"
        self.out.copy_(self.fn())


class DecodeGraphRunner:
    """Captured decode forwards for batch sizes up to `max_bs` over static input buffers.

    Owns the static buffers and the graphs; mutates the model runner's KV pool and
    req_to_token on every `forward` (like `ModelRunner.forward`).
    """

    def __init__(
        self,
        runner: ModelRunner,
        max_bs: int,
        pad_row: int = 0,
        graph_factory: Callable[[object], Graph] | None = None,
        verify_rows: int = 0,
        extend_max_reads: int = 0,
    ) -> None:
        self.runner = runner
        # short extends as decode rows (`can_run_extend`): at most this many token reads per layer (sum over the
        # items of new tokens x their context); 0: extends run eagerly
        self.extend_max_reads = extend_max_reads
        # speculative decoding: the most rows a verify step gives one request (0: none); sizes whose
        # verify steps take another lowlat path than their decode graph froze get a verify graph
        self.verify_rows = verify_rows
        self.sizes = capture_batch_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        self.table_width = runner.req_to_token.shape[1]
        self.graph_factory = checked_graph_factory(runner, pad_row, graph_factory)
        self.pad_row = pad_row
        self.device = runner.device
        # NOTE: static inputs; every graph reads views [:bs] of these, so a step writes them in place. A step copies
        # `ints` (PaddedDecode.ints) in one host-to-device copy; the graph's first kernel fills `seq_lens` from its
        # last row and writes the new slots into req_to_token (kernels/graph_step.py).
        self.ints = torch.zeros(5, self.max_bs, dtype=torch.int64, device=self.device)
        self.ints[3].fill_(pad_row)
        self.ints[4].fill_(1)
        self.seq_lens = torch.ones(self.max_bs, dtype=torch.int32, device=self.device)
        self.greedy_ids = torch.zeros(self.max_bs, dtype=torch.int64, device=self.device)  # argmax of the last replay
        # the hidden states of the last replay's rows, for a runner that keeps them (EAGLE speculation)
        self.hidden_out = runner.kept_hidden_buffer(self.max_bs) if runner.keep_hidden else None
        cuda = self.device.type == "cuda"
        self._staging = PinnedStaging((5, self.max_bs), self.device)
        if cuda:
            from lmserver.kernels.graph_step import argmax_rows, write_decode_inputs
        else:
            from lmserver.kernels.graph_step import argmax_rows_ref as argmax_rows
            from lmserver.kernels.graph_step import write_decode_inputs_ref as write_decode_inputs
        self._argmax, self._write_inputs = argmax_rows, write_decode_inputs
        self.graphs: dict[int, Graph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # bs -> (bs, vocab) logits (model dtype) of the last replay
        self.cascade_graphs: dict[int, Graph] = {}  # the same with cascade attention (sizes >= 2)
        self.cascade_outputs: dict[int, torch.Tensor] = {}
        self.verify_graphs: dict[int, Graph] = {}  # the same with the lowlat path of verify rows (into `outputs`)
        self.num_cascade_replays = 0
        self._padded = [padded_batch_size(b, self.sizes) for b in range(self.max_bs + 1)]
        self.num_replays = 0
        self.num_greedy_replays = 0  # replays whose tokens were the graph's argmax (forward_greedy)
        self.num_verify_replays = 0  # speculative verify steps replayed as decode rows (forward_verify)
        self.num_extend_replays = 0  # extends replayed as decode rows (forward_extend)

    def _static_batch(self, bs: int, cascade: bool = False) -> ForwardBatch:
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            batch_size=bs,
            input_ids=self.ints[0, :bs],
            positions=self.ints[1, :bs],
            out_cache_loc=self.ints[2, :bs],
            req_pool_indices=self.ints[3, :bs],
            seq_lens=self.seq_lens[:bs],
            # NOTE: an upper bound, not the lengths: a plan must not freeze per-step host values.
            seq_lens_cpu=[self.table_width] * bs,
            attn_backend=self.runner.attn_backend,
            cascade=self.runner.attn_backend.cascade_metadata(bs) if cascade else None,  # type: ignore[attr-defined]
        )

    def padded_size(self, bs: int) -> int:
        """The captured size a batch of `bs` rows pads to; raises CudaGraphError when none holds it. Pure."""
        padded = self._padded[bs] if 0 < bs <= self.max_bs else None
        if padded is None:
            raise CudaGraphError(f"batch size {bs} has no captured graph (sizes {self.sizes})")
        return padded

    def step_fn(self, bs: int, cascade: bool = False, verify_rows: int = 0) -> Callable[[], torch.Tensor]:
        """One decode forward of the static buffers' first `bs` rows (what a graph of size `bs` records):
        inputs written from `ints`, attention plan, the layers (`verify_rows`: the lowlat path of verify rows),
        logits, their argmax into `greedy_ids`; returns the (bs, vocab) logits."""
        batch = self._static_batch(bs, cascade)
        runner = self.runner

        def fn() -> torch.Tensor:
            self._write_inputs(self.ints, self.seq_lens[:bs], runner.req_to_token, PAD_SLOT, self.greedy_ids)
            runner.attn_backend.plan(batch)
            # (bs, hidden); a lowlat plugin's path is recorded (for a verify graph, the path of verify rows)
            hidden = runner.hidden(batch, capturing=True, verify_rows=verify_rows)
            if self.hidden_out is not None:
                self.hidden_out[:bs].copy_(runner.model.model.aux_hidden if runner.aux_hidden  # type: ignore[union-attr, arg-type]
                                           else hidden)
            # NOTE: logits in the model's dtype (argmax is exact on them); `forward` casts the rows it returns
            logits: torch.Tensor = runner.model.compute_raw_logits(hidden)  # type: ignore[operator]  # (bs, vocab)
            self._argmax(logits, out=self.greedy_ids[:bs])
            return logits

        return fn

    @staticmethod
    def _into(fn: Callable[[], torch.Tensor], out: torch.Tensor) -> Callable[[], torch.Tensor]:
        def into() -> torch.Tensor:
            return out.copy_(fn())

        return into

    @torch.inference_mode()
    def capture(self) -> None:
        """Warms up and captures every size, largest first; mutates self and padding slot 0."""
        pool = torch.cuda.graph_pool_handle() if self.graph_factory is TorchCudaGraph else None
        cascade = self.runner.prefix_planner is not None
        for bs in reversed(self.sizes):
            for variant in (False, True) if cascade and bs >= 2 else (False,):
                fn = self.step_fn(bs, variant)
                if variant:  # NOTE: into the plain graph's logits (one (bs, vocab) output per size, not two)
                    fn = self._into(fn, self.outputs[bs])
                for _ in range(2):  # NOTE: compiles kernels and allocates scratch outside the capture
                    fn()
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                graph = self.graph_factory(pool)
                out = graph.capture(fn)
                if variant:
                    self.cascade_outputs[bs], self.cascade_graphs[bs] = out, graph
                else:
                    self.outputs[bs], self.graphs[bs] = out, graph
        lowlat = self.runner.lowlat
        for bs in reversed(self.sizes):
            rows = self.verify_graph_rows(bs)
            if lowlat is None or not rows or not lowlat.needs_verify_graph(bs, rows, self.table_width):
                continue
            fn = self._into(self.step_fn(bs, verify_rows=rows), self.outputs[bs])
            for _ in range(2):
                fn()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            graph = self.graph_factory(pool)
            graph.capture(fn)
            self.verify_graphs[bs] = graph
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def verify_graph_rows(self, bs: int) -> int:
        """The rows per request a verify graph of `bs` rows is captured for (where the lowlat plugin needs one):
        a speculative verify step's at most (`verify_rows`; a size below it holds steps of fewer rows), else, with
        graph extends, `bs` (an extend of one request fills the size); 0: none. The plugin launches every count of
        two or more rows per request alike (`needs_verify_graph`), so the graph serves fewer rows too where the
        session picks the same path for them (`_verify_graph` asks). Pure."""
        if self.verify_rows:
            return min(self.verify_rows, bs)
        return bs if self.extend_max_reads and bs > 1 else 0

    def can_run(self, decision: ScheduleDecision) -> bool:
        """True for a decode decision of 1..max_bs requests once captured. Pure."""
        return decision.mode == "decode" and 0 < len(decision.items) <= self.max_bs and bool(self.graphs)

    def forward(self, decision: ScheduleDecision, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Replays the graph of the padded size; returns float32 logits (num_logit_rows, vocab)
        like `ModelRunner.forward`. Mutates req_to_token, the KV pool and the static buffers.
        `input_ids` ((bs,) on the device) replaces the items' token ids: read inside the graph when it
        is the previous replay's argmax row for row (`forward_greedy`'s result), else copied in."""
        bs = len(decision.items)
        step, logits = self._replay(decision, input_ids)
        if step.logit_rows == list(range(bs)):
            return logits[:bs].to(torch.float32, copy=True)  # NOTE: a copy: the next replay overwrites `logits`
        return logits[torch.tensor(step.logit_rows, dtype=torch.int64, device=self.device)].float()

    @torch.inference_mode()
    def forward_greedy(self, decision: ScheduleDecision, input_ids: torch.Tensor | None = None) -> torch.Tensor | None:
        """`forward` for a step whose every row takes its argmax token unchanged (greedy, no penalty
        or mask): replays the graph and returns the (bs,) int64 argmax the graph computed, a view of
        `greedy_ids` that the next replay overwrites (read it, on the device stream, before then).
        Returns None, running nothing, when not every row wants logits."""
        bs = len(decision.items)
        if any(len(item.logit_offsets) != 1 for item in decision.items):
            return None
        self._replay(decision, input_ids)
        self.num_greedy_replays += 1
        return self.greedy_ids[:bs]

    def can_verify(self, decision: ScheduleDecision) -> bool:
        """True when a verify step (`decision` of mode extend whose every item wants all its rows'
        logits, as `Scheduler.add_drafts` makes them) fits a captured size as decode rows and, with
        a lowlat plugin, that size's graph froze the path the plugin takes for verify rows. Pure
        (asks the plugin session without counting)."""
        items = decision.items
        if decision.mode != "extend" or not self.graphs or not items:
            return False
        if any(len(item.logit_offsets) != len(item.token_ids) or item.mm_spans for item in items):
            return False
        n = sum(len(item.token_ids) for item in items)
        padded = self._padded[n] if n <= self.max_bs else None
        if padded is None:
            return False
        return self._verify_graph(padded, max(len(item.token_ids) for item in items)) is not None

    def _verify_graph(self, padded: int, rows_per_request: int) -> tuple[Graph, StepKind] | None:
        """The graph of `padded` rows that serves a verify step (the decode graph, or the verify
        graph where lowlat's path for verify rows differs), with its kind, or None. Pure."""
        lowlat = self.runner.lowlat
        if lowlat is None:
            return self.graphs[padded], StepKind.DECODE
        kind = lowlat.verify_graph(padded, rows_per_request, self.table_width)
        if kind == StepKind.DECODE:
            return self.graphs[padded], kind
        if kind == StepKind.VERIFY and padded in self.verify_graphs:
            return self.verify_graphs[padded], kind
        return None

    def can_run_extend(self, decision: ScheduleDecision) -> bool:
        """True for an extend decision that the decode graph of its padded row count runs as decode rows (one per
        new token, `pad_verify`): `extend_max_reads` > 0, at most max_bs new tokens in all, no image rows, every
        item's table writes ending with its new tokens' slots, rows x context within `extend_max_reads`, and (with
        a lowlat plugin) that graph's frozen path and launch right for rows of one request. Pure."""
        items = decision.items
        if not self.extend_max_reads or decision.mode != "extend" or not self.graphs or not items:
            return False
        rows = reads = widest = 0
        for item in items:
            if item.mm_spans or not fits_decode_rows(item):
                return False
            n = len(item.token_ids)
            rows, reads, widest = rows + n, reads + n * (item.prefix_len + n), max(widest, n)
        if rows > self.max_bs or reads > self.extend_max_reads:
            return False
        padded = self._padded[rows]
        if padded is None:
            return False
        found = self._verify_graph(padded, widest)
        if found is None:
            return False
        lowlat = self.runner.lowlat
        # NOTE: a decode graph replays the plugin's decode launch; where the plugin launches rows of one request
        # otherwise (`needs_verify_graph`), the size's verify graph serves (`verify_graph_rows`); without one (e.g. a
        # speculative verify graph of another path), the extend runs eagerly
        return not (lowlat is not None and found[1] == StepKind.DECODE
                    and lowlat.needs_verify_graph(padded, widest, self.table_width))

    @torch.inference_mode()
    def forward_extend(self, decision: ScheduleDecision) -> torch.Tensor:
        """An extend (`can_run_extend` must hold) replayed as decode rows: float32 logits of the rows each item
        asks for (`logit_offsets`), in item order, as `ModelRunner.forward` returns them. Mutates req_to_token,
        the KV pool and the static buffers."""
        widest = max(len(item.token_ids) for item in decision.items)
        _, logits = self._replay(decision, None, verify_rows_per_request=widest)
        self.num_extend_replays += 1
        wanted: list[int] = []
        base = 0
        for item in decision.items:
            wanted.extend(base + offset for offset in item.logit_offsets)
            base += len(item.token_ids)
        # NOTE: a gather (a copy): the next replay overwrites `logits`
        return logits[to_device(wanted, torch.int64, self.device)].float()

    @torch.inference_mode()
    def forward_verify(self, decision: ScheduleDecision, greedy: bool) -> torch.Tensor:
        """A verify step (see `can_verify`, which must hold) replayed as decode rows
        (`verify_rows`): returns the rows' (num_rows,) int64 argmax (`greedy`; a view the next
        replay overwrites) or their float32 logits (num_rows, vocab), rows in item order.
        Mutates req_to_token, the KV pool and the static buffers."""
        n = sum(len(item.token_ids) for item in decision.items)
        rows_per_request = max(len(item.token_ids) for item in decision.items)
        _, logits = self._replay(decision, None, verify_rows_per_request=rows_per_request)
        self.num_verify_replays += 1
        if greedy:
            self.num_greedy_replays += 1
            return self.greedy_ids[:n]
        return logits[:n].to(torch.float32, copy=True)

    def _replay(self, decision: ScheduleDecision | list[ForwardItem], input_ids: torch.Tensor | None,
                verify_rows_per_request: int = 0) -> tuple[PaddedDecode, torch.Tensor]:
        """Writes a step's inputs and replays its graph; returns the step and the graph's logits.
        `verify_rows_per_request` > 0: the items are a verify step's (`pad_verify`: one decode row per
        new token; never cascade: rows of one request repeat its table row)."""
        items = decision if isinstance(decision, list) else decision.items
        bs = sum(len(item.token_ids) for item in items) if verify_rows_per_request else len(items)
        padded = self._padded[bs]
        assert padded is not None, f"batch size {bs} has no captured graph"
        step = (pad_verify if verify_rows_per_request else pad_decode)(items, padded, self.pad_row)
        if step.table[2]:
            table = to_device(step.table, torch.int64, self.device)  # (3, k)
            self.runner.req_to_token[table[0], table[1]] = table[2].to(torch.int32)
        from_argmax = input_ids is not None and _is_prefix_view(input_ids, self.greedy_ids)
        if from_argmax:  # the previous replay's argmax, row for row: the graph reads it (id -(j + 1) = row j)
            step.ints[0][:bs] = range(-1, -bs - 1, -1)
        self._copy_ints(step.ints, padded)
        if input_ids is not None and not from_argmax:
            self.ints[0, :bs].copy_(input_ids, non_blocking=True)
        graph, logits = self.graphs[padded], self.outputs[padded]  # logits: (padded, vocab)
        kind = StepKind.DECODE
        if verify_rows_per_request:
            found = self._verify_graph(padded, verify_rows_per_request)
            assert found is not None, f"no graph serves a verify step of {padded} rows"
            graph, kind = found
        if self.runner.lowlat is not None:  # counts the step; checks it runs the path its graph froze
            self.runner.lowlat.on_replay(padded, self.table_width, verify_rows_per_request, kind)
        planner = self.runner.prefix_planner
        if planner is not None:  # NOTE: every table write is mirrored, whichever graph runs
            planner.record_decode(verify_rows(items) if verify_rows_per_request else items)
        if (not verify_rows_per_request and padded in self.cascade_graphs
                and self.runner.cascade_for(step.ints[3][:bs], step.seq_lens[:bs], padded)):
            graph, logits = self.cascade_graphs[padded], self.cascade_outputs[padded]
            self.num_cascade_replays += 1
        graph.replay()
        self.num_replays += 1
        if self.hidden_out is not None:
            self.runner.last_hidden = self.hidden_out[:bs]
        return step, logits

    def _copy_ints(self, ints: list[list[int]], padded: int) -> None:
        """One host-to-device copy of a step's (5, padded) inputs through the pinned staging buffers."""

        def fill(host: np.ndarray) -> None:
            # NOTE: numpy converts the lists straight into the pinned buffer (5 x 256 ints: 15 us against 57 through
            # torch.tensor; 0.7 against 4.4 at one row)
            host[:, :padded] = ints

        # NOTE: the whole buffer (contiguous); the graph of size `padded` reads only its first `padded` columns
        self._staging.send(fill, self.ints)


def _is_prefix_view(t: torch.Tensor, base: torch.Tensor) -> bool:
    """True when `t` is `base[:len(t)]` (same storage, offset and stride)."""
    return (t.dim() == 1 and t.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
            and t.storage_offset() == base.storage_offset() and t.stride() == base.stride())


# NOTE: a test hook: with this set to 1, CPU runners get the graph runner with `EagerGraph`
# (same static buffers, padding and replay order, no CUDA), so multi-process paths such as tensor
# parallelism can exercise it on CPUs. Spawned ranks inherit it through the environment.
EAGER_GRAPHS_ENV = "LMSERVER_TEST_EAGER_GRAPHS"


def maybe_decode_graph_runner(config: ServerConfig, runner: ModelRunner, tp_size: int = 1) -> DecodeGraphRunner | None:
    """Captures decode graphs for a resolved config, or returns None (logged once) when they are
    off: --disable-cuda-graph, no CUDA device, an attention backend that is not capturable
    (`supports_cuda_graph` False), or tensor parallelism with --no-enable-tp-cuda-graph. Under TP
    every rank calls this at the same point of its start-up with the same config: captures run
    the forward's collectives, so all ranks capture the same sizes in the same order."""
    if config.disable_cuda_graph:
        logger.info("CUDA graphs: off (--disable-cuda-graph)")
        return None
    eager = os.environ.get(EAGER_GRAPHS_ENV) == "1"
    if runner.device.type != "cuda" and not eager:
        return None
    backend = runner.attn_backend
    if not getattr(backend, "supports_cuda_graph", True):
        logger.warning("CUDA graphs: off (the %r attention backend cannot plan inside a captured graph); "
                       "decode runs eagerly", getattr(backend, "name", type(backend).__name__))
        return None
    if tp_size > 1 and not config.enable_tp_cuda_graph:
        logger.warning("CUDA graphs: off with tp_size=%d (--no-enable-tp-cuda-graph: decode runs eagerly)", tp_size)
        return None
    # a resolved config always sets it (resolve_cuda_graph_max_bs); the default for one that is not
    requested = config.cuda_graph_max_bs if config.cuda_graph_max_bs is not None else SMALL_GPU_GRAPH_MAX_BS
    max_bs = min(requested, config.max_running_requests or requested)
    if max_bs < 1:
        raise CudaGraphError(f"cuda_graph_max_bs must be >= 1, got {config.cuda_graph_max_bs}")
    verify_rows = config.speculative_num_draft_tokens + 1 if config.speculative_algorithm and tp_size == 1 else 0
    # NOTE: not under TP: followers mirror a broadcast decision with forwards of their own (see EngineCore._verify)
    max_reads = config.cuda_graph_extend_max_reads
    if max_reads is not None and max_reads < 1:
        raise CudaGraphError(f"cuda_graph_extend_max_reads must be >= 1, got {max_reads}")
    extend_reads = (max_reads or EXTEND_MAX_READS) if tp_size == 1 and config.enable_cuda_graph_extend else 0
    graphs = DecodeGraphRunner(runner, max_bs, graph_factory=EagerGraph if runner.device.type != "cuda" else None,
                               verify_rows=verify_rows, extend_max_reads=extend_reads)
    graphs.capture()
    logger.info("CUDA graphs: captured decode batch sizes %s%s", graphs.sizes,
                f"; verify graphs (lowlat path of verify rows) {sorted(graphs.verify_graphs)}" if graphs.verify_graphs else "")
    return graphs


def draft_graph_runner(runner: ModelRunner, max_bs: int) -> DecodeGraphRunner | None:
    """Captured decode steps of a draft model's runner (an EAGLE head's steps) up to `max_bs`
    rows: on a CUDA device, or with `EagerGraph` under the test hook; None elsewhere."""
    cuda = runner.device.type == "cuda"
    if max_bs < 1 or not cuda and os.environ.get(EAGER_GRAPHS_ENV) != "1":
        return None
    graphs = DecodeGraphRunner(runner, max_bs, graph_factory=None if cuda else EagerGraph)
    graphs.capture()
    logger.info("CUDA graphs: captured draft decode batch sizes %s", graphs.sizes)
    return graphs
