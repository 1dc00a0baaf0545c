"""Typed exceptions raised at lowlat's public boundary."""

from __future__ import annotations


class LowlatError(Exception):
    """Base class of every error lowlat raises on purpose."""


class Unsupported(LowlatError):
    """A plugin cannot serve this server configuration or model, for the server's whole lifetime.

    Decided once, at start-up, with every reason found (not only the first). In ``auto`` mode the
    session records it and runs the original forward; in ``require`` mode it is raised.
    """

    def __init__(self, plugin: str, reasons: tuple[str, ...]) -> None:
        self.plugin = plugin
        self.reasons = tuple(reasons)
        joined = "; ".join(self.reasons) if self.reasons else "no reason given"
        super().__init__(f"lowlat plugin {plugin!r} is unsupported here: {joined}")

    def __reduce__(self) -> tuple[type[Unsupported], tuple[str, tuple[str, ...]]]:
        # picklable with its reasons: start-up errors cross processes (TP ranks, a server's core)
        return (Unsupported, (self.plugin, self.reasons))


class PluginLoadError(LowlatError):
    """An entry point of the ``lowlat.plugins`` group could not be loaded or gave no PluginSpec."""


class RegistryError(LowlatError):
    """A registry operation was invalid (duplicate name, unknown name, no active registry)."""


class StartupOrderError(LowlatError):
    """A start-up stage was called out of order (see ``lowlat.Stage`` for the order)."""


class AgreementError(LowlatError):
    """Tensor-parallel ranks disagree in a way that cannot be resolved by turning the plugin off."""


class GraphPathMismatch(LowlatError):
    """A CUDA-graph replay would take a different path than the one frozen at capture."""


class KernelError(LowlatError):
    """A kernel reported an error through its device-side error flag (e.g. a bounded spin ran out)."""


class ShapeError(LowlatError, ValueError):
    """Tensors given to a layer or kernel do not match the declared shapes or dtypes."""
