"""ModelRunner: turns a ScheduleDecision (plain data) into tensors and runs the model.

It owns the model, the KV pool, the request-to-token table and the attention backend. One
`forward` = table writes, `attn_backend.plan(batch)`, the model forward, and logits for the rows
the decision asks for. A decode decision replays a captured CUDA graph instead when
`cuda_graph` is set and covers its batch size. With `prefix_planner` set (cascade attention on,
a backend with `supports_cascade`), the table writes are mirrored on the host and a decode batch
whose rows share KV prefixes gets cascade metadata (`cascade_for`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from lmserver.forward.batch import AttentionBackend, ForwardBatch, ForwardMode
from lmserver.forward.kv_pool import KVPool
from lmserver.runner.attention.shared_prefix import SharedPrefixPlanner
from lmserver.runner.host_batch import host_batch
from lmserver.runner.host_tensors import pack_to_device, to_device
from lmserver.scheduler.scheduler import ScheduleDecision

if TYPE_CHECKING:
    from lmserver.kernels.cascade_decode import CascadeMetadata
    from lmserver.runner.cuda_graph import DecodeGraphRunner
    from lmserver.runner.lowlat_hook import LowlatHook
    from lmserver.runner.prefill_graph import PrefillGraphRunner


# (index of the item in the decision, offset into its token_ids, embedding rows (n, hidden))
MMRows = tuple[int, int, torch.Tensor]


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_pool: KVPool,
        req_to_token: torch.Tensor,
        attn_backend: AttentionBackend,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token  # (max_running_requests, max_context_len) int32
        self.attn_backend = attn_backend
        self.device = device
        self.cuda_graph: DecodeGraphRunner | None = None  # decode graphs (lmserver.runner.cuda_graph)
        self.prefill_graph: PrefillGraphRunner | None = None  # extend graphs (lmserver.runner.prefill_graph)
        self.lowlat: LowlatHook | None = None  # a lowlat plugin's decode path (lmserver.runner.lowlat_hook)
        # EAGLE speculation reads the target's final-norm hidden states of every forward's tokens: with
        # keep_hidden set (before decode graphs are captured) `last_hidden` holds them (T, hidden), flat in item
        # order, until the next forward
        self.keep_hidden = False
        self.last_hidden: torch.Tensor | None = None
        # EAGLE-3: `last_hidden` is the model's `aux_hidden` (the residual stream after its aux_layers) instead
        self.aux_hidden = False
        self.prefix_planner: SharedPrefixPlanner | None = None  # cascade attention (enable_cascade)

    def kept_hidden_buffer(self, rows: int) -> torch.Tensor:
        """A zeroed (rows, width) buffer in the model's dtype for `last_hidden` rows kept by a graph: width the hidden
        size, or (EAGLE-3, `aux_hidden`) the aux layers' residual streams side by side."""
        width: int = self.model.config.hidden_size  # type: ignore[union-attr, assignment]
        if self.aux_hidden:
            width *= len(self.model.model.aux_layers)  # type: ignore[union-attr, arg-type]
        return torch.zeros(rows, width, dtype=next(self.model.parameters()).dtype, device=self.device)

    def enable_cascade(self) -> bool:
        """Turns cascade decode attention on when the backend supports it (before any forward and
        before decode graphs are captured); returns whether it is on. Mutates self."""
        if getattr(self.attn_backend, "supports_cascade", False) and self.lowlat is None:
            self.prefix_planner = SharedPrefixPlanner(*self.req_to_token.shape)
        return self.prefix_planner is not None

    def cascade_for(self, rows: Sequence[int], seq_lens: Sequence[int], batch_size: int) -> CascadeMetadata | None:
        """The backend's cascade metadata of `batch_size`, written for the decode rows `rows`
        (table rows, the first len(rows) batch rows) of `seq_lens` tokens, or None when they share
        too little (or cascade is off). Mutates the planner's cache and the metadata."""
        if self.prefix_planner is None:
            return None
        groups = self.prefix_planner.plan(rows, seq_lens)
        if groups is None:
            return None
        meta: CascadeMetadata = self.attn_backend.cascade_metadata(batch_size)  # type: ignore[attr-defined]
        meta.write(groups.groups)
        return meta

    def _tensor(self, data: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return to_device(data, dtype, self.device)

    def build_batch(self, decision: ScheduleDecision,
                    mm_rows: Sequence[MMRows] = ()) -> tuple[ForwardBatch, torch.Tensor]:
        """ForwardBatch of `decision` and the flat token indices whose logits are wanted; with
        `mm_rows` (EXTEND) the batch's `input_embeds` carry those embedding rows.

        Mutates req_to_token (the rows of the decision's requests).
        """
        items = decision.items
        planner = self.prefix_planner
        if planner is not None:
            if decision.mode == "decode":
                planner.record_decode(items)
            else:
                for item in items:
                    planner.record(item.req_pool_idx, item.table_start, item.table_slots)
        h = host_batch(items, self.req_to_token.shape[1])
        # NOTE: every host array goes in one of two copies (int64, int32): see host_tensors.pack_to_device
        input_ids, positions, out_loc, rows, t_flat, logit_idx = pack_to_device(
            [h.input_ids, h.positions, h.out_loc, h.rows, h.table_index, h.logit_idx], torch.int64, self.device)
        t_vals, seq_lens, prefix_lens, ext_lens, starts = pack_to_device(
            [h.table_slots, h.seq_lens, h.prefix_lens, h.ext_lens, h.starts], torch.int32, self.device)
        if len(h.table_slots):  # NOTE: a flat index_copy_: index_put_ on CPU costs time in the table's size
            self.req_to_token.view(-1).index_copy_(0, t_flat, t_vals)
        mode = ForwardMode.DECODE if decision.mode == "decode" else ForwardMode.EXTEND
        batch = ForwardBatch(
            mode=mode,
            batch_size=len(items),
            input_ids=input_ids,
            positions=positions,
            out_cache_loc=out_loc,
            req_pool_indices=rows,
            seq_lens=seq_lens,
            seq_lens_cpu=h.seq_lens.tolist(),
            req_pool_indices_cpu=h.rows.tolist(),
            attn_backend=self.attn_backend,
        )
        if mode == ForwardMode.EXTEND:
            if mm_rows:
                batch.input_embeds = self._input_embeds(batch.input_ids, h.starts.tolist(), mm_rows)
            batch.extend_prefix_lens = prefix_lens
            batch.extend_seq_lens = ext_lens
            batch.extend_start_loc = starts
            batch.extend_prefix_lens_cpu = h.prefix_lens.tolist()
            batch.extend_seq_lens_cpu = h.ext_lens.tolist()
        return batch, logit_idx

    def _input_embeds(self, input_ids: torch.Tensor, starts: list[int], mm_rows: Sequence[MMRows]) -> torch.Tensor:
        """Token embeddings of `input_ids` with the `mm_rows` written over their rows."""
        embeds: torch.Tensor = self.model.embed_tokens(input_ids)  # type: ignore[operator]  # (T, hidden)
        index: list[int] = []
        for item_index, offset, rows in mm_rows:
            start = starts[item_index] + offset
            index.extend(range(start, start + rows.shape[0]))
        values = torch.cat([rows for _, _, rows in mm_rows]).to(embeds.dtype)
        return embeds.index_copy_(0, self._tensor(index), values)

    @torch.inference_mode()
    def forward(self, decision: ScheduleDecision, input_ids: torch.Tensor | None = None,
                mm_rows: Sequence[MMRows] = ()) -> torch.Tensor:
        """Runs the decision's forward; returns float32 logits (num_logit_rows, vocab) in item
        order (each item's `logit_offsets` in order). Mutates the KV pool and req_to_token.

        `input_ids` ((bs,) int64 on the device, DECODE only) replaces the items' token ids: the
        overlap scheduler's tokens that the host has not seen yet (engine/overlap.py).
        `mm_rows` (EXTEND only): vision embeddings that replace the embeddings of image / video
        tokens (each (decision item index, offset into its token_ids, rows))."""
        if input_ids is not None and decision.mode != "decode":
            raise ValueError("device input_ids are for decode decisions only")
        if mm_rows and decision.mode != "extend":
            raise ValueError("multimodal rows are for extend decisions only")
        if self.cuda_graph is not None and self.cuda_graph.can_run(decision):
            return self.cuda_graph.forward(decision, input_ids)
        if self.cuda_graph is not None and not mm_rows and self.cuda_graph.can_run_extend(decision):
            return self.cuda_graph.forward_extend(decision)
        key = self.prefill_graph.graph_key(decision, bool(mm_rows)) if self.prefill_graph is not None else None
        if key is not None:
            assert self.prefill_graph is not None
            return self.prefill_graph.forward(decision, key, mm_rows)
        batch, logit_idx = self.build_batch(decision, mm_rows)
        if input_ids is not None:
            batch.input_ids = input_ids
        if batch.mode == ForwardMode.DECODE and self.prefix_planner is not None:
            assert batch.req_pool_indices_cpu is not None
            batch.cascade = self.cascade_for(batch.req_pool_indices_cpu, batch.seq_lens_cpu, batch.batch_size)
        self.attn_backend.plan(batch)
        hidden = self.hidden(batch)  # (num_tokens, hidden)
        if self.keep_hidden:
            self.last_hidden = self.model.model.aux_hidden if self.aux_hidden else hidden  # type: ignore[union-attr, assignment]
        return self.model.compute_logits(hidden[logit_idx])  # type: ignore[operator, no-any-return]

    def hidden(self, batch: ForwardBatch, capturing: bool = False, verify_rows: int = 0) -> torch.Tensor:
        """Final-norm hidden states of a planned `batch`: the model's forward, or a lowlat plugin's
        when one is installed and covers the step (see runner/lowlat_hook.py). `verify_rows`: a
        verify graph's capture (LowlatHook.hidden)."""
        def original() -> torch.Tensor:
            if batch.input_embeds is not None:
                return self.model(  # type: ignore[no-any-return]
                    batch.input_ids, batch.positions, batch, input_embeds=batch.input_embeds)
            return self.model(batch.input_ids, batch.positions, batch)  # type: ignore[no-any-return]

        if self.lowlat is None or batch.input_embeds is not None:
            return original()
        return self.lowlat.hidden(batch, original, capturing=capturing, verify_rows=verify_rows)
