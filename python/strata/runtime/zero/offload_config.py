"""deepspeed.runtime.zero.offload_config's enums that scripts pass to engine.offload_states."""
from enum import Enum


class OffloadDeviceEnum(str, Enum):
    """Where offloaded state goes (DeepSpeed's values)."""
    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, Enum):
    """The states engine.offload_states moves (DeepSpeed's names): lp_params the working
    (16-bit) params, hp_params the fp32 master, optim_states Adam's m and v, lp_grads the
    gradients; contiguous_grad_buffer the gradient buffers, which strata drops in any case."""
    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


__all__ = ["OffloadDeviceEnum", "OffloadStateTypeEnum"]
