"""Plugin registries: objects passed around, or scoped with a context variable (no hidden global)."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterable, Iterator
from importlib import metadata
from typing import Any

from lowlat.errors import PluginLoadError, RegistryError
from lowlat.spec import PluginSpec

ENTRY_POINT_GROUP = "lowlat.plugins"

_ACTIVE: contextvars.ContextVar[Registry | None] = contextvars.ContextVar("lowlat_registry", default=None)


class Registry:
    """A set of ``PluginSpec`` by name. Not thread-safe; build it at start-up, then read it."""

    def __init__(self, specs: Iterable[PluginSpec] = ()) -> None:
        self._specs: dict[str, PluginSpec] = {}
        for spec in specs:
            self.add(spec)

    def add(self, spec: PluginSpec, *, replace: bool = False) -> PluginSpec:
        """Add ``spec`` (mutates the registry). A second spec of the same name needs ``replace``."""
        if not isinstance(spec, PluginSpec):
            raise RegistryError(f"expected a PluginSpec, got {type(spec).__name__}")
        if spec.name in self._specs and not replace:
            old = self._specs[spec.name]
            raise RegistryError(
                f"plugin {spec.name!r} is already registered (version {old.version}); "
                "pass replace=True to override it"
            )
        self._specs[spec.name] = spec
        return spec

    def get(self, name: str) -> PluginSpec:
        """The spec named ``name``; the error lists the registered names."""
        try:
            return self._specs[name]
        except KeyError:
            raise RegistryError(f"no plugin {name!r}; registered: {sorted(self._specs)}") from None

    def names(self) -> tuple[str, ...]:
        """Registered names, sorted."""
        return tuple(sorted(self._specs))

    def specs(self) -> tuple[PluginSpec, ...]:
        """Registered specs, highest priority first, then by name."""
        return tuple(sorted(self._specs.values(), key=lambda s: (-s.priority, s.name)))

    def for_arch(self, arch: str) -> tuple[PluginSpec, ...]:
        """Specs that serve model architecture ``arch``, highest priority first."""
        return tuple(s for s in self.specs() if arch in s.archs)

    def __contains__(self, name: object) -> bool:
        return name in self._specs

    def __len__(self) -> int:
        return len(self._specs)

    def discover(self, group: str = ENTRY_POINT_GROUP, entry_points: Iterable[Any] | None = None) -> tuple[str, ...]:
        """Load plugins advertised under the entry-point ``group`` into this registry (mutates it).

        Each entry point may name a ``PluginSpec``, an iterable of them, or a callable returning
        either. A failing entry point raises ``PluginLoadError`` naming it (never skipped silently).
        Returns the names added.
        """
        eps = list(entry_points) if entry_points is not None else list(metadata.entry_points(group=group))
        added: list[str] = []
        for ep in sorted(eps, key=lambda e: e.name):
            try:
                obj = ep.load()
            except Exception as exc:
                raise PluginLoadError(f"entry point {ep.name!r} ({ep.value}) of group {group!r} failed to load: {exc}") from exc
            for spec in _as_specs(obj, ep.name):
                if spec.name in self._specs and self._specs[spec.name] is spec:
                    continue
                self.add(spec)
                added.append(spec.name)
        return tuple(added)

    @classmethod
    def from_entry_points(cls, group: str = ENTRY_POINT_GROUP) -> Registry:
        """A new registry holding every installed plugin (lowlat's own ``nvidia`` and ``amd`` included)."""
        reg = cls()
        reg.discover(group)
        return reg


def _as_specs(obj: Any, ep_name: str) -> list[PluginSpec]:
    if callable(obj) and not isinstance(obj, PluginSpec):
        obj = obj()
    if isinstance(obj, PluginSpec):
        return [obj]
    if isinstance(obj, Iterable):
        items = list(obj)
        if items and all(isinstance(s, PluginSpec) for s in items):
            return items
    raise PluginLoadError(f"entry point {ep_name!r} gave {type(obj).__name__}, expected PluginSpec(s)")


@contextlib.contextmanager
def use_registry(registry: Registry) -> Iterator[Registry]:
    """Make ``registry`` the target of ``lowlat.register`` inside the ``with`` block (context-scoped)."""
    token = _ACTIVE.set(registry)
    try:
        yield registry
    finally:
        _ACTIVE.reset(token)


def current_registry() -> Registry:
    """The registry made active by ``use_registry``; raises when none is active."""
    reg = _ACTIVE.get()
    if reg is None:
        raise RegistryError("no active registry: call inside `with lowlat.use_registry(reg):` or use reg.add(spec)")
    return reg


def register(spec: PluginSpec) -> PluginSpec:
    """Add ``spec`` to the active registry (see ``use_registry``); mutates that registry."""
    return current_registry().add(spec)

