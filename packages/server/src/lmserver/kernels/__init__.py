"""Fast kernels of lmserver (Triton) and their torch-native references, the test oracles.

- `reference`: torch-native versions of every kernel (float32/float64), also the CPU path.
- `dispatch.select_kernels`: chooses Triton or the references once, with a reason.
- Triton modules (import them only when Triton is meant to run; they import triton):
  `decode_attention`, `extend_attention`, `norm`, `activation`, `rope`, `kv_store`,
  `sampling`, `bitmask`.
- `prefill_sdpa`: fresh long prompts' causal attention through torch SDPA (cuDNN on Hopper).
"""

from lmserver.kernels._util import KernelInputError
from lmserver.kernels.dispatch import KernelOps, KernelUnavailableError, native_kernels, select_kernels

__all__ = ["KernelInputError", "KernelOps", "KernelUnavailableError", "native_kernels", "select_kernels"]
