"""The grammar compile worker process (`worker_entry`) and what both sides of its pipes share.

A worker is a fresh interpreter that imports cfsm and this module only (no torch): it reads the
vocabulary spec (`vocab_spec`) first, builds the cfsm `Vocabulary` and calls `prepare()` once,
then compiles one `CompileJob` at a time. A compiled `cfsm.Index` (or `cfsm.GrammarIndex`, a
context-free grammar's pushdown matcher) goes back as its arrays (`index_payload`; the
vocabulary never travels back) and the engine rebuilds the index over its own
(`index_from_payload`). Messages are pickles whose arrays travel out of band (`send_message`,
`recv_message`). The engine side is `workers.CompilePool`.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing.connection as mpc
import os
import pickle
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

import cfsm
from cfsm.automata.automaton import Dfa

__all__ = ["KINDS", "CompileJob", "compile_error_message", "compile_index", "index_from_payload", "index_payload",
           "recv_message", "send_message", "vocab_spec", "warm_admission", "warm_index", "worker_entry"]

KINDS = ("regex", "json_schema", "json_object", "ebnf")

# (tokens, eos_token_ids, size, special_token_ids): what a worker needs to build the Vocabulary
VocabSpec = tuple[tuple[bytes, ...], tuple[int, ...], int, tuple[int, ...]]
# (dfa.transitions, dfa.accepting, dfa.start, masks, mask_row, grammar, approximations) of an Index,
# or ("grammar", GrammarIndex.payload()) of a GrammarIndex (its counted chains included)
IndexPayload = tuple[Any, ...]
CompiledIndex = cfsm.Index | cfsm.GrammarIndex

PROTOCOL = 5  # pickle protocol of every message
_NICE = 5  # scheduling priority of a worker, below the engine's


@dataclass(frozen=True)
class CompileJob:
    """One compile, as sent to a worker."""

    job_id: int
    kind: str
    text: str
    config: cfsm.CfsmConfig


# --- the compile itself (both sides) ----------------------------------------------------------------


def compile_index(kind: str, text: str, vocab: cfsm.Vocabulary, config: cfsm.CfsmConfig) -> CompiledIndex:
    """Compiles one grammar with cfsm. Raises what cfsm raises, ValueError for an unknown kind."""
    if kind == "regex":
        return cfsm.compile_regex(text, vocab, config)
    if kind == "json_schema":
        return cfsm.compile_json_schema(text, vocab, config)
    if kind == "json_object":
        return cfsm.compile_json_object(vocab, config, object_only=True)
    if kind == "ebnf":
        return cfsm.compile_ebnf(text, vocab, config)
    raise ValueError(f"unknown grammar kind {kind!r}; expected one of {KINDS}")


def compile_error_message(kind: str, exc: BaseException) -> str:
    """The client-facing message of a failed compile (the HTTP layer answers 400 with it). Pure."""
    if isinstance(exc, RecursionError):
        return f"invalid {kind} grammar: it nests too deeply to compile ({exc})"
    if isinstance(exc, cfsm.CfsmError | ValueError | KeyError | TypeError):
        return f"invalid {kind} grammar: {exc}"
    # NOTE: whatever else a compile raises fails the requests of that grammar only
    return f"compiling the {kind} grammar failed: {type(exc).__name__}: {exc}"


def index_payload(index: CompiledIndex) -> IndexPayload:
    """The arrays and notes of `index`, without its vocabulary (what a worker sends back). A pushdown
    index's payload carries what its first masks would otherwise derive on the engine's thread (the
    counted chains: ~0.3 s on the 2-core CPU for some real-world schemas). Pure (but fills caches)."""
    if isinstance(index, cfsm.GrammarIndex):
        return ("grammar", index.payload())
    dfa = index.dfa
    return (dfa.transitions, dfa.accepting, int(dfa.start), index.masks, index.mask_row, index.grammar,
            tuple(index.approximations))


def index_from_payload(payload: IndexPayload, vocab: cfsm.Vocabulary) -> CompiledIndex:
    """The index of `payload` over `vocab` (the engine's own vocabulary; cf. cfsm `Compiler._load`)."""
    if isinstance(payload[0], str) and payload[0] == "grammar":
        return cfsm.GrammarIndex.from_payload(payload[1], vocab)
    transitions, accepting, start, masks, mask_row, grammar, approximations = payload
    dfa = Dfa(transitions=transitions, accepting=accepting, start=int(start))
    return cfsm.Index(vocab=vocab, dfa=dfa, masks=masks, mask_row=mask_row, grammar=grammar,
                      approximations=tuple(approximations))


def admission_configurations(index: cfsm.GrammarIndex) -> list[int]:
    """The parser configurations whose masks a request's admission reads (`EngineCore.
    _admit_constrained`): the start, and the one after the jump-forward over the text forced from
    it (as `ReqGrammar.forced_text` cuts it: without trailing spaces; and with them). Fills the
    index's configuration table only."""
    sids = [index.start]
    forced = cfsm.Guide(index).jump_forward()
    if forced:
        for text in dict.fromkeys((forced.rstrip(" "), forced)):
            sid = index.walk(index.start, text.encode()) if text else 0
            if sid:
                sids.append(sid)
    return sids


def warm_admission(index: CompiledIndex) -> CompiledIndex:
    """Computes the masks of a pushdown index's `admission_configurations`, in the worker after a
    compile (the walks and key infos they need travel with the payload) and again in the engine
    after the rebuild (the rows themselves, from those keys: lookups). A configuration's first
    mask walks the vocabulary from its stacks: 50-500 ms on the 2-core CPU for the configuration
    after the forced `{"` of some real-world schemas, which the engine thread paid inside the step
    that admitted the request (issue 27's storm stalls). Returns `index`."""
    if isinstance(index, cfsm.GrammarIndex):
        index.warm(admission_configurations(index))
    return index


def warm_index(index: CompiledIndex) -> CompiledIndex:
    """Computes what `index` builds on first use (`cfsm.Index.warm`: forced-string table, per-row
    token flags, EOS mask; `cfsm.GrammarIndex.warm`: its vocabulary and network tables and the masks
    its admission reads, `admission_configurations`), so the engine thread does not at a request's
    admission (tens of ms for a DFA of 30k states; numpy, mostly without the GIL). Returns `index`."""
    if isinstance(index, cfsm.GrammarIndex):
        return warm_admission(index)  # NOTE: the walks came with the payload: builds the rows from them
    return index.warm()


def vocab_spec(vocab: cfsm.Vocabulary) -> VocabSpec:
    """What a worker needs to rebuild `vocab` (about 0.5 MB pickled for a 49k vocabulary). Pure."""
    return (tuple(vocab.tokens), tuple(vocab.eos_token_ids), int(vocab.size), tuple(sorted(vocab.special_token_ids)))


# --- messages: a pickle whose arrays travel out of band --------------------------------------------------


def send_message(conn: mpc.Connection, msg: Any) -> None:
    """Writes `msg` as one frame (pickle protocol 5 without the array data, and the data sizes) then
    each array's bytes raw, so the reader can read them straight into fresh buffers (`recv_message`).
    Raises what pickling raises before anything is written."""
    buffers: list[pickle.PickleBuffer] = []
    head = pickle.dumps(msg, protocol=PROTOCOL, buffer_callback=buffers.append)
    views = [b.raw() for b in buffers]
    conn.send_bytes(pickle.dumps(([v.nbytes for v in views], head), protocol=PROTOCOL))
    fd = conn.fileno()
    for view in views:
        done = 0
        while done < view.nbytes:
            done += os.write(fd, view[done:])


def recv_message(conn: mpc.Connection) -> Any:
    """Reads one `send_message` message. The array bytes go from the pipe into their buffers in
    `os.readv` calls, which run without the GIL: the engine thread barely notices a 30 MB index
    (a plain unpickle would hold the GIL for its copy, about 20 ms). Raises EOFError at a closed pipe."""
    sizes, head = pickle.loads(conn.recv_bytes())
    fd = conn.fileno()
    buffers = []
    for size in sizes:
        buf = np.empty(size, dtype=np.uint8)  # NOTE: pages are touched by the kernel's copy, not here
        view = buf.data
        done = 0
        while done < size:
            n = os.readv(fd, [view[done:]])
            if n == 0:
                raise EOFError("the worker closed its pipe in the middle of a message")
            done += n
        buffers.append(buf)
    return pickle.loads(head, buffers=buffers)


# --- the worker process ---------------------------------------------------------------------------------


def _exit_with_parent(parent_pid: int) -> None:
    """Ends this process when the engine process dies, even by SIGKILL: the kernel's parent-death
    signal on Linux, and a thread that watches the parent pid elsewhere (and as a fallback)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(0)

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent_pid:
                os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def worker_entry() -> None:
    """The worker process's main (`python -c`, argv: jobs fd, results fd, parent pid): reads the
    vocabulary spec (the first message), builds and prepares the vocabulary, then compiles jobs
    until EOF or None.

    Sends ("ready", pid), then per job ("ok", job_id, payload) or ("error", job_id, message).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C: the engine stops us in order
    jobs_fd, results_fd, parent_pid = (int(a) for a in sys.argv[1:4])
    _exit_with_parent(parent_pid)
    with contextlib.suppress(OSError):
        os.nice(_NICE)  # where cores are few, the engine's decode goes first
    jobs = mpc.Connection(jobs_fd, writable=False)
    results = mpc.Connection(results_fd, readable=False)
    try:
        spec: VocabSpec = pickle.loads(jobs.recv_bytes())
    except (EOFError, OSError):
        return
    tokens, eos, size, special = spec
    vocab = cfsm.Vocabulary(tokens, eos, size=size, special_token_ids=special).prepare()
    del spec, tokens
    # NOTE: this process's own garbage collector: the vocabulary tables live as long as the process
    # (frozen out of every collection), and a compile allocates many short-lived objects with few
    # cycles, so it runs with the collector off and one collection after it
    gc.collect()
    gc.freeze()
    send_message(results, ("ready", os.getpid()))
    while True:
        try:
            job: CompileJob | None = pickle.loads(jobs.recv_bytes())
        except (EOFError, OSError):
            return
        if job is None:
            return
        gc.disable()
        try:
            index = warm_admission(compile_index(job.kind, job.text, vocab, job.config))
            msg: tuple[Any, ...] = ("ok", job.job_id, index_payload(index))
            del index
        except BaseException as exc:  # noqa: BLE001 - reported to the requests of this grammar
            msg = ("error", job.job_id, compile_error_message(job.kind, exc))
        finally:
            gc.enable()
        try:
            send_message(results, msg)
        except (BrokenPipeError, OSError):
            return
        except Exception as exc:  # noqa: BLE001 - e.g. an unpicklable approximation note
            send_message(results, ("error", job.job_id, compile_error_message(job.kind, exc)))
        del msg
        gc.collect()
