"""Req: the scheduler's view of one request (plain Python + numpy, no torch)."""

from __future__ import annotations

import enum
from typing import Any

import numpy as np
import numpy.typing as npt

from lmserver.io_struct import SamplingParams


class ReqStatus(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"  # admitted, prefill (possibly chunked) not complete
    RUNNING = "running"  # decoding
    FINISHED = "finished"


class Req:
    """One request with n == 1. The KV fields follow radixcache's ownership protocol:

    - `kv[:kv_len]` are the slots of tokens `fill_ids[:kv_len]` whose K/V is written (or being
      written by the current forward); `kv` may have spare capacity past `kv_len` (pages).
    - `kv[:cached_len]` are tree-owned (locked through `last_node`); the rest are request-owned.
    """

    def __init__(
        self,
        rid: str,
        input_ids: list[int],
        sampling_params: SamplingParams,
        max_new_tokens: int,
        *,
        arrival: int,
        extra_key: str | None = None,
        logprob_start_len: int = -1,
    ) -> None:
        self.rid = rid
        self.input_ids = list(input_ids)
        self.sampling_params = sampling_params
        self.max_new_tokens = max_new_tokens
        self.extra_key = extra_key
        self.logprob_start_len = logprob_start_len
        self.arrival = arrival
        self.output_ids: list[int] = []
        self.status = ReqStatus.WAITING
        self.wait_rounds = 0
        self.num_retractions = 0
        self.cached_tokens = 0  # prefix-cache hit at first admission (reported to the user)
        self.admitted_once = False
        self.finish_reason: dict[str, Any] | None = None
        # set by the engine: compute input-token logprobs during the (next) prefill
        self.need_input_logprobs = False
        self.reset_kv()

    def reset_kv(self) -> None:
        """Forgets every KV slot (after release); mutates only self."""
        self.kv: npt.NDArray[np.int64] = np.zeros(0, dtype=np.int64)
        self.kv_len = 0
        self.cached_len = 0
        self.last_node: Any = None
        self.req_pool_idx: int | None = None
        self.table_valid_len = 0  # req_to_token[row, :table_valid_len] matches kv

    @property
    def fill_ids(self) -> list[int]:
        """Prompt plus generated tokens: what the KV cache must hold before the next sample."""
        return self.input_ids + self.output_ids

    @property
    def fill_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def remaining_new_tokens(self) -> int:
        return max(self.max_new_tokens - len(self.output_ids), 0)

    def prefix_cap(self, page_size: int) -> int:
        """Longest cached prefix this request may reuse (page-aligned).

        At least one token is always recomputed (its logits give the next token); with input
        logprobs from position k, tokens from k - 1 on are recomputed (their logits are needed).
        """
        cap = self.fill_len - 1
        if self.logprob_start_len >= 0:
            cap = min(cap, max(self.logprob_start_len - 1, 0))
        return max(cap - cap % page_size, 0)

    def __repr__(self) -> str:
        return (
            f"Req({self.rid!r}, {self.status.value}, in={len(self.input_ids)}, out={len(self.output_ids)}, "
            f"kv_len={self.kv_len}, cached_len={self.cached_len})"
        )
