"""Optional: SGLang's Python `RadixCache` behind the benchmark's adapter protocol.

SGLang is not a dependency of this repository. Set it up in a separate virtual environment
outside the repo (see benchmarks/RESULTS.md for the exact commands): torch from the local wheel,
`pip install --no-deps sglang`, plus the few pure-Python packages its import chain needs. The
radix-cache module drags in SGLang's model configs, kernels and memory pools at import time;
none of them is used by the tree itself, so `import_sglang_radix_cache()` replaces those modules
with inert stubs before importing it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from array import array
from typing import Any

import numpy as np

_STUBBED = (
    "torchvision",
    "sglang.kernels",
    "sglang.srt.configs",
    "sglang.srt.distributed",
    "sglang.srt.layers",
    "sglang.srt.mem_cache.allocator",
    "sglang.srt.mem_cache.memory_pool",
)


class _Inert:
    """Stands for any attribute of a stubbed module (classes, functions, constants)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> _Inert:
        return _Inert()

    def __getattr__(self, name: str) -> _Inert:
        return _Inert()

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (object,)


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, stubbed: tuple[str, ...] = _STUBBED) -> None:
        self.stubbed = stubbed

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if any(name == r or name.startswith(r + ".") for r in self.stubbed):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = lambda attr: _Inert()  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def install_stubs(extra: tuple[str, ...] = ()) -> None:
    """Put a finder for the stubbed modules (plus `extra`) first on `sys.meta_path`, once per set."""
    stubbed = _STUBBED + extra
    if not any(isinstance(f, _StubFinder) and f.stubbed == stubbed for f in sys.meta_path):
        sys.meta_path.insert(0, _StubFinder(stubbed))


def import_sglang_radix_cache() -> types.ModuleType:
    try:
        import torch  # noqa: F401
    except ImportError as exc:
        raise SystemExit("--sglang needs torch and sglang in this interpreter; see benchmarks/radixcache/README.md") from exc
    install_stubs()
    try:
        import sglang.srt.mem_cache.radix_cache as rc
    except ImportError as exc:
        raise SystemExit(f"--sglang: cannot import sglang's radix cache ({exc}); see benchmarks/radixcache/README.md") from exc
    return rc


class _FreedSink:
    """Stands in for SGLang's KV allocator: evict() hands the freed slot tensors here."""

    device = "cpu"

    def __init__(self) -> None:
        self.freed: list[Any] = []

    def free_segment(self, value: Any, start_pos: int = 0) -> None:
        self.freed.append(value)

    def free(self, value: Any) -> None:
        self.freed.append(value)


class SGLangAdapter:
    """SGLang's RadixCache with its native types: `RadixKey(array('q'))` keys, int64 tensors."""

    frees_tail = False  # insert returns None: the engine model frees duplicates and tail

    def __init__(self, page_size: int = 1) -> None:
        import torch

        self._torch = torch
        self._rc = import_sglang_radix_cache()
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams

        self._Evict, self._Insert, self._Match = EvictParams, InsertParams, MatchPrefixParams
        self._sink = _FreedSink()
        self.cache = self._rc.RadixCache.create_simulated(mock_allocator=self._sink, page_size=page_size)
        self.page_size = page_size
        self.name = f"sglang {_sglang_version()}"

    def native_key(self, tokens: np.ndarray) -> Any:
        return self._rc.RadixKey(array("q", tokens.tobytes()))

    def native_value(self, slots: np.ndarray) -> Any:
        return self._torch.from_numpy(np.ascontiguousarray(slots))

    def match(self, key: Any) -> tuple[int, Any, Any]:
        m = self.cache.match_prefix(self._Match(key=key))
        node = m.last_device_node
        return m.device_prefix_len, node, self.cache.path_device_indices(node)

    def indices_to_numpy(self, indices: Any) -> np.ndarray:
        return indices.numpy()

    def insert(self, key: Any, value: Any, cached_len: int, finished: bool) -> tuple[int, None]:
        # NOTE: SGLang's RadixCache leaves the frees to its scheduler (the engine model does them)
        return int(self.cache.insert(self._Insert(key=key, value=value)).prefix_len), None

    def lock(self, handle: Any) -> None:
        self.cache.inc_lock_ref(handle)

    def unlock(self, handle: Any) -> None:
        self.cache.dec_lock_ref(handle)

    def evict(self, num_tokens: int) -> np.ndarray:
        self.cache.evict(self._Evict(num_tokens=num_tokens))
        freed, self._sink.freed = self._sink.freed, []
        if not freed:
            return np.zeros(0, dtype=np.int64)
        return self._torch.cat(freed).numpy()

    def peek_prefix_len(self, key: Any, extra_key: Any = None) -> int:
        # NOTE: SGLang's scheduler orders its queue with match_prefix itself (it mutates)
        native = self.native_key(key) if isinstance(key, np.ndarray) else key
        return int(self.cache.match_prefix(self._Match(key=native)).device_prefix_len)

    def touch_prefix(self, key: Any, extra_key: Any = None) -> int:
        return self.peek_prefix_len(key, extra_key)

    @property
    def total_size(self) -> int:
        return int(self.cache.total_size())


def _sglang_version() -> str:
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:
        return "?"
