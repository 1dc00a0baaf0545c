"""The one frozen configuration object of lowlat."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Mode = Literal["off", "auto", "require"]
AmdMode = Literal["persistent", "staged"]
PdlMode = Literal["auto", "on", "off"]


@dataclass(frozen=True)
class LowlatConfig:
    """How a session chooses and runs plugins.

    Attributes:
        mode: ``off`` never uses a plugin; ``auto`` uses the best supported one and falls back to
            the original forward otherwise; ``require`` raises ``Unsupported`` when no plugin can
            serve the configuration.
        plugins: allow-list of plugin names; empty means every registered plugin is a candidate.
        disabled: plugin names never to use.
        amd_mode: ``persistent`` (two persistent launches per layer) or ``staged`` (one launch per
            stage) for the ``amd`` plugin.
        pdl: programmatic dependent launch for the ``nvidia`` plugin; ``auto`` uses it where the
            Triton version and the GPU support it.
        spin_limit: upper bound on polling iterations of a persistent kernel waiting on a tile
            before it raises its error flag instead of hanging.
        max_attn_splits: most split-KV partitions used by the decode attention kernels.
        measured_coverage: a built plugin declines decode batches above the largest one at which it
            measured faster than the generic path on this GPU and layer shape (``nvidia``:
            ``lowlat.kernels.tuning.WINS_UP_TO``), so those steps run the original forward; ``False``
            runs the plugin on every batch its coverage allows (to benchmark it there).
        measured_only: a built plugin declines every step on a GPU and layer shape it has no measured
            table for (``nvidia``: no ``WINS_UP_TO`` entry), so only measured wins take it (a server's
            default on a GPU); ``False`` takes every covered batch there.
    """

    mode: Mode = "auto"
    plugins: tuple[str, ...] = ()
    disabled: tuple[str, ...] = ()
    amd_mode: AmdMode = "persistent"
    pdl: PdlMode = "auto"
    spin_limit: int = 1 << 18
    max_attn_splits: int = 16
    measured_coverage: bool = True
    measured_only: bool = False

    def __post_init__(self) -> None:
        if self.mode not in ("off", "auto", "require"):
            raise ValueError(f"LowlatConfig.mode must be 'off', 'auto' or 'require', got {self.mode!r}")
        if self.amd_mode not in ("persistent", "staged"):
            raise ValueError(f"LowlatConfig.amd_mode must be 'persistent' or 'staged', got {self.amd_mode!r}")
        if self.pdl not in ("auto", "on", "off"):
            raise ValueError(f"LowlatConfig.pdl must be 'auto', 'on' or 'off', got {self.pdl!r}")
        if self.spin_limit < 1:
            raise ValueError(f"LowlatConfig.spin_limit must be >= 1, got {self.spin_limit}")
        if self.max_attn_splits < 1:
            raise ValueError(f"LowlatConfig.max_attn_splits must be >= 1, got {self.max_attn_splits}")
