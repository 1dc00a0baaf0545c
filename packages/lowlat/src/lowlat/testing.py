"""Fakes and builders for tests and benchmarks: fake TP groups, random layers, paged metadata; case files run in a
child pytest (under the Triton interpreter)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from lowlat.build import BuildContext, Built
from lowlat.layer import ForwardMeta, KVCache, LayerShape, LayerWeights, rope_inv_freq
from lowlat.moe import MoELayerWeights, MoEShape
from lowlat.spec import Coverage, PluginSpec, Requirements, ServerSetup, Step

T = TypeVar("T")


class FakeWorld:
    """In-process stand-in for a TP group: ``world_size`` ranks run as threads and meet at barriers."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._barrier = threading.Barrier(world_size)
        self._slots: list[Any] = [None] * world_size
        self.calls: list[str] = []

    def group(self, rank: int) -> FakeGroup:
        return FakeGroup(self, rank)

    def _exchange(self, rank: int, value: Any, op: str) -> list[Any]:
        self._slots[rank] = value
        self._barrier.wait()
        out = list(self._slots)
        if rank == 0:
            self.calls.append(op)
        self._barrier.wait()
        return out

    def run(self, fn: Callable[[FakeGroup], T]) -> list[T]:
        """Run ``fn(group)`` once per rank concurrently; re-raise the first rank's error."""
        results: list[Any] = [None] * self.world_size
        errors: list[BaseException | None] = [None] * self.world_size

        def body(rank: int) -> None:
            try:
                results[rank] = fn(self.group(rank))
            except BaseException as exc:
                errors[rank] = exc
                self._barrier.abort()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for exc in errors:
            if exc is not None:
                raise exc
        return results


@dataclass
class FakeGroup:
    """One rank's view of a ``FakeWorld``; implements ``lowlat.Group``."""

    world: FakeWorld
    rank: int

    @property
    def world_size(self) -> int:  # type: ignore[override]
        return self.world.world_size

    def all_reduce_min(self, value: int) -> int:
        return min(self.world._exchange(self.rank, int(value), "all_reduce_min"))

    def all_gather_object(self, obj: Any) -> list[Any]:
        return self.world._exchange(self.rank, obj, "all_gather_object")


def random_layer(
    shape: LayerShape,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    generator: torch.Generator | None = None,
    theta: float = 10000.0,
) -> LayerWeights:
    """Random weights scaled so activations stay O(1) through many layers (never all zeros)."""

    def lin(out_f: int, in_f: int) -> torch.Tensor:
        w = torch.randn(out_f, in_f, generator=generator) / in_f**0.5
        return w.to(device=device, dtype=dtype)

    def norm() -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn(shape.hidden_size, generator=generator)).to(device=device, dtype=dtype)

    h, i = shape.hidden_size, shape.intermediate_size
    return LayerWeights(
        input_norm=norm(),
        qkv=lin(shape.qkv_size, h),
        o_proj=lin(h, shape.q_size),
        post_norm=norm(),
        gate_up=lin(2 * i, h),
        down=lin(h, i),
        rope_inv_freq=rope_inv_freq(shape.head_dim, theta, device=device),
    )


def random_moe_layer(
    shape: LayerShape,
    moe: MoEShape,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    generator: torch.Generator | None = None,
    router_scale: float = 1.0,
) -> MoELayerWeights:
    """Random MoE layer weights (attention half as ``random_layer``); ``router_scale`` spreads the logits."""
    dense = random_layer(shape, dtype, device, generator)
    h, e, i = shape.hidden_size, moe.num_experts, moe.expert_intermediate_size

    def lin(*size: int) -> torch.Tensor:
        return (torch.randn(*size, generator=generator) / size[-1] ** 0.5).to(device=device, dtype=dtype)

    return MoELayerWeights(
        input_norm=dense.input_norm, qkv=dense.qkv, o_proj=dense.o_proj, post_norm=dense.post_norm,
        router=(lin(e, h).float() * router_scale).to(dtype), w13=lin(e, 2 * i, h), w2=lin(e, h, i),
        rope_inv_freq=dense.rope_inv_freq,
    )


def random_kv(
    shape: LayerShape, num_slots: int, dtype: torch.dtype, device: torch.device | str = "cpu", generator: torch.Generator | None = None
) -> KVCache:
    """A KV cache filled with random values (so unwritten or misread slots show up)."""
    size = (num_slots, shape.num_kv_heads, shape.head_dim)
    k = torch.randn(size, generator=generator).to(device=device, dtype=dtype)
    v = torch.randn(size, generator=generator).to(device=device, dtype=dtype)
    return KVCache(k, v)


