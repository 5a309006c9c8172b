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

import torch
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
              "all_to_all", "all_to_all_single", "barrier", "broadcast", "broadcast_object_list",
              "gather", "get_backend", "get_global_rank", "get_rank", "get_world_size", "irecv",
              "isend", "new_group", "recv", "reduce", "reduce_scatter",
              "reduce_scatter_tensor", "scatter", "send"):
    globals()[_name] = _started(getattr(_dist, _name))

@_started
def monitored_barrier(group=None, timeout=None, wait_all_ranks: bool = False):
    """torch's monitored_barrier (a barrier that names the ranks that did not reach it by
    `timeout`) where the group's backend is Gloo, the one torch implements it for; a plain
    barrier elsewhere (NCCL on GPUs), where DeepSpeed's raises."""
    if _dist.get_backend(group) == "gloo":
        return _dist.monitored_barrier(group=group, timeout=timeout,
                                       wait_all_ranks=wait_all_ranks)
    return _dist.barrier(group=group)  # `timeout` unused: the group's own timeout applies


inference_all_reduce = all_reduce  # noqa: F821  (DeepSpeed's inference path: the same sum)


@_started
def get_world_group():
    """The default (world) process group."""
    return _dist.group.WORLD


@_started
def get_all_ranks_from_group(group=None) -> list:
    """The global ranks of `group` (the world's where None), in group-rank order."""
    return _dist.get_process_group_ranks(group if group is not None else _dist.group.WORLD)


@_started
def all_reduce_coalesced(tensors, op=ReduceOp.SUM, group=None, async_op=False):
    """all_reduce of each tensor in `tensors`, in place: one collective per device and dtype
    (their tensors flattened into one buffer; that copy is the memory it costs)."""
    if async_op:
        raise NotImplementedError("strata.comm.all_reduce_coalesced: async_op=True is not "
                                  "supported; call all_reduce(..., async_op=True) per tensor")
    buckets: dict = {}
    for t in tensors:
        buckets.setdefault((t.device, t.dtype), []).append(t)
    for same in buckets.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        _dist.all_reduce(flat, op=op, group=group)
        at = 0
        for t in same:
            t.copy_(flat[at:at + t.numel()].view_as(t))
            at += t.numel()
    return None


def has_all_reduce_coalesced() -> bool:
    return True


def configure(*args, **kwargs) -> None:
    """DeepSpeed's comms-logging configuration: strata logs no collectives of torch.distributed;
    accepted and ignored, as DeepSpeed does when comms_logger is off."""


def log_summary(show_straggler: bool = False, return_dict: bool = False):
    """DeepSpeed's comms-logging summary: nothing is logged (see configure), so it is empty."""
    return {} if return_dict else None


def get_local_world_size() -> int:
    """Ranks on this node (LOCAL_WORLD_SIZE; else the world size where initialised, else 1)."""
    if "LOCAL_WORLD_SIZE" in os.environ:
        return int(os.environ["LOCAL_WORLD_SIZE"])
    return _dist.get_world_size() if is_initialized() else 1


def has_all_gather_into_tensor() -> bool:
    return True


def has_reduce_scatter_tensor() -> bool:
    return True
