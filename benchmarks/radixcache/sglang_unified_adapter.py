"""Optional: SGLang's `UnifiedRadixCache` (Rust TreeCore) behind the benchmark's adapter protocol.

The unified cache is what SGLang builds for a full-attention model: `CacheInitParams` with the
FULL component only and the `rust` tree-core backend (its compiled `mem_cache` extension). It
needs no request objects or pools for match / insert / lock / evict: the KV allocator is the
only collaborator, and it only receives frees (`free_segment`), which `_FreedSink` collects.

Semantics, matched to SGLang's scheduler (`checkpoint_into_tree`, `release_kv_cache`):
- insert takes `prev_prefix_len` = the request's cached length, and the tree itself frees the
  duplicate slots in [prev_prefix_len, prefix_len) (timed, inside `insert`, returned to the
  engine model); the key is cut to whole pages by the tree, the value to the key's length here.
- the unaligned tail at finish is freed by the engine (`free_kv_row`), untimed, as for the
  classic cache: `frees_tail = False`.
- lock / unlock are `lock(node)` -> `TreeLock` and `unlock(TreeLock)`; the handle a match returns
  carries its lock.

Importing the module needs a few more inert stubs than the classic cache (the OpenAI protocol
types, grammar backends and `schedule_batch`, reached through `StreamingSession`'s imports; none is
called on a FULL-only tree), and `page_interleave_shard_size` is pinned to 1, its value for any
stock (non page-interleaved) allocator, since the allocator package is stubbed.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import sglang_adapter

_EXTRA_STUBS = ("openai", "sglang.srt.constrained", "sglang.srt.managers.schedule_batch")


class _Handle:
    """A matched node id plus the lock taken on it (SGLang's `TreeLock`)."""

    __slots__ = ("lock", "node")

    def __init__(self, node: Any) -> None:
        self.node = node
        self.lock: Any = None


def import_sglang_unified_cache() -> Any:
    sglang_adapter.import_sglang_radix_cache()
    sglang_adapter.install_stubs(_EXTRA_STUBS)
    try:
        import sglang.srt.mem_cache.unified_radix_cache as urc
    except ImportError as exc:
        raise SystemExit(f"--sglang-impl unified: cannot import sglang's unified radix cache ({exc})") from exc
    urc.page_interleave_shard_size = lambda allocator: 1  # a stock allocator's value
    return urc


class SGLangUnifiedAdapter:
    """SGLang's UnifiedRadixCache with the Rust tree core; native `RadixKey` keys, int64 tensors."""

    frees_tail = False  # the engine frees the unaligned tail (SGLang's free_kv_row)

    def __init__(self, page_size: int = 1) -> None:
        import torch

        self._torch = torch
        urc = import_sglang_unified_cache()
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.radix_cache import RadixKey
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

        self._Evict, self._Insert, self._Match, self._RadixKey = EvictParams, InsertParams, MatchPrefixParams, RadixKey
        self._sink = sglang_adapter._FreedSink()
        params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=self._sink,
                                 page_size=page_size, tree_components=(ComponentType.FULL,), tree_core_backend="rust",
                                 eviction_policy="lru")
        self.cache = urc.UnifiedRadixCache(params)
        core = type(self.cache.tree_core).__name__
        if core != "RustUnifiedTreeCore":
            raise SystemExit(f"--sglang-impl unified: expected the Rust tree core, got {core}")
        self.page_size = page_size
        self.name = f"sglang-unified {sglang_adapter._sglang_version()}"

    def native_key(self, tokens: np.ndarray) -> Any:
        from array import array

        return self._RadixKey(array("q", np.ascontiguousarray(tokens, dtype=np.int64).tobytes()))

    def native_value(self, slots: np.ndarray) -> Any:
        return self._torch.from_numpy(np.ascontiguousarray(slots))

    def match(self, key: Any) -> tuple[int, Any, Any]:
        m = self.cache.match_prefix(self._Match(key=key))
        node = m.last_device_node
        return m.device_prefix_len, _Handle(node), self.cache.path_device_indices(node)

    def indices_to_numpy(self, indices: Any) -> np.ndarray:
        return indices.numpy()

    def _take_freed(self) -> np.ndarray:
        freed, self._sink.freed = self._sink.freed, []
        if not freed:
            return np.zeros(0, dtype=np.int64)
        return self._torch.cat(freed).numpy()

    def insert(self, key: Any, value: Any, cached_len: int, finished: bool) -> tuple[int, np.ndarray]:
        r = self.cache.insert(self._Insert(key=key, value=value[: len(key)], prev_prefix_len=cached_len))
        return int(r.prefix_len), self._take_freed()

    def lock(self, handle: _Handle) -> None:
        handle.lock = self.cache.lock(handle.node)

    def unlock(self, handle: _Handle) -> None:
        self.cache.unlock(handle.lock)
        handle.lock = None

    def evict(self, num_tokens: int) -> np.ndarray:
        self.cache.evict(self._Evict(num_tokens=num_tokens))
        return self._take_freed()

    def peek_prefix_len(self, key: Any, extra_key: Any = None) -> int:
        # NOTE: as with the classic cache, the scheduler's ordering matches (and so touches)
        native = self.native_key(key) if isinstance(key, np.ndarray) else key
        return int(self.cache.match_prefix(self._Match(key=native)).device_prefix_len)

    def touch_prefix(self, key: Any, extra_key: Any = None) -> int:
        return self.peek_prefix_len(key, extra_key)

    @property
    def total_size(self) -> int:
        return int(self.cache.total_size()[0])
