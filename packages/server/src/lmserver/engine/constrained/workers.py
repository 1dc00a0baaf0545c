"""Grammar compile worker processes: cfsm compiles outside the engine process, with kill on timeout.

`CompilePool` keeps `num_workers` worker processes, each a fresh interpreter (fork + exec, what
multiprocessing's "spawn" does: the engine process holds CUDA and torch state and is never
forked) that runs `compile_worker.worker_entry` and talks over two pipes. Unlike
multiprocessing's spawn it does not re-run the parent's `__main__` script in the worker (an
offline `Engine` script without an `if __name__ == "__main__"` guard would load its model
there), and the worker imports cfsm only.

One thread of the engine process (the dispatcher) starts the workers on the first job (the
vocabulary first), hands queued jobs to idle workers, receives results, and kills a worker
whose job outlived the latest deadline of the requests waiting for it (a replacement starts at
once). It waits in `multiprocessing.connection.wait`, without the GIL; a result's arrays are
read straight into their buffers by `os.readv`, also without it (for a 34 MB index the GIL is
held about 6 ms: the unpickle of the rest, the `Index`, its lazy caches built ahead).

Jobs are handed out in arrival order, and a compile cannot be paused, so a few slow compiles
would hold every worker while quick ones queue behind them (a storm of real-world schemas: most
compile in milliseconds, a few take 20 s; the quick ones waited 16-22 s and timed out in the
queue). So when every worker has been on its job for `long_job_s` and jobs wait, one more worker
starts (up to `max_workers`, twice `num_workers` by default); workers beyond `num_workers` exit
once they are idle with nothing queued.

Workers exit with the engine process: `shutdown()`, pipe EOF, a parent-death signal (Linux)
and a parent-pid watch thread.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
import logging
import multiprocessing.connection as mpc
import os
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import cfsm
from lmserver.engine.constrained.compile_worker import (
    PROTOCOL,
    CompiledIndex,
    CompileJob,
    index_from_payload,
    recv_message,
    vocab_spec,
    warm_index,
)

__all__ = ["CompilePool", "PoolStats"]

logger = logging.getLogger(__name__)

_F_SETPIPE_SZ = 1031  # Linux fcntl: a 1 MiB result pipe needs 5 reads (not 80) for a 5 MB index
_PIPE_BYTES = 1 << 20
_READY_TIMEOUT_S = 120.0  # a worker that is not ready by then is killed (and the jobs fail)
_TICK_S = 0.1  # the dispatcher's longest sleep while jobs exist (deadlines, injected clocks)


_PATH_ENV = "LMSERVER_GRAMMAR_WORKER_PATH"
# NOTE: no "" (the current folder) on the worker's path, and the folders the engine imported cfsm and
# lmserver from where the worker's path lacks them: it compiles with the cfsm the engine rebuilds indexes with
_WORKER_CODE = (f"import os, sys; sys.path[:] = [p for p in sys.path if p]; "
                f"sys.path[:0] = [p for p in os.environ.get({_PATH_ENV!r}, '').split(os.pathsep) "
                f"if p and p not in sys.path]; "
                f"from lmserver.engine.constrained.compile_worker import worker_entry; worker_entry()")


def _worker_env() -> dict[str, str]:
    """The engine's environment, naming the folders of its cfsm and lmserver."""
    import lmserver

    roots = [os.path.dirname(os.path.dirname(os.path.abspath(m.__file__ or ""))) for m in (cfsm, lmserver)]
    return dict(os.environ, **{_PATH_ENV: os.pathsep.join(dict.fromkeys(roots))})


def _send_quietly(conn: mpc.Connection, data: bytes) -> None:
    with contextlib.suppress(OSError, ValueError):  # the worker died first: its EOF is reported elsewhere
        conn.send_bytes(data)

@dataclass(eq=False)
class _Job:
    """A queued or running compile and the future its requests wait on (engine side)."""

    job: CompileJob
    future: cf.Future[CompiledIndex]
    deadline: float  # the latest deadline of the requests waiting for it; then it is killed


@dataclass(eq=False)
class _Worker:
    proc: subprocess.Popen[bytes]
    jobs: mpc.Connection  # engine -> worker
    results: mpc.Connection  # worker -> engine
    started: float
    pid: int | None = None  # set by its "ready" message
    job: _Job | None = None
    job_started: float = 0.0  # time.monotonic() when it got its job
    jobs_done: int = 0


