"""Process model: the engine core in a spawned subprocess, HTTP + tokenization in this one.

Start: spawn the core process, wait for its `CoreReady`, serve HTTP with uvicorn, run
`/health_generate` once internally and then print the ready line (`READY_PREFIX` + URL).
Stop: SIGINT/SIGTERM drain (new requests get 503; running ones finish within
`--shutdown-timeout-s`, then get a 503 / an SSE error event), then stop uvicorn; the core is
asked to shut down, joined, and killed if it lingers (exit status 0). A second signal stops at
once. A core that dies or fails makes the server unhealthy (503) and the process exit with
status 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import shutil
import signal
import socket
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn

from lmserver.config import ServerConfig
from lmserver.edge.api import create_app
from lmserver.edge.core_loop import DEFAULT_CORE_FACTORY, run_core_process
from lmserver.edge.ipc import IpcAddrs
from lmserver.edge.tokenizer_manager import EngineDeadError, TokenizerManager
from lmserver.netutil import SERVER_KEEP_ALIVE_S

logger = logging.getLogger("lmserver")

READY_PREFIX = "lmserver: ready at "
_WATCH_INTERVAL_S = 0.5


def launch_server(config: ServerConfig, *, core_factory: str = DEFAULT_CORE_FACTORY,
                  core_kwargs: dict[str, Any] | None = None) -> int:
    """Runs the server until a signal or a core failure; returns the process exit status.

    `core_factory` (`"module:callable"`, called with the config and `core_kwargs`) builds the
    engine core inside the subprocess; tests pass `lmserver.testing:FakeEngineCore`.
    """
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(message)s",
                        stream=sys.stderr)
    try:
        return asyncio.run(_serve(config, core_factory, core_kwargs))
    except KeyboardInterrupt:
        return 0


async def _serve(config: ServerConfig, core_factory: str, core_kwargs: dict[str, Any] | None) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_signal(signum: int, _: Any) -> None:
        logger.info("received signal %d, shutting down", signum)
        loop.call_soon_threadsafe(stop.set)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)

    problem = _port_problem(config.host, config.port)
    if problem:
        logger.error("cannot serve on %s:%s: %s (choose another --port)", config.host, config.port, problem)
        return 1
    addrs = IpcAddrs.new()
    mgr = TokenizerManager(config, addrs)
    proc = multiprocessing.get_context("spawn").Process(
        target=run_core_process, args=(config, addrs, core_factory, core_kwargs), name="lmserver-core")
    proc.start()
    try:
        ready = await _wait_ready(mgr, proc, stop)
        if ready is None:
            return 0 if stop.is_set() else 1
        logger.info("resolved config: %s", ready.resolved_config)
        return await _run_http(config, mgr, proc, stop)
    finally:
        await mgr.shutdown()
        # NOTE: a core still loading its model does not read ShutdownReq: terminate it at once; a
        # core the drain gave up on (mark_dead) is not sent ShutdownReq either: a short grace then
        grace_s = 0.0 if mgr.ready is None else 10.0 if mgr.dead_reason is None else 2.0
        await loop.run_in_executor(None, _reap, proc, grace_s)
        shutil.rmtree(addrs.folder, ignore_errors=True)


async def _wait_ready(mgr: TokenizerManager, proc: Any, stop: asyncio.Event) -> Any:
    task = asyncio.ensure_future(mgr.wait_ready())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=_WATCH_INTERVAL_S)
            if stop.is_set():
                return None
            if not task.done() and not proc.is_alive():
                logger.error("the engine core process exited with status %s before it was ready", proc.exitcode)
                return None
        return task.result()
    except EngineDeadError as exc:
        logger.error("%s", exc)
        return None
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


class _DrainingServer(uvicorn.Server):
    """uvicorn's server whose first SIGINT/SIGTERM calls `on_signal` (which starts the drain)
    instead of stopping at once; a second signal stops it at once (uvicorn's own handling)."""

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[int, Any], object]) -> None:
        super().__init__(config)
        self._on_signal = on_signal
        self._num_signals = 0

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._num_signals += 1
        if self._num_signals == 1:
            self._on_signal(sig, frame)
            return
        super().handle_exit(sig, frame)


async def _drain(config: ServerConfig, mgr: TokenizerManager, proc: Any) -> None:
    """Stops admitting requests (new ones get 503), lets the running ones finish for up to
    `shutdown_timeout_s`, then fails the rest (a JSON 503, or an SSE error event then [DONE])."""
    loop = asyncio.get_running_loop()
    mgr.shutting_down = True
    deadline = loop.time() + config.shutdown_timeout_s
    if mgr.num_pending:
        logger.info("draining: %d requests running, waiting up to %.0f s (--shutdown-timeout-s)", mgr.num_pending,
                    config.shutdown_timeout_s)
    while mgr.num_pending and loop.time() < deadline and proc.is_alive() and mgr.dead_reason is None:
        await asyncio.sleep(0.05)
    if mgr.num_pending and mgr.dead_reason is None:
        logger.warning("draining: %d requests still running after %.0f s; ending them", mgr.num_pending,
                       config.shutdown_timeout_s)
        # NOTE: fails every waiter with EngineDeadError: the routes answer 503 / an SSE error event + [DONE]
        mgr.mark_dead(f"the server is shutting down (the request did not finish within {config.shutdown_timeout_s:g} "
                      "s, --shutdown-timeout-s)")


async def _run_http(config: ServerConfig, mgr: TokenizerManager, proc: Any, stop: asyncio.Event) -> int:
    loop = asyncio.get_running_loop()
    server = _DrainingServer(uvicorn.Config(
        create_app(mgr), host=config.host, port=config.port, log_level=config.log_level,
        access_log=config.log_requests, timeout_graceful_shutdown=5, log_config=None,
        timeout_keep_alive=SERVER_KEEP_ALIVE_S), on_signal=lambda *_: loop.call_soon_threadsafe(stop.set))
    status = {"code": 0}

    async def watch() -> None:
        while not server.should_exit:
            await asyncio.sleep(_WATCH_INTERVAL_S)
            if stop.is_set():
                await _drain(config, mgr, proc)
                server.should_exit = True
            elif not proc.is_alive() or mgr.dead_reason is not None:
                mgr.mark_dead(mgr.dead_reason or f"the engine core process exited with status {proc.exitcode}")
                status["code"] = 1
                server.should_exit = True

    async def announce() -> None:
        while not server.started:
            if server.should_exit:
                return
            await asyncio.sleep(0.05)
        while not server.should_exit:
            if await mgr.health_generate(timeout_s=60.0):
                print(f"{READY_PREFIX}http://{config.host}:{config.port}", flush=True)
                return
            await asyncio.sleep(0.5)

    tasks = [asyncio.ensure_future(watch()), asyncio.ensure_future(announce())]
    try:
        await server.serve()
    except SystemExit as exc:  # uvicorn exits on a start-up failure such as a port in use
        logger.error("the HTTP server failed to start (exit %s)", exc.code)
        status["code"] = 1
    finally:
        for t in tasks:
            t.cancel()
    if not server.started:
        status["code"] = 1
    return status["code"]


def _port_problem(host: str, port: int) -> str | None:
    """Why `host:port` cannot be bound now (checked before the model loads), or None."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def _reap(proc: Any, grace_s: float) -> None:
    """Joins the core process for `grace_s`; then terminates, then kills it if it does not exit."""
    proc.join(timeout=grace_s)
    if proc.is_alive():
        logger.warning("the engine core did not stop; terminating it")
        proc.terminate()
        proc.join(timeout=5)
    if proc.is_alive():
        proc.kill()
        proc.join()
