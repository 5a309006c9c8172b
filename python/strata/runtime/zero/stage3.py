"""deepspeed.runtime.zero.stage3's memory estimators, from strata's planner (_estimate)."""
from __future__ import annotations

from ._estimate import estimate, model_to_params

_PLACEMENTS = (("cpu", "cpu"), ("none", "cpu"), ("none", "none"), ("nvme", "nvme"))


def estimate_zero3_model_states_mem_needs_all_cold(total_params, largest_layer_params,
                                                   num_gpus_per_node=1, num_nodes=1,
                                                   additional_buffer_factor=1.5):
    """As DeepSpeed's: prints per-CPU and per-GPU memory for ZeRO-3 with parameters and optimizer
    offloaded to cpu (and, strata's, both to NVMe) or not: what strata's engine allocates."""
    return estimate(3, _PLACEMENTS, total_params, largest_layer_params, num_gpus_per_node,
                    num_nodes, additional_buffer_factor)


def estimate_zero3_model_states_mem_needs_all_live(model, num_gpus_per_node=1, num_nodes=1,
                                                   additional_buffer_factor=1.5):
    """As DeepSpeed's: estimate_zero3_model_states_mem_needs_all_cold for `model`'s sizes."""
    total, largest = model_to_params(model)
    return estimate_zero3_model_states_mem_needs_all_cold(total, largest, num_gpus_per_node,
                                                          num_nodes, additional_buffer_factor)
