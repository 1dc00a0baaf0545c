"""Rank processes of a tensor-parallel engine.

Rank 0 is the engine core process: it schedules, broadcasts each `ScheduleDecision` over the
gloo control group, runs its shard of the forward and samples. Ranks 1..N-1 ("followers") run
`follower_main`: join the group, receive the resolved config, load and shard the same model,
build the same KV layout, then run every broadcast decision until rank 0 sends None.

Start-up order on rank 0: load the full model -> spawn this node's followers -> join the group
-> broadcast the resolved config -> shard. Liveness: rank 0 watches its followers and exits the
core process (status 1, with the rank and its exit status in the log) when one dies, so the
server reports unhealthy and exits instead of hanging in a collective; followers exit when
their parent dies. Several nodes: `--nnodes`, `--node-rank`, `--dist-init-addr host:port`;
nodes other than 0 run `run_follower_node` (no HTTP) with ranks node_rank * per_node + i.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from lmserver.config import ServerConfig
from lmserver.distributed.group import TPGroup
from lmserver.distributed.shard import shard_model_, tp_head_counts
from lmserver.models.config import ModelConfig
from lmserver.netutil import free_port

logger = logging.getLogger("lmserver.tp")

_WATCH_INTERVAL_S = 0.5


def _backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def _ranks_per_node(config: ServerConfig) -> int:
    if config.tp_size % config.nnodes:
        raise ValueError(f"tp_size ({config.tp_size}) must be divisible by nnodes ({config.nnodes})")
    return config.tp_size // config.nnodes


def _init_method(config: ServerConfig) -> str:
    if config.nnodes > 1 and not config.dist_init_addr:
        raise ValueError("several nodes need --dist-init-addr host:port (node 0's address)")
    return f"tcp://{config.dist_init_addr}" if config.dist_init_addr else f"tcp://127.0.0.1:{free_port()}"


def _watch_followers(procs: list[Any], stopping: threading.Event) -> None:
    """Exits this process (status 1) when a follower dies, unless we are stopping anyway."""

    def loop() -> None:
        while not stopping.is_set():
            for rank, proc in enumerate(procs, start=1):
                if proc.exitcode is not None and not stopping.is_set():
                    logger.error(
                        "tensor-parallel rank %d exited with status %s; stopping the engine",
                        rank,
                        proc.exitcode,
                    )
                    logging.shutdown()
                    os._exit(1)
            time.sleep(_WATCH_INTERVAL_S)

    threading.Thread(target=loop, name="lmserver-tp-watchdog", daemon=True).start()


@dataclass
class TPContext:
    """Rank 0's handle on the group: wraps the model runner and stops the followers."""

    group: TPGroup
    local_kv_heads: int
    procs: list[Any] = field(default_factory=list)
    stopping: threading.Event = field(default_factory=threading.Event)

    def wrap_runner(self, runner: Any) -> Any:
        return _BroadcastingRunner(runner, self)

    def shutdown(self) -> None:
        """Tells every rank to stop, joins this node's followers (terminating stragglers)."""
        if self.stopping.is_set():
            return
        self.stopping.set()
        with contextlib.suppress(Exception):  # a peer already gone: nothing left to tell
            self.group.broadcast_object(None)
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
        self.group.destroy()


class _BroadcastingRunner:
    """The model runner of rank 0: every decision goes to all ranks before the local forward."""

    def __init__(self, runner: Any, ctx: TPContext) -> None:
        self._runner = runner
        self._ctx = ctx

    def forward(self, decision: Any) -> torch.Tensor:
        self._ctx.group.broadcast_object(decision)
        return self._runner.forward(decision)  # type: ignore[no-any-return]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)


