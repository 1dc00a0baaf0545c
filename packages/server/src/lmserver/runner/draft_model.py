"""DraftModel: a small model of the target's vocabulary proposing draft tokens greedily
(`--speculative-algorithm draft_model --speculative-draft-model-path FOLDER`).

It keeps its own KV cache (no radix tree): per request the KV of the tokens it has seen. A
proposal catches up on the tokens the target accepted since the last one (one extend forward
for every drafting request), then decodes k - 1 more steps; after verification the KV of the
rejected drafts is dropped (`accepted`). Greedy drafts are deterministic, so the target's
acceptance rules stay exact for sampled requests too (runner/verify.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from lmserver.forward.kv_pool import KVPool, make_req_to_token
from lmserver.models.config import ModelConfig
from lmserver.models.loader import load_model, read_model_config
from lmserver.runner.attention.registry import default_registry
from lmserver.runner.draft_chain import DraftChainGraphs
from lmserver.runner.model_runner import ModelRunner
from lmserver.runner.sampler import greedy_argmax
from lmserver.scheduler import ForwardItem, ScheduleDecision

logger = logging.getLogger(__name__)


class DraftModelError(ValueError):
    """The draft model cannot serve this target (vocabulary, architecture, files)."""


@dataclass
class DraftReq:
    row: int
    tokens: list[int] = field(default_factory=list)  # tokens whose KV is in the draft cache
    slots: list[int] = field(default_factory=list)
    synced: int = 0  # tokens[:synced] are known to equal the target's (checked at the last proposal)


class DraftModel:
    def __init__(self, model_path: str, *, target_vocab_size: int, dtype: torch.dtype, device: torch.device,
                 context_length: int, max_requests: int, num_slots: int, attention_backend: str,
                 graph_max_bs: int = 0, chain_steps: int = 0, load_format: str = "auto", seed: int = 0) -> None:
        config = read_model_config(model_path)
        if config.vocab_size != target_vocab_size:
            raise DraftModelError(f"the draft model at {model_path} has a vocabulary of {config.vocab_size} tokens, "
                                  f"the target {target_vocab_size}: a draft model must share the target's tokenizer")
        if config.is_multimodal:
            raise DraftModelError("a multimodal draft model is not supported; use its text model")
        # load_format "dummy": random weights of the folder's config (performance work, as the target's)
        model = load_model(config, model_path, load_format=load_format, dtype=dtype, device=device,
                           max_positions=context_length, seed=seed)
        self._init_cache(model, config, dtype=dtype, device=device, context_length=context_length,
                         max_requests=max_requests, num_slots=num_slots, attention_backend=attention_backend)
        if graph_max_bs > 0:  # the draft's decode steps replay captured graphs
            from lmserver.runner.cuda_graph import draft_graph_runner

            self.runner.cuda_graph = draft_graph_runner(self.runner, graph_max_bs)
        self._chain = self._capture_chain(chain_steps)

    def _capture_chain(self, steps: int, carry: Callable[[int], None] | None = None) -> DraftChainGraphs | None:
        """The chain graphs of `steps` decode steps over the captured decode graphs (a draft model: k for k drafts,
        its first step the one token to catch up on; an EAGLE head: k - 1 after its catch-up forward), or None
        (no graphs, or `steps` < 1)."""
        graphs = self.runner.cuda_graph
        if graphs is None or steps < 1:
            return None
        chain = DraftChainGraphs(graphs, steps, carry)
        chain.capture()
        logger.info("CUDA graphs: draft chains of %d decode steps at batch sizes %s", steps, graphs.sizes)
        return chain

    def _init_cache(self, model: torch.nn.Module, config: ModelConfig, *, dtype: torch.dtype, device: torch.device,
                    context_length: int, max_requests: int, num_slots: int, attention_backend: str) -> None:
        """The draft's own KV pool, request table and model runner over `model`; mutates self."""
        self.model = model
        self.context_length = context_length
        pool = KVPool(num_slots + 1, config.num_hidden_layers, config.num_key_value_heads, config.head_dim,
                      dtype, device)
        pool.zero_padding(1)
        table = make_req_to_token(max_requests, context_length, device)
        backend = default_registry().create(attention_backend, pool, table)
        self.runner = ModelRunner(self.model, pool, table, backend, device)
        self._num_slots = num_slots
        self._free_slots = list(range(num_slots, 0, -1))  # slot 0 is padding
        self._free_rows = list(range(max_requests - 1, -1, -1))
        self._reqs: dict[str, DraftReq] = {}

    def propose(self, contexts: dict[str, Sequence[int]], k: dict[str, int]) -> dict[str, list[int]]:
        """Greedy drafts, `k[rid]` tokens after each request's `contexts[rid]` (its prompt and
        output so far, only ever extended by accepted tokens). Requests the cache has no room
        for get none. Mutates the draft KV cache."""
        active: dict[str, DraftReq] = {}
        free = len(self._free_slots)  # NOTE: what the requests taken so far leave
        for rid, tokens in contexts.items():
            req = self._reqs.get(rid)
            if req is None:
                if not self._free_rows:
                    continue
                req = self._reqs[rid] = DraftReq(self._free_rows.pop())
            if req.tokens != list(tokens[: len(req.tokens)]):  # the target's tokens changed (jump-forward): restart
                self._drop_kv(req, 0)
            if len(req.tokens) >= len(tokens):  # the last token is fed again: its logits give the first draft
                self._drop_kv(req, len(tokens) - 1)
            need = len(tokens) - len(req.tokens) + k[rid] - 1
            if need > free or len(tokens) + k[rid] > self.context_length:
                continue
            free -= need
            active[rid] = req
        if not active:
            return {}
        drafts: dict[str, list[int]] = {rid: [] for rid in active}
        news = {rid: list(contexts[rid][len(req.tokens) :]) for rid, req in active.items()}
        if all(len(new) == 1 for new in news.values()) and self._chain_runs(active, k, 0):
            # the steady state (the target kept some drafts, then its own token): the one token to catch up on is
            # the chain's first step, all k drafts in one replay
            for req in active.values():
                req.synced = len(req.tokens) + 1
            self._chain_drafts(active, drafts, {rid: new[0] for rid, new in news.items()})
            return drafts
        # catch up: the tokens the cache has not seen, the last one's logits give the first draft
        items = []
        for rid, req in active.items():
            items.append(self._item(rid, req, news[rid]))
            req.synced = len(req.tokens)
        for rid, token in zip(active, self._forward(ScheduleDecision("extend", items)), strict=True):
            drafts[rid].append(token)
        for step in range(1, max(k[rid] for rid in active)):
            rids = [rid for rid in active if k[rid] > step]
            decision = ScheduleDecision("decode", [self._item(rid, active[rid], [drafts[rid][-1]]) for rid in rids])
            for rid, token in zip(rids, self._forward(decision), strict=True):
                drafts[rid].append(token)
        return drafts

    @property
    def num_chain_replays(self) -> int:
        """Proposals whose decode steps replayed one chain graph (`DraftChainGraphs`)."""
        return self._chain.num_replays if self._chain is not None else 0

    def _chain_runs(self, active: dict[str, DraftReq], k: dict[str, int], drafted: int) -> bool:
        """Whether the rest of this proposal replays one chain graph: every active request wants the same k, and
        the chain's steps are the k - `drafted` drafts still to come (`drafted` 1: the first came from a catch-up
        forward), at a captured batch size. Pure."""
        ks = {k[rid] for rid in active}
        return self._chain is not None and len(ks) == 1 and self._chain.can_run(len(active), ks.pop() - drafted)

    def _chain_drafts(self, active: dict[str, DraftReq], drafts: dict[str, list[int]], first: dict[str, int]) -> None:
        """One chain replay (`_chain_runs` holds) whose first step feeds `first[rid]` (the one token to catch up on,
        or the first draft): appends each request's next `steps` drafts. Mutates the draft KV cache as the
        step-by-step loop does."""
        assert self._chain is not None
        rids = list(active)
        base = {rid: len(active[rid].tokens) for rid in rids}
        # after the first, a step feeds the previous step's argmax, known only inside the graph: a placeholder in the
        # item and in req.tokens, the token written back once read
        step_items = [[self._item(rid, active[rid], [first[rid] if j == 0 else -1]) for rid in rids]
                      for j in range(self._chain.steps)]
        ids = self._chain.run(step_items).tolist()  # (steps, requests)
        for i, rid in enumerate(rids):
            drafts[rid].extend(int(row[i]) for row in ids)
            for j in range(1, self._chain.steps):
                active[rid].tokens[base[rid] + j] = int(ids[j - 1][i])

    def observe(self, rid: str, start: int, features: torch.Tensor) -> None:
        """The target's hidden states of positions it kept: a draft model reads tokens only (an
        EAGLE head overrides this)."""

    def accepted(self, rid: str, context: Sequence[int]) -> None:
        """After verification: the request's tokens are now `context`; the draft keeps the KV
        of its longest prefix and drops the rest (rejected drafts)."""
        req = self._reqs.get(rid)
        if req is None:
            return
        limit = min(len(req.tokens), len(context) - 1)  # the last token of `context` has no KV yet
        keep = min(req.synced, limit)  # NOTE: only the drafted tail is compared, not the whole context
        while keep < limit and req.tokens[keep] == context[keep]:
            keep += 1
        self._drop_kv(req, keep)

    def forget(self, rid: str) -> None:
        req = self._reqs.pop(rid, None)
        if req is not None:
            self._drop_kv(req, 0)
            self._free_rows.append(req.row)

    def _drop_kv(self, req: DraftReq, keep: int) -> None:
        self._free_slots.extend(req.slots[keep:])
        del req.slots[keep:]
        del req.tokens[keep:]
        req.synced = min(req.synced, keep)

    def _item(self, rid: str, req: DraftReq, new: list[int]) -> ForwardItem:
        start = len(req.tokens)
        slots = [self._free_slots.pop() for _ in new]
        req.tokens.extend(new)
        req.slots.extend(slots)
        return ForwardItem(rid=rid, req_pool_idx=req.row, prefix_len=start, token_ids=new, out_slots=slots,
                           table_start=start, table_slots=slots, logit_offsets=[len(new) - 1],
                           completes_prefill=False)

    def _forward(self, decision: ScheduleDecision) -> list[int]:
        logits = self.runner.forward(decision)
        return [int(t) for t in greedy_argmax(logits).tolist()]

    def check_empty(self) -> None:
        """Raises AssertionError unless every slot and row is free (no request holds any)."""
        assert not self._reqs, f"draft requests still held: {list(self._reqs)}"
        assert sorted(self._free_slots) == list(range(1, self._num_slots + 1)), "draft KV slots leaked"
