"""`TreeNode`: one edge of the radix tree (a run of whole pages) and the slots that hold its KV."""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np
import numpy.typing as npt


class TreeNode:
    """A node of `RadixCache`; callers treat it as an opaque handle (for `lock`/`unlock`).

    Read-only attributes useful to eviction policies: `num_tokens`, `last_access` (logical
    clock of the last match/insert through it), `hit_count`, `created` (logical clock at
    creation), `priority`, `lock_ref`, `extra_key`. A namespace root has `parent is None`.
    """

    __slots__ = (
        "children",
        "parent",
        "_key",
        "_tail",
        "value",
        "lock_ref",
        "last_access",
        "hit_count",
        "created",
        "priority",
        "extra_key",
        "in_heap",
        "removed",
        "hashes",
        "stamp",
    )

    def __init__(
        self,
        key: bytes,
        value: npt.NDArray[np.int64],
        parent: TreeNode | None,
        extra_key: Hashable,
        tick: int,
    ) -> None:
        self.children: dict[bytes, TreeNode] = {}
        self.parent = parent
        # the edge's int64 token ids as bytes: `_key`, followed by the `_tail` parts when an
        # in-place extension appended some (joined at the first read of `key`: a leaf extended
        # by a request's output is seldom walked past its first page, which `_key` holds)
        self._key = key
        self._tail: list[bytes] | None = None
        self.value = value  # slot ids, read-only, len == num_tokens
        self.lock_ref = 0
        self.last_access = tick
        self.hit_count = 0
        self.created = tick
        self.priority = 0
        self.extra_key = extra_key
        self.in_heap = False
        self.removed = False
        self.hashes: list[int] | None = None  # one chained hash per page, when events are on
        # cache version at the last change of this node's own edge (key, slots), parent or
        # removal; not of its children (RadixCache.refresh_prefix relies on exactly this)
        self.stamp = 0

    @property
    def key(self) -> bytes:
        """The edge's token ids as int64 bytes."""
        if self._tail is not None:
            self._key = b"".join([self._key, *self._tail])
            self._tail = None
        return self._key

    @key.setter
    def key(self, key: bytes) -> None:
        self._key = key
        self._tail = None

    def append_key(self, more: bytes) -> None:
        """Appends `more` to `key` without copying it now (an in-place leaf extension)."""
        if self._tail is None:
            self._tail = [more]
        else:
            self._tail.append(more)

    @property
    def num_tokens(self) -> int:
        return len(self.value)

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def token_ids(self) -> npt.NDArray[np.int64]:
        """The token ids on this node's edge (a read-only view)."""
        return np.frombuffer(self.key, dtype=np.int64)

    def __repr__(self) -> str:
        return (
            f"TreeNode(num_tokens={self.num_tokens}, lock_ref={self.lock_ref}, "
            f"children={len(self.children)}, extra_key={self.extra_key!r})"
        )
