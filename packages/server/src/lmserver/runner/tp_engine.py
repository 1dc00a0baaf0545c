"""Rank processes of a tensor-parallel engine.

Rank 0 is the engine core process: it schedules, broadcasts each `ScheduleDecision` over the
gloo control group, runs its shard of the forward and samples. Ranks 1..N-1 ("followers") run
`follower_main`: join the group, receive the resolved config, load and shard the same model,
build the same KV layout, then run every broadcast decision until rank 0 sends None.

Start-up order on rank 0: load the full model -> spawn this node's followers -> join the group
-> broadcast the resolved config (and rank 0's lowlat plugin specs) -> shard -> lowlat: check the
shard, agree, build (every rank, collectives over the group) -> size the KV cache -> broadcast its
slot count (`TPContext.share_num_slots`; None instead tells the followers start-up failed, as
`TPContext.shutdown` does). A lowlat `require` failure is raised by every rank at the agreement:
followers then wait for rank 0's stop and exit cleanly, rank 0 reports it. Liveness: rank 0 watches its followers and exits the
core process (status 1, with the rank and its exit status in the log) when one dies, so the
server reports unhealthy and exits instead of hanging in a collective; followers exit when
their parent dies. With the host KV tier, rank 0 sends its host pool's slot count after the KV
pool's. Every decision goes out with the host-tier copies rank 0 made since the last one
(`MirroredHostKV`) and where its image rows go (`MMPlaces`), the rows following as one tensor
broadcast; rank 0 alone encodes images and drafts (a draft model, an EAGLE head). Several nodes:
`--nnodes`, `--node-rank`, `--dist-init-addr host:port`; nodes other than 0 run
`run_follower_node` (no HTTP) with ranks node_rank * per_node + i.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
import os
import pickle
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
import torch

from lmserver.config import ServerConfig
from lmserver.models.config import ModelConfig
from lmserver.netutil import free_port
from lmserver.runner.distributed.group import TPGroup
from lmserver.runner.distributed.shard import check_fp8_splits, shard_model_, tp_head_counts

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


HostCopy = tuple[str, npt.NDArray[np.int64], npt.NDArray[np.int64]]  # ("offload" | "load", first slots, second)


class MirroredHostKV:
    """Rank 0's host-tier copies (radixcache's `KVTransfer`) under tensor parallelism: each runs on this rank's host
    pool at once and is queued for the followers, which run the queue on theirs before the next forward. Every rank
    thereby orders each copy against the forwards as rank 0 does: a load before the forward that reads its slots, an
    offload before the forward that may rewrite them (and copies among themselves in call order)."""

    def __init__(self, local: Any) -> None:
        self.local = local  # this rank's HostKVPool
        self._queued: list[HostCopy] = []

    def offload(self, device_slots: npt.NDArray[np.int64], host_slots: npt.NDArray[np.int64]) -> None:
        self.local.offload(device_slots, host_slots)
        self._queued.append(("offload", np.array(device_slots, dtype=np.int64), np.array(host_slots, dtype=np.int64)))

    def load(self, host_slots: npt.NDArray[np.int64], device_slots: npt.NDArray[np.int64]) -> None:
        self.local.load(host_slots, device_slots)
        self._queued.append(("load", np.array(host_slots, dtype=np.int64), np.array(device_slots, dtype=np.int64)))

    def take(self) -> list[HostCopy]:
        """The copies queued since the last call, in call order. Mutates: the queue."""
        queued, self._queued = self._queued, []
        return queued


def run_host_copies(host: Any, copies: list[HostCopy]) -> None:
    """A follower's share of rank 0's queued host-tier copies, in order, on its own host pool."""
    for kind, first, second in copies:
        if kind == "offload":
            host.offload(first, second)
        else:
            host.load(first, second)


@dataclass
class TPContext:
    """Rank 0's handle on the group: wraps the model runner and stops the followers."""

    group: TPGroup
    local_kv_heads: int
    procs: list[Any] = field(default_factory=list)
    stopping: threading.Event = field(default_factory=threading.Event)
    host_kv: MirroredHostKV | None = None  # the host tier's copies, when there is one (`mirror_host_kv`)

    def wrap_runner(self, runner: Any) -> Any:
        return _BroadcastingRunner(runner, self)

    def share_num_slots(self, num_slots: int) -> None:
        """Sends the KV pool size (decided after lowlat's agreed workspace) to every follower."""
        self.group.broadcast_object(num_slots)

    def mirror_host_kv(self, host: Any) -> MirroredHostKV:
        """Rank 0's host KV pool `host` (built right after its device pool, as the followers build theirs): sends its
        slot count to every follower and returns the transfer that queues each copy for them."""
        self.group.broadcast_object(host.num_slots)
        self.host_kv = MirroredHostKV(host)
        return self.host_kv

    def take_host_copies(self) -> list[HostCopy]:
        return self.host_kv.take() if self.host_kv is not None else []

    def shutdown(self) -> None:
        """Tells every rank to stop, joins this node's followers (terminating stragglers)."""
        if self.stopping.is_set():
            return
        self.stopping.set()
        with contextlib.suppress(Exception):  # a peer already gone: nothing left to tell
            self.group.broadcast_object(None)
        for rank, proc in enumerate(self.procs, start=1):
            proc.join(timeout=10)
            if proc.is_alive():
                logger.warning("tensor-parallel rank %d did not stop when told to; terminating it", rank)
                proc.terminate()
                proc.join(timeout=5)
        self.group.destroy()


