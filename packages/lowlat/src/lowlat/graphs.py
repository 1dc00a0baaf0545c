"""The CUDA-graph path recorder: which path each captured (step kind, batch size) froze."""

from __future__ import annotations

from dataclasses import dataclass

from lowlat.errors import GraphPathMismatch
from lowlat.spec import StepKind

PLUGIN = "plugin"
ORIGINAL = "original"


@dataclass(frozen=True)
class GraphEntry:
    """One captured graph: its key, the frozen path and, for the original path, why."""

    kind: StepKind
    batch_size: int
    path: str
    reason: str | None
    replays: int = 0


class PathRecorder:
    """Records the path frozen into each CUDA graph and checks it again on every replay."""

    def __init__(self) -> None:
        self._entries: dict[tuple[StepKind, int], GraphEntry] = {}

    def record(self, kind: StepKind, batch_size: int, path: str, reason: str | None = None) -> None:
        """Note that the graph for (kind, batch_size) froze ``path`` (mutates; recapture overwrites)."""
        if path not in (PLUGIN, ORIGINAL):
            raise ValueError(f"path must be {PLUGIN!r} or {ORIGINAL!r}, got {path!r}")
        self._entries[(kind, batch_size)] = GraphEntry(kind, batch_size, path, reason)

    def check(self, kind: StepKind, batch_size: int, path: str) -> GraphEntry:
        """Raise ``GraphPathMismatch`` unless a graph for (kind, batch_size) froze ``path``.

        Counts the replay (mutates the entry) and returns the updated entry.
        """
        entry = self._entries.get((kind, batch_size))
        if entry is None:
            raise GraphPathMismatch(
                f"no graph was captured for ({kind.value}, batch {batch_size}); captured: "
                f"{sorted((k.value, b) for k, b in self._entries)}"
            )
        if entry.path != path:
            raise GraphPathMismatch(
                f"graph ({kind.value}, batch {batch_size}) froze the {entry.path} path, but the dispatcher "
                f"now picks {path}; recapture the graph after changing coverage"
            )
        updated = GraphEntry(entry.kind, entry.batch_size, entry.path, entry.reason, entry.replays + 1)
        self._entries[(kind, batch_size)] = updated
        return updated

    def entry(self, kind: StepKind, batch_size: int) -> GraphEntry | None:
        """The graph captured for (kind, batch_size), or None. Pure."""
        return self._entries.get((kind, batch_size))

    def entries(self) -> tuple[GraphEntry, ...]:
        """Every captured graph, by kind then batch size."""
        return tuple(self._entries[k] for k in sorted(self._entries, key=lambda k: (k[0].value, k[1])))
