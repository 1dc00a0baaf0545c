"""Grammar backend: compile regex / JSON Schema / EBNF constraints with cfsm, off the engine thread.

Compiles run in worker processes (`workers.CompilePool`, started on the first grammar); with
`compile_workers=0` they run in daemon threads of this process instead (tests only: a thread's
compile holds the GIL and stalls decoding).

Compiled `cfsm.Index` objects are cached by `GrammarKey` (kind, text, strict; the backend's cfsm
config is fixed); concurrent requests for one grammar share one compile; a failed compile is
retried on the next submit. At most `max_pending` distinct compiles are queued or running: a
new one beyond that fails its request with `GrammarQueueFullError` (HTTP 503). A request whose
grammar is not ready by its deadline fails with a timeout; in worker processes the compile is
killed once no request waits for it any more (the latest deadline of its requests passed).

    backend = GrammarBackend(tokenizer, vocab_size, eos_token_ids)
    ticket = backend.submit(GrammarKey("regex", r"[0-9]+"))
    backend.result(ticket)   # Index, None (not ready) or raises GrammarError
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import hashlib
import json
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import cfsm
from lmserver.engine.constrained.compile_worker import (
    KINDS,
    CompiledIndex,
    CompileJob,
    compile_error_message,
    compile_index,
    warm_index,
)
from lmserver.engine.constrained.workers import CompilePool, PoolStats
from lmserver.io_struct import InvalidRequestError, OverloadedError, SamplingParams

__all__ = ["KINDS", "GrammarBackend", "GrammarError", "GrammarKey", "GrammarQueueFullError", "GrammarTicket",
           "grammar_key"]

logger = logging.getLogger(__name__)

DEFAULT_MAX_LENGTH = 4 << 20  # characters of a regex, JSON Schema or EBNF text (--grammar-max-length)
# JSON Schema texts up to this many characters are parsed on the engine thread (a 400 for bad JSON before any
# compile) and re-serialized compactly (one cache entry for any spacing); longer ones are keyed as sent and
# parsed by the worker (json.loads of 4 MB would hold the engine thread for tens of ms)
CANONICAL_MAX_LENGTH = 1 << 16


class GrammarError(InvalidRequestError):
    """A grammar failed to compile (unsupported construct, bad JSON, timeout); the HTTP layer
    answers 400 with this message."""


class GrammarQueueFullError(GrammarError, OverloadedError):
    """Too many distinct grammars are queued or compiling; the HTTP layer answers 503 (retry later)."""

    status = 503


@dataclass(frozen=True)
class GrammarKey:
    """What to compile: `kind` is "regex", "json_schema", "json_object" or "ebnf" (GBNF, start
    rule `root`); `text` its source;
    `strict` (JSON Schema only): a keyword cfsm can only over-approximate fails the compile."""

    kind: str
    text: str
    strict: bool = False


@dataclass(frozen=True)
class GrammarTicket:
    """A pending compile for one request (its deadline is per request)."""

    key: GrammarKey
    future: cf.Future[CompiledIndex]
    deadline: float


def grammar_key(params: SamplingParams, *, strict: bool = False, max_length: int = DEFAULT_MAX_LENGTH) -> GrammarKey | None:
    """The grammar a request asks for, or None. `strict` is the server default of
    `params.json_schema_strict`. Raises GrammarError for a text longer than `max_length`
    characters, and for JSON Schema text that is not JSON (an EBNF's errors come from its
    compile, with line and column). Pure."""
    for name in ("regex", "json_schema", "ebnf"):
        text = getattr(params, name)
        if text is not None and len(text) > max_length:
            raise GrammarError(f"the {name} is {len(text):,} characters long; this server takes at most "
                               f"{max_length:,} (--grammar-max-length)")
    if params.regex is not None:
        return GrammarKey("regex", params.regex)
    if params.ebnf is not None:
        return GrammarKey("ebnf", params.ebnf)
    if params.json_schema is not None:
        per_request = params.json_schema_strict
        strict = strict if per_request is None else bool(per_request)
        if len(params.json_schema) > CANONICAL_MAX_LENGTH:
            return GrammarKey("json_schema", params.json_schema, strict=strict)
        try:
            schema = json.loads(params.json_schema)
        except RecursionError:
            raise GrammarError("json_schema nests too deeply to parse") from None
        except ValueError as exc:
            raise GrammarError(f"json_schema is not valid JSON: {exc}") from None
        # NOTE: {"type": "object"} alone (OpenAI's json_object) means any JSON object; cfsm's
        # default (no undeclared properties) would only allow "{}".
        if schema == {"type": "object"}:
            return GrammarKey("json_object", "")
        return GrammarKey("json_schema", json.dumps(schema, separators=(",", ":")), strict=strict)
    return None


# a pushdown grammar's index caches one row per parser configuration it has seen (about 1.5 KB);
# past this many, new requests get a fresh compile (the old index goes with its last request)
MAX_GRAMMAR_CONFIGURATIONS = 200_000


def _outgrown(index: CompiledIndex) -> bool:
    return isinstance(index, cfsm.GrammarIndex) and index.num_configurations > MAX_GRAMMAR_CONFIGURATIONS


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


@dataclass(eq=False)
class _Entry:
    """A cached grammar: its compile's future, and the pool's handle while it runs."""

    future: cf.Future[CompiledIndex]
    job: Any = None  # workers._Job of a process compile (its deadline is extended by later requests)


def cgroup_cpu_limit(cpu_max: str) -> float | None:
    """CPUs a cgroup v2 `cpu.max` text ("QUOTA PERIOD", or "max PERIOD" for none) allows, or None
    (no quota, unreadable). Pure."""
    parts = cpu_max.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    try:
        quota, period = float(parts[0]), float(parts[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def available_cpus() -> int:
    """CPUs this process may use: its affinity set, lowered by a cgroup v2 CPU quota (a container
    limited to 4 CPUs on a 16-core host reports 16 in `os.cpu_count()`). At least 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 2
    try:
        with open("/sys/fs/cgroup/cpu.max", encoding="ascii") as f:
            limit = cgroup_cpu_limit(f.read())
    except OSError:
        limit = None
    if limit is not None:
        cpus = min(cpus, max(int(limit), 1))
    return max(cpus, 1)