def start_tensor_parallel(
    config: ServerConfig, model_config: ModelConfig, model_path: str, model: torch.nn.Module, num_slots: int
) -> TPContext:
    """Rank 0: spawns this node's followers, joins the group, shares the config, shards `model`.

    `config` is the resolved config; `num_slots` the KV pool size every rank allocates.
    Raises TensorParallelError before spawning anything when the model does not split.
    """
    _, local_kv_heads = tp_head_counts(model_config, config.tp_size)
    per_node = _ranks_per_node(config)
    init_method = _init_method(config)
    backend = _backend(config.device)
    ctx = multiprocessing.get_context("spawn")
    procs = []
    for local_rank in range(1, per_node):
        proc = ctx.Process(
            target=follower_main,
            args=(local_rank, config.tp_size, init_method, backend, local_rank),
            name=f"lmserver-tp-rank{local_rank}",
        )
        proc.start()
        logger.info("tensor-parallel rank %d started (pid %d)", local_rank, proc.pid)
        procs.append(proc)
    stopping = threading.Event()
    _watch_followers(procs, stopping)
    tp = TPContext(TPGroup.init(0, config.tp_size, init_method, backend), local_kv_heads, procs, stopping)
    tp.group.broadcast_object({"config": config, "model_path": model_path, "num_slots": num_slots})
    shard_model_(model, model_config, tp.group)
    atexit.register(tp.shutdown)
    logger.info(
        "tensor parallelism: %d ranks (%s), %d KV heads per rank", config.tp_size, backend, local_kv_heads
    )
    return tp


def follower_main(rank: int, size: int, init_method: str, backend: str, local_rank: int) -> None:
    """A follower rank: joins, builds its shard of the engine, runs decisions until told to stop."""
    from lmserver.attention.base import default_registry
    from lmserver.engine.kv_pool import KVPool, make_req_to_token
    from lmserver.engine.model_runner import ModelRunner
    from lmserver.model_loader import DTYPES, load_model, read_model_config

    _exit_with_parent()
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    group = TPGroup.init(rank, size, init_method, backend)
    info = group.broadcast_object()
    rc: ServerConfig = info["config"]
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    dtype = DTYPES[rc.dtype]
    mc = read_model_config(info["model_path"])
    assert rc.context_length is not None and rc.max_running_requests is not None
    model = load_model(
        mc,
        info["model_path"],
        load_format=rc.load_format,
        dtype=dtype,
        device=device,
        max_positions=rc.context_length,
        seed=rc.random_seed,
    )
    shard_model_(model, mc, group)
    _, kv_heads = tp_head_counts(mc, size)
    pool = KVPool(info["num_slots"], mc.num_hidden_layers, kv_heads, mc.head_dim, dtype, device)
    pool.zero_padding(rc.page_size)
    table = make_req_to_token(rc.max_running_requests, rc.context_length, device)
    runner = ModelRunner(
        model, pool, table, default_registry().create(rc.attention_backend, pool, table), device
    )
    from lmserver.engine.cuda_graph import maybe_decode_graph_runner

    # NOTE: rank 0 captures at the same point of its start-up (after its runner, before serving)
    runner.cuda_graph = maybe_decode_graph_runner(rc, runner, size)
    while True:
        decision = group.broadcast_object()
        if decision is None:
            break
        runner.forward(decision)
    group.destroy()


def _exit_with_parent() -> None:
    parent = multiprocessing.parent_process()

    def loop() -> None:
        while parent is None or parent.is_alive():
            time.sleep(_WATCH_INTERVAL_S)
        os._exit(1)

    threading.Thread(target=loop, name="lmserver-tp-parent-watch", daemon=True).start()


def run_follower_node(config: ServerConfig) -> int:
    """A node with node_rank > 0: runs its ranks as followers until they stop; exit status."""
    per_node = _ranks_per_node(config)
    init_method = _init_method(config)
    device = config.device if config.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    backend = _backend(device)
    ctx = multiprocessing.get_context("spawn")
    procs = []
    for local_rank in range(per_node):
        rank = config.node_rank * per_node + local_rank
        proc = ctx.Process(
            target=follower_main,
            args=(rank, config.tp_size, init_method, backend, local_rank),
            name=f"lmserver-tp-rank{rank}",
        )
        proc.start()
        procs.append(proc)
    print(
        f"lmserver: node {config.node_rank} runs tensor-parallel ranks "
        f"{config.node_rank * per_node}..{config.node_rank * per_node + per_node - 1}",
        flush=True,
    )
    status = 0
    for proc in procs:
        proc.join()
        status = status or (proc.exitcode or 0)
    return status