@dataclass
class PoolStats:
    """Counters of a `CompilePool` (read under no lock; approximate while it runs)."""

    started: int = 0  # worker processes started
    extra_started: int = 0  # of which beyond num_workers, because every worker was on a long job
    retired: int = 0  # extra workers that exited idle
    killed: int = 0  # workers killed because their compile timed out
    died: int = 0  # workers that exited on their own (crash, OOM kill)
    compiled: int = 0
    failed: int = 0
    receive_s: float = 0.0  # dispatcher thread CPU time spent receiving results (recv, unpickle, Index)
    max_receive_s: float = 0.0
    rounds: int = 0  # dispatcher rounds (each checks the deadlines)


class CompilePool:
    """Worker processes compiling grammars; thread-safe.

    `submit` queues a job and returns its future; the future gets the `cfsm.Index` (over the
    vocabulary `vocab()` returns) or `on_error(kind, message)`'s exception. Workers start with
    the first job; `shutdown()` stops them.
    """

    def __init__(self, num_workers: int, vocab: Callable[[], cfsm.Vocabulary], *,
                 on_error: Callable[[str, str], BaseException], on_timeout: Callable[[CompileJob], BaseException],
                 clock: Callable[[], float] = time.monotonic, name: str = "lmserver-grammar",
                 max_workers: int | None = None, long_job_s: float = 1.0) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.num_workers = num_workers
        self.max_workers = 2 * num_workers if max_workers is None else max(max_workers, num_workers)
        self.long_job_s = long_job_s
        self._vocab_fn = vocab
        self._on_error = on_error
        self._on_timeout = on_timeout
        self.clock = clock
        self.name = name
        self.stats = PoolStats()
        self._lock = threading.Lock()
        self._queue: collections.deque[_Job] = collections.deque()
        self._workers: list[_Worker] = []
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._stopping = False
        self._job_ids = 0
        self._spec: bytes | None = None  # the pickled VocabSpec every worker gets first
        self._vocab: cfsm.Vocabulary | None = None
        self._start_error: str | None = None

    # --- engine-thread API (any thread) ------------------------------------------------------------

    @property
    def num_pending(self) -> int:
        """Jobs queued or running."""
        with self._lock:
            return len(self._queue) + sum(w.job is not None for w in self._workers)

    def worker_pids(self) -> list[int]:
        """Pids of the live worker processes (started ones included)."""
        with self._lock:
            return [w.proc.pid for w in self._workers]

    def busy(self) -> dict[int, str]:
        """Worker pid -> the kind of the grammar it is compiling."""
        with self._lock:
            return {w.proc.pid: w.job.job.kind for w in self._workers if w.job is not None}

    def submit(self, kind: str, text: str, config: cfsm.CfsmConfig, deadline: float) -> tuple[_Job, cf.Future[CompiledIndex]]:
        """Queues a compile; returns (its handle for `extend`, its future). Starts the pool on first use."""
        with self._lock:
            if self._stopping:
                raise RuntimeError("the grammar compile pool is shut down")
            self._job_ids += 1
            job = _Job(CompileJob(self._job_ids, kind, text, config), cf.Future(), deadline)
            self._queue.append(job)
            self._start_error = None  # a failed start-up is retried for a new job
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name=f"{self.name}-dispatch", daemon=True)
                self._thread.start()
        self._wake()
        return job, job.future

    def extend(self, job: _Job, deadline: float) -> None:
        """Another request waits for `job` until `deadline`: it is not killed before then."""
        with self._lock:
            job.deadline = max(job.deadline, deadline)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stops the dispatcher and the workers (killed if they do not exit in `timeout_s`); pending
        jobs fail. Idempotent."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            thread = self._thread
        self._wake()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
        with self._lock:
            workers, self._workers = self._workers, []
            queued = list(self._queue)
            self._queue.clear()
        for w in workers:
            if w.job is not None:  # its compile fails anyway: do not wait for it
                w.proc.kill()
            with contextlib.suppress(OSError, ValueError):
                w.jobs.send_bytes(pickle.dumps(None, protocol=PROTOCOL))
        deadline = time.monotonic() + timeout_s
        for w in workers:
            try:
                w.proc.wait(max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                w.proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    w.proc.wait(1.0)
            self._close(w)
            if w.job is not None:
                queued.append(w.job)
        for job in queued:
            self._fail(job, "the grammar compile pool was shut down")
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    # --- the dispatcher thread ----------------------------------------------------------------------

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"x")

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException:  # noqa: BLE001 - the pool is dead: fail what waits, never hang a request
            logger.exception("grammar compile dispatcher failed")
            with self._lock:
                self._start_error = "the grammar compile dispatcher failed (see the server log)"
            self._fail_queued()

    def _loop(self) -> None:
        while True:
            with self._lock:
                if self._stopping:
                    return
            self._ensure_workers()
            self._dispatch()
            self._retire()
            self._expire()
            self.stats.rounds += 1
            with self._lock:
                busy = bool(self._queue) or any(w.job is not None or w.pid is None for w in self._workers)
                waitables: list[Any] = [self._wake_r]
                # NOTE: a worker that exits closes its end of the results pipe: EOF there
                waitables += [w.results for w in self._workers]
            ready = mpc.wait(waitables, timeout=_TICK_S if busy else None)
            for obj in ready:
                if obj == self._wake_r:
                    with contextlib.suppress(BlockingIOError, OSError):
                        os.read(self._wake_r, 4096)
            for w in list(self._workers):
                if w.results in ready:
                    self._receive(w)

    def _ensure_workers(self) -> None:
        """Starts workers up to `num_workers` (the vocabulary first, once)."""
        with self._lock:
            missing = self.num_workers - len(self._workers)
            now = time.monotonic()
            if missing <= 0 and self._queue and len(self._workers) < self.max_workers and all(
                    w.pid is not None and w.job is not None and now - w.job_started >= self.long_job_s
                    for w in self._workers):
                missing = 1  # every worker is on a long compile while jobs wait: one more (one at a time)
                self.stats.extra_started += 1
            if missing <= 0 or self._start_error is not None:  # NOTE: a failed start waits for a new job
                return
        if self._spec is None:
            self._vocab = self._vocab_fn()
            self._spec = pickle.dumps(vocab_spec(self._vocab), protocol=PROTOCOL)
        for _ in range(missing):
            self._start_worker()

    def _start_worker(self) -> None:
        spec = self._spec
        assert spec is not None
        jobs_r, jobs_w = os.pipe()
        results_r, results_w = os.pipe()
        with contextlib.suppress(OSError, AttributeError):
            import fcntl

            fcntl.fcntl(results_w, _F_SETPIPE_SZ, _PIPE_BYTES)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-c", _WORKER_CODE, str(jobs_r), str(results_w), str(os.getpid())],
                pass_fds=(jobs_r, results_w), stdin=subprocess.DEVNULL, env=_worker_env())
        except BaseException:
            os.close(jobs_w)
            os.close(results_r)
            raise
        finally:
            # NOTE: the child has its ends now; closing ours makes a dead worker read as EOF
            with contextlib.suppress(OSError):
                os.close(jobs_r)
            with contextlib.suppress(OSError):
                os.close(results_w)
        jobs = mpc.Connection(jobs_w, readable=False)
        results = mpc.Connection(results_r, writable=False)
        # NOTE: the spec (0.5 MB for 49k tokens) outgrows the pipe until the child reads it: a thread writes
        # it, the dispatcher goes on; no job is written before the worker's "ready" (it read the spec then)
        threading.Thread(target=_send_quietly, args=(jobs, spec), name=f"{self.name}-spec", daemon=True).start()
        self.stats.started += 1
        with self._lock:
            self._workers.append(_Worker(proc, jobs, results, time.monotonic()))

    def _dispatch(self) -> None:
        """Hands queued jobs to idle ready workers (FIFO)."""
        while True:
            with self._lock:
                idle = next((w for w in self._workers if w.pid is not None and w.job is None), None)
                if idle is None or not self._queue:
                    return
                job = self._queue.popleft()
                idle.job = job
                idle.job_started = time.monotonic()
            try:
                idle.jobs.send_bytes(pickle.dumps(job.job, protocol=PROTOCOL))
            except (OSError, ValueError):
                self._reap(idle, "could not take a job")

    def _retire(self) -> None:
        """Lets idle workers beyond `num_workers` exit while nothing is queued."""
        with self._lock:
            extra = len(self._workers) - self.num_workers
            if extra <= 0 or self._queue:
                return
            idle = [w for w in self._workers if w.pid is not None and w.job is None][:extra]
        for w in idle:
            _send_quietly(w.jobs, pickle.dumps(None, protocol=PROTOCOL))  # it exits at once
            self._remove(w, kill=False)
            self.stats.retired += 1

    def _expire(self) -> None:
        """Fails the queued jobs past their deadline and kills the workers whose job is."""
        now = self.clock()
        with self._lock:
            late = [j for j in self._queue if now >= j.deadline]
            for j in late:
                self._queue.remove(j)
            running = [w for w in self._workers if w.job is not None and now >= w.job.deadline]
            starting = [w for w in self._workers if w.pid is None and time.monotonic() - w.started > _READY_TIMEOUT_S]
        for j in late:
            self._set(j, exc=self._on_timeout(j.job))
        for w in running:
            job = w.job
            assert job is not None
            logger.warning("grammar compile %d (%s) outlived its requests' deadline: killing worker %s",
                           job.job.job_id, job.job.kind, w.pid)
            self.stats.killed += 1
            self._remove(w, kill=True)
            self._set(job, exc=self._on_timeout(job.job))
        for w in starting:
            self._reap(w, f"was not ready after {_READY_TIMEOUT_S:g} s", kill=True)

    def _receive(self, w: _Worker) -> None:
        start = time.thread_time()
        try:
            msg = recv_message(w.results)
        except (EOFError, OSError):
            self._reap(w, "exited")
            return
        except Exception as exc:  # noqa: BLE001 - an unreadable result fails its job, not the pool
            msg = ("error", w.job.job.job_id if w.job else -1, f"unreadable compile result: {exc!r}")
        if msg[0] == "ready":
            with self._lock:
                w.pid = int(msg[1])
            return
        with self._lock:
            job, w.job = w.job, None
            w.jobs_done += 1
        # NOTE: the worker gets its next job before the index is rebuilt and warmed here (GIL time in
        # the engine's process, longer while its decode loop is busy): it compiles meanwhile
        self._dispatch()
        if job is None or job.job.job_id != msg[1]:  # pragma: no cover - one job per worker at a time
            logger.error("grammar worker %s sent a result for job %s it did not have", w.pid, msg[1])
            return
        if msg[0] == "ok":
            assert self._vocab is not None
            try:
                index = warm_index(index_from_payload(msg[2], self._vocab))
            except Exception as exc:  # noqa: BLE001
                self._set(job, exc=self._on_error(job.job.kind, f"compiled {job.job.kind} grammar is unusable: {exc!r}"))
                return
            spent = time.thread_time() - start
            self.stats.receive_s += spent
            self.stats.max_receive_s = max(self.stats.max_receive_s, spent)
            self.stats.compiled += 1
            self._set(job, index=index)
        else:
            self.stats.failed += 1
            self._set(job, exc=self._on_error(job.job.kind, str(msg[2])))

    def _reap(self, w: _Worker, why: str, kill: bool = False) -> None:
        """A worker is gone (or must go): its job fails; a replacement starts on the next round
        (after a failed start-up: with the next job)."""
        if not kill:
            self.stats.died += 1
        exitcode = self._remove(w, kill=True)
        job = w.job
        if w.pid is None and job is None:  # it failed while starting: restarting at once could loop forever
            msg = f"a grammar compile worker {why} while starting (exit code {exitcode}); see the server log"
            logger.error(msg)
            with self._lock:
                self._start_error = msg
            self._fail_queued()
            return
        logger.error("grammar compile worker %s %s (exit code %s)", w.pid, why, exitcode)
        if job is not None:
            self._fail(job, f"the grammar compile worker {why} while compiling it (exit code {exitcode}); "
                            "the grammar may need too much memory")

    def _remove(self, w: _Worker, kill: bool) -> int | None:
        """Takes `w` out of the pool, killed if `kill`; returns its exit code."""
        with self._lock:
            if w in self._workers:
                self._workers.remove(w)
        if kill and w.proc.poll() is None:
            w.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            w.proc.wait(5.0)
        self._close(w)
        return w.proc.returncode

    @staticmethod
    def _close(w: _Worker) -> None:
        for conn in (w.jobs, w.results):
            with contextlib.suppress(OSError):
                conn.close()

    def _fail_queued(self) -> None:
        with self._lock:
            queued = list(self._queue)
            self._queue.clear()
            msg = self._start_error or "the grammar compile workers are unavailable"
        for job in queued:
            self._fail(job, msg)

    def _fail(self, job: _Job, message: str) -> None:
        self.stats.failed += 1
        self._set(job, exc=self._on_error(job.job.kind, message))

    @staticmethod
    def _set(job: _Job, index: CompiledIndex | None = None, exc: BaseException | None = None) -> None:
        if job.future.done():
            return
        if exc is not None:
            job.future.set_exception(exc)
        else:
            job.future.set_result(index)  # type: ignore[arg-type]

