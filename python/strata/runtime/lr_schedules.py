"""deepspeed.runtime.lr_schedules: DeepSpeed's scheduler classes (WarmupLR, WarmupDecayLR,
WarmupCosineLR, OneCycle, LRRangeTest) for scripts that build one on an optimizer themselves:

    sched = WarmupLR(optimizer, warmup_min_lr=0, warmup_max_lr=1e-3, warmup_num_steps=100)
    engine, optimizer, _, sched = strata.initialize(model=model, optimizer=optimizer,
                                                    lr_scheduler=sched, config=ds_config)

With their constructors' arguments, defaults, per-group lists and state_dict, on any torch
optimizer (a client one, or the one initialize returns): each writes its lr (OneCycle also its
momentum, as betas) into the optimizer's param_groups, where the engine reads them. The values
are the engine's own rule for the config's "scheduler" section (strata._strata.LrSchedule,
core/zero/lr_schedule.h), one schedule per param group, so the same schedule given either way
trains the same bits.
"""
from __future__ import annotations

import json
from typing import Optional

import torch

from .. import _strata

WARMUP_LOG_RATE = "log"
WARMUP_LINEAR_RATE = "linear"


def get_torch_optimizer(optimizer):
    """As DeepSpeed's: a torch optimizer, or the torch optimizer a wrapper holds (.optimizer)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        return inner
    raise TypeError(f"{type(optimizer).__name__} is not an Optimizer")


class _Schedule:
    """One schedule per param group from the class's keyword arguments (a list or tuple gives
    one value per group, as DeepSpeed's _format_param); positioned by last_batch_iteration."""
    _type = ""
    _null_means_group_lr = ("warmup_max_lr",)  # DeepSpeed's WarmupLR: None is the group's lr

    def __init__(self, optimizer, last_batch_iteration: int = -1, **params):
        self.optimizer = get_torch_optimizer(optimizer)
        groups = self.optimizer.param_groups
        self._schedules = []
        for i, group in enumerate(groups):
            mine = {}
            for name, value in params.items():
                if isinstance(value, (list, tuple)):
                    if len(value) != len(groups):
                        raise ValueError(f"expected {len(groups)} values for {name}, got "
                                         f"{len(value)}")
                    value = value[i]
                if value is not None or name in self._null_means_group_lr:
                    mine[name] = value  # None as JSON null: each group's own lr
            cfg = {"optimizer": {"type": "AdamW", "params": {"lr": float(group["lr"])}},
                   "scheduler": {"type": self._type, "params": mine}}
            self._schedules.append(_strata.LrSchedule(json.dumps(cfg)))
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = None
        if last_batch_iteration == -1:  # as DeepSpeed's constructors: the lr before step 1
            self._write()

    def get_lr(self) -> list:
        return [s.lr_at(self.last_batch_iteration) for s in self._schedules]

    def get_last_lr(self) -> list:
        assert self._last_lr is not None, "need to call step() first"
        return self._last_lr

    def step(self, last_batch_iteration: Optional[int] = None) -> None:
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._write()

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, sd: dict) -> None:
        self.last_batch_iteration = sd["last_batch_iteration"]

    def _write(self) -> None:
        self._last_lr = self.get_lr()
        for group, lr, s in zip(self.optimizer.param_groups, self._last_lr, self._schedules):
            group["lr"] = lr
            betas = s.betas_at(self.last_batch_iteration)
            if betas is not None and "betas" in group:
                group["betas"] = tuple(betas)


class WarmupLR(_Schedule):
    """DeepSpeed's WarmupLR: from warmup_min_lr to warmup_max_lr (default: each group's lr)
    over warmup_num_steps, "log" or "linear", then constant."""
    _type = "WarmupLR"

    def __init__(self, optimizer, warmup_min_lr=0.0, warmup_max_lr=None,
                 warmup_num_steps: int = 1000, warmup_type: str = WARMUP_LOG_RATE,
                 last_batch_iteration: int = -1):
        super().__init__(optimizer, last_batch_iteration, warmup_min_lr=warmup_min_lr,
                         warmup_max_lr=warmup_max_lr, warmup_num_steps=warmup_num_steps,
                         warmup_type=warmup_type)


