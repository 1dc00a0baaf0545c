"""A small engine model that drives a prefix cache through a trace, timing every cache call.

Per round: order the waiting queue (longest cached prefix first, aging bound, deferral of
requests that share an uncached prefix with one admitted this round), admit within the running
limit, the prefill token budget and memory (evicting when the allocator runs dry); the round's
prefill runs as one batch, so its requests cannot reuse each other's new KV; after it each prompt
is inserted and re-locked (SGLang's `cache_unfinished_req`); every round each running
request decodes `decode_chunk` tokens; at finish prompt + output are inserted and unlocked
(`cache_finished_req`), and the request's follow-ups (next turn, child thoughts) start waiting.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from traces import TraceReq

from radixcache import RadixCache, SlotAllocator
from radixcache.ordering import Ordering, dfs_weight_order, longest_prefix_first


class CacheAdapter(Protocol):
    """The calls the engine model makes; keys/values are converted to the cache's native types
    by `native_key`/`native_value` outside the timed regions."""

    name: str
    page_size: int
    frees_tail: bool  # when insert returns its frees: whether they include the unaligned tail at finish

    def native_key(self, tokens: np.ndarray) -> Any: ...
    def native_value(self, slots: np.ndarray) -> Any: ...
    def match(self, key: Any) -> tuple[int, Any, Any]: ...  # (length, handle, native indices)
    def indices_to_numpy(self, indices: Any) -> np.ndarray: ...
    def insert(self, key: Any, value: Any, cached_len: int, finished: bool) -> tuple[int, np.ndarray | None]: ...
    # (prefix_len, the slots to free, or None: the engine works them out, as SGLang's scheduler)
    def lock(self, handle: Any) -> None: ...
    def unlock(self, handle: Any) -> None: ...
    def evict(self, num_tokens: int) -> np.ndarray: ...
    def peek_prefix_len(self, key: Any, extra_key: Any = None) -> int: ...
    def touch_prefix(self, key: Any, extra_key: Any = None) -> int: ...
    @property
    def total_size(self) -> int: ...


class RadixCacheAdapter:
    name = "radixcache"
    frees_tail = True

    def __init__(self, page_size: int = 1, eviction: str = "lru", **options: Any) -> None:
        self.cache = RadixCache(page_size, eviction, **options)
        self.page_size = page_size

    def native_key(self, tokens: np.ndarray) -> Any:
        return tokens

    def native_value(self, slots: np.ndarray) -> Any:
        return slots

    def match(self, key: Any) -> tuple[int, Any, Any]:
        m = self.cache.match_prefix(key)
        return m.length, m.last_node, m.indices

    def indices_to_numpy(self, indices: Any) -> np.ndarray:
        return indices

    def insert(self, key: Any, value: Any, cached_len: int, finished: bool) -> tuple[int, np.ndarray | None]:
        r = self.cache.insert(key, value, cached_len=cached_len, finished=finished)
        return r.prefix_len, r.free

    def lock(self, handle: Any) -> None:
        self.cache.lock(handle)

    def unlock(self, handle: Any) -> None:
        self.cache.unlock(handle)

    def evict(self, num_tokens: int) -> np.ndarray:
        return self.cache.evict(num_tokens)

    def peek_prefix_len(self, key: Any, extra_key: Any = None) -> int:
        return self.cache.peek_prefix_len(key)

    def touch_prefix(self, key: Any, extra_key: Any = None) -> int:
        return self.cache.touch_prefix(key)

    @property
    def total_size(self) -> int:
        return self.cache.total_size


@dataclass
class SimConfig:
    capacity: int
    max_running: int = 64
    prefill_budget: int = 8192
    decode_chunk: int = 16
    max_wait_rounds: int | None = 8
    defer_shared_tokens: int | None = 64
    touch: bool = True  # refresh LRU clocks of waiting requests' prefixes every round
    order: str = "lpm"  # "lpm" (longest prefix first), "dfs-weight" (radixcache only), "fcfs"


@dataclass
class SimResult:
    cached_tokens: int = 0
    prompt_tokens: int = 0
    evict_calls: int = 0
    evicted_tokens: int = 0
    rounds: int = 0
    requests: int = 0
    max_wait: int = 0
    times_ns: dict[str, list[int]] = field(default_factory=lambda: {k: [] for k in ("match", "insert", "evict", "lock")})
    order_ns: int = 0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / max(self.prompt_tokens, 1)


@dataclass
class _Running:
    req: TraceReq
    full_key: Any
    kv: np.ndarray
    cached_len: int
    handle: Any
    remaining: int


def _order(cache: CacheAdapter, cfg: SimConfig, keys: list[np.ndarray], waits: list[int]) -> Ordering:
    if cfg.order == "fcfs":
        return Ordering(list(range(len(keys))), len(keys))
    kwargs: dict[str, Any] = dict(waited_rounds=waits, max_wait_rounds=cfg.max_wait_rounds,
                                  defer_shared_tokens=cfg.defer_shared_tokens, touch=cfg.touch)
    if cfg.order == "lpm":
        return longest_prefix_first(cache, keys, **kwargs)
    if cfg.order == "dfs-weight":
        if not isinstance(cache, RadixCacheAdapter):
            raise SystemExit("--order dfs-weight walks radixcache's own tree; run it without --sglang")
        return dfs_weight_order(cache.cache, keys, **kwargs)
    raise SystemExit(f"unknown order {cfg.order!r}")


def simulate(trace: list[TraceReq], cache: CacheAdapter, cfg: SimConfig) -> SimResult:
    res = SimResult()
    t = res.times_ns
    clock = time.perf_counter_ns
    alloc = SlotAllocator(cfg.capacity, cache.page_size)
    children: dict[int, list[TraceReq]] = {}
    roots: list[TraceReq] = []
    for r in trace:
        (roots if r.parent is None else children.setdefault(r.parent, [])).append(r)
    roots.sort(key=lambda r: (r.arrival_step, r.rid))
    prompt_keys = {}
    waiting: list[TraceReq] = []
    waits: list[int] = []
    running: list[_Running] = []
    next_root = 0
    step = 0

    def timed(op: str, fn: Any, *args: Any) -> Any:
        t0 = clock()
        out = fn(*args)
        t[op].append(clock() - t0)
        return out

    while next_root < len(roots) or waiting or running:
        while next_root < len(roots) and roots[next_root].arrival_step <= step:
            waiting.append(roots[next_root])
            waits.append(0)
            next_root += 1
        if waiting:
            for r in waiting:
                if r.rid not in prompt_keys:
                    prompt_keys[r.rid] = cache.native_key(r.prompt)
            t0 = clock()
            order = _order(cache, cfg, [r.prompt for r in waiting], waits)
            res.order_ns += clock() - t0
            budget = cfg.prefill_budget
            admitted: set[int] = set()
            prefilled: list[tuple[Any, _Running]] = []
            for i in order.order[: order.num_ready]:
                if len(running) + len(prefilled) >= cfg.max_running:
                    break
                req = waiting[i]
                key = prompt_keys.pop(req.rid)
                n_prompt = len(req.prompt)
                length, handle, idx = timed("match", cache.match, key)
                new_tokens = n_prompt - length
                if new_tokens > budget and admitted:
                    prompt_keys[req.rid] = key
                    break
                timed("lock", cache.lock, handle)
                need = new_tokens + len(req.output)
                slots = alloc.alloc(need)
                if slots is None:
                    pages_need = -(-need // cache.page_size) * cache.page_size
                    freed = timed("evict", cache.evict, pages_need - alloc.available)
                    res.evict_calls += 1
                    res.evicted_tokens += len(freed)
                    alloc.free(freed)
                    slots = alloc.alloc(need)
                if slots is None:
                    timed("lock", cache.unlock, handle)
                    prompt_keys[req.rid] = key
                    break
                budget -= new_tokens
                res.cached_tokens += length
                res.prompt_tokens += n_prompt
                res.max_wait = max(res.max_wait, waits[i])
                kv = np.concatenate([cache.indices_to_numpy(idx), slots])  # whole pages
                full = cache.native_key(np.concatenate([req.prompt, req.output]))
                prefilled.append((key, _Running(req, full, kv, length, handle, len(req.output))))
                admitted.add(i)
            # the round's prefill batch ran (in parallel: no request reused another's new KV);
            # cache each prompt now so that later rounds can share it (cache_unfinished_req)
            for key, run in prefilled:
                n_prompt = len(run.req.prompt)
                prefix, free = timed("insert", cache.insert, key, cache.native_value(run.kv[:n_prompt]),
                                     run.cached_len, False)
                alloc.free(run.kv[run.cached_len : prefix] if free is None else free)
                length2, handle2, idx2 = timed("match", cache.match, key)
                timed("lock", cache.lock, handle2)
                timed("lock", cache.unlock, run.handle)
                run.kv[:length2] = cache.indices_to_numpy(idx2)
                run.cached_len, run.handle = length2, handle2
                running.append(run)
            if not admitted and not running and next_root >= len(roots):
                raise RuntimeError(f"{cache.name}: request {waiting[order.order[0]].rid} can never fit")
            waiting = [r for j, r in enumerate(waiting) if j not in admitted]
            waits = [w + 1 for j, w in enumerate(waits) if j not in admitted]
        still: list[_Running] = []
        for run in running:
            run.remaining -= cfg.decode_chunk
            if run.remaining > 0:
                still.append(run)
                continue
            prefix, free = timed("insert", cache.insert, run.full_key, cache.native_value(run.kv), run.cached_len, True)
            n_full = len(run.req.prompt) + len(run.req.output)
            if free is None:  # the duplicates, then the unaligned tail's pages
                alloc.free(run.kv[run.cached_len : prefix])
                alloc.free(run.kv[n_full - n_full % cache.page_size :])
            else:
                alloc.free(free)
                if not cache.frees_tail:  # the cache freed the duplicates, the engine frees the tail
                    alloc.free(run.kv[n_full - n_full % cache.page_size :])
            timed("lock", cache.unlock, run.handle)
            res.requests += 1
            for child in children.get(run.req.rid, ()):
                waiting.append(child)
                waits.append(0)
        running = still
        step += 1
    res.rounds = step
    leaked = cfg.capacity - alloc.available - cache.total_size
    if leaked:
        raise AssertionError(f"{cache.name}: {leaked} slots leaked (neither free nor cached)")
    return res
