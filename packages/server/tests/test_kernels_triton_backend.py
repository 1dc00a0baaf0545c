"""The `triton` attention backend against `torch_native` (its reference) on random batches:
a chunked prefill with cached prefixes, then decode steps; outputs and the KV pool must agree.
Runs on CUDA (`gpu`) and on the CPU in the TRITON_INTERPRET=1 child (test_kernels_interpret.py)."""

from __future__ import annotations

import os

import pytest
import torch

from lmserver.kernels.testing import kernel_devices
from lmserver.runner.attention.testing import compare_backends
from lmserver.runner.attention.torch_native import TorchNativeBackend

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = kernel_devices()


# The interpreter child runs the SmolLM2 shape only (the Llama shape is slow there; its kernels are
# covered by test_kernels_triton.py); CUDA runs both.
SHAPES = [pytest.param((9, 3, 64), id="smollm2")]
if not INTERPRET:
    SHAPES.append(pytest.param((32, 8, 128), id="llama3-8b"))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_backend_matches_torch_native(device: str, shape: tuple[int, int, int]) -> None:
    from lmserver.runner.attention.triton_backend import TritonBackend

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    cpu = device == "cpu"
    compare_backends(TorchNativeBackend, TritonBackend, device=device, shape=shape, dtype=dtype,
                     num_slots=400 if cpu else 20000, width=512 if cpu else 8192,
                     chunks=[[30, 5, 17], [0, 40, 1]] if cpu else [[3000, 512, 1], [700, 0, 2000]],
                     decode_steps=3, tol=1e-5 if dtype == torch.float32 else 1.6e-2)
