"""The attention backend interface and its registry.

A backend owns no weights. It reads and writes the KV pool: `forward` first stores the new
k, v at `batch.out_cache_loc` for its layer, then attends over every slot of each request
(`req_to_token[req_pool_indices[i], :seq_lens[i]]`).
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from lmserver.engine.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from lmserver.engine.kv_pool import KVPool


class UnknownAttentionBackendError(ValueError):
    """The requested attention backend is not registered."""


class AttentionLayer(nn.Module):
    """Per-layer attention parameters; calls the batch's backend (holds no weights)."""

    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """q (T, H, D), k and v (T, KV, D) -> (T, H * D). Writes k, v into the KV pool."""
        assert batch.attn_backend is not None, "ForwardBatch has no attention backend"
        return batch.attn_backend.forward(q, k, v, self)


class AttentionBackend(abc.ABC):
    """Plans once per forward, then computes attention per layer."""

    name: str = "base"
    # False: `plan` cannot run inside a captured CUDA graph; the decode graph runner then runs
    # decode eagerly and logs why (engine/cuda_graph.py).
    supports_cuda_graph: bool = True

    def __init__(self, kv_pool: KVPool, req_to_token: torch.Tensor) -> None:
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token  # (max_running_requests, max_context_len) int32

    @abc.abstractmethod
    def plan(self, batch: ForwardBatch) -> None:
        """Builds per-forward metadata (index tensors, masks) from `batch`; mutates only self."""

    @abc.abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer) -> torch.Tensor:
        """Stores k, v (T, KV, D) for `layer` and returns attention output (T, H * D)."""


BackendFactory = Callable[["KVPool", torch.Tensor], AttentionBackend]


class AttentionRegistry:
    """Name -> backend factory. New backends are new modules that register here."""

    def __init__(self) -> None:
        self._factories: dict[str, BackendFactory] = {}
        self._unavailable: dict[str, str] = {}  # name -> why an optional backend is missing

    def register(self, name: str, factory: BackendFactory) -> None:
        """Adds (or replaces) `name`; mutates the registry."""
        self._factories[name] = factory
        self._unavailable.pop(name, None)

    def mark_unavailable(self, name: str, reason: str) -> None:
        """Records why optional backend `name` is not registered (named by `create`'s error)."""
        if name not in self._factories:
            self._unavailable[name] = reason

    def unavailable_reason(self, name: str) -> str | None:
        return self._unavailable.get(name)

    def names(self) -> list[str]:
        return sorted(self._factories)

    def create(self, name: str, kv_pool: KVPool, req_to_token: torch.Tensor) -> AttentionBackend:
        if name not in self._factories:
            why = self._unavailable.get(name)
            raise UnknownAttentionBackendError(
                f"attention backend {name!r} is not available"
                + (f" ({why})" if why else "")
                + f"; choose one of {self.names()}"
            )
        return self._factories[name](kv_pool, req_to_token)


# name -> (module, class) of optional backends added as new modules (e.g. by the GPU work).
_OPTIONAL_BACKENDS = {
    "triton": ("lmserver.attention.triton_backend", "TritonBackend"),
    "flashinfer": ("lmserver.attention.flashinfer_backend", "FlashInferBackend"),
}
# name -> what to install when an optional backend does not import
INSTALL_HINTS = {
    "triton": "install the triton package",
    "flashinfer": "install the flashinfer package (pip install flashinfer-python)",
}


def default_registry() -> AttentionRegistry:
    """A new registry with the built-in backends: `torch_native`, plus optional ones that import."""
    import importlib

    from lmserver.attention.torch_native import TorchNativeBackend

    registry = AttentionRegistry()
    registry.register("torch_native", TorchNativeBackend)
    for name, (module_name, class_name) in _OPTIONAL_BACKENDS.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            registry.mark_unavailable(name, f"{INSTALL_HINTS.get(name, 'it did not import')}: {e}")
            continue
        registry.register(name, getattr(module, class_name))
    return registry
