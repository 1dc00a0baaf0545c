"""lowlat inside the engine: start-up in lowlat's order, then the per-step choice of path.

`--lowlat-plugins`: `off` (default), `auto` (the best supported plugin, else the model's own
forward) or `require:<name>` (that plugin, or a start-up error with every reason). The engine
calls, in this order: `LowlatHook.start` before the weights load (configure), `after_load`
(loaded -> check_model -> agree -> build -> memory_measured: the workspace bytes come off the KV
budget), `attach` once the KV pool exists (kv_sized -> install -> warmup); CUDA-graph capture
records the path each decode batch size froze (`hidden(..., capturing=True)`), replays check it.

Decode steps inside the agreed coverage run every decoder layer through the plugin (via
`lmserver.runner.lowlat_adapter`); every other step runs the model's forward and its reason is counted.

FP8: the set-up names an FP8 KV cache (`--kv-cache-dtype fp8_e4m3`: KV dtype `fp8_e4m3`) and FP8 weights
(`--quantization fp8` or an FP8 checkpoint: server feature `lowlat.FP8_WEIGHTS`), so a plugin that reads neither
is refused before the weights load, with that reason in `explain()`; the `nvidia` plugin takes both.

Tensor parallelism: every rank runs its own hook (rank 0 in the engine core, the others in
`distributed.tp_engine.follower_main`) over the same registry (rank 0's plugin specs) and set-up.
`after_load` gets the loaded shard and the TP group: each rank checks its shard, the ranks agree
(lowlat's MIN of verdicts over the gloo control group) before any workspace is built, exchange
their build outcomes and take the same (largest) workspace off the KV budget. A plugin off on any
rank is off on every rank; every rank's reasons are logged on rank 0 (`report()["ranks"]`). In
`require` mode every rank raises the same `Unsupported`; rank 0 raises a set-up failure before any
follower exists.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lmserver.forward.batch import ForwardBatch, ForwardMode
from lmserver.forward.kv_pool import KVPool
from lmserver.models.config import ModelConfig
from lmserver.runner.distributed import TensorParallelError, TPGroup, tp_head_counts
from lmserver.runner.lowlat_adapter import LowlatAdapterError, decode_forward, kv_caches, plugin_layers
from lowlat import FP8_WEIGHTS, LowlatConfig, Session, TorchGroup
from lowlat.errors import RegistryError
from lowlat.graphs import PLUGIN
from lowlat.guards import detect_setup
from lowlat.registry import Registry, current_registry
from lowlat.spec import Step, StepKind

logger = logging.getLogger("lmserver.lowlat")

__all__ = ["EAGER_WARMUP_BATCH_SIZES", "WARMUP_BATCH_SIZES", "LowlatHook", "kv_tokens_after_workspace", "parse_lowlat_plugins",
           "warmup_batch_sizes"]


ALL_BATCHES = "+all-batches"
MEASURED_ONLY = "+measured-only"


def parse_lowlat_plugins(value: str) -> LowlatConfig | None:
    """`off` -> None; `auto` -> any plugin; `require:<name>` -> that plugin or an error. A `+all-batches`
    suffix runs the plugin at every batch it covers, also above the largest one it measured faster than
    the generic path at (`LowlatConfig.measured_coverage=False`); `+measured-only` (the server's default on
    a GPU: `auto+measured-only`) leaves GPUs and shapes the plugin has no measurement for to the generic
    path (`LowlatConfig.measured_only`). Pure."""
    value = value.strip()
    measured_only = value.endswith(MEASURED_ONLY)
    value = value.removesuffix(MEASURED_ONLY).strip()
    measured = not value.endswith(ALL_BATCHES)
    base = value.removesuffix(ALL_BATCHES).strip()
    if base == "off":
        return None
    if base == "auto":
        return LowlatConfig(mode="auto", measured_coverage=measured, measured_only=measured_only)
    name = base.removeprefix("require:").strip() if base.startswith("require:") else ""
    if name:
        return LowlatConfig(mode="require", plugins=(name,), measured_coverage=measured, measured_only=measured_only)
    raise ValueError(f"lowlat_plugins must be 'off', 'auto' or 'require:<name>' (optionally with "
                     f"'{ALL_BATCHES}' or '{MEASURED_ONLY}'), got {value!r}")


def _registry() -> Registry:
    """The registry a caller made active (`lowlat.use_registry`), else every installed plugin."""
    try:
        return current_registry()
    except RegistryError:  # no active registry: use the entry points
        return Registry.from_entry_points()


WARMUP_BATCH_SIZES = (1, 2, 4, 8)  # every TP rank warms the plugin up for the same sizes
EAGER_WARMUP_BATCH_SIZES = tuple(range(1, 17))  # every decode batch a plugin may cover (the bundled ones: <= 16)


def warmup_batch_sizes(disable_cuda_graph: bool, device_type: str) -> tuple[int, ...]:
    """Decode batch sizes to warm a plugin up for (`Session.warmup` skips those it does not cover). With decode
    graphs, the captured sizes compile the rest; decoding eagerly (`--disable-cuda-graph`, or no CUDA device),
    every batch runs at its own size, and the nvidia plugin's kernels compile once per batch size: all of them at
    start-up, not on a request's first step of that size."""
    return EAGER_WARMUP_BATCH_SIZES if disable_cuda_graph or device_type != "cuda" else WARMUP_BATCH_SIZES


