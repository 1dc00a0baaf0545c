"""The engine-core process: a loop that polls ZMQ, steps the core and sends outputs.

The loop never blocks on I/O while the core has work: it drains incoming messages without
waiting, runs one `core.step()`, and pushes the outputs. Only when the core is idle does it wait
(up to `_IDLE_POLL_MS`) for the next message. It also sends periodic `CoreStats`, writes the
periodic stats log line, and exits when its parent process dies (no orphans).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import zmq

from lmserver.config import ServerConfig
from lmserver.edge.ipc import (
    RPC_METHODS,
    TERM_TIMEOUT_S,
    AbortReq,
    BatchOut,
    CoreFatal,
    CoreReady,
    CoreStats,
    IpcAddrs,
    RpcReq,
    RpcResp,
    ShutdownReq,
    terminate_context,
    unpack,
)
from lmserver.io_struct import GenerateReq, InvalidRequestError, ReqOutput

logger = logging.getLogger("lmserver.core")

DEFAULT_CORE_FACTORY = "lmserver.engine:EngineCore"
_IDLE_POLL_MS = 50
# While the core has work, one drain handles messages for at most this long, then a step runs (the
# rest stay queued, in order): 96 JSON Schema requests arriving at once (each parsed by add_request)
# were one long gap for the running streams.
_DRAIN_BUDGET_S = 0.005
_STATS_INTERVAL_S = 1.0


def kv_usage(stats: dict[str, Any]) -> float:
    """The fraction of the KV cache in use, from a core's stats (`token_usage` or `kv_usage`)."""
    return float(stats.get("token_usage", stats.get("kv_usage", 0.0)))


def load_factory(spec: str) -> Callable[..., Any]:
    """Imports `"module:attribute"`, e.g. `lmserver.engine:EngineCore`."""
    module, _, attr = spec.partition(":")
    if not attr:
        raise ValueError(f"core factory must look like 'module:attribute', got {spec!r}")
    return getattr(importlib.import_module(module), attr)  # type: ignore[no-any-return]


def _config_dict(resolved: Any) -> dict[str, Any]:
    if hasattr(resolved, "to_dict"):
        return dict(resolved.to_dict())
    if isinstance(resolved, dict):
        return dict(resolved)
    return {"resolved_config": repr(resolved)}


class CoreLoop:
    """Owns one engine core and its two sockets. `run()` returns when asked to shut down."""

    def __init__(self, core: Any, config: ServerConfig, pull: zmq.Socket, push: zmq.Socket) -> None:
        self.core = core
        self.config = config
        self.pull = pull
        self.push = push
        self._parent_pid = os.getppid()
        self._stopping = False
        self._tokens_since_log = 0
        self._last_log = time.monotonic()
        self._last_stats = 0.0

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.pull, zmq.POLLIN)
        stalled = False
        while not self._stopping:
            busy = self.core.has_work()
            # NOTE: a step with no outputs (e.g. requests waiting for a grammar compile) waits 1 ms
            # for messages instead of spinning, so background work in this process gets the GIL.
            timeout_ms = (1 if stalled else 0) if busy else _IDLE_POLL_MS
            if poller.poll(timeout_ms):
                self._drain(_DRAIN_BUDGET_S if busy else None)
            if self._stopping:
                break
            stalled = False
            if self.core.has_work():
                outputs: list[ReqOutput] = self.core.step()
                stalled = not outputs
                if outputs:
                    self._tokens_since_log += sum(len(o.new_token_ids) for o in outputs)
                    self.push.send_pyobj(BatchOut(outputs))
            self._periodic()

    def _drain(self, budget_s: float | None = None) -> None:
        """Handles the queued messages in order; with `budget_s`, stops after that long (at least one)."""
        end = time.perf_counter() + budget_s if budget_s is not None else None
        while True:
            try:
                # NOTE: a request's pixels arrive as frames of their own, unpickled without a copy
                msg = unpack(self.pull.recv_multipart(zmq.NOBLOCK, copy=False))
            except zmq.Again:
                return
            self._handle(msg)
            if end is not None and time.perf_counter() >= end:
                return

    def _handle(self, msg: Any) -> None:
        if isinstance(msg, GenerateReq):
            try:
                self.core.add_request(msg)
            except InvalidRequestError as exc:
                self._reject(msg.rid, str(exc), exc.status)
            except Exception as exc:  # noqa: BLE001 - one bad request must not take the server down
                logger.exception("add_request failed for %s", msg.rid)
                with contextlib.suppress(Exception):
                    self.core.abort_request(msg.rid)
                self._reject(msg.rid, f"the engine rejected the request: {type(exc).__name__}: {exc}")
        elif isinstance(msg, AbortReq):
            self.core.abort_request(msg.rid)
        elif isinstance(msg, RpcReq):
            self.push.send_pyobj(self._rpc(msg))
        elif isinstance(msg, ShutdownReq):
            self._stopping = True
        else:
            logger.warning("core loop: unknown message %r ignored", type(msg).__name__)

    def _reject(self, rid: str, message: str, status: int = 400) -> None:
        self.push.send_pyobj(BatchOut([ReqOutput(
            rid=rid, new_token_ids=[], new_text="", finished=True,
            finish_reason={"type": "abort", "message": message}, error=message, error_status=status)]))

    def _rpc(self, msg: RpcReq) -> RpcResp:
        if msg.method not in RPC_METHODS:
            return RpcResp(msg.id, error=f"unknown method {msg.method!r}")
        try:
            return RpcResp(msg.id, result=getattr(self.core, msg.method)())
        except Exception as exc:  # noqa: BLE001 - e.g. a failed invariant check is an answer, not a crash
            return RpcResp(msg.id, error=f"{type(exc).__name__}: {exc}")

    def _periodic(self) -> None:
        now = time.monotonic()
        if now - self._last_stats >= _STATS_INTERVAL_S:
            self._last_stats = now
            if os.getppid() != self._parent_pid:
                logger.error("core loop: the server process is gone; exiting")
                self._stopping = True
                return
            self.push.send_pyobj(CoreStats(dict(self.core.get_stats())))
        elapsed = now - self._last_log
        if elapsed >= self.config.log_interval_s and (self._tokens_since_log or self.core.has_work()):
            stats = self.core.get_stats()
            logger.info(
                "gen throughput %.1f tok/s, running %s, waiting %s, KV usage %.1f%%, cache hit rate %.1f%%",
                self._tokens_since_log / elapsed, stats.get("num_running_reqs", "?"),
                stats.get("num_waiting_reqs", "?"), 100 * kv_usage(stats),
                100 * float(stats.get("cache_hit_rate", 0.0)))
            self._tokens_since_log = 0
            self._last_log = now


