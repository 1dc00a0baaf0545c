"""Process model: clean stop on SIGTERM/SIGINT without orphans; a crashed core makes the server
report unhealthy and exit non-zero instead of hanging."""

from __future__ import annotations

import signal
import time
from typing import Any

import httpx
import pytest

from lmserver.testing import ServerProcess


def _gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] == "Z":
                    return True  # a zombie has released everything; its parent is gone
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_cleanly_without_orphans(sig: int) -> None:
    srv = ServerProcess(core="fake").start()
    try:
        core_pid = httpx.get(srv.base_url + "/get_server_info", timeout=30).json()["core_pid"]
        assert core_pid != srv.proc.pid and not _gone(core_pid, 0.1)
    finally:
        code = srv.stop(sig)
    assert code == 0, srv.log_tail()
    assert _gone(core_pid), "the core process outlived the server"


def test_core_crash_gives_503_and_nonzero_exit() -> None:
    srv = ServerProcess(core="crash").start()  # the fake core raises in its third step
    try:
        # step 1 was the start-up health check; step 2 streams a token; step 3 crashes
        r = httpx.post(srv.base_url + "/generate", json={"text": "hello there", "stream": True,
                                                         "sampling_params": {"max_new_tokens": 20}}, timeout=30)
        events = [line for line in r.text.split("\n") if line.startswith("data: ")]
        assert r.status_code == 200 and '"text"' in events[0]
        assert "engine is unavailable" in events[-2] and "fake core crash" in events[-2] and events[-1] == "data: [DONE]"
        srv.proc.wait(timeout=20)
    finally:
        srv.stop()
    assert srv.proc.returncode == 1, srv.log_tail()
    assert any("engine core is dead" in line for line in srv.lines)


def test_core_exits_when_the_server_is_killed() -> None:
    srv = ServerProcess(core="fake").start()
    core_pid = httpx.get(srv.base_url + "/get_server_info", timeout=30).json()["core_pid"]
    srv.stop(signal.SIGKILL)
    assert _gone(core_pid), "the core process was orphaned"


def test_port_in_use_exits_1_before_loading_the_model() -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        srv = ServerProcess(core="crash", port=busy.getsockname()[1])
        with pytest.raises(RuntimeError, match="did not become ready"):
            srv.start(timeout_s=120)
    assert srv.proc.returncode == 1
    assert any("Address already in use" in line for line in srv.lines)


def test_engine_start_failure_exits_1_with_the_reason(tmp_path: Any) -> None:
    srv = ServerProcess(["--model-path", str(tmp_path / "no-such-model")], core=None)
    with pytest.raises(RuntimeError, match="did not become ready"):
        srv.start(timeout_s=300)
    assert srv.proc.returncode == 1
    assert any("failed to start" in line and "no-such-model" in line for line in srv.lines), srv.log_tail()


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(x) for x in f.read().split()]


def test_sigterm_while_the_model_loads_stops_at_once() -> None:
    srv = ServerProcess(core="slow_start").start(wait=False)
    deadline = time.monotonic() + 60
    while not _children(srv.proc.pid):  # the core process exists (and sleeps in its constructor)
        assert time.monotonic() < deadline and srv.proc.poll() is None, srv.log_tail()
        time.sleep(0.1)
    time.sleep(1.0)
    children = _children(srv.proc.pid)  # the core (and multiprocessing's resource tracker)
    t0 = time.monotonic()
    assert srv.stop() == 0, srv.log_tail()
    assert time.monotonic() - t0 < 8.0
    assert all(_gone(pid) for pid in children)
