"""Lockstep check: SGLang's classic RadixCache and its UnifiedRadixCache (Rust tree core) make the
same decisions on the benchmark's traces (both are whole-node LRU trees with the same split rule).

One engine model (`sim.py`) drives a tee adapter that forwards every call to both caches and
fails at the first call where they differ: matched length and slot ids, inserted prefix length,
the slots an insert makes the engine free (the classic cache's duplicates computed as the engine
model does), the set of slots an evict frees. Needs the SGLang venv (see README.md).

    PYTHONPATH=packages/radixcache/src "$SGL_VENV/bin/python" -W ignore \\
        benchmarks/radixcache/sglang_parity.py [--page-sizes 1,16] [--traces ...] [--capacities ...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sglang_adapter  # noqa: E402
import sglang_unified_adapter  # noqa: E402
import sim  # noqa: E402
import traces  # noqa: E402


class Divergence(AssertionError):
    pass


class TeeAdapter:
    """Both SGLang caches behind one adapter; the unified cache's frees go to the engine."""

    frees_tail = False

    def __init__(self, page_size: int) -> None:
        self.classic = sglang_adapter.SGLangAdapter(page_size)
        self.unified = sglang_unified_adapter.SGLangUnifiedAdapter(page_size)
        self.page_size = page_size
        self.name = "classic|unified"
        self.calls = 0

    def _check(self, what: str, a: Any, b: Any) -> None:
        self.calls += 1
        if isinstance(a, np.ndarray):
            same = np.array_equal(a, b)
        else:
            same = a == b
        if not same:
            raise Divergence(f"call {self.calls}: {what} differs: classic {a!r} unified {b!r}")

    def native_key(self, tokens: np.ndarray) -> Any:
        return self.classic.native_key(tokens), self.unified.native_key(tokens)

    def native_value(self, slots: np.ndarray) -> Any:
        return self.classic.native_value(slots), self.unified.native_value(slots)

    def match(self, key: Any) -> tuple[int, Any, Any]:
        la, ha, ia = self.classic.match(key[0])
        lb, hb, ib = self.unified.match(key[1])
        self._check("match length", la, lb)
        self._check("match slots", ia.numpy(), ib.numpy())
        return la, (ha, hb), ia

    def indices_to_numpy(self, indices: Any) -> np.ndarray:
        return indices.numpy()

    def insert(self, key: Any, value: Any, cached_len: int, finished: bool) -> tuple[int, np.ndarray]:
        pa, _ = self.classic.insert(key[0], value[0], cached_len, finished)
        pb, freed = self.unified.insert(key[1], value[1], cached_len, finished)
        self._check("insert prefix length", pa, pb)
        duplicates = value[0].numpy()[cached_len:pa]  # what the engine frees for the classic cache
        self._check("duplicates freed", np.sort(duplicates), np.sort(freed))
        return pb, freed

    def lock(self, handle: Any) -> None:
        self.classic.lock(handle[0])
        self.unified.lock(handle[1])

    def unlock(self, handle: Any) -> None:
        self.classic.unlock(handle[0])
        self.unified.unlock(handle[1])

    def evict(self, num_tokens: int) -> np.ndarray:
        a = self.classic.evict(num_tokens)
        b = self.unified.evict(num_tokens)
        self._check("evicted slots", np.sort(a), np.sort(b))
        return b

    def peek_prefix_len(self, key: Any, extra_key: Any = None) -> int:
        a = self.classic.peek_prefix_len(key)
        b = self.unified.peek_prefix_len(key)
        self._check("peek length", a, b)
        return b

    def touch_prefix(self, key: Any, extra_key: Any = None) -> int:
        return self.peek_prefix_len(key, extra_key)

    @property
    def total_size(self) -> int:
        a, b = self.classic.total_size, self.unified.total_size
        self._check("total size", a, b)
        return b


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", default=",".join(traces.TRACES))
    ap.add_argument("--capacities", default="200000,20000")
    ap.add_argument("--page-sizes", default="1,16")
    args = ap.parse_args(argv)
    failures = 0
    for name in [n for n in args.traces.split(",") if n]:
        trace = traces.TRACES[name]()
        for page in [int(p) for p in args.page_sizes.split(",")]:
            for cap in [int(c) for c in args.capacities.split(",")]:
                tee = TeeAdapter(page)
                try:
                    res = sim.simulate(trace, tee, sim.SimConfig(capacity=cap))
                    verdict = f"same on all {tee.calls} compared calls, hit {res.hit_rate:.4f}, evicts {res.evict_calls}"
                except Divergence as exc:
                    failures += 1
                    verdict = f"DIVERGED: {exc}"
                print(f"{name:16s} page {page:2d} slots {cap:7d}: {verdict}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
