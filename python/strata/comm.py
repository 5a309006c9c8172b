"""As deepspeed.comm, for scripts written for DeepSpeed (`import strata.comm as dist` in place of
`import deepspeed.comm as dist`): torch.distributed's collectives and queries under the names
DeepSpeed's module gives them, get_local_rank / get_local_world_size from the launcher's
environment, and init_distributed (strata.init_distributed). They act on the group
init_distributed (or the script, or strata.initialize under a launcher) started. A call made
before any group is up starts one as init_distributed does: DeepSpeed's initialize always starts
it, so its scripts call get_rank() without init_distributed. strata's engine keeps its own
communicator."""
from __future__ import annotations

import functools
import os

import torch.distributed as _dist
from torch.distributed import (ReduceOp, destroy_process_group, is_available,  # noqa: F401
                               is_initialized)

from .engine import _local_rank as get_local_rank  # noqa: F401  (LOCAL_RANK; 0 without one)
from .engine import init_distributed  # noqa: F401


def _started(fn):
    """torch.distributed's `fn`, with init_distributed() first where no group is up yet."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        if not _dist.is_initialized():
            init_distributed()
        return fn(*args, **kwargs)
    return call


for _name in ("all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce",
              "all_to_all_single", "barrier", "broadcast", "broadcast_object_list", "gather",
              "get_backend", "get_global_rank", "get_rank", "get_world_size", "irecv", "isend",
              "new_group", "recv", "reduce", "reduce_scatter", "reduce_scatter_tensor", "scatter",
              "send"):
    globals()[_name] = _started(getattr(_dist, _name))


def get_local_world_size() -> int:
    """Ranks on this node (LOCAL_WORLD_SIZE; else the world size where initialised, else 1)."""
    if "LOCAL_WORLD_SIZE" in os.environ:
        return int(os.environ["LOCAL_WORLD_SIZE"])
    return _dist.get_world_size() if is_initialized() else 1


def has_all_gather_into_tensor() -> bool:
    return True


def has_reduce_scatter_tensor() -> bool:
    return True
