"""`ServerProcess`: `lmserver serve` as a child process, waited for until its ready line (used by `make serve`'s
main job, the benchmarks and the tests; `lmserver.testing` re-exports it)."""

from __future__ import annotations

import os
from collections import deque
from typing import Any

from lmserver.netutil import free_port

__all__ = ["ServerProcess"]


class ServerProcess:
    """A server started as a child process; `start()` waits for its ready line.

    `args` are `lmserver serve` options; `core` picks a fake core factory from this module
    (`"fake"`, `"slow"`, `"crash"`, `"slow_start"`) or the real engine (`None`). stdout and stderr are kept in
    `lines` (the last 2000 lines) for assertions and failure messages.
    """

    def __init__(self, args: list[str] | None = None, core: str | None = "fake", port: int | None = None,
                 env: dict[str, str] | None = None) -> None:
        import sys

        args = args or []
        dp = int(args[args.index("--dp-size") + 1]) if "--dp-size" in args else 0
        self.port = port or free_port(span=1 + dp)  # a DP server's replicas listen on port + 1 ..
        self.base_url = f"http://127.0.0.1:{self.port}"
        full = ["--port", str(self.port), *args]
        if core is None:
            self.cmd = [sys.executable, "-m", "lmserver", "serve", *full]
        else:
            factory = {"fake": "FakeEngineCore", "slow": "slow_core", "crash": "crashing_core",
                       "slow_start": "slow_start_core"}[core]
            code = ("import sys; from lmserver.testing import serve_fake; "
                    f"sys.exit(serve_fake(sys.argv[1:], 'lmserver.testing:{factory}'))")
            self.cmd = [sys.executable, "-c", code, *full]
        self.env = env
        self.lines: deque[str] = deque(maxlen=2000)
        self.proc: Any = None

    def start(self, timeout_s: float = 300.0, wait: bool = True) -> ServerProcess:
        import subprocess
        import threading
        import time

        env = dict(os.environ, **(self.env or {}))
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env, bufsize=1)
        ready = threading.Event()

        def pump() -> None:
            from lmserver.edge.launch import READY_PREFIX

            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.lines.append(line.rstrip("\n"))
                if line.startswith(READY_PREFIX):
                    ready.set()

        threading.Thread(target=pump, daemon=True).start()
        if not wait:
            return self
        deadline = time.monotonic() + timeout_s
        while not ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the server did not become ready:\n" + self.log_tail())
        return self

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(list(self.lines)[-n:])

    def stop(self, sig: int | None = None, timeout_s: float = 30.0) -> int:
        """Sends `sig` (SIGTERM by default), waits, and returns the exit status."""
        import signal
        import subprocess

        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig or signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return int(self.proc.returncode)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
