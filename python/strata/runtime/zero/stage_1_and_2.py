"""deepspeed.runtime.zero.stage_1_and_2's memory estimators, from strata's planner
(_estimate)."""
from __future__ import annotations

from ._estimate import estimate, model_to_params

_PLACEMENTS = (("none", "cpu"), ("none", "none"))


def estimate_zero2_model_states_mem_needs_all_cold(total_params, num_gpus_per_node=1,
                                                   num_nodes=1, additional_buffer_factor=1.5):
    """As DeepSpeed's: prints per-CPU and per-GPU memory for ZeRO-2 with the optimizer offloaded
    to cpu or not: what strata's engine allocates."""
    return estimate(2, _PLACEMENTS, total_params, 0, num_gpus_per_node, num_nodes,
                    additional_buffer_factor)


def estimate_zero2_model_states_mem_needs_all_live(model, num_gpus_per_node=1, num_nodes=1,
                                                   additional_buffer_factor=1.5):
    """As DeepSpeed's: estimate_zero2_model_states_mem_needs_all_cold for `model`'s size."""
    total, _ = model_to_params(model)
    return estimate_zero2_model_states_mem_needs_all_cold(total, num_gpus_per_node, num_nodes,
                                                          additional_buffer_factor)