class WarmupDecayLR(_Schedule):
    """DeepSpeed's WarmupDecayLR: WarmupLR's warmup (warmup_max_lr 0.001 by default), then a
    linear decay to 0 at total_num_steps."""
    _type = "WarmupDecayLR"

    def __init__(self, optimizer, total_num_steps: int, warmup_min_lr=0.0, warmup_max_lr=0.001,
                 warmup_num_steps: int = 1000, warmup_type: str = WARMUP_LOG_RATE,
                 last_batch_iteration: int = -1):
        super().__init__(optimizer, last_batch_iteration, total_num_steps=total_num_steps,
                         warmup_min_lr=warmup_min_lr, warmup_max_lr=warmup_max_lr,
                         warmup_num_steps=warmup_num_steps, warmup_type=warmup_type)


class WarmupCosineLR(_Schedule):
    """DeepSpeed's WarmupCosineLR: each group's lr times a ratio warmed up from
    warmup_min_ratio, then a cosine down to cos_min_ratio at total_num_steps."""
    _type = "WarmupCosineLR"

    def __init__(self, optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001,
                 warmup_type: str = WARMUP_LOG_RATE, last_batch_iteration: int = -1):
        super().__init__(optimizer, last_batch_iteration, total_num_steps=total_num_steps,
                         warmup_min_ratio=warmup_min_ratio, warmup_num_steps=warmup_num_steps,
                         cos_min_ratio=cos_min_ratio, warmup_type=warmup_type)


class OneCycle(_Schedule):
    """DeepSpeed's OneCycle: the lr (and, with cycle_momentum, betas[0]) cycled between the
    bounds over the two step sizes, then decayed."""
    _type = "OneCycle"

    def __init__(self, optimizer, cycle_min_lr, cycle_max_lr, decay_lr_rate=0.0,
                 cycle_first_step_size=2000, cycle_second_step_size=None,
                 cycle_first_stair_count=0, cycle_second_stair_count=None, decay_step_size=0,
                 cycle_momentum=True, cycle_min_mom=0.8, cycle_max_mom=0.9, decay_mom_rate=0.0,
                 last_batch_iteration=-1):
        super().__init__(optimizer, last_batch_iteration, cycle_min_lr=cycle_min_lr,
                         cycle_max_lr=cycle_max_lr, decay_lr_rate=decay_lr_rate,
                         cycle_first_step_size=cycle_first_step_size,
                         cycle_second_step_size=cycle_second_step_size,
                         cycle_first_stair_count=cycle_first_stair_count,
                         cycle_second_stair_count=cycle_second_stair_count,
                         decay_step_size=decay_step_size, cycle_momentum=cycle_momentum,
                         cycle_min_mom=cycle_min_mom, cycle_max_mom=cycle_max_mom,
                         decay_mom_rate=decay_mom_rate)

    def get_mom(self) -> list:
        """Each group's (beta1, beta2) at the current position (None where not cycled)."""
        return [s.betas_at(self.last_batch_iteration) for s in self._schedules]


class LRRangeTest(_Schedule):
    """DeepSpeed's LRRangeTest: lr_range_test_min_lr grown by step_rate every step_size steps
    (continuously, or in stairs)."""
    _type = "LRRangeTest"

    def __init__(self, optimizer, lr_range_test_min_lr=1e-3, lr_range_test_step_size=2000,
                 lr_range_test_step_rate=1.0, lr_range_test_staircase=False,
                 last_batch_iteration=-1):
        super().__init__(optimizer, last_batch_iteration,
                         lr_range_test_min_lr=lr_range_test_min_lr,
                         lr_range_test_step_size=lr_range_test_step_size,
                         lr_range_test_step_rate=lr_range_test_step_rate,
                         lr_range_test_staircase=lr_range_test_staircase)


VALID_LR_SCHEDULES = ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]

__all__ = ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest",
           "VALID_LR_SCHEDULES", "WARMUP_LOG_RATE", "WARMUP_LINEAR_RATE", "get_torch_optimizer"]
