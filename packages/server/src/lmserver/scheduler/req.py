"""Req: the scheduler's view of one request (plain Python + numpy, no torch)."""

from __future__ import annotations

import contextlib
import enum
import struct
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from lmserver.io_struct import MultimodalItem, SamplingParams

# np.frombuffer(b, _INT64) takes ~0.3 us, with the keyword dtype=np.int64 ~0.7 us
_INT64 = np.dtype(np.int64)


_PACKERS: dict[int, struct.Struct] = {}  # by length: no format string made and looked up per call


def _pack_int64(ids: list[int]) -> bytes:
    """`ids` as native int64 bytes (struct.pack: about 2x faster than np.array on a list);
    raises struct.error for an id that is no int64."""
    n = len(ids)
    packer = _PACKERS.get(n)
    if packer is None:
        packer = struct.Struct(f"{n}q")
        if len(_PACKERS) < 4096:
            _PACKERS[n] = packer
    return packer.pack(*ids)


def _int64_bytes(ids: list[int]) -> bytes:
    """`ids` as native int64 bytes; an id out of int64 range or no int raises numpy's error."""
    try:
        return _pack_int64(ids)
    except struct.error:
        return np.array(ids, dtype=np.int64).tobytes()


def _int64_array(ids: list[int]) -> npt.NDArray[np.int64]:
    """`ids` as a read-only int64 array."""
    return np.frombuffer(_int64_bytes(ids), _INT64)


class MMSpan(NamedTuple):
    """Rows `[item_start, item_start + length)` of the embeddings of `Req.mm_items[item_index]`,
    placed at `token_offset` of a forward's new tokens of that request."""

    item_index: int
    item_start: int
    length: int
    token_offset: int


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

    `kv` is a view of the first `kv_alloc` entries of a growing buffer (capacity doubles), so
    adding a decode slot is amortized O(1). `input_ids` is fixed after construction (its int64
    copy for the radix tree is made once); `output_ids` may change.
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
        mm_items: tuple[MultimodalItem, ...] = (),
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
        # SLO admission (relative target): the batch this request started in, when it started with
        # nothing waiting (a protected request); None: not protected (scheduler/admission.py)
        self.slo_base_rows: int | None = None
        self.finish_reason: dict[str, Any] | None = None
        # set by the engine: compute input-token logprobs during the (next) prefill
        self.need_input_logprobs = False
        # input_ids as int64 (the radix-tree key), made here while the list is in the CPU cache
        # (about 2 us for 256 ids; converted later from a cold list it took ~11 us); left to the
        # first fill_key when an id is no int64, so the error comes where it always did
        self._input_key: npt.NDArray[np.int64] | None = None
        with contextlib.suppress(struct.error):
            self._input_key = np.frombuffer(_pack_int64(self.input_ids), _INT64)
        # images / videos of the prompt, by offset; their tokens' key is their pad value
        self.mm_items = tuple(sorted(mm_items, key=lambda item: item.offset))
        if self.mm_items:
            key = _int64_array(self.input_ids).copy()
            for item in self.mm_items:
                key[item.offset : item.end] = item.pad_value
            key.flags.writeable = False
            self._input_key = key
        # (output_ids copy, PrefixPath) of the last radix peek (KVManager's)
        self.peek_memo: tuple[list[int], Any] | None = None
        self.reset_kv()

    def reset_kv(self) -> None:
        """Forgets every KV slot (after release); mutates only self."""
        self._kv_buf: npt.NDArray[np.int64] = np.zeros(0, dtype=np.int64)
        self.kv_alloc = 0  # slots held: len(kv)
        self.kv_len = 0
        self.cached_len = 0
        self.last_node: Any = None
        self.locked_len = 0  # tokens of the tree path ending at last_node (0 for a root)
        self.req_pool_idx: int | None = None
        self.table_valid_len = 0  # req_to_token[row, :table_valid_len] matches kv

    @property
    def kv(self) -> npt.NDArray[np.int64]:
        """The request's slots, token by token (a view: writes go to the request's buffer)."""
        return self._kv_buf[: self.kv_alloc]

    @kv.setter
    def kv(self, slots: npt.NDArray[np.int64]) -> None:
        self._kv_buf = slots
        self.kv_alloc = len(slots)

    def set_kv(self, slots: npt.NDArray[np.int64], capacity: int) -> None:
        """Holds a copy of `slots` in a buffer of at least `capacity` entries; mutates only self."""
        buf = np.empty(max(capacity, len(slots)), dtype=np.int64)
        buf[: len(slots)] = slots
        self._kv_buf = buf
        self.kv_alloc = len(slots)

    def append_slots(self, slots: npt.NDArray[np.int64]) -> None:
        """Appends `slots` to `kv`, doubling the buffer when full; mutates only self."""
        start = self.kv_alloc
        end = start + len(slots)
        buf = self._kv_buf
        if end > len(buf):
            grown = np.empty(max(end, 2 * len(buf), 16), dtype=np.int64)
            grown[:start] = buf[:start]
            self._kv_buf = buf = grown
        buf[start:end] = slots
        self.kv_alloc = end

    def append_slot(self, slot: int) -> None:
        """`append_slots([slot])`, cheaper (a decode step); mutates only self."""
        end = self.kv_alloc
        buf = self._kv_buf
        if end == len(buf):
            grown = np.empty(max(2 * end, 16), dtype=np.int64)
            grown[:end] = buf
            self._kv_buf = buf = grown
        buf[end] = slot
        self.kv_alloc = end + 1

    def mm_spans(self, start: int, end: int) -> tuple[MMSpan, ...]:
        """The parts of this request's images / videos among tokens [start, end) (prompt positions)."""
        spans = []
        for index, item in enumerate(self.mm_items):
            lo, hi = max(start, item.offset), min(end, item.end)
            if lo < hi:
                spans.append(MMSpan(index, lo - item.offset, hi - lo, lo - start))
        return tuple(spans)

    def _prompt_key(self) -> npt.NDArray[np.int64]:
        """`input_ids` as a read-only int64 array (image / video tokens as their pad values),
        converted once."""
        key = self._input_key
        if key is None:
            key = self._input_key = _int64_array(self.input_ids)
        return key

    def fill_key(self) -> npt.NDArray[np.int64]:
        """`fill_ids` as a read-only int64 array (the radix-tree key); the prompt part is
        converted once."""
        key = self._prompt_key()
        if not self.output_ids:
            return key
        return np.frombuffer(key.tobytes() + _int64_bytes(self.output_ids), _INT64)

    def fill_key_range(self, start: int, end: int) -> npt.NDArray[np.int64]:
        """`fill_key()[start:end]` (0 <= start <= end <= fill_len) without converting the tokens
        outside the range; read-only."""
        key = self._prompt_key()
        n_in = len(key)
        if end <= n_in:
            return key[start:end]
        outs = self.output_ids
        lo, hi = max(start - n_in, 0), end - n_in
        tail = _int64_bytes(outs if lo == 0 and hi == len(outs) else outs[lo:hi])  # no copy of all
        if start >= n_in:
            return np.frombuffer(tail, _INT64)
        return np.frombuffer(key[start:].tobytes() + tail, _INT64)

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