def kv_tokens_after_workspace(max_total_tokens: int, workspace_bytes: int, bytes_per_slot: int) -> int:
    """The KV budget in tokens once the plugin's (agreed) workspace is taken off it. Pure.

    Every TP rank takes the same agreed workspace off, so the ranks size identical caches.
    """
    return max(max_total_tokens - -(-workspace_bytes // bytes_per_slot), 16)


class LowlatHook:
    """One engine's (one TP rank's) lowlat session and the dispatch of its forward steps."""

    def __init__(self, session: Session, tp_size: int = 1, rank: int = 0, kv_dtype: torch.dtype | None = None) -> None:
        self.session = session
        self.tp_size, self.rank = tp_size, rank
        self.kv_dtype = kv_dtype  # the KV pool's storage dtype when it differs from the model's (FP8), else None
        self.rank_reports: list[dict[str, Any]] = []  # every rank's start-up account (TP), in rank order
        self._model: Any = None
        self._kvs: list[Any] = []
        self._req_to_token: torch.Tensor | None = None

    @classmethod
    def start(cls, value: str | None, model_config: ModelConfig, dtype: str, device: str, tp_size: int,
              max_context: int, features: frozenset[str] = frozenset(), rank: int = 0,
              registry: Registry | None = None, quantization: str | None = None,
              kv_cache_dtype: str = "auto") -> LowlatHook | None:
        """Configures a session before the weights load; None when `value` is `off` (or None: a config that did not
        go through `resolve_config`, whose default it is on the CPU).

        `quantization` / `kv_cache_dtype`: the server's options; FP8 weights (`quantization` fp8 or an FP8
        checkpoint) add the `FP8_WEIGHTS` feature, an `fp8_e4m3` KV cache sets the set-up's KV dtype.

        `registry`: the plugins to consider (followers get rank 0's); default: the active
        registry, else the installed plugins. Raises `lowlat.Unsupported` in `require` mode when
        no plugin fits the set-up (under TP on rank 0 only: followers raise it at the agreement,
        together with every other rank).
        """
        config = parse_lowlat_plugins(value or "off")
        if config is None:
            return None
        session = Session(config, registry if registry is not None else _registry())
        arch = model_config.architecture
        if model_config.is_multimodal:  # a plugin serves the decoder (decode steps are text-only)
            from lmserver.models.registry import text_architecture

            arch = text_architecture(str(model_config.hf_config.get("text_config", {}).get("model_type", "llama")))
        from lmserver.models.quantization import read_fp8_spec

        if read_fp8_spec(model_config.hf_config, quantization) is not None:
            features = features | {FP8_WEIGHTS}
        fp8_kv = kv_cache_dtype == "fp8_e4m3"
        setup = detect_setup(arch, dtype, kv_dtype="fp8_e4m3" if fp8_kv else None, device=device, tp_size=tp_size,
                             features=features, max_context=max_context)
        session.configure(setup)
        if session.deferred is not None and rank == 0:
            raise session.deferred  # no follower exists yet: every rank has this set-up
        return cls(session, tp_size, rank, kv_dtype=torch.float8_e4m3fn if fp8_kv else None)

    def after_load(self, model: torch.nn.Module, device: torch.device, dtype: torch.dtype,
                   group: TPGroup | None = None) -> int:
        """Checks the loaded model (this rank's shard), agrees over `group` and builds.

        Returns the workspace bytes to take off the KV budget (under TP the largest of any rank,
        identical on every rank). Collective when `group` spans several ranks; raises
        `lowlat.Unsupported` in `require` mode on every rank alike.
        """
        self.session.loaded()
        try:
            layers = plugin_layers(model, self.tp_size)
            runner_reasons: tuple[str, ...] = ()
        except (LowlatAdapterError, TensorParallelError) as exc:
            layers, runner_reasons = None, (str(exc),)
        self.session.check_model(model, runner_reasons)
        tp = group is not None and group.size > 1
        agreement_group = TorchGroup(group.control, device="cpu") if group is not None and tp else None
        self.session.agree(agreement_group)
        if layers is not None:
            all_reduce = group.all_reduce if group is not None and tp else None
            self.session.build(layers.shape, layers.weights, device, dtype, kv_dtype=self.kv_dtype, moe=layers.moe,
                               all_reduce=all_reduce)
        else:
            self.session.build(None, (), device, dtype)  # type: ignore[arg-type]  # nothing selected: no-op
        workspace = self.session.memory_measured()
        mine = self._rank_report(workspace)
        self.rank_reports = agreement_group.all_gather_object(mine) if agreement_group is not None else [mine]
        if self.rank == 0:
            self._log_start()
        return workspace

    def kv_tokens(self, max_total_tokens: int, workspace: int, config: ModelConfig, dtype: torch.dtype) -> int:
        """`max_total_tokens` less the workspace, counted in this rank's KV slots (of the KV storage dtype: FP8 when
        the hook was started with an FP8 cache, else `dtype`). Pure."""
        _, kv_heads = tp_head_counts(config, self.tp_size)
        per_slot = KVPool.bytes_per_slot(config.num_hidden_layers, kv_heads, config.head_dim, self.kv_dtype or dtype)
        return kv_tokens_after_workspace(max_total_tokens, workspace, per_slot)

    def _rank_report(self, workspace: int) -> dict[str, Any]:
        agreement = self.session.agreement
        return {
            "rank": self.rank,
            "selected": self.session.selected.name if self.session.selected else None,
            "verdicts": [{"plugin": v.plugin, "status": v.status, "reasons": list(v.reasons)}
                         for v in self.session.verdicts.values()],
            "agreement": list(agreement.reasons) if agreement is not None else [],
            "built": self.session.built is not None,
            "workspace_bytes": workspace,
        }

    def _log_start(self) -> None:
        """Rank 0: every rank's refused plugins with their reasons, then the outcome."""
        for rep in self.rank_reports:
            for v in rep["verdicts"]:
                if v["status"] != "selected" and v["reasons"]:
                    logger.info("lowlat rank %d: %s %s: %s", rep["rank"], v["plugin"], v["status"],
                                "; ".join(v["reasons"]))
        first = self.rank_reports[0]
        if first["agreement"]:
            logger.info("lowlat off on every rank: %s", "; ".join(first["agreement"]))
        logger.info("lowlat: plugin %s on %d rank(s), workspace %d bytes", first["selected"] or "none (original forward)",
                    len(self.rank_reports), first["workspace_bytes"])

    def attach(self, model: torch.nn.Module, pool: KVPool, req_to_token: torch.Tensor, num_slots: int,
               warmup_batch_sizes: Sequence[int] = WARMUP_BATCH_SIZES) -> None:
        """Installs the dispatcher over the engine's KV pool and warms the plugin up."""
        self.session.kv_sized(num_slots)
        self._model, self._kvs, self._req_to_token = model, kv_caches(pool), req_to_token
        self.session.install()
        self.session.warmup(warmup_batch_sizes)

    @staticmethod
    def _step(batch: ForwardBatch) -> Step:
        if batch.mode == ForwardMode.DECODE:
            return Step.decode(batch.batch_size, max(batch.seq_lens_cpu, default=0))
        ext = batch.extend_seq_lens_cpu or [batch.num_tokens]
        return Step(StepKind.EXTEND, batch.batch_size, batch.num_tokens, max(ext), max(batch.seq_lens_cpu, default=0))

    def hidden(self, batch: ForwardBatch, original: Callable[[], torch.Tensor], capturing: bool = False,
               verify_rows: int = 0) -> torch.Tensor:
        """Final-norm hidden states of `batch` on the plugin path or the original one.

        `capturing`: a CUDA graph is being captured for this batch size (the path is recorded and
        the attention is sized for the whole table width); replays are checked by `on_replay`.
        `verify_rows` > 0 (with `capturing`): the graph is a verify graph of the batch's decode rows, at
        most that many per request, recorded as (verify, rows).
        """
        step = self._step(batch)
        graph = None
        if verify_rows:
            step = Step.verify(batch.batch_size, verify_rows, step.max_context)
            graph = (StepKind.VERIFY, batch.batch_size)
        path = self.session.capture(step, graph) if capturing else self.session.select(step)
        if path != PLUGIN or batch.mode != ForwardMode.DECODE:
            # NOTE: the adapter maps decode batches only; a plugin declaring extend or verify
            # coverage still gets only decode steps from lmserver.
            return original()
        built = self.session.built
        assert built is not None and self._req_to_token is not None
        max_seq_len = 0 if capturing else max(batch.seq_lens_cpu, default=0)
        return decode_forward(self._model, built, batch, self._kvs, self._req_to_token, max_seq_len,
                              rows_per_request=max(verify_rows, 1))

    def on_replay(self, batch_size: int, max_context: int, verify_rows_per_request: int = 0,
                  graph: StepKind = StepKind.DECODE) -> None:
        """A captured graph of `batch_size` rows is about to replay: count it and check its path.
        `verify_rows_per_request` > 0: the replay is a verify step of at most that many rows per
        request, in the `graph` (decode or verify) that `verify_graph` named (one row per request: the
        decode step it is)."""
        step = _rows_step(batch_size, verify_rows_per_request, max_context)
        self.session.replay(step, graph=(graph, batch_size) if step.kind == StepKind.VERIFY else None)

    def verify_graph(self, batch_size: int, rows_per_request: int, max_context: int) -> StepKind | None:
        """The graph of `batch_size` rows that froze the path the session picks for a verify step of
        those rows (at most `rows_per_request` per request): a verify graph (captured where the paths
        or the plugin's launches differ: `needs_verify_graph`), else the decode graph, else None. One row
        per request is a decode step: only its decode graph. Pure."""
        step = _rows_step(batch_size, rows_per_request, max_context)
        want = self.session.path_for(step)
        kinds = (StepKind.VERIFY, StepKind.DECODE) if step.kind == StepKind.VERIFY else (StepKind.DECODE,)
        return next((kind for kind in kinds if self.session.frozen_path(kind, batch_size) == want), None)

    def needs_verify_graph(self, batch_size: int, rows_per_request: int, max_context: int) -> bool:
        """Whether verify steps of `batch_size` rows take another path than that size's decode graph
        froze, or the plugin path with another launch than its decode rows' (never for one row per
        request: a decode step). Pure."""
        step = _rows_step(batch_size, rows_per_request, max_context)
        if step.kind != StepKind.VERIFY:
            return False
        want = self.session.path_for(step)
        if want == PLUGIN and self.session.verify_launch_differs():
            return True
        return self.session.frozen_path(StepKind.DECODE, batch_size) != want

    def report(self) -> dict[str, Any]:
        """Plain-data account of the session (selected plugin, verdicts, steps, fallbacks)."""
        r = self.session.report()
        return {
            "mode": r.mode,
            "selected": r.selected,
            "verdicts": [{"plugin": v.plugin, "status": v.status, "reasons": list(v.reasons)} for v in r.verdicts],
            "workspace_bytes": r.workspace_bytes,
            "plugin_steps": r.plugin_steps,
            "plugin_steps_by_kind": dict(r.plugin_steps_by_kind),
            "fallbacks": dict(r.fallbacks),
            "graphs": [str(g) for g in r.graphs],
            "ranks": self.rank_reports,
        }

    def explain(self) -> str:
        return self.session.explain()


def _rows_step(batch_size: int, rows_per_request: int, max_context: int) -> Step:
    """The step of `batch_size` decode rows, at most `rows_per_request` (> 0) of them per request: a verify step,
    or with one row per request the decode step it is (the plugin's verify coverage is about several rows; a
    short extend of one new token per request is replayed in the decode graph)."""
    if rows_per_request > 1:
        return Step.verify(batch_size, rows_per_request, max_context)
    return Step.decode(batch_size, max_context)
