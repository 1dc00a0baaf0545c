"""Measured GEMV kernel choices per GPU and layer shape.

``benchmarks/lowlat/bench_gemv.py`` times every stage's candidates (``dot`` and ``rows`` kernels,
block sizes, warps, stages) on the GPU, each stage as 32 PDL-chained launches over distinct
weights (nothing served from L2), and prints the winners as entries for ``TABLES``. A GPU or shape
without an entry gets ``LaunchConfig``'s defaults.
"""

from __future__ import annotations

from lowlat.kernels.ops import GemvConfig
from lowlat.layer import LayerShape

# (GPU name, (hidden, q heads, kv heads, head_dim, intermediate)) -> (stage, max batch, config), ...
Entry = tuple[str, int, GemvConfig]
TABLES: dict[tuple[str, tuple[int, int, int, int, int]], tuple[Entry, ...]] = {}


def shape_key(shape: LayerShape) -> tuple[int, int, int, int, int]:
    return (shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.intermediate_size)


def tuned_table(device_name: str, shape: LayerShape) -> tuple[Entry, ...]:
    """The measured entries for this GPU and shape, or none."""
    return TABLES.get((device_name, shape_key(shape)), ())