def auto_compile_workers(num_cpus: int) -> int:
    """Compile workers for a machine of `num_cpus` cores: a quarter of them, 2 to 8 (a storm of
    distinct schemas queues behind too few; the engine loop needs its own core). Pure."""
    return max(2, min(8, num_cpus // 4))


class GrammarBackend:
    """Compiles grammars for one tokenizer in `compile_workers` worker processes (0: two threads
    of this process), with an LRU of `cache_size` keys. Thread-safe.

    The cfsm `Vocabulary` is built from `tokenizer` with the first compile, off the engine
    thread, so servers that never see a constraint pay nothing (tests pass `vocab` and `encode`
    instead of a tokenizer).
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        *,
        compile_timeout_s: float = 30.0,
        compile_workers: int = -1,
        max_pending: int = 256,
        cache_size: int = 256,
        cfsm_config: cfsm.CfsmConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        vocab: cfsm.Vocabulary | None = None,
        encode: Callable[[str], list[int]] | None = None,
    ) -> None:
        if compile_timeout_s <= 0:
            raise ValueError(f"compile_timeout_s must be > 0, got {compile_timeout_s}")
        if compile_workers < -1:
            raise ValueError(f"compile_workers must be >= -1 (-1: auto, 0: threads of the engine process), "
                             f"got {compile_workers}")
        cpus = available_cpus()
        if compile_workers == -1:
            compile_workers = auto_compile_workers(cpus)
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.compile_timeout_s = compile_timeout_s
        self.compile_workers = compile_workers
        self.max_pending = max_pending
        self.cache_size = cache_size
        self.cfsm_config = cfsm_config or cfsm.CfsmConfig()
        self.clock = clock
        self._threads: _DaemonPool | None = None
        self._pool: CompilePool | None = None
        if compile_workers == 0:
            self._threads = _DaemonPool(2, "lmserver-grammar")
        else:
            # NOTE: extra workers (while every worker is on a long compile) only where the engine keeps a CPU
            extra_cap = max(compile_workers, min(2 * compile_workers, cpus - 1))
            self._pool = CompilePool(compile_workers, lambda: self.vocab, on_error=self._error,
                                     on_timeout=self._timeout_error, clock=clock, max_workers=extra_cap)
        # NOTE: reentrant: a future's done-callback may run at once, inside submit
        self._lock = threading.RLock()
        self._vocab_lock = threading.Lock()
        self._cache: OrderedDict[GrammarKey, _Entry] = OrderedDict()
        self._inflight: set[cf.Future[CompiledIndex]] = set()
        self._vocab: cfsm.Vocabulary | None = vocab
        self._encode = encode
        self.hits = 0
        self.misses = 0
        self.rejected = 0  # compiles refused because `max_pending` were queued or running

    # --- vocabulary --------------------------------------------------------------------------

    @property
    def vocab(self) -> cfsm.Vocabulary:
        """The cfsm vocabulary of the tokenizer (built once, thread-safe)."""
        with self._vocab_lock:
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

    @property
    def num_pending(self) -> int:
        """Distinct compiles queued or running."""
        with self._lock:
            return len(self._inflight)

    @property
    def pool_stats(self) -> PoolStats | None:
        """Counters of the worker processes (None with threads)."""
        return None if self._pool is None else self._pool.stats

    def worker_pids(self) -> list[int]:
        """Pids of the compile worker processes (empty with threads or before the first compile)."""
        return [] if self._pool is None else self._pool.worker_pids()

    def submit(self, key: GrammarKey) -> GrammarTicket:
        """Starts (or joins) the compile of `key`; never raises (a refused compile is a failed
        ticket). Mutates the cache (LRU order, new entry) and the pending set."""
        deadline = self.clock() + self.compile_timeout_s
        with self._lock:
            entry = self._cache.get(key)
            fut = entry.future if entry is not None else None
            if fut is not None and fut.done() and fut.exception() is None and _outgrown(fut.result()):
                # NOTE: requests still using the old index keep it; new ones get a fresh compile
                del self._cache[key]
                entry = fut = None
            if entry is not None and fut is not None and not (fut.done() and fut.exception() is not None):
                self._cache.move_to_end(key)
                self.hits += 1
                if entry.job is not None and not fut.done() and self._pool is not None:
                    self._pool.extend(entry.job, deadline)
                return GrammarTicket(key, fut, deadline)
            if len(self._inflight) >= self.max_pending:
                self.rejected += 1
                refused: cf.Future[CompiledIndex] = cf.Future()
                refused.set_exception(GrammarQueueFullError(
                    f"the server is compiling {len(self._inflight)} grammars already (--grammar-max-pending); "
                    "retry later"))
                return GrammarTicket(key, refused, deadline)
            self.misses += 1
            entry = self._start(key, deadline)
            self._cache[key] = entry
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            self._inflight.add(entry.future)
            entry.future.add_done_callback(lambda f: self._done(key, f))
        return GrammarTicket(key, entry.future, deadline)

    def _start(self, key: GrammarKey, deadline: float) -> _Entry:
        config = self._config(key)
        if self._pool is not None:
            job, fut = self._pool.submit(key.kind, key.text, config, deadline)
            return _Entry(fut, job)
        assert self._threads is not None
        return _Entry(self._threads.submit(lambda: self._build(key)))

    def _config(self, key: GrammarKey) -> cfsm.CfsmConfig:
        if key.kind == "json_schema" and key.strict != self.cfsm_config.strict:
            return dataclasses.replace(self.cfsm_config, strict=key.strict)
        return self.cfsm_config

    def _build(self, key: GrammarKey) -> CompiledIndex:
        """One compile in this process (the thread pool's work), warmed as a worker's result is."""
        return warm_index(compile_index(key.kind, key.text, self.vocab, self._config(key)))

    def _done(self, key: GrammarKey, fut: cf.Future[CompiledIndex]) -> None:
        with self._lock:
            self._inflight.discard(fut)
        if fut.exception() is None:
            notes = fut.result().approximations
            if notes:  # NOTE: once per compile, i.e. once per distinct grammar while it stays cached
                digest = hashlib.sha1(key.text.encode()).hexdigest()[:12]
                logger.warning("json_schema %s (%s...): the grammar over-approximates %s; every valid document is "
                               "accepted, some invalid ones too (strict mode refuses such schemas): %s",
                               digest, key.text[:60], sorted({a.keyword for a in notes}),
                               "; ".join(str(a) for a in notes))

    def _error(self, kind: str, message: str) -> GrammarError:
        return GrammarError(message)

    def _timeout_error(self, job: CompileJob | None = None, kind: str | None = None) -> GrammarError:
        kind = kind or (job.kind if job is not None else "")
        return GrammarError(
            f"compiling the {kind} grammar took longer than {self.compile_timeout_s:g} s "
            "(--grammar-compile-timeout-s); simplify it (bounded repetitions, fewer alternatives)")

    def result(self, ticket: GrammarTicket) -> CompiledIndex | None:
        """The compiled index, None while compiling, or raises GrammarError (bad grammar, timeout,
        full queue). Mutates nothing."""
        fut = ticket.future
        if not fut.done():
            if self.clock() >= ticket.deadline:
                raise self._timeout_error(kind=ticket.key.kind)
            return None
        exc = fut.exception()
        if exc is None:
            return fut.result()
        if isinstance(exc, GrammarError):
            raise exc
        raise GrammarError(compile_error_message(ticket.key.kind, exc)) from None

    def compile(self, key: GrammarKey) -> CompiledIndex:
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
        """Stops the worker processes (pending compiles fail) or the threads (once their current
        compile ends; they are daemon threads). Idempotent."""
        if self._pool is not None:
            self._pool.shutdown()
        if self._threads is not None:
            self._threads.shutdown()