class _BroadcastingRunner:
    """The model runner of rank 0: every decision goes to all ranks before the local forward."""

    def __init__(self, runner: Any, ctx: TPContext) -> None:
        self._runner = runner
        self._ctx = ctx

    def forward(self, decision: Any, input_ids: torch.Tensor | None = None,
                mm_rows: Sequence[tuple[int, int, torch.Tensor]] = ()) -> torch.Tensor:
        """Sends the decision (with the host-tier copies made since the last one, and where the image rows go), then
        the image rows themselves as one tensor, then runs rank 0's forward."""
        if input_ids is not None:  # NOTE: the overlap schedule (device input ids) is off under TP
            raise ValueError("device input_ids are not sent to tensor-parallel followers")
        rows = torch.cat([r for _, _, r in mm_rows]).contiguous() if mm_rows else None
        places = MMPlaces([(item, offset, r.shape[0]) for item, offset, r in mm_rows],
                          rows.dtype if rows is not None else None)
        self._ctx.group.broadcast_object((self._ctx.take_host_copies(), decision, places))
        if rows is not None:
            self._ctx.group.broadcast_tensor(rows)
        return self._runner.forward(decision, mm_rows=mm_rows)  # type: ignore[no-any-return]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)


def start_tensor_parallel(
    config: ServerConfig, model_config: ModelConfig, model_path: str, model: torch.nn.Module,
    lowlat_specs: tuple[Any, ...] = (),
) -> TPContext:
    """Rank 0: spawns this node's followers, joins the group, shares the config, shards `model`.

    `config` is the resolved config; `lowlat_specs` the lowlat plugins rank 0 considers (every
    rank uses the same ones). The caller sends the KV pool size with `share_num_slots` next.
    Raises TensorParallelError (model does not split) or ValueError (a plugin spec cannot reach
    the other ranks) before spawning anything.
    """
    _, local_kv_heads = tp_head_counts(model_config, config.tp_size)
    check_fp8_splits(model, model_config, config.tp_size)
    try:
        pickle.dumps(lowlat_specs)
    except Exception as exc:  # noqa: BLE001 - any pickling failure means the same thing
        raise ValueError(
            "lowlat plugin specs must be picklable to reach the tensor-parallel ranks "
            f"(define them at module level): {exc}"
        ) from exc
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
    tp.group.broadcast_object({"config": config, "model_path": model_path, "lowlat_specs": lowlat_specs})
    shard_model_(model, model_config, tp.group)
    atexit.register(tp.shutdown)
    logger.info(
        "tensor parallelism: %d ranks (%s), %d KV heads per rank", config.tp_size, backend, local_kv_heads
    )
    return tp


