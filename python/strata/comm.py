"""As deepspeed.comm, for scripts written for DeepSpeed (`import strata.comm as dist` in place of
`import deepspeed.comm as dist`): torch.distributed's collectives and queries under the names
DeepSpeed's module gives them, get_local_rank / get_local_world_size from the launcher's
environment, and init_distributed (strata.init_distributed). They act on the group
init_distributed (or the script) started; strata's engine keeps its own communicator."""
from __future__ import annotations

import os

from torch.distributed import (ReduceOp, all_gather, all_gather_into_tensor,  # noqa: F401
                               all_gather_object, all_reduce, all_to_all_single, barrier,
                               broadcast, broadcast_object_list, destroy_process_group, gather,
                               get_backend, get_global_rank, get_rank, get_world_size, irecv,
                               is_available, is_initialized, isend, new_group, recv, reduce,
                               reduce_scatter, reduce_scatter_tensor, scatter, send)

from .engine import _local_rank as get_local_rank  # noqa: F401  (LOCAL_RANK; 0 without one)
from .engine import init_distributed  # noqa: F401


def get_local_world_size() -> int:
    """Ranks on this node (LOCAL_WORLD_SIZE; else the world size where initialised, else 1)."""
    if "LOCAL_WORLD_SIZE" in os.environ:
        return int(os.environ["LOCAL_WORLD_SIZE"])
    return get_world_size() if is_initialized() else 1


def has_all_gather_into_tensor() -> bool:
    return True


def has_reduce_scatter_tensor() -> bool:
    return True
