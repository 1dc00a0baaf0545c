"""Registry objects, context-scoped register(), and entry-point discovery."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

import lowlat
from lowlat import PluginLoadError, Registry, RegistryError, register, use_registry
from lowlat.testing import fake_spec


def test_add_get_and_priority_order() -> None:
    reg = Registry([fake_spec("b", priority=1), fake_spec("a", priority=1), fake_spec("c", priority=5)])
    assert reg.names() == ("a", "b", "c")
    assert [s.name for s in reg.specs()] == ["c", "a", "b"]
    assert [s.name for s in reg.for_arch("LlamaForCausalLM")] == ["c", "a", "b"]
    assert reg.for_arch("Other") == ()
    with pytest.raises(RegistryError, match="already registered"):
        reg.add(fake_spec("a"))
    reg.add(fake_spec("a", priority=9), replace=True)
    assert reg.get("a").priority == 9
    with pytest.raises(RegistryError, match=r"registered: \['a', 'b', 'c'\]"):
        reg.get("zzz")


def test_register_needs_an_active_registry_and_is_scoped() -> None:
    with pytest.raises(RegistryError, match="no active registry"):
        register(fake_spec())
    outer, inner = Registry(), Registry()
    with use_registry(outer):
        register(fake_spec("x"))
        with use_registry(inner):
            register(fake_spec("y"))
        register(fake_spec("z"))
    assert outer.names() == ("x", "z") and inner.names() == ("y",)
    with pytest.raises(RegistryError):
        lowlat.current_registry()


@dataclass
class FakeEntryPoint:
    name: str
    obj: Any
    value: str = "pkg.mod:obj"

    def load(self) -> Any:
        if isinstance(self.obj, Exception):
            raise self.obj
        return self.obj


def test_discover_accepts_spec_list_and_factory() -> None:
    reg = Registry()
    added = reg.discover(entry_points=[
        FakeEntryPoint("one", fake_spec("one")),
        FakeEntryPoint("many", [fake_spec("m1"), fake_spec("m2")]),
        FakeEntryPoint("factory", lambda: fake_spec("f")),
    ])
    assert sorted(added) == ["f", "m1", "m2", "one"]


@pytest.mark.parametrize("obj", [ImportError("no module"), 42, [1, 2]])
def test_discover_fails_loudly(obj: Any) -> None:
    with pytest.raises(PluginLoadError, match="bad"):
        Registry().discover(entry_points=[FakeEntryPoint("bad", obj)])