def follower_main(rank: int, size: int, init_method: str, backend: str, local_rank: int) -> None:
    """A follower rank: joins, builds its shard of the engine, runs decisions until told to stop."""
    from lmserver.forward.kv_pool import KVPool, make_req_to_token
    from lmserver.models.loader import DTYPES, load_model, read_model_config
    from lmserver.runner.attention.registry import default_registry
    from lmserver.runner.host_kv import HostKVPool
    from lmserver.runner.lowlat_hook import LowlatHook, warmup_batch_sizes
    from lmserver.runner.model_runner import ModelRunner
    from lmserver.runner.resolve import engine_kv_pool_options
    from lowlat import Registry, Unsupported

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
    lowlat = LowlatHook.start(rc.lowlat_plugins, mc, rc.dtype, str(device), size, rc.context_length,
                              rank=rank, registry=Registry(info["lowlat_specs"]), quantization=rc.quantization,
                              kv_cache_dtype=rc.kv_cache_dtype)
    model = load_model(
        mc,
        info["model_path"],
        load_format=rc.load_format,
        dtype=dtype,
        device=device,
        max_positions=rc.context_length,
        seed=rc.random_seed,
        disable_fused_kernels=rc.disable_fused_kernels,
        quantization=rc.quantization,
        quantize_lm_head=rc.quantize_lm_head,
    )
    shard_model_(model, mc, group)
    failed: Unsupported | None = None
    if lowlat is not None:
        try:
            lowlat.after_load(model, device, dtype, group)
        except Unsupported as exc:  # raised on every rank alike; rank 0 reports it and stops us
            failed = exc
    num_slots = group.broadcast_object()
    if num_slots is None:  # rank 0 failed to start (or is stopping)
        group.destroy()
        return
    if failed is not None:
        raise RuntimeError(f"rank {rank} failed lowlat start-up but rank 0 went on: {failed}")
    _, kv_heads = tp_head_counts(mc, size)
    # NOTE: rank 0's options (FP8 storage, K basis, KV scales): engine/builder.py builds its pool the same way
    pool = KVPool(num_slots, mc.num_hidden_layers, kv_heads, mc.head_dim, dtype, device,
                  **engine_kv_pool_options(rc, model, lowlat))
    pool.zero_padding(rc.page_size)
    host: HostKVPool | None = None
    if rc.enable_hierarchical_cache:  # NOTE: rank 0 builds its host pool right after its device pool too
        host_slots = group.broadcast_object()
        if host_slots is None:  # rank 0 failed to build its host tier
            group.destroy()
            return
        host = HostKVPool(pool, host_slots, io_backend=rc.hicache_io_backend)
    table = make_req_to_token(rc.max_running_requests, rc.context_length, device)
    runner = ModelRunner(
        model, pool, table, default_registry().create(rc.attention_backend, pool, table), device
    )
    if lowlat is not None:
        lowlat.attach(model, pool, table, num_slots, warmup_batch_sizes(rc.disable_cuda_graph, device.type))
        runner.lowlat = lowlat
    if not rc.disable_cascade_attention:  # as rank 0 does: the same graphs (and collectives) on every rank
        runner.enable_cascade()
    from lmserver.runner.cuda_graph import maybe_decode_graph_runner
    from lmserver.runner.prefill_graph import maybe_prefill_graph_runner

    # NOTE: rank 0 captures at the same point of its start-up (after its runner, before serving), in this order
    runner.cuda_graph = maybe_decode_graph_runner(rc, runner, size)
    runner.prefill_graph = maybe_prefill_graph_runner(rc, runner, size)
    hidden_size = mc.hidden_size  # the image rows' width: the language model's
    while True:
        step = group.broadcast_object()
        if step is None:
            break
        copies, decision, places = step
        if copies:
            assert host is not None, "host-tier copies without a host tier"
            run_host_copies(host, copies)
        runner.forward(decision, mm_rows=receive_mm_rows(group, places, hidden_size, device))
    group.destroy()


class MMPlaces(NamedTuple):
    """Where a decision's image rows go (each block's decision item index, offset into its tokens, row count) and
    their dtype; the rows follow as one tensor (`_BroadcastingRunner.forward`)."""

    blocks: list[tuple[int, int, int]]
    dtype: torch.dtype | None


def receive_mm_rows(group: TPGroup, places: MMPlaces, hidden_size: int,
                    device: torch.device) -> list[tuple[int, int, torch.Tensor]]:
    """A follower's copy of the image rows rank 0 sent with a decision, as `ModelRunner.forward`'s `mm_rows`."""
    if not places.blocks:
        return []
    counts = [n for _, _, n in places.blocks]
    rows = group.broadcast_tensor(torch.empty(sum(counts), hidden_size, dtype=places.dtype, device=device))
    return [(item, offset, part) for (item, offset, _), part in zip(places.blocks, rows.split(counts), strict=True)]


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
