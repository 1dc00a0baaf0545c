"""Token keys: any 1-D sequence of int token ids, held as int64 arrays (and their bytes)."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from radixcache.errors import InvalidKeyError

KeyLike = npt.ArrayLike  # 1-D sequence of int token ids: list, range, array('q'), ndarray of any int dtype

TOKEN_BYTES = 8  # keys are stored as int64 bytes
EMPTY = np.zeros(0, dtype=np.int64)
EMPTY.setflags(write=False)
INT64 = np.dtype(np.int64)  # positional to np.frombuffer: half the cost of dtype=np.int64
_INT64_MAX = np.iinfo(np.int64).max


def as_key(key: KeyLike) -> npt.NDArray[np.int64]:
    """`key` as a 1-D int64 array: no copy for an int64 ndarray, one conversion for a list,
    tuple, range, `array.array` or an ndarray of another integer dtype (int32, uint16, ...).
    Raises `InvalidKeyError` for anything else (floats, bools, nested sequences, ids past int64)."""
    if type(key) is np.ndarray and key.dtype is INT64 and key.ndim == 1:  # the usual key: fast
        return key
    if isinstance(key, np.ndarray):
        arr = key
    else:
        try:
            arr = np.asarray(key)
        except (TypeError, ValueError, OverflowError) as exc:
            raise InvalidKeyError(f"key must be a 1-D sequence of int token ids: {exc}") from exc
    if arr.ndim != 1:
        raise InvalidKeyError(f"key must be 1-D, got shape {arr.shape}")
    kind = arr.dtype.kind
    if kind == "i":
        return arr if arr.dtype == INT64 else arr.astype(np.int64)
    if kind == "u":
        if arr.dtype.itemsize == 8 and len(arr) and int(arr.max()) > _INT64_MAX:
            raise InvalidKeyError("token ids must fit in int64")
        return arr.astype(np.int64)
    if len(arr) == 0:  # [] converts to float64
        return EMPTY
    raise InvalidKeyError(f"token ids must be integers, got dtype {arr.dtype}")


def key_bytes(arr: npt.NDArray[np.int64], n: int) -> bytes:
    """`arr[:n].tobytes()` (arr: a 1-D int64 key); no copy when `arr` is exactly the bytes
    object it views (a key made by `np.frombuffer(bytes)`, or a whole-length view of one)."""
    base = arr.base
    if type(base) is bytes:  # np.frombuffer(base): contiguous, so all of base when as long
        if len(base) == n * TOKEN_BYTES:
            return base
    elif type(base) is np.ndarray and n == len(arr) and arr.strides == (TOKEN_BYTES,):
        outer = base.base  # a view of a frombuffer array: all of its bytes when as long
        if type(outer) is bytes and len(outer) == n * TOKEN_BYTES:
            return outer
    return arr[:n].tobytes()
