"""`host_tensor` / `to_device` (built through numpy) against `torch.tensor` on the same data."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmserver.runner.host_tensors import host_tensor, to_device

CPU = torch.device("cpu")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=300), st.sampled_from([torch.int64, torch.int32]))
def test_int_lists_equal_torch_tensor(data: list[int], dtype: torch.dtype) -> None:
    got = to_device(data, dtype, CPU)
    want = torch.tensor(data, dtype=dtype)
    assert got.dtype == dtype and got.shape == want.shape and torch.equal(got, want)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(allow_nan=False, width=32), max_size=100))
def test_float_lists_equal_torch_tensor(data: list[float]) -> None:
    assert torch.equal(host_tensor(data, torch.float32, CPU), torch.tensor(data, dtype=torch.float32))


@pytest.mark.parametrize(("data", "dtype"), [
    ([[1, 2, 3], [4, 5, 6]], torch.int64),  # nested rows
    ([], torch.int32),
    ([True, False], torch.bool),
    ([0.5, 1.25], torch.bfloat16),  # no numpy dtype: torch.tensor's path
])
def test_shapes_and_dtypes(data: list, dtype: torch.dtype) -> None:
    got = host_tensor(data, dtype, CPU)
    want = torch.tensor(data, dtype=dtype)
    assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)


def test_never_aliases_the_callers_array() -> None:
    """A caller's numpy array is copied (as torch.tensor copies): writing it later changes nothing sent."""
    src = np.arange(8, dtype=np.int64)
    got = host_tensor(src, torch.int64, CPU)  # type: ignore[arg-type]
    src[:] = -1
    assert got.tolist() == list(range(8))


def test_out_of_range_ints_are_refused() -> None:
    with pytest.raises((OverflowError, RuntimeError, ValueError)):
        host_tensor([2**40], torch.int32, CPU)
