"""Data parallelism: `--dp-size N` runs N single-replica servers behind the router.

Replica i listens on `port + 1 + i` (same host) and runs the same config with `dp_size=1`;
the router (`lmserver.edge.router`) serves on `port`. On CUDA each replica gets its own `tp_size` GPUs
through CUDA_VISIBLE_DEVICES (replica i: the i-th group of `tp_size` of the visible GPUs), so
`--dp-size 2` on a two-GPU host puts one replica on each; with fewer GPUs than `dp_size * tp_size`
the groups wrap around and replicas share GPUs (logged). SIGINT/SIGTERM stop the router and every
replica. A replica that dies is dropped by the router's health checks; when all of them are
gone the whole server exits non-zero instead of hanging.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import sys
import threading
import time

from lmserver.config import API_KEY_ENV, ServerConfig
from lmserver.edge.launch import READY_PREFIX

logger = logging.getLogger("lmserver.dp")

_READY_TIMEOUT_S = 900.0


def replica_args(config: ServerConfig, index: int) -> list[str]:
    """Command-line options reproducing `config` for replica `index` (dp_size 1, own port); the API
    key never goes on a command line (any user can list those): `replica_env` carries it."""
    replica = config.replace(dp_size=1, port=config.port + 1 + index)
    args: list[str] = []
    for f in dataclasses.fields(ServerConfig):
        value = getattr(replica, f.name)
        if value == f.default or f.name == "api_key":
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            args.append(flag if value else "--no-" + f.name.replace("_", "-"))
        else:
            args += [flag, str(value)]
    return args


def replica_gpus(index: int, tp_size: int, visible: list[str]) -> list[str]:
    """The GPUs (entries of `visible`, the parent's CUDA device list) of replica `index`: the
    index-th group of `tp_size`, wrapping around when there are fewer than needed. Pure."""
    if not visible:
        return []
    n = len(visible)
    return [visible[(index * tp_size + k) % n] for k in range(tp_size)]


def visible_cuda_devices(environ: dict[str, str]) -> list[str]:
    """The CUDA devices this process may use, as CUDA_VISIBLE_DEVICES entries: the variable's
    list when set, else 0..count-1 (torch's count; no CUDA context is created)."""
    if "CUDA_VISIBLE_DEVICES" in environ:
        return [d.strip() for d in environ["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


def replica_env(config: ServerConfig, index: int, environ: dict[str, str], visible: list[str]) -> dict[str, str]:
    """The environment of replica `index`: the parent's, with CUDA_VISIBLE_DEVICES narrowed to the
    replica's GPUs when the server runs on CUDA and GPUs are visible, and the API key in
    `cli.API_KEY_ENV` (set, or removed when the server has none). Pure."""
    env = dict(environ)
    env.pop(API_KEY_ENV, None)
    if config.api_key:
        env[API_KEY_ENV] = config.api_key
    if config.device != "cpu" and visible:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(replica_gpus(index, config.tp_size, visible))
    return env


def launch_dp(config: ServerConfig) -> int:
    """Starts the replicas, waits until each prints its ready line, then runs the router."""
    from lmserver.edge.router.app import RouterConfig, serve

    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(message)s")
    visible = [] if config.device == "cpu" else visible_cuda_devices(dict(os.environ))
    if visible and len(visible) < config.dp_size * config.tp_size:
        logger.warning("%d replicas x tp_size %d need %d GPUs, %d visible: replicas share GPUs",
                       config.dp_size, config.tp_size, config.dp_size * config.tp_size, len(visible))
    envs = [replica_env(config, i, dict(os.environ), visible) for i in range(config.dp_size)]
    for i, env in enumerate(envs):
        if "CUDA_VISIBLE_DEVICES" in env and visible:
            logger.info("replica %d: CUDA_VISIBLE_DEVICES=%s", i, env["CUDA_VISIBLE_DEVICES"])
    procs = [
        subprocess.Popen([sys.executable, "-m", "lmserver", "serve", *replica_args(config, i)],
                         stdout=subprocess.PIPE, text=True, env=envs[i])
        for i in range(config.dp_size)
    ]
    urls = [f"http://{config.host}:{config.port + 1 + i}" for i in range(config.dp_size)]
    try:
        for i, proc in enumerate(procs):
            if not _wait_ready(proc, i, _READY_TIMEOUT_S):
                logger.error("replica %d (%s) failed to start (exit status %s)", i, urls[i], proc.poll())
                return 1
            threading.Thread(target=_drain, args=(proc, i), daemon=True).start()
        logger.info("%d replicas ready: %s", len(procs), ", ".join(urls))
        all_dead = threading.Event()
        watcher = threading.Thread(target=_exit_when_all_dead, args=(procs, all_dead), daemon=True)
        watcher.start()
        serve(RouterConfig(workers=tuple(urls), policy=config.router_policy, host=config.host, port=config.port,
                           api_key=config.api_key, max_request_bytes=config.max_request_bytes),
              ready_line=f"{READY_PREFIX}http://{config.host}:{config.port}")
        return 1 if all_dead.is_set() else 0
    finally:
        _stop_all(procs)


# NOTE: replica output is echoed with a "[dp i] " prefix so that only the router's own line
# starts with READY_PREFIX (clients wait for that line).
def _wait_ready(proc: subprocess.Popen[str], index: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            return False  # the replica exited
        sys.stdout.write(f"[dp {index}] {line}")
        if line.startswith(READY_PREFIX):
            return True
    return False


def _drain(proc: subprocess.Popen[str], index: int) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(f"[dp {index}] {line}")


def _exit_when_all_dead(procs: list[subprocess.Popen[str]], all_dead: threading.Event) -> None:
    while any(p.poll() is None for p in procs):
        time.sleep(1.0)
    all_dead.set()
    logger.error("every replica has exited; stopping the router")
    os.kill(os.getpid(), signal.SIGTERM)


def _stop_all(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
