"""`without_gc`: run a compile step with Python's cyclic garbage collector paused.

Compiles allocate many short-lived acyclic objects (frozensets, tuples, small lists), which
trigger collections; in a process holding many objects (a loaded model, torch) each full
collection walks them all and can double a compile's time. Reference counting still frees
everything the step drops; the collector is re-enabled afterwards (process-wide while paused).
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from typing import ParamSpec, TypeVar

__all__ = ["without_gc"]

P = ParamSpec("P")
R = TypeVar("R")


def without_gc(fn: Callable[P, R]) -> Callable[P, R]:
    """Wrap `fn` so it runs with the collector paused (nested calls leave it to the outermost)."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        if not gc.isenabled():
            return fn(*args, **kwargs)
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            gc.enable()

    return wrapper
