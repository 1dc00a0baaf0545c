"""The attention backend registry: name -> factory, the built-in backends (`torch_native`,
plus `triton` and `flashinfer` where they import)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from lmserver.forward.batch import AttentionBackend
from lmserver.runner.attention.torch_native import TorchNativeBackend

if TYPE_CHECKING:
    from lmserver.forward.kv_pool import KVPool


class UnknownAttentionBackendError(ValueError):
    """The requested attention backend is not registered."""


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
    "triton": ("lmserver.runner.attention.triton_backend", "TritonBackend"),
    "triton_cudnn": ("lmserver.runner.attention.triton_backend", "TritonCudnnPrefillBackend"),
    "flashinfer": ("lmserver.runner.attention.flashinfer_backend", "FlashInferBackend"),
}
# name -> what to install when an optional backend does not import
INSTALL_HINTS = {
    "triton": "install the triton package",
    "triton_cudnn": "install the triton package",
    "flashinfer": "install the flashinfer package (pip install flashinfer-python)",
}


def default_registry() -> AttentionRegistry:
    """A new registry with the built-in backends: `torch_native`, plus optional ones that import."""
    import importlib

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
