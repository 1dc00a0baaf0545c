"""`ReqGrammar`: one request's cfsm `Guide`, with token acceptance and jump-forward planning.

Jump-forward (SGLang paper, section 4 and appendix B.1): when the guide's state forces a
string, the text so far plus the forced string is retokenized; the request rolls back to the
common token prefix and appends the new tokens in one step instead of one decode each.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

import cfsm

__all__ = ["STUCK_MESSAGE", "DraftRowGrammar", "JumpForward", "ReqGrammar"]

STUCK_MESSAGE = ("the grammar allows no token here: what it requires next has bytes no token of the model's "
                 "vocabulary spells")


@dataclass(frozen=True)
class JumpForward:
    """Replace the last `num_rollback` output tokens with `token_ids` (which spell their bytes
    followed by `text`, the forced string without its trailing spaces). `finishes`: the grammar
    is complete after it (nothing but EOS may follow)."""

    num_rollback: int
    token_ids: tuple[int, ...]
    text: str
    finishes: bool = False

    @property
    def num_new_tokens(self) -> int:
        """Net growth of the output (tokens not produced by the model)."""
        return len(self.token_ids) - self.num_rollback

    def ends_request(self, remaining: int) -> bool:
        """True when the request is over after it: the grammar is complete, or it uses the
        `remaining` new-token budget. Pure."""
        return self.finishes or self.num_new_tokens >= remaining


def guide_mask_key(g: cfsm.Guide) -> tuple[cfsm.Index | cfsm.GrammarIndex, int, bool]:
    """What a guide's mask depends on: (index, DFA state or parser configuration, finished). Equal keys (the index by
    identity) give equal masks. Pure."""
    return (g.index, g.state, g.eos_accepted)  # what cfsm's fill reads


class DraftRowGrammar:
    """The grammar of one row of a speculative verify step: the request's guide after the drafts before that row
    (`ReqGrammar.draft_rows`), masked as a request's grammar is (`BatchMasker` reads `guide` and `mask_key`)."""

    def __init__(self, guide: cfsm.Guide) -> None:
        self.guide = guide

    def mask_key(self) -> tuple[cfsm.Index | cfsm.GrammarIndex, int, bool]:
        return guide_mask_key(self.guide)


