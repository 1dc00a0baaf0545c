"""What a plugin's build step receives (``BuildContext``) and returns (``Built``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from lowlat.config import LowlatConfig
from lowlat.layer import ForwardMeta, KVCache, LayerShape, LayerWeights
from lowlat.moe import MoELayerWeights, MoEShape
from lowlat.spec import Coverage, ServerSetup, Step

if TYPE_CHECKING:
    from lowlat.tp import Reducer


@dataclass(frozen=True)
class BuildContext:
    """Everything a plugin needs to prepare weights and allocate workspaces at start-up.

    Built after the model is loaded and TP ranks agreed, before the KV cache is sized, so the
    memory a plugin allocates here is counted by the runner's memory measurement.
    ``coverage`` is the agreed coverage (intersection over TP ranks). A mixture-of-experts model
    passes ``moe`` and its layers in ``moe_weights`` (``weights`` is then empty).

    Tensor parallelism (``setup.tp_size > 1``): ``weights`` are rank ``tp_rank``'s shards and
    ``shape`` counts this rank's heads and intermediate features (attention heads and gate/up
    rows column-split, o_proj and down columns row-split; ``lowlat.tp.shard_layer``); ``all_reduce`` sums
    a tensor over the ranks in place (a collective of the runner's TP group, graph-safe on NCCL), or
    ``reducer`` (a ``lowlat.tp.Reducer``) does. A plugin that runs sharded must sum o_proj's and down's
    partial outputs with it before each residual add.
    """

    shape: LayerShape
    weights: tuple[LayerWeights, ...]  # one per layer
    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype
    coverage: Coverage
    config: LowlatConfig
    setup: ServerSetup
    max_context: int
    moe: MoEShape | None = None
    moe_weights: tuple[MoELayerWeights, ...] = ()
    tp_rank: int = 0
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
    reducer: Reducer | None = None

    @property
    def tp_size(self) -> int:
        return self.setup.tp_size

    @property
    def num_layers(self) -> int:
        return len(self.moe_weights) if self.moe is not None else len(self.weights)

    @property
    def max_batch_size(self) -> int:
        return self.coverage.max_tokens


@runtime_checkable
class Built(Protocol):
    """A built plugin: a layer forward the dispatcher can call in place of the original.

    ``forward`` must be graph-safe: no allocations, no host syncs, static addresses for a given
    batch size. It mutates ``kv`` (the new tokens' K and V) and the plugin's own workspace only,
    and returns the layer's output residual stream (a view of a plugin-owned buffer that stays
    valid until the plugin's forward runs twice more).

    Optional: a ``verify_launch_differs`` attribute, True where ``forward`` launches steps of several rows per
    request (``ForwardMeta.rows_per_request`` > 1: verify steps) otherwise than decode steps of as many rows, so that
    the engine captures their CUDA graphs apart (``Session.verify_launch_differs``); absent means False.
    """

    @property
    def name(self) -> str:
        """The plugin's name."""
        ...

    @property
    def workspace_bytes(self) -> int:
        """Bytes of device memory the plugin allocated at build (counted before KV sizing)."""
        ...

    def covers(self, step: Step) -> bool:
        """Whether ``forward`` serves ``step`` (beyond the spec's declared coverage). Pure."""
        ...

    def forward(self, layer: int, x: torch.Tensor, kv: KVCache, meta: ForwardMeta) -> torch.Tensor:
        """Run decoder layer ``layer`` on ``x`` (num_tokens, hidden); see the class docstring."""
        ...

    def warmup(self, batch_sizes: Sequence[int]) -> None:
        """Compile and run every kernel once per batch size on plugin-owned scratch data."""
        ...
