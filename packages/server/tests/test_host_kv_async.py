"""The host KV pool's asynchronous copies: the ordering of its two streams, checked on the CPU.

`DeferredStreams` is a fake pair of streams: operations are queued and run later, in a random
interleaving that respects only the waits HostKVPool issued. A simulated engine writes KV on the
main stream, offloads and reuses the freed slots at once, loads back and reads (checks) on the
main stream; every check and the final pools must equal a dict model of where each KV lives (what
a never-evicting pool would hold). Dropping any of HostKVPool's waits makes some interleaving fail.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np
import pytest
import torch

from lmserver.forward.kv_pool import KVPool
from lmserver.runner.host_kv import HostKVPool, _runs
from radixcache import HierarchicalCache, SlotAllocator

_LAYERS, _HEADS, _DIM = 3, 2, 4


class DeferredStreams:
    """`CopyStreams` whose operations run only when `step` picks them (plus a `main` queue for
    the simulated engine's own work). A wait is an operation of its queue that is runnable once
    the other queue has run as many operations as it had when the wait was issued."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.queues: dict[str, list[tuple[str, object]]] = {"main": [], "copy": []}
        self.done = {"main": 0, "copy": 0}

    def on_copy(self, fn: Callable[[], None]) -> None:
        self.queues["copy"].append(("run", fn))

    def on_main(self, fn: Callable[[], None]) -> None:
        self.queues["main"].append(("run", fn))

    def copy_waits_main(self) -> None:
        self.queues["copy"].append(("wait", len(self.queues["main"])))

    def main_waits_copy(self) -> None:
        self.queues["main"].append(("wait", len(self.queues["copy"])))

    def _runnable(self, name: str) -> bool:
        q, i = self.queues[name], self.done[name]
        if i == len(q):
            return False
        kind, arg = q[i]
        other = "copy" if name == "main" else "main"
        return kind == "run" or self.done[other] >= arg  # type: ignore[operator]

    def step(self, max_ops: int) -> None:
        """Runs up to `max_ops` operations, each from a random runnable queue."""
        for _ in range(max_ops):
            ready = [q for q in self.queues if self._runnable(q)]
            if not ready:
                return
            name = self.rng.choice(ready)
            kind, arg = self.queues[name][self.done[name]]
            self.done[name] += 1
            if kind == "run":
                arg()  # type: ignore[operator]

    def drain(self) -> None:
        self.step(10**9)
        assert all(self.done[q] == len(self.queues[q]) for q in self.queues), "deadlock"


def _content(tag: int) -> torch.Tensor:
    """The KV a token of `tag` has: (L, 2, heads, dim), distinct per tag, layer, K/V, element."""
    return torch.arange(_LAYERS * 2 * _HEADS * _DIM, dtype=torch.float32).view(_LAYERS, 2, _HEADS, _DIM) + 1000 * tag


def _read_device(pool: KVPool, slot: int) -> torch.Tensor:
    return torch.stack([torch.stack((pool.k_cache[i][slot], pool.v_cache[i][slot])) for i in range(_LAYERS)])


def _write_device(pool: KVPool, slot: int, tag: int) -> None:
    c = _content(tag)
    for i in range(_LAYERS):
        pool.k_cache[i][slot] = c[i, 0]
        pool.v_cache[i][slot] = c[i, 1]


def _host_row(host: HostKVPool, slot: int) -> torch.Tensor:
    return host.kv[slot].view(torch.uint8).view(torch.float32).view(_LAYERS, 2, _HEADS, _DIM)


@pytest.mark.parametrize("io_backend", ["kernel", "direct"])
@pytest.mark.parametrize("chunk_tokens", [2, 4096])
@pytest.mark.parametrize("seed", range(12))
def test_async_copies_keep_every_kv_under_any_interleaving(io_backend: str, chunk_tokens: int, seed: int) -> None:
    rng = random.Random(seed)
    streams = DeferredStreams(random.Random(seed + 1000))
    dev_slots, host_slots = 24, 40
    pool = KVPool(dev_slots, _LAYERS, _HEADS, _DIM, torch.float32, "cpu")
    host = HostKVPool(pool, host_slots, io_backend=io_backend, streams=streams, chunk_tokens=chunk_tokens)
    assert host.io_backend == io_backend and host.word == torch.int64
    dev_tag: dict[int, int] = {}  # device slot -> tag of the KV it holds once all issued work ran
    host_tag: dict[int, int] = {}
    tags = iter(range(1, 10**6))
    checks = [0]

    def write(slots: list[int]) -> None:  # a forward writing new KV into slots
        for s in slots:
            t = next(tags)
            dev_tag[s] = t
            streams.on_main(lambda s=s, t=t: _write_device(pool, s, t))

    def check(slots: list[int]) -> None:  # a forward reading KV: must see what the model says
        for s in slots:
            t = dev_tag[s]

            def read(s: int = s, t: int = t) -> None:
                assert torch.equal(_read_device(pool, s), _content(t)), f"device slot {s} != tag {t}"
                checks[0] += 1

            streams.on_main(read)

    write(list(range(1, dev_slots)))
    for _ in range(40):
        action = rng.choice(["offload", "load", "check", "write"])
        n = rng.randint(1, 6)
        if action == "offload":  # device eviction: copy out, then the freed slots are rewritten at once
            dev = rng.sample(sorted(dev_tag), min(n, len(dev_tag)))
            hst = rng.sample(range(1, host_slots), len(dev))  # may overwrite host rows (host eviction)
            if rng.random() < 0.5:
                hst = sorted(hst)
            host.offload(np.array(dev, dtype=np.int64), np.array(hst, dtype=np.int64))
            for d, h in zip(dev, hst, strict=True):
                host_tag[h] = dev_tag[d]
            write(dev)
        elif action == "load" and host_tag:  # a host hit into slots whose old KV may still be read
            hst = rng.sample(sorted(host_tag), min(n, len(host_tag)))
            dev = rng.sample(range(1, dev_slots), len(hst))
            check([d for d in dev if d in dev_tag])  # earlier readers of the old contents
            host.load(np.array(hst, dtype=np.int64), np.array(dev, dtype=np.int64))
            for d, h in zip(dev, hst, strict=True):
                dev_tag[d] = host_tag[h]
            check(dev)
        elif action == "check":
            check(rng.sample(sorted(dev_tag), min(n, len(dev_tag))))
        else:
            write(rng.sample(range(1, dev_slots), n))
        streams.step(rng.randint(0, 12))  # the device runs some of what is queued
    streams.drain()
    assert checks[0] > 0
    for s, t in dev_tag.items():  # the oracle: a pool that never evicted holds these
        assert torch.equal(_read_device(pool, s), _content(t))
    for s, t in host_tag.items():
        assert torch.equal(_host_row(host, s), _content(t))
    assert host.offloaded_tokens > 0


def test_runs_split_host_slots_into_consecutive_runs() -> None:
    slots = np.array([4, 5, 6, 9, 3, 4, 10], dtype=np.int64)
    assert _runs(slots) == [(0, 3, 4), (3, 4, 9), (4, 6, 3), (6, 7, 10)]
    assert _runs(np.zeros(0, dtype=np.int64)) == []


def test_byte_rows_that_are_not_whole_words_copy_as_bytes() -> None:
    pool = KVPool(8, 2, 1, 3, torch.float16, "cpu")  # 6 bytes per layer row: uint8 words
    for i in range(2):
        pool.k_cache[i].copy_(torch.randn(8, 1, 3))
        pool.v_cache[i].copy_(torch.randn(8, 1, 3))
    want = [(k.clone(), v.clone()) for k, v in zip(pool.k_cache, pool.v_cache, strict=True)]
    host = HostKVPool(pool, 6)
    assert host.word == torch.uint8
    host.offload(np.array([2, 5, 7], dtype=np.int64), np.array([3, 1, 2], dtype=np.int64))
    host.load(np.array([1, 2, 3], dtype=np.int64), np.array([1, 3, 4], dtype=np.int64))
    for i in range(2):
        assert torch.equal(pool.k_cache[i][[1, 3, 4]], want[i][0][[5, 7, 2]])
        assert torch.equal(pool.v_cache[i][[1, 3, 4]], want[i][1][[5, 7, 2]])


def test_bad_arguments_are_refused() -> None:
    pool = KVPool(8, 1, 1, 4, torch.float32, "cpu")
    with pytest.raises(ValueError, match="io_backend"):
        HostKVPool(pool, 4, io_backend="dma")
    with pytest.raises(ValueError, match="chunk_tokens"):
        HostKVPool(pool, 4, chunk_tokens=0)
    host = HostKVPool(pool, 4)
    with pytest.raises(ValueError, match="offload of 2"):
        host.offload(np.array([1, 2], dtype=np.int64), np.array([1], dtype=np.int64))
    with pytest.raises(ValueError, match="load of 1"):
        host.load(np.array([1], dtype=np.int64), np.array([1, 2], dtype=np.int64))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("io_backend", ["kernel", "direct"])
def test_copies_match_the_torch_reference(io_backend: str, device: str) -> None:
    """Fresh random KV (bf16, Llama-3-8B's heads): offload to shuffled host slots with one long
    run among them (the host rows equal a torch.stack reference), wipe, load back into other
    device slots and read on the main stream without a synchronize; chunked (500 of 1,500)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gen = torch.Generator(device).manual_seed(int(torch.randint(0, 2**31, ())))
    layers, slots, n = 4, 4096, 1500
    pool = KVPool(slots, layers, 8, 128, torch.bfloat16, device)
    for i in range(layers):
        pool.k_cache[i].copy_(torch.randn(pool.k_cache[i].shape, generator=gen, device=device))
        pool.v_cache[i].copy_(torch.randn(pool.v_cache[i].shape, generator=gen, device=device))
    host = HostKVPool(pool, 6000, io_backend=io_backend, chunk_tokens=500)
    assert host.io_backend == io_backend and host.kv.is_pinned() == (device == "cuda")
    perm = torch.randperm(slots - 1, generator=gen, device=device).cpu().numpy() + 1
    dev, back = perm[:n].astype(np.int64), perm[n : 2 * n].astype(np.int64)
    others = np.setdiff1d(np.arange(1, 6000), np.arange(2000, 2300))
    others = others[torch.randperm(len(others), generator=gen, device=device).cpu().numpy()[: n - 300]]
    hst = np.concatenate((np.arange(2000, 2300), others)).astype(np.int64)  # distinct; one run of 300
    d = torch.from_numpy(dev).to(device)
    want_k = [c[d].clone() for c in pool.k_cache]
    want_v = [c[d].clone() for c in pool.v_cache]
    host.offload(dev, hst)
    for i in range(layers):  # the freed slots are rewritten at once (main stream)
        pool.k_cache[i][d] = 0
        pool.v_cache[i][d] = 0
    if device == "cuda":
        torch.cuda.synchronize()
    ref_rows = torch.stack([torch.stack((want_k[i], want_v[i]), 1) for i in range(layers)], 1)  # (n, L, 2, KV, D)
    got_rows = host.kv[torch.from_numpy(hst)].view(torch.uint8).view(torch.bfloat16).view(ref_rows.shape)
    assert torch.equal(got_rows, ref_rows.cpu())
    host.load(hst, back)
    b = torch.from_numpy(back).to(device)
    got_k = [c[b].clone() for c in pool.k_cache]  # NOTE: no synchronize: the main stream waits for the load
    got_v = [c[b].clone() for c in pool.v_cache]
    for i in range(layers):
        assert torch.equal(got_k[i], want_k[i]) and torch.equal(got_v[i], want_v[i])


def _prefix_content(key: list[int], i: int) -> torch.Tensor:
    """The KV token `i` of `key` has: a function of the prefix it ends (exact in float32)."""
    return _content(hash(tuple(key[: i + 1])) % 100_000)


@pytest.mark.parametrize("write_policy", ["write_back", "write_through"])
@pytest.mark.parametrize("seed", range(6))
def test_tier_driven_async_copies_equal_a_never_evicting_pool(write_policy: str, seed: int) -> None:
    """radixcache's HierarchicalCache decides every eviction, offload, load and slot reuse; the
    copies and the simulated forwards run deferred in random interleavings. Every reused token's
    KV (read on the main stream when its forward runs) and every slot either tree holds at the
    end equals what that prefix's forward computed, as a never-evicting pool would give; both
    pools' slots are conserved."""
    rng = random.Random(seed)
    streams = DeferredStreams(random.Random(seed + 500))
    dev_alloc, host_alloc = SlotAllocator(48, 1), SlotAllocator(400, 1)
    pool = KVPool(dev_alloc.buffer_size, _LAYERS, _HEADS, _DIM, torch.float32, "cpu")
    host = HostKVPool(pool, host_alloc.buffer_size, io_backend=rng.choice(["kernel", "direct"]), streams=streams,
                      chunk_tokens=rng.choice([3, 4096]))
    tier = HierarchicalCache.build(dev_alloc, host_alloc, host, write_policy=write_policy)  # type: ignore[arg-type]
    dev = tier.device
    chats = [[1000 * c + t for t in range(rng.randint(2, 6))] for c in range(5)]
    reads = [0]

    def forward(key: list[int], kv: np.ndarray, start: int) -> None:
        for i, slot in enumerate(kv.tolist()):
            if i < start:  # reused KV: loaded back or kept on the device

                def read(slot: int = slot, i: int = i) -> None:
                    assert torch.equal(_read_device(pool, slot), _prefix_content(key, i)), (slot, i)
                    reads[0] += 1

                streams.on_main(read)
            else:
                c = _prefix_content(key, i)
                streams.on_main(lambda slot=slot, c=c: _write_device_rows(pool, slot, c))

    running: list[tuple[list[int], np.ndarray, int, object]] = []
    for _ in range(30):
        c = rng.randrange(len(chats))
        if any(r[0][: len(chats[c])] == chats[c] for r in running):
            continue  # that chat's previous turn still runs
        chats[c] = chats[c] + [rng.randrange(1, 999) for _ in range(rng.randint(1, 5))]
        key = chats[c]
        m = tier.match_prefix(key, limit=len(key) - 1)
        dev.lock(m.last_node)
        new = dev.alloc(len(key) - m.length)
        if new is None:
            dev.unlock(m.last_node)
            continue
        kv = np.concatenate((m.indices, new))
        forward(key, kv, m.length)
        running.append((key, kv, m.length, m.last_node))
        while running and (len(running) > 2 or rng.random() < 0.5):  # finish one, in any order
            key, kv, cached, node = running.pop(rng.randrange(len(running)))
            tier.insert(key, kv, cached_len=cached)
            dev.unlock(node)  # type: ignore[arg-type]
        streams.step(rng.randint(0, 40))
    for key, kv, cached, node in running:
        tier.insert(key, kv, cached_len=cached)
        dev.unlock(node)  # type: ignore[arg-type]
    streams.drain()
    assert reads[0] > 0 and tier.stats.host_hits > 0 and tier.stats.dropped_tokens == 0
    tier.check_integrity()
    sizes = tier.sizes()
    assert sizes.device.free + sizes.device.total == dev_alloc.num_slots and sizes.device.protected == 0
    assert sizes.host.free + sizes.host.total == host_alloc.num_slots and sizes.host.protected == 0
    for key in chats:  # what each tree holds is what the prefixes computed
        for i, slot in enumerate(dev.match_prefix(key).indices.tolist()):
            assert torch.equal(_read_device(pool, slot), _prefix_content(key, i))
        for i, slot in enumerate(tier.host.match_prefix(key).indices.tolist()):
            assert torch.equal(_host_row(host, slot), _prefix_content(key, i))


def _write_device_rows(pool: KVPool, slot: int, c: torch.Tensor) -> None:
    for i in range(_LAYERS):
        pool.k_cache[i][slot] = c[i, 0]
        pool.v_cache[i][slot] = c[i, 1]
