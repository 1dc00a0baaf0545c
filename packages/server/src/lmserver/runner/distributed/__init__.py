"""Tensor parallelism on torch.distributed: the group, parallel layers, model sharding, and the
rank processes of the engine (rank 0 schedules and broadcasts each decision)."""

from lmserver.runner.distributed.group import TPGroup
from lmserver.runner.distributed.shard import (
    TensorParallelError,
    check_fp8_splits,
    shard_model_,
    tp_head_counts,
)

__all__ = ["TPGroup", "TensorParallelError", "check_fp8_splits", "shard_model_", "tp_head_counts"]
