"""lowlat inside the engine: start-up in lowlat's order, then the per-step choice of path.

`--lowlat-plugins`: `off` (default), `auto` (the best supported plugin, else the model's own
forward) or `require:<name>` (that plugin, or a start-up error with every reason). The engine
calls, in this order: `LowlatHook.start` before the weights load (configure), `after_load`
(loaded -> check_model -> agree -> build -> memory_measured: the workspace bytes come off the KV
budget), `attach` once the KV pool exists (kv_sized -> install -> warmup); CUDA-graph capture
records the path each decode batch size froze (`hidden(..., capturing=True)`), replays check it.

Decode steps inside the agreed coverage run every decoder layer through the plugin (via
`lmserver.lowlat_adapter`); every other step runs the model's forward and its reason is counted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from lmserver.engine.forward_batch import ForwardBatch, ForwardMode
from lmserver.engine.kv_pool import KVPool
from lmserver.lowlat_adapter import LowlatAdapterError, decode_forward, kv_caches, plugin_layers
from lmserver.models.config import ModelConfig
from lowlat import LowlatConfig, Session, Unsupported
from lowlat.errors import RegistryError
from lowlat.graphs import PLUGIN
from lowlat.guards import detect_setup
from lowlat.registry import Registry, current_registry
from lowlat.spec import Step, StepKind

logger = logging.getLogger("lmserver.lowlat")

__all__ = ["LowlatHook", "parse_lowlat_plugins"]


def parse_lowlat_plugins(value: str) -> LowlatConfig | None:
    """`off` -> None; `auto` -> any plugin; `require:<name>` -> that plugin or an error. Pure."""
    value = value.strip()
    if value == "off":
        return None
    if value == "auto":
        return LowlatConfig(mode="auto")
    name = value.removeprefix("require:").strip() if value.startswith("require:") else ""
    if name:
        return LowlatConfig(mode="require", plugins=(name,))
    raise ValueError(f"lowlat_plugins must be 'off', 'auto' or 'require:<name>', got {value!r}")


def _registry() -> Registry:
    """The registry a caller made active (`lowlat.use_registry`), else every installed plugin."""
    try:
        return current_registry()
    except RegistryError:  # no active registry: use the entry points
        return Registry.from_entry_points()


class LowlatHook:
    """One engine's lowlat session and the dispatch of its forward steps."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self._model: Any = None
        self._kvs: list[Any] = []
        self._req_to_token: torch.Tensor | None = None

    @classmethod
    def start(cls, value: str, model_config: ModelConfig, dtype: str, device: str, tp_size: int,
              max_context: int, features: frozenset[str] = frozenset()) -> LowlatHook | None:
        """Configures a session before the weights load; None when `value` is `off`.

        Raises `lowlat.Unsupported` in `require` mode when no plugin fits the set-up.
        """
        config = parse_lowlat_plugins(value)
        if config is None:
            return None
        if tp_size > 1:
            reason = "lmserver does not run lowlat plugins under tensor parallelism yet"
            if config.mode == "require":
                raise Unsupported(config.plugins[0] if config.plugins else "any", (reason,))
            logger.info("lowlat off: %s", reason)
            return None
        session = Session(config, _registry())
        setup = detect_setup(model_config.architecture, dtype, device=device, tp_size=tp_size,
                             features=features, max_context=max_context)
        session.configure(setup)
        return cls(session)

    def after_load(self, model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> int:
        """Checks the loaded model, agrees (one rank) and builds; returns the workspace bytes."""
        self.session.loaded()
        try:
            layers = plugin_layers(model)
            runner_reasons: tuple[str, ...] = ()
        except LowlatAdapterError as exc:
            layers, runner_reasons = None, (str(exc),)
        self.session.check_model(model, runner_reasons)
        self.session.agree(None)
        if layers is not None:
            self.session.build(layers.shape, layers.weights, device, dtype, moe=layers.moe)
        else:
            self.session.build(None, (), device, dtype)  # type: ignore[arg-type]  # nothing selected: no-op
        workspace = self.session.memory_measured()
        selected = self.session.selected.name if self.session.selected else None
        logger.info("lowlat: plugin %s, workspace %d bytes", selected or "none (original forward)", workspace)
        return workspace

    def attach(self, model: torch.nn.Module, pool: KVPool, req_to_token: torch.Tensor, num_slots: int,
               warmup_batch_sizes: list[int]) -> None:
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

    def hidden(self, batch: ForwardBatch, original: Callable[[], torch.Tensor], capturing: bool = False) -> torch.Tensor:
        """Final-norm hidden states of `batch` on the plugin path or the original one.

        `capturing`: a CUDA graph is being captured for this batch size (the path is recorded and
        the attention is sized for the whole table width); replays are checked by `on_replay`.
        """
        step = self._step(batch)
        path = self.session.capture(step) if capturing else self.session.select(step)
        if path != PLUGIN or batch.mode != ForwardMode.DECODE:
            # NOTE: the adapter maps decode batches only; a plugin declaring extend or verify
            # coverage still gets only decode steps from lmserver.
            return original()
        built = self.session.built
        assert built is not None and self._req_to_token is not None
        max_seq_len = 0 if capturing else max(batch.seq_lens_cpu, default=0)
        return decode_forward(self._model, built, batch, self._kvs, self._req_to_token, max_seq_len)

    def on_replay(self, batch_size: int, max_context: int) -> None:
        """A captured decode graph of `batch_size` is about to replay: count it and check its path."""
        self.session.replay(Step.decode(batch_size, max_context))

    def report(self) -> dict[str, Any]:
        """Plain-data account of the session (selected plugin, verdicts, steps, fallbacks)."""
        r = self.session.report()
        return {
            "mode": r.mode,
            "selected": r.selected,
            "verdicts": [{"plugin": v.plugin, "status": v.status, "reasons": list(v.reasons)} for v in r.verdicts],
            "workspace_bytes": r.workspace_bytes,
            "plugin_steps": r.plugin_steps,
            "fallbacks": dict(r.fallbacks),
            "graphs": [str(g) for g in r.graphs],
        }

    def explain(self) -> str:
        return self.session.explain()