def run_core_process(config: ServerConfig, addrs: IpcAddrs, factory: str,
                     factory_kwargs: dict[str, Any] | None = None) -> None:
    """Entry point of the core subprocess: builds the core, sends `CoreReady`, runs the loop.

    Any exception is reported to the front end as `CoreFatal` and exits with status 1.
    """
    # NOTE: a terminal's Ctrl-C reaches the whole process group; the front end stops this process.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s [core] %(message)s", stream=sys.stderr)
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.connect(addrs.to_core)
    push = ctx.socket(zmq.PUSH)
    push.connect(addrs.from_core)
    code = 0
    core: Any = None
    try:
        core = load_factory(factory)(config, **(factory_kwargs or {}))
        # NOTE: the start-up heap (torch, the model's modules, the tokenizer) lives as long as the process:
        # frozen out of the collector, a full collection walks only what came since (a full collection of the
        # whole heap is a candidate for the #27 storm's longest gaps, see engine/step_trace.py; vLLM does the same)
        gc.collect()
        gc.freeze()
        push.send_pyobj(CoreReady(
            tokenizer=core.tokenizer, model_path=str(core.model_path), vocab_size=int(core.vocab_size),
            context_length=int(core.context_length), resolved_config=_config_dict(core.resolved_config)))
        CoreLoop(core, config, pull, push).run()
    except BaseException as exc:  # noqa: BLE001 - reported to the front end, then exit non-zero
        code = 1
        detail = "".join(traceback.format_exception(exc))
        logger.error("core process failed:\n%s", detail)
        with contextlib.suppress(zmq.ZMQError):
            push.send_pyobj(CoreFatal(f"{type(exc).__name__}: {exc}"), zmq.NOBLOCK)
    finally:
        constrained = getattr(core, "constrained", None)
        if constrained is not None:  # the grammar compile worker processes (they also exit with this process)
            with contextlib.suppress(Exception):
                constrained.shutdown()
        # NOTE: linger only to deliver a CoreFatal; after a clean shutdown nobody reads this socket.
        push.close(linger=1000 if code else 0)
        pull.close(linger=0)
        if not terminate_context(ctx):
            logger.warning("the ZMQ context did not terminate within %.0f s; exiting without it", TERM_TIMEOUT_S)
    logging.shutdown()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown (torch, CUDA): the parent is waiting for this exit
