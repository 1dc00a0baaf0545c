"""Request traces of LM programs and the optimal cache hit rate computed from them.

`RecordingTransport` wraps the httpx transport of a client (lmdsl's `RuntimeEndpoint` takes one;
the `openai` client takes an `http_client`) and records every generation request: the prompt
text, which prompt positions the request must compute whatever is cached (its last token; from
`logprob_start_len - 1` when it asks for prompt logprobs; everything for an `echo` request), the
output, and the server's `prompt_tokens` / `cached_tokens`.

`optimal_hit_rate` is the paper's Figure 13 bound: with a cache that never evicts and the best
order, every distinct prompt-token prefix is computed once; prefixes a request generated (its
output tokens whose KV exists) need no prefill; tokens a request must compute are always computed.
`selftest()` checks it against two brute-force oracles.
"""

from __future__ import annotations

import itertools
import json
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

GEN_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")


@dataclass
class Call:
    """One prompt sent to the server (a batched request gives one Call per prompt).

    must_from: None = only the last prompt token must be computed; k = positions k.. must be.
    prompt_ids / output_ids are filled by `tokenize_trace` (or taken from the response).
    """

    text: str
    must_from: int | None = None
    output_text: str = ""
    output_ids: list[int] | None = None
    prompt_ids: list[int] | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    t_start: float = 0.0
    t_end: float = 0.0
    kind: str = "gen"
    extra: dict[str, Any] = field(default_factory=dict)


class RecordingTransport(httpx.BaseTransport):
    """An httpx transport that forwards to `inner` and records generation calls in `self.calls`.

    Mutates: self.calls (appended under a lock, one entry per prompt).
    """

    def __init__(self, inner: httpx.BaseTransport | None = None) -> None:
        self.inner = inner or httpx.HTTPTransport()
        self.calls: list[Call] = []
        self._lock = threading.Lock()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        t0 = time.perf_counter()
        response = self.inner.handle_request(request)
        path = request.url.path
        if request.method not in ("POST", "PUT") or not path.endswith(GEN_PATHS):
            return response
        response.read()
        t1 = time.perf_counter()
        if response.status_code >= 400:
            return response
        body = json.loads(request.content or b"{}")
        reply = json.loads(response.content)
        if path.endswith("/generate"):
            calls = _native_calls(body, reply)
        elif path.endswith("/v1/completions"):
            calls = _completion_calls(body, reply)
        else:
            calls = []  # NOTE: chat requests carry messages, not text; the suite uses completions only
        for c in calls:
            c.t_start, c.t_end = t0, t1
        with self._lock:
            self.calls.extend(calls)
        return response

    def close(self) -> None:
        self.inner.close()


def _native_calls(body: dict[str, Any], reply: Any) -> list[Call]:
    texts = body["text"] if isinstance(body.get("text"), list) else [body.get("text", "")]
    replies = reply if isinstance(reply, list) else [reply]
    out = []
    for i, (text, r) in enumerate(zip(texts, replies, strict=True)):
        meta = r["meta_info"]
        sp = body.get("sampling_params", {})
        sp = sp[i] if isinstance(sp, list) else sp
        lsl = body.get("logprob_start_len", -1)
        lsl = lsl[i] if isinstance(lsl, list) else lsl
        want_lp = body.get("return_logprob", False)
        want_lp = want_lp[i] if isinstance(want_lp, list) else want_lp
        must_from = max(lsl - 1, 0) if want_lp and lsl is not None and lsl >= 0 else None
        kind = "hint" if sp.get("max_new_tokens") == 0 and not want_lp else ("score" if want_lp else "gen")
        if sp.get("regex") or sp.get("json_schema"):
            kind = "constrained"
        out.append(Call(text=text, must_from=must_from, output_text=r.get("text", ""),
                        output_ids=list(r.get("output_ids") or []), prompt_tokens=int(meta["prompt_tokens"]),
                        cached_tokens=int(meta.get("cached_tokens", 0)), kind=kind))
    return out