def decode_meta(
    seq_lens: Sequence[int],
    num_slots: int,
    max_context: int,
    device: torch.device | str = "cpu",
    generator: torch.Generator | None = None,
    max_reqs: int | None = None,
) -> ForwardMeta:
    """Decode metadata for requests of ``seq_lens`` tokens (the new token included).

    Each request gets distinct random slots (a scattered, paged layout) and a random row of a
    ``req_to_token`` table with ``max_reqs`` rows; the new token's slot is the last position's.
    """
    batch = len(seq_lens)
    total = sum(seq_lens)
    if total > num_slots:
        raise ValueError(f"{total} tokens do not fit in {num_slots} slots")
    max_reqs = max_reqs or batch + 2
    perm = torch.randperm(num_slots, generator=generator)[:total]
    rows = torch.randperm(max_reqs, generator=generator)[:batch]
    table = torch.randint(0, num_slots, (max_reqs, max_context), generator=generator, dtype=torch.int32)
    start = 0
    for r, n in enumerate(seq_lens):
        table[rows[r], :n] = perm[start : start + n].to(torch.int32)
        start += n
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out_loc = table[rows, lens.long() - 1].to(torch.int64)
    return ForwardMeta(
        req_to_token=table.to(device),
        req_pool_indices=rows.to(device=device, dtype=torch.int64),
        seq_lens=lens.to(device),
        positions=(lens - 1).to(device=device, dtype=torch.int64),
        out_cache_loc=out_loc.to(device),
        max_seq_len=max_context,
    )


@dataclass
class TinyModel:
    """A tiny Llama-style model (embedding, layers, final norm, tied-free lm_head) for greedy tests."""

    shape: LayerShape
    layers: list[LayerWeights]
    embed: torch.Tensor  # (vocab, hidden)
    final_norm: torch.Tensor  # (hidden,)
    lm_head: torch.Tensor  # (vocab, hidden)

    @classmethod
    def random(
        cls, shape: LayerShape, num_layers: int, vocab: int, dtype: torch.dtype = torch.float32, seed: int = 0
    ) -> TinyModel:
        g = torch.Generator().manual_seed(seed)
        layers = [random_layer(shape, dtype, generator=g) for _ in range(num_layers)]
        embed = torch.randn(vocab, shape.hidden_size, generator=g).to(dtype)
        lm_head = (torch.randn(vocab, shape.hidden_size, generator=g) / shape.hidden_size**0.5).to(dtype)
        return cls(shape, layers, embed, torch.ones(shape.hidden_size, dtype=dtype), lm_head)


class EchoBuilt:
    """A ``Built`` that records its calls; ``forward`` returns its input unchanged."""

    def __init__(self, name: str, max_batch: int, workspace_bytes: int = 1024) -> None:
        self.name = name
        self.workspace_bytes = workspace_bytes
        self.max_batch = max_batch
        self.warmed: list[int] = []
        self.calls: list[int] = []

    def covers(self, step: Step) -> bool:
        return step.batch_size <= self.max_batch

    def forward(self, layer: int, x: torch.Tensor, kv: KVCache, meta: ForwardMeta) -> torch.Tensor:
        self.calls.append(layer)
        return x

    def warmup(self, batch_sizes: Any) -> None:
        self.warmed.extend(batch_sizes)


def fake_spec(
    name: str = "fake",
    priority: int = 0,
    requirements: Requirements | None = None,
    coverage: Coverage | None = None,
    built_max_batch: int = 64,
    check_model: Any = None,
    build: Any = None,
) -> PluginSpec:
    """A plugin spec for LlamaForCausalLM whose build gives an ``EchoBuilt``."""

    def _build(ctx: BuildContext) -> Built:
        return EchoBuilt(name, built_max_batch)

    return PluginSpec(
        name=name,
        version="1.0",
        archs=("LlamaForCausalLM",),
        requirements=requirements or Requirements(),
        coverage=coverage or Coverage(max_tokens=16),
        build=build or _build,
        check_model=check_model,
        priority=priority,
    )


def fake_setup(**kw: Any) -> ServerSetup:
    """An H100/H200-like bf16 set-up for LlamaForCausalLM; keyword arguments override fields."""
    base: dict[str, Any] = dict(
        arch="LlamaForCausalLM", dtype="bfloat16", kv_dtype="bfloat16", vendor="nvidia", capability=(9, 0), device="cuda"
    )
    base.update(kw)
    return ServerSetup(**base)


LayerFn = Callable[[int, torch.Tensor, KVCache, ForwardMeta], torch.Tensor]


