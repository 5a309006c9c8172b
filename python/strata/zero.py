"""deepspeed.zero's context managers, as far as strata has them."""
from __future__ import annotations

import contextlib
from typing import Iterable, Optional, Union


class Init:
    """deepspeed.zero.Init (partition at construction) is not supported yet: build the model
    normally and pass it to strata.initialize, which partitions it."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(
            "strata.zero.Init: partitioning at construction is not supported yet; construct the "
            "model normally and strata.initialize partitions it")


@contextlib.contextmanager
def GatheredParameters(params: Union[Iterable, "object"], modifier_rank: Optional[int] = None,
                       fwd_module=None, enabled: bool = True):
    """Makes the parameters of strata engines whole (working dtype) inside the block, read-only.

    modifier_rank (writing back changes made inside the block) is not supported yet.
    """
    if modifier_rank is not None:
        raise NotImplementedError(
            "strata.zero.GatheredParameters(modifier_rank=...): writing parameters back is not "
            "supported yet")
    if not enabled:
        yield
        return
    if hasattr(params, "data"):
        params = [params]
    engines = {}
    for p in params:
        e = getattr(p, "_strata_engine", None)
        if e is not None:
            engines[id(e)] = e
    with contextlib.ExitStack() as stack:
        for e in engines.values():
            stack.enter_context(e.gathered_parameters())
        yield