def _completion_calls(body: dict[str, Any], reply: dict[str, Any]) -> list[Call]:
    prompts = body["prompt"] if isinstance(body.get("prompt"), list) else [body.get("prompt", "")]
    echo = bool(body.get("echo")) and body.get("logprobs") is not None
    choices = sorted(reply.get("choices", []), key=lambda c: c.get("index", 0))
    n = max(len(choices) // max(len(prompts), 1), 1)
    usage = reply.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    out = []
    for i, text in enumerate(prompts):
        ch = choices[i * n]["text"] if i * n < len(choices) else ""
        if echo and ch.startswith(text):
            ch = ch[len(text):]
        out.append(Call(text=text, must_from=0 if echo else None, output_text=ch,
                        kind="score" if echo else "gen"))
    # NOTE: usage is per response; it goes on the first call so that totals stay exact
    if out:
        out[0].prompt_tokens = int(usage.get("prompt_tokens", 0))
        out[0].cached_tokens = int(details.get("cached_tokens", 0))
    return out


def tokenize_trace(client: httpx.Client, calls: list[Call], chunk: int = 64) -> int:
    """Fills prompt_ids (and output_ids when the response had none) with the server's `/tokenize`.

    Returns how many native calls' token counts differ from the server's `prompt_tokens`.
    Mutates: the calls.
    """
    def enc(texts: list[str], special: bool) -> list[list[int]]:
        ids: list[list[int]] = []
        for k in range(0, len(texts), chunk):
            part = texts[k:k + chunk]
            r = client.post("/tokenize", json={"prompt": part, "add_special_tokens": special})
            r.raise_for_status()
            ids.extend(r.json()["tokens"])
        return ids

    for c, ids in zip(calls, enc([c.text for c in calls], True), strict=True):
        c.prompt_ids = ids
    need = [c for c in calls if c.output_ids is None and c.output_text]
    for c, ids in zip(need, enc([c.output_text for c in need], False), strict=True):
        c.output_ids = ids
    return sum(1 for c in calls if c.prompt_tokens and c.prompt_ids is not None
               and len(c.prompt_ids) != c.prompt_tokens and c.kind != "score")


def _must_from(c: Call, length: int) -> int:
    last = max(length - 1, 0)
    return last if c.must_from is None else min(c.must_from, last)


def optimal_misses(calls: list[Call]) -> tuple[int, int]:
    """(prompt tokens, the fewest prompt tokens that must be computed) over the trace.

    A prompt prefix needs no compute if it was already computed (by any request, once) or
    generated (an output token whose KV exists: all but a request's last output token);
    positions a request must compute are counted per request.
    """
    children: dict[tuple[int, int], int] = {}

    def walk(ids: list[int]) -> list[int]:
        node, path = 0, []
        for t in ids:
            nxt = children.get((node, t))
            if nxt is None:
                nxt = children[(node, t)] = len(children) + 1
            node = nxt
            path.append(node)
        return path

    prompt_nodes: set[int] = set()
    generated: set[int] = set()
    forced: set[int] = set()
    total = forced_count = 0
    for c in calls:
        ids = c.prompt_ids or []
        if not ids:
            continue
        path = walk(ids + list(c.output_ids or []))
        n = len(ids)
        total += n
        f = _must_from(c, n)
        forced_count += n - f
        prompt_nodes.update(path[:f])
        forced.update(path[f:n])
        generated.update(path[n:n + max(len(c.output_ids or []) - 1, 0)])
    free = prompt_nodes - generated - forced
    return total, forced_count + len(free)


def optimal_hit_rate(calls: list[Call]) -> float:
    total, misses = optimal_misses(calls)
    return 1.0 - misses / total if total else 0.0


def achieved_hit_rate(calls: list[Call]) -> float:
    total = sum(c.prompt_tokens for c in calls)
    return sum(c.cached_tokens for c in calls) / total if total else 0.0


def radix_replay_seconds(calls: list[Call], repeat: int = 3) -> float:
    """Host time of the radix-tree operations of this trace (match, lock, insert, unlock per
    request, in trace order, through `radixcache.RadixCache`); best of `repeat`.

    A stand-in for the server's own radix management time, which the server does not report.
    """
    from radixcache import RadixCache

    keys = [(np.asarray(c.prompt_ids, dtype=np.int64),
             np.asarray((c.prompt_ids or []) + (c.output_ids or [])[:-1], dtype=np.int64))
            for c in calls if c.prompt_ids]
    best = float("inf")
    for _ in range(repeat):
        cache = RadixCache(page_size=1)
        next_slot = 0
        t0 = time.perf_counter()
        for prompt, full in keys:
            m = cache.match_prefix(prompt)
            cache.lock(m.last_node)
            kv = np.arange(next_slot, next_slot + len(full), dtype=np.int64)
            next_slot += len(full)
            cache.insert(full, kv)
            cache.unlock(m.last_node)
        best = min(best, time.perf_counter() - t0)
    return best


# ---------------------------------------------------------------- self-test against oracles
def _oracle_misses_sets(calls: list[Call]) -> int:
    """Same bound, by sets of prefix tuples (no trie)."""
    prompts, gen, forced = set(), set(), set()
    count = 0
    for c in calls:
        ids = tuple(c.prompt_ids or [])
        if not ids:
            continue
        out = tuple(c.output_ids or [])
        f = _must_from(c, len(ids))
        count += len(ids) - f
        prompts |= {ids[: i + 1] for i in range(f)}
        forced |= {ids[: i + 1] for i in range(f, len(ids))}
        full = ids + out
        gen |= {full[: i + 1] for i in range(len(ids), len(ids) + max(len(out) - 1, 0))}
    return count + len(prompts - gen - forced)


def _simulate(calls: list[Call]) -> int:
    """Computed prompt tokens when the calls run one by one in this order with an unbounded
    cache that keeps every computed prefix (prompts and outputs)."""
    cached: set[tuple[int, ...]] = set()
    computed = 0
    for c in calls:
        ids = tuple(c.prompt_ids or [])
        f = _must_from(c, len(ids))
        hit = 0
        while hit < f and ids[: hit + 1] in cached:
            hit += 1
        computed += len(ids) - hit
        out = tuple(c.output_ids or [])
        full = ids + out
        cached |= {full[: i + 1] for i in range(len(ids) + max(len(out) - 1, 0))}
    return computed


def selftest(seed: int = 0, rounds: int = 300) -> None:
    """Raises AssertionError if `optimal_misses` disagrees with the oracles on random traces."""
    rng = random.Random(seed)
    for r in range(rounds):
        calls = []
        for _ in range(rng.randint(1, 5)):
            ids = [rng.randint(0, 2) for _ in range(rng.randint(1, 6))]
            plain = r % 3 == 0
            out = [] if plain else [rng.randint(0, 2) for _ in range(rng.randint(0, 3))]
            must = None if plain or rng.random() < 0.6 else rng.randint(0, len(ids))
            calls.append(Call(text="", prompt_ids=ids, output_ids=out, must_from=must))
        _, misses = optimal_misses(calls)
        assert misses == _oracle_misses_sets(calls), calls
        best = min(_simulate(list(p)) for p in itertools.permutations(calls))
        assert best >= misses, (calls, best, misses)
        if r % 3 == 0:  # only last tokens forced, no outputs: shortest first reaches the bound
            assert _simulate(sorted(calls, key=lambda c: len(c.prompt_ids or []))) == misses, calls
