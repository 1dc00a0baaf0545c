"""Grammar backend: compile regex / JSON Schema constraints with cfsm in a thread pool.

Compiled `cfsm.Index` objects are cached by `(kind, text)`; concurrent requests for the same
grammar share one compilation. A compile that outlives `compile_timeout_s` fails the requests
waiting on it (the thread keeps running and its result still lands in the cache).

    backend = GrammarBackend(tokenizer, vocab_size, eos_token_ids)
    ticket = backend.submit(GrammarKey("regex", r"[0-9]+"))
    backend.result(ticket)   # Index, None (not ready) or raises GrammarError
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import cfsm
from lmserver.io_struct import InvalidRequestError, SamplingParams

__all__ = ["GrammarBackend", "GrammarError", "GrammarKey", "GrammarTicket", "grammar_key"]

KINDS = ("regex", "json_schema", "json_object")


class GrammarError(InvalidRequestError):
    """A grammar failed to compile (unsupported construct, bad JSON, timeout); the HTTP layer
    answers 400 with this message."""


@dataclass(frozen=True)
class GrammarKey:
    """What to compile: `kind` is "regex", "json_schema" or "json_object"; `text` its source."""

    kind: str
    text: str


@dataclass(frozen=True)
class GrammarTicket:
    """A pending compile for one request (its deadline is per request)."""

    key: GrammarKey
    future: cf.Future[cfsm.Index]
    deadline: float


def grammar_key(params: SamplingParams) -> GrammarKey | None:
    """The grammar a request asks for, or None. Raises GrammarError for `ebnf` (not supported
    yet) and for JSON Schema text that is not JSON. Pure."""
    if params.ebnf is not None:
        raise GrammarError("ebnf constraints are not supported yet; use regex or json_schema")
    if params.regex is not None:
        return GrammarKey("regex", params.regex)
    if params.json_schema is not None:
        try:
            schema = json.loads(params.json_schema)
        except ValueError as exc:
            raise GrammarError(f"json_schema is not valid JSON: {exc}") from None
        # NOTE: {"type": "object"} alone (OpenAI's json_object) means any JSON object; cfsm's
        # default (no undeclared properties) would only allow "{}".
        if schema == {"type": "object"}:
            return GrammarKey("json_object", "")
        return GrammarKey("json_schema", json.dumps(schema, separators=(",", ":")))
    return None


class _DaemonPool:
    """A minimal thread pool of daemon threads: a compile that never ends (timed out) does not
    keep the process from exiting, unlike `concurrent.futures.ThreadPoolExecutor`."""

    def __init__(self, num_threads: int, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[cf.Future[Any], Callable[[], Any]] | None] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
                         for i in range(num_threads)]
        for t in self._threads:
            t.start()

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            fut, fn = job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - delivered to the waiting request
                fut.set_exception(exc)

    def submit(self, fn: Callable[[], Any]) -> cf.Future[Any]:
        fut: cf.Future[Any] = cf.Future()
        self._jobs.put((fut, fn))
        return fut

    def shutdown(self) -> None:
        for _ in self._threads:
            self._jobs.put(None)


def _compile(key: GrammarKey, vocab: cfsm.Vocabulary, config: cfsm.CfsmConfig) -> cfsm.Index:
    if key.kind == "regex":
        return cfsm.compile_regex(key.text, vocab, config)
    if key.kind == "json_schema":
        return cfsm.compile_json_schema(key.text, vocab, config)
    if key.kind == "json_object":
        return cfsm.compile_json_object(vocab, config, object_only=True)
    raise GrammarError(f"unknown grammar kind {key.kind!r}; expected one of {KINDS}")


class GrammarBackend:
    """Compiles grammars for one tokenizer in worker threads, with an LRU of `cache_size` keys.

    The cfsm `Vocabulary` is built from `tokenizer` on the first compile, in a worker, so servers
    that never see a constraint pay nothing (tests pass `vocab` and `encode` instead of a
    tokenizer). Thread-safe.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        *,
        compile_timeout_s: float = 30.0,
        max_workers: int = 2,
        cache_size: int = 256,
        cfsm_config: cfsm.CfsmConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        vocab: cfsm.Vocabulary | None = None,
        encode: Callable[[str], list[int]] | None = None,
    ) -> None:
        if compile_timeout_s <= 0:
            raise ValueError(f"compile_timeout_s must be > 0, got {compile_timeout_s}")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.compile_timeout_s = compile_timeout_s
        self.cache_size = cache_size
        self.cfsm_config = cfsm_config or cfsm.CfsmConfig()
        self.clock = clock
        self._pool = _DaemonPool(max_workers, "lmserver-grammar")
        self._lock = threading.Lock()
        self._cache: OrderedDict[GrammarKey, cf.Future[cfsm.Index]] = OrderedDict()
        self._vocab: cfsm.Vocabulary | None = vocab
        self._encode = encode
        self.hits = 0
        self.misses = 0

    # --- vocabulary --------------------------------------------------------------------------

    @property
    def vocab(self) -> cfsm.Vocabulary:
        """The cfsm vocabulary of the tokenizer (built once, thread-safe)."""
        with self._lock:
            if self._vocab is None:
                from cfsm.hf import vocabulary_from_hf

                self._vocab = vocabulary_from_hf(self.tokenizer, size=self.vocab_size,
                                                 eos_token_ids=self.eos_token_ids)
            return self._vocab

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` without special tokens (jump-forward retokenization)."""
        if self._encode is not None:
            return self._encode(text)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    # --- compilation ---------------------------------------------------------------------------

    def submit(self, key: GrammarKey) -> GrammarTicket:
        """Starts (or joins) the compile of `key`. Mutates the cache (LRU order, new entry)."""
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None and not (fut.done() and fut.exception() is not None):
                self._cache.move_to_end(key)
                self.hits += 1
            else:
                self.misses += 1
                fut = self._pool.submit(lambda: self._build(key))
                self._cache[key] = fut
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        return GrammarTicket(key, fut, self.clock() + self.compile_timeout_s)

    def _build(self, key: GrammarKey) -> cfsm.Index:
        return _compile(key, self.vocab, self.cfsm_config)

    def result(self, ticket: GrammarTicket) -> cfsm.Index | None:
        """The compiled index, None while compiling, or raises GrammarError (bad grammar or
        timeout). Mutates nothing."""
        fut = ticket.future
        if not fut.done():
            if self.clock() >= ticket.deadline:
                raise GrammarError(
                    f"compiling the {ticket.key.kind} grammar took longer than {self.compile_timeout_s:g} s "
                    "(--grammar-compile-timeout-s); simplify it (bounded repetitions, fewer alternatives)")
            return None
        exc = fut.exception()
        if exc is None:
            return fut.result()
        if isinstance(exc, GrammarError):
            raise exc
        if isinstance(exc, cfsm.CfsmError | ValueError | RecursionError | KeyError | TypeError):
            raise GrammarError(f"invalid {ticket.key.kind} grammar: {exc}") from None
        # NOTE: whatever else a compile raises fails that request only, never the engine loop
        raise GrammarError(f"compiling the {ticket.key.kind} grammar failed: {type(exc).__name__}: {exc}") from None

    def compile(self, key: GrammarKey) -> cfsm.Index:
        """Blocking compile (cached): waits up to the timeout. Raises GrammarError."""
        ticket = self.submit(key)
        cf.wait([ticket.future], timeout=max(ticket.deadline - self.clock(), 0.0))
        index = self.result(ticket)
        if index is None:  # pragma: no cover - the wait above only returns early when done
            raise GrammarError("grammar compile did not finish")
        return index

    def wait(self, tickets: Sequence[GrammarTicket], timeout_s: float) -> None:
        """Blocks until one of `tickets` is done or `timeout_s` passed. Mutates nothing."""
        if tickets:
            cf.wait([t.future for t in tickets], timeout=timeout_s, return_when=cf.FIRST_COMPLETED)

    def shutdown(self) -> None:
        """Stops the worker threads once their current compile ends (they are daemon threads)."""
        self._pool.shutdown()