def model_forward(
    model: TinyModel, token_ids: torch.Tensor, kvs: Sequence[KVCache], meta: ForwardMeta, layer_fn: LayerFn | None = None
) -> torch.Tensor:
    """Logits (num_tokens, vocab) float32 of ``model`` on ``token_ids`` (num_tokens,).

    ``layer_fn(layer, x, kv, meta)`` runs one decoder layer (default: the torch reference).
    Mutates ``kvs`` (the new tokens' K and V).
    """
    from lowlat.reference import reference_decoder_layer, rms_norm

    def ref(i: int, x: torch.Tensor, kv: KVCache, m: ForwardMeta) -> torch.Tensor:
        return reference_decoder_layer(x, model.layers[i], kv, m, model.shape)

    fn = layer_fn or ref
    x = model.embed[token_ids.long()]
    for i in range(len(model.layers)):
        x = fn(i, x, kvs[i], meta)
    h = rms_norm(x, model.final_norm, model.shape.rms_eps)
    return (h.float() @ model.lm_head.float().T).float()


def greedy_decode(
    model: TinyModel,
    prompts: Sequence[Sequence[int]],
    num_steps: int,
    layer_fn: LayerFn | None = None,
    seed: int = 0,
) -> list[list[int]]:
    """Greedy tokens per prompt: prefill with the reference, then ``num_steps`` decode steps with
    ``layer_fn`` (default: the reference) over a shared, randomly paged KV cache."""
    g = torch.Generator().manual_seed(seed)
    shape = model.shape
    dtype, dev = model.embed.dtype, model.embed.device
    lens = [len(p) for p in prompts]
    max_context = max(lens) + num_steps
    num_slots = sum(lens) + len(prompts) * num_steps + 16
    kvs = [random_kv(shape, num_slots, dtype, dev, generator=g) for _ in model.layers]
    rows = torch.arange(len(prompts), dtype=torch.int64, device=dev)
    slots = torch.randperm(num_slots, generator=g)[: len(prompts) * max_context].view(len(prompts), max_context).to(dev)
    table = slots.to(torch.int32)  # (num_prompts, max_context): disjoint, scattered slots
    # prefill (reference extend path)
    flat = torch.tensor([t for p in prompts for t in p], dtype=torch.int64, device=dev)
    positions = torch.cat([torch.arange(n, device=dev) for n in lens])
    out_loc = torch.cat([slots[r, :n] for r, n in enumerate(lens)])
    lens_t = torch.tensor(lens, dtype=torch.int32, device=dev)
    meta = ForwardMeta(table, rows, lens_t, positions, out_loc, extend_lens=lens_t, max_seq_len=max_context)
    logits = model_forward(model, flat, kvs, meta)
    last = torch.tensor(lens, device=dev).cumsum(0) - 1
    next_ids = logits[last].argmax(-1)
    outs: list[list[int]] = [[int(t)] for t in next_ids]
    seq_lens = lens_t
    for _ in range(num_steps - 1):
        seq_lens = seq_lens + 1
        pos = (seq_lens - 1).long()
        meta = ForwardMeta(table, rows, seq_lens, pos, slots[rows, pos], max_seq_len=max_context)
        next_ids = model_forward(model, next_ids, kvs, meta, layer_fn).argmax(-1)
        for r, t in enumerate(next_ids.tolist()):
            outs[r].append(int(t))
    return outs


INTERPRET_ENV = {"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}  # the Triton interpreter, no GPU visible


def run_case_file(cases: str | Path, env_extra: dict[str, str], marks: str | None = None, skips: bool = False,
                  timeout_s: float = 900) -> str:
    """The tests of the case file `cases` (``packages/<pkg>/tests/<file>``) in a child pytest with `env_extra` on top
    of this process's environment (`INTERPRET_ENV`: under the interpreter, which must be chosen before triton is
    imported); `marks`: a ``-m`` expression (the cases' own slow tier); `skips`: cases may skip (the TP cases on a
    machine with fewer GPUs than ranks). Asserts that the child passed (no deselection without `marks`, no skip
    without `skips`); returns its summary line."""
    cases = Path(cases).resolve()
    root = cases.parents[3]
    env = {k: v for k, v in os.environ.items() if k not in ("LMSYS_GPU_ONLY", "TRITON_INTERPRET")}
    env.update(env_extra)
    select = ["-m", marks] if marks else []
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(root), *select, str(cases)],
        cwd=root, env=env, capture_output=True, text=True, timeout=timeout_s,
    )
    summary = proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, summary
    last = proc.stdout.strip().splitlines()[-1]
    assert " passed" in last and (skips or "skipped" not in last), summary
    assert marks is not None or "deselected" not in last, summary
    return last
