"""Typed messages between the HTTP process and the engine-core process (pickled over ZMQ).

Front end -> core: `GenerateReq` (from io_struct), `AbortReq`, `RpcReq`, `ShutdownReq`.
Core -> front end: `CoreReady` (once), `BatchOut`, `RpcResp`, `CoreStats` (periodic),
`CoreFatal` (the core is about to exit with an error).
"""

from __future__ import annotations

import os
import pickle
import tempfile
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lmserver.io_struct import ReqOutput

if TYPE_CHECKING:
    import zmq

# how long a process about to exit waits for its ZMQ context to terminate (`terminate_context`)
TERM_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class AbortReq:
    rid: str


@dataclass(frozen=True)
class RpcReq:
    """A call of one core method by name, answered by an `RpcResp` with the same id.

    Only the names in `RPC_METHODS` are accepted by the core loop.
    """

    id: int
    method: str


RPC_METHODS = ("flush_cache", "get_stats", "check_memory_invariant", "get_step_trace")


@dataclass(frozen=True)
class RpcResp:
    id: int
    result: Any = None
    error: str | None = None


@dataclass(frozen=True)
class ShutdownReq:
    pass


@dataclass
class CoreReady:
    """Sent once the core is built: what the front end needs to tokenize and report."""

    tokenizer: Any
    model_path: str
    vocab_size: int
    context_length: int
    resolved_config: dict[str, Any]
    pid: int = field(default_factory=os.getpid)


@dataclass
class BatchOut:
    outputs: list[ReqOutput]


@dataclass
class CoreStats:
    stats: dict[str, Any]


@dataclass
class CoreFatal:
    message: str


@dataclass(frozen=True)
class IpcAddrs:
    """ZMQ endpoints: `to_core` (front end PUSH -> core PULL), `from_core` (core PUSH -> front end PULL)."""

    to_core: str
    from_core: str

    @property
    def folder(self) -> str:
        """The folder holding both ipc:// socket files."""
        return os.path.dirname(self.to_core.removeprefix("ipc://"))

    @classmethod
    def new(cls) -> IpcAddrs:
        """Fresh ipc:// endpoints in a new private temporary folder (created here)."""
        folder = tempfile.mkdtemp(prefix="lmserver-ipc-")
        return cls(to_core=f"ipc://{folder}/to_core", from_core=f"ipc://{folder}/from_core")


def pack(msg: Any) -> list[Any]:
    """`msg` as ZMQ frames: its pickle (protocol 5), then each buffer it holds out of band (numpy
    arrays, e.g. a request's pixels), sent without a copy. A message without such buffers is one
    frame, which `recv_pyobj` reads as well."""
    buffers: list[pickle.PickleBuffer] = []
    head = pickle.dumps(msg, protocol=5, buffer_callback=buffers.append)
    return [head, *(b.raw() for b in buffers)]


def unpack(frames: list[Any]) -> Any:
    """The message of `pack`'s frames (`zmq.Frame`s or bytes); large arrays come back as views of their
    frames (no copy)."""
    head, *rest = frames
    return pickle.loads(getattr(head, "buffer", head), buffers=[getattr(f, "buffer", f) for f in rest])


def terminate_context(ctx: zmq.Context[Any], timeout_s: float = TERM_TIMEOUT_S) -> bool:
    """``ctx.term()``, waited for at most ``timeout_s`` in a daemon thread; True if it returned in time.

    term() blocks until every socket of the context is closed and has delivered or dropped its queued
    messages (its linger); it was seen blocking forever in the front end of a server whose core failed at
    start-up (a CI run). Both callers are about to exit: on a timeout they go on and the thread ends with
    the process."""
    done = threading.Event()

    def term() -> None:
        try:
            ctx.term()
        finally:
            done.set()

    threading.Thread(target=term, name="zmq-term", daemon=True).start()
    return done.wait(timeout_s)
