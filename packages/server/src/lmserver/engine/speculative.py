"""Speculative decoding in the engine (`--speculative-algorithm ngram`).

A decode round becomes a verify forward when some running request has draft tokens: each such
request's item carries its last token and its drafts (one KV slot each, every row's logits),
requests without drafts keep their one-token row in the same forward. Acceptance is exact
(runner/verify.py); the KV of rejected drafts is freed at once, so the radix cache only
ever receives accepted tokens.

Every request drafts. Logit bias, penalties and the min-new-tokens mask apply to each verify row
as the decode step of that row would apply them (the request's output followed by the drafts
before the row). A constrained request's drafts are cut to what its grammar takes, up to a
token after which a jump-forward or the end follows (that token stays the target's to emit, as
in a decode step), and each of its verify rows is masked by the grammar after the drafts before
it: the tokens a decode step per token would emit. A request asking for logprobs has each
emitted token's logprobs read from its verify row, the model's distribution at that position
(as a decode step's row would give them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from lmserver.io_struct import ReqOutput
from lmserver.runner.host_tensors import to_device
from lmserver.runner.ngram import NgramIndex
from lmserver.runner.sampler import (
    SamplingInfo,
    apply_penalties,
    changes_logits,
    filtered_probs,
    greedy_argmax,
)
from lmserver.runner.verify import accept_greedy, accept_sampled

if TYPE_CHECKING:
    from lmserver.runner.draft_model import DraftModel
    from lmserver.scheduler import ScheduleDecision, Scheduler

ALGORITHMS = ("ngram", "draft_model", "eagle")
MODEL_ALGORITHMS = ("draft_model", "eagle")  # the ones that read --speculative-draft-model-path


@dataclass(frozen=True)
class SpecConfig:
    algorithm: str
    num_draft_tokens: int = 4
    ngram_min_match: int = 2
    ngram_max_match: int = 4
    # benchmarks on random weights: every eligible request drafts num_draft_tokens tokens and
    # accepts this many per step on average, whatever the logits (outputs are then not the model's)
    simulate_accept_length: float | None = None
    draft_model_path: str | None = None  # draft_model: a model folder sharing the target's tokenizer; eagle: a head

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"speculative_algorithm {self.algorithm!r} is not supported; supported: "
                             f"{', '.join(ALGORITHMS)}")
        if (self.algorithm in MODEL_ALGORITHMS) != (self.draft_model_path is not None):
            raise ValueError("speculative_draft_model_path is needed by (and only by) speculative_algorithm "
                             "draft_model and eagle")
        if not 1 <= self.num_draft_tokens <= 16:
            raise ValueError("speculative_num_draft_tokens must be in [1, 16]")
        if not 1 <= self.ngram_min_match <= self.ngram_max_match:
            raise ValueError("need 1 <= speculative_ngram_min_match <= speculative_ngram_max_match")
        sim = self.simulate_accept_length
        if sim is not None and not 1.0 <= sim <= self.num_draft_tokens + 1:
            raise ValueError(f"speculative_simulate_accept_length must be in [1, num_draft_tokens + 1 = "
                             f"{self.num_draft_tokens + 1}]")


class _Tokens(Sequence[int]):
    """prompt + output without copying them (NgramIndex reads the new tail and short slices)."""

    def __init__(self, prompt: list[int], output: list[int]) -> None:
        self.prompt, self.output = prompt, output

    def __len__(self) -> int:
        return len(self.prompt) + len(self.output)

    def __getitem__(self, key):  # type: ignore[no-untyped-def, override]
        n = len(self.prompt)
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step != 1:
                return (self.prompt + self.output)[key]
            if stop <= n:
                return self.prompt[start:stop]
            if start >= n:
                return self.output[start - n : stop - n]
            return self.prompt[start:] + self.output[: stop - n]
        if key < 0:
            key += len(self)
        return self.prompt[key] if key < n else self.output[key - n]


class Speculator:
    """Drafts per request and verifies them; owns the acceptance counters."""

    def __init__(self, config: SpecConfig, context_length: int, draft_model: DraftModel | None = None) -> None:
        self.config = config
        self.context_length = context_length
        self.draft_model = draft_model
        self._indexes: dict[str, NgramIndex] = {}
        self._simulated = 0.0  # accepted drafts owed by the simulated acceptance length
        self._grammar_rows: dict[str, list[Any]] = {}  # the row masks of the last drafts' constrained requests
        self.counters = {"spec_verify_steps": 0, "spec_verify_requests": 0, "spec_draft_tokens": 0,
                         "spec_accepted_tokens": 0, "spec_emitted_tokens": 0}

    def drafts(self, decision: ScheduleDecision, states: dict[str, Any]) -> dict[str, list[int]]:
        """Draft tokens for the requests of a decode `decision` that may speculate."""
        out: dict[str, list[int]] = {}
        rooms: dict[str, int] = {}
        for item in decision.items:
            state = states.get(item.rid)
            if state is None:
                continue
            if state.grammar is not None and self.config.simulate_accept_length is not None:
                continue  # simulated drafts are not the grammar's
            sreq = state.sreq
            room = min(self.config.num_draft_tokens, sreq.remaining_new_tokens - 1,
                       self.context_length - sreq.fill_len - 1)
            if room <= 0:
                continue
            if self.draft_model is not None:  # NOTE: simulated acceptance still pays for the draft model's proposals
                rooms[item.rid] = room
                continue
            if self.config.simulate_accept_length is not None:
                out[item.rid] = [sreq.fill_ids[-1]] * room  # any tokens: acceptance is simulated
                continue
            index = self._indexes.get(item.rid)
            if index is None:
                index = self._indexes[item.rid] = NgramIndex(self.config.ngram_min_match, self.config.ngram_max_match)
            d = index.propose(_Tokens(sreq.input_ids, sreq.output_ids), room)
            if d:
                out[item.rid] = d
        if rooms and self.draft_model is not None:
            out.update(self.draft_model.propose({rid: states[rid].sreq.fill_ids for rid in rooms}, rooms))
        return self._grammar_drafts(out, states)

    def _grammar_drafts(self, out: dict[str, list[int]], states: dict[str, Any]) -> dict[str, list[int]]:
        """`out` with each constrained request's drafts cut to what its grammar takes (`ReqGrammar.draft_rows`, whose
        row masks `verify` applies); a request left with none decodes one token (a draft model drops its drafts'
        KV). Mutates `out` and the row masks kept for `verify`."""
        self._grammar_rows = {}
        emptied = []
        for rid, d in list(out.items()):
            grammar = states[rid].grammar
            if grammar is None:
                continue
            rows = grammar.draft_rows(d)
            if len(rows) > 1:
                out[rid] = d[: len(rows) - 1]
                self._grammar_rows[rid] = rows
            else:
                del out[rid]
                emptied.append(rid)
        self.settle(emptied, states)
        return out

    def settle(self, rids: Iterable[str], states: dict[str, Any]) -> None:
        """Requests whose drafts were not verified (no KV slots for them): a draft model drops
        the drafts' KV."""
        if self.draft_model is None:
            return
        for rid in rids:
            state = states.get(rid)
            if state is not None:
                self.draft_model.accepted(rid, state.sreq.fill_ids)

    def observe(self, decision: ScheduleDecision, hidden: torch.Tensor | None) -> None:
        """An EAGLE head reads the target's final-norm hidden states (`hidden`, the forward's
        tokens flat in item order) of every token a forward computed; other draft sources
        ignore them."""
        eagle = self.draft_model
        if hidden is None or eagle is None:  # hidden is kept only when a head reads it
            return
        row = 0
        for item in decision.items:
            n = len(item.token_ids)
            eagle.observe(item.rid, item.prefix_len, hidden[row : row + n])
            row += n

    def forget(self, rid: str) -> None:
        self._indexes.pop(rid, None)
        if self.draft_model is not None:
            self.draft_model.forget(rid)

    def verify(self, decision: ScheduleDecision, drafts: dict[str, list[int]], logits: torch.Tensor,
               states: dict[str, Any], scheduler: Scheduler,
               sample_plain: Callable[[list[int], list[Any]], list[ReqOutput]],
               append: Callable[[Any, int], list[ReqOutput]], argmax: bool = False,
               hidden: torch.Tensor | None = None,
               record_logprobs: Callable[[Any, torch.Tensor, int], None] | None = None,
               mask_rows: Callable[[torch.Tensor, Sequence[Any]], torch.Tensor] | None = None) -> list[ReqOutput]:
        """Processes a verify forward's `logits` (rows in item order): plain rows through
        `sample_plain(rows, states)`, drafted requests by the acceptance rules, each emitted
        token through `append(state, token)` with the request's KV cut to what the token
        needs. `argmax`: `logits` is already each row's (num_rows,) argmax token (every drafted
        request greedy). `hidden`: the forward's final-norm hidden states (an EAGLE head observes
        the rows whose KV is kept). `record_logprobs(state, row, token)`: before a drafted request that
        returns logprobs emits `token`, its logits `row` (1, vocab). `mask_rows(rows, grammars)`: masks logits rows
        in place by grammars (None: unmasked): a constrained request's rows by its grammar after the drafts before
        each (the masks `drafts` made; logprobs stay the model's). Mutates the requests, their KV and the
        counters."""
        eagle = self.draft_model if hidden is not None else None  # hidden is kept only when a head reads it
        plain_rows: list[int] = []
        plain_states: list[Any] = []
        spec: list[tuple[Any, int, list[int], int]] = []  # (state, first row, drafts, prefix_len)
        row = 0
        for item in decision.items:
            d = drafts.get(item.rid)
            if d:
                spec.append((states[item.rid], row, d, item.prefix_len))
                row += len(d) + 1
            else:
                plain_rows.append(row)
                plain_states.append(states[item.rid])
                if eagle is not None and hidden is not None:  # before the append that may end the request
                    eagle.observe(item.rid, item.prefix_len, hidden[row : row + 1])
                row += 1
        scheduler.commit(decision)
        outputs = sample_plain(plain_rows, plain_states) if plain_rows else []
        simulate = self.config.simulate_accept_length is not None
        greedy = [s for s in spec if simulate or s[0].info.params.is_greedy]
        sampled = [s for s in spec if not simulate and not s[0].info.params.is_greedy]
        assert not (argmax and sampled), "argmax rows for a sampled request"
        emitted: list[tuple[Any, list[int], int, int]] = []  # (state, tokens, prefix_len, first row)
        grammar_rows, self._grammar_rows = self._grammar_rows, {}
        assert not (argmax and grammar_rows), "argmax rows for a constrained request"

        def row_infos(group: list[tuple[Any, int, list[int], int]]) -> list[SamplingInfo] | None:
            """Each verify row's sampling inputs (bias, penalties, the min-new-tokens mask): the request's, its output
            followed by the drafts before the row, as the decode step of that row would see it; None: nothing
            changes these rows."""
            if not any(changes_logits(state.info) for state, _, _, _ in group):
                return None
            return [replace(state.info, output_ids=state.info.output_ids + d[:j])
                    for state, _, d, _ in group for j in range(len(d) + 1)]

        def row_masks(group: list[tuple[Any, int, list[int], int]]) -> list[Any] | None:
            masks = [m for state, _, d, _ in group
                     for m in (grammar_rows[state.req.rid][: len(d) + 1] if state.req.rid in grammar_rows
                               else [None] * (len(d) + 1))]
            return masks if any(m is not None for m in masks) else None

        if greedy:
            rows = [r for _, start, d, _ in greedy for r in range(start, start + len(d) + 1)]
            picked = logits.index_select(0, to_device(rows, torch.long, logits.device))
            infos = row_infos(greedy)
            if infos is not None:
                picked = apply_penalties(picked, infos)
            masks = row_masks(greedy)
            if masks is not None:
                assert mask_rows is not None, "constrained drafts without a masker"
                picked = mask_rows(picked, masks)
            targets = (picked if argmax else greedy_argmax(picked)).tolist()
            pos = 0
            for state, start, d, prefix in greedy:
                mine = targets[pos : pos + len(d) + 1]
                tokens = self._simulated_tokens(d, mine) if simulate else accept_greedy(mine, d)
                emitted.append((state, tokens, prefix, start))
                pos += len(d) + 1
        for state, start, d, prefix in sampled:
            rows_t = logits[start : start + len(d) + 1]
            infos = row_infos([(state, start, d, prefix)])
            if infos is not None:
                rows_t = apply_penalties(rows_t, infos)  # NOTE: a copy when anything applies
            masks = row_masks([(state, start, d, prefix)])
            if masks is not None:
                assert mask_rows is not None, "constrained drafts without a masker"
                rows_t = mask_rows(rows_t.clone(), masks)  # NOTE: a copy: logprobs read the model's rows
            probs = filtered_probs(rows_t, [state.info.params] * (len(d) + 1))
            emitted.append((state, accept_sampled(probs, d, state.info.generator), prefix, start))
        if eagle is not None and hidden is not None:
            # the KV each request keeps: its rows up to the last accepted draft (before any append ends it)
            for state, tokens, prefix, start in emitted:
                eagle.observe(state.req.rid, prefix, hidden[start : start + len(tokens)])
        c = self.counters
        c["spec_verify_steps"] += 1
        for state, tokens, prefix, start in emitted:
            c["spec_verify_requests"] += 1
            c["spec_draft_tokens"] += len(drafts[state.req.rid])
            c["spec_accepted_tokens"] += len(tokens) - 1
            sreq = state.sreq
            lp = record_logprobs if state.req.return_logprob else None
            assert lp is None or not argmax, "argmax rows for a request returning logprobs"
            for j, token in enumerate(tokens):
                sreq.kv_len = prefix + 1 + j  # the KV of the last token and the drafts accepted before `token`
                c["spec_emitted_tokens"] += 1
                if lp is not None:
                    lp(state, logits[start + j : start + j + 1], token)
                outputs.extend(append(state, token))
                if state.finished:
                    break
            if not state.finished:
                scheduler.keep_kv(sreq, sreq.kv_len)
                if self.draft_model is not None:
                    self.draft_model.accepted(state.req.rid, sreq.fill_ids)
        return outputs

    def _simulated_tokens(self, drafts: list[int], targets: list[int]) -> list[int]:
        """Simulated acceptance: drafts[:a], then the target's token after them (row a), with a
        spread over steps so that the mean of a + 1 is the configured length (capped by the
        number of drafts)."""
        assert self.config.simulate_accept_length is not None
        self._simulated += self.config.simulate_accept_length - 1.0
        a = min(int(self._simulated), len(drafts))
        self._simulated -= a
        return [*drafts[:a], targets[a]]

    def stats(self) -> dict[str, Any]:
        c = self.counters
        stats: dict[str, Any] = dict(c)
        n = c["spec_verify_requests"]
        stats["spec_accept_length"] = (c["spec_accepted_tokens"] + n) / n if n else 0.0
        stats["spec_accept_rate"] = c["spec_accepted_tokens"] / c["spec_draft_tokens"] if c["spec_draft_tokens"] else 0.0
        if self.draft_model is not None:  # proposals whose draft steps replayed one chain graph
            stats["spec_draft_chain_replays"] = self.draft_model.num_chain_replays
        return stats