class ReqGrammar:
    """The grammar state of one request. Not thread-safe (the engine loop owns it)."""

    def __init__(self, index: cfsm.Index | cfsm.GrammarIndex, encode: Callable[[str], list[int]], *,
                 jump_forward: bool = True) -> None:
        self.index = index
        self.guide = cfsm.Guide(index)
        # what the grammar over-approximates (str of cfsm.Approximation); reported once per request
        self.approximations = [str(a) for a in getattr(index, "approximations", ())]
        self._approximations_sent = False
        self.encode = encode
        self.jump_forward_enabled = jump_forward
        self.jump_forward_tokens = 0  # net tokens added by jump-forward so far
        self.num_jumps = 0
        self.num_prefills = 0  # completed prefills (the first, then one per jump-forward); engine-owned
        # the last jump the policy declined: (forced text, its net new tokens, output length then);
        # engine-owned, lets later steps of the same forced text skip the retokenization
        self.declined: tuple[str, int, int] | None = None

    def take_approximations(self) -> list[str] | None:
        """The grammar's approximation notes the first time (None after, or when there are none).
        Mutates the sent flag."""
        if self._approximations_sent or not self.approximations:
            return None
        self._approximations_sent = True
        return self.approximations

    def fill_mask(self, out: np.ndarray, row: int) -> None:
        """Writes this request's allowed-token bitmask into `out[row]`. Mutates `out`."""
        self.guide.fill_mask(out, row)

    def mask_key(self) -> tuple[cfsm.Index | cfsm.GrammarIndex, int, bool]:
        """What this request's mask depends on (`guide_mask_key`), so a mask filled earlier may be used while the
        key is unchanged. Pure."""
        return guide_mask_key(self.guide)

    def accept(self, token_id: int) -> bool:
        """Advances the guide over a sampled token; False (state unchanged) if the grammar
        rejects it. Mutates the guide."""
        try:
            self.guide.advance(int(token_id))
        except cfsm.RejectedTokenError:
            return False
        return True

    def is_finished(self) -> bool:
        """True when the grammar is complete and nothing may follow (only EOS is allowed)."""
        return self.guide.is_finished()

    def is_stuck(self) -> bool:
        """True when no token may follow and the grammar is not complete: what it requires next has bytes no
        token of the vocabulary spells (a character outside the tokenizer's alphabet). Sampling there could
        only produce a rejected token. Pure."""
        g = self.guide
        if g.eos_accepted or g.can_stop():
            return False
        return not g.has_tokens()

    def forced_text(self, guide: cfsm.Guide | None = None) -> str:
        """The text the grammar forces from here (or from `guide`'s state: a copy of this request's) ("" when none
        or jump-forward is off), without trailing spaces. Cheap (no retokenization). Mutates nothing."""
        if not self.jump_forward_enabled:
            return ""
        forced = (guide or self.guide).jump_forward()
        # NOTE: byte-level BPE attaches a space to the word after it; a jump ending in " " would
        # leave the model after a lone space token (out of distribution), so the model writes it.
        return forced.rstrip(" ") if forced else ""

    def draft_rows(self, drafts: Sequence[int]) -> list[DraftRowGrammar]:
        """The masks of a verify step's rows over `drafts` (speculative decoding): the grammar at drafts[:0], ...,
        drafts[:n], for the longest prefix of n drafts the grammar accepts with more to choose after each: a token
        after which text is forced (a jump-forward follows it), nothing but EOS may follow, or nothing at all can
        follow is the target's to emit as a decode step's row would be, its jump or end after it. No row (an
        empty list) while a jump is pending from here: that step is a plain one. Mutates nothing."""
        if self.forced_text():
            return []
        g = self.guide.copy(history=False)
        rows = [DraftRowGrammar(g.copy(history=False))]
        for token in drafts:
            try:
                g.advance(int(token))
            except cfsm.RejectedTokenError:
                break
            if g.is_finished() or not g.has_tokens() or self.forced_text(g):
                break
            rows.append(DraftRowGrammar(g.copy(history=False)))
        return rows

    def plan_jump(self, output_ids: Sequence[int], max_new_tokens: int) -> JumpForward | None:
        """The jump-forward from the current state over `output_ids` (the request's generated
        tokens, all accepted by the guide), at least 1 and at most `max_new_tokens` tokens of net
        growth; None when nothing is forced, it would not grow the output, or jump-forward is
        off. Mutates nothing."""
        if max_new_tokens <= 0:
            return None
        forced = self.forced_text()
        if not forced:
            return None
        try:
            plan = cfsm.plan_jump_forward(list(output_ids), forced, self.index.vocab, self.encode)
        except ValueError:  # a forced byte no token spells: no jump (the mask then allows nothing either)
            return None
        rollback, tokens = plan.num_rollback, plan.token_ids
        if len(tokens) - rollback > max_new_tokens:
            tokens = tokens[: rollback + max_new_tokens]
        # NOTE: a retokenization that merges sampled tokens can add no token or take some away
        # (rollback >= new tokens); skipping it keeps `jump_forward_tokens` (the output tokens not
        # sampled, reported per request as a running total) nondecreasing, and the model writes
        # the short forced text itself
        if len(tokens) - rollback < 1:
            return None
        # NOTE: a retokenization the guide does not accept would desync mask and output; verify
        # on a copy (cheap: a few token steps) and skip the jump rather than fail the request.
        probe = self.guide.copy()
        try:
            probe.rollback(rollback)
            probe.advance_many(tokens)
        except (cfsm.RejectedTokenError, ValueError):
            return None
        return JumpForward(rollback, tuple(tokens), forced, finishes=probe.is_finished())

    def apply_jump(self, jump: JumpForward) -> None:
        """Rolls the guide back and over the jump's tokens. Mutates the guide and counters."""
        self.guide.rollback(jump.num_rollback)
        self.guide.advance_many(jump.token_ids)
        self.jump_forward_tokens += jump.num_new_tokens
        self.num_jumps += 1
