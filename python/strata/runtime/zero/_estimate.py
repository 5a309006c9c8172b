"""DeepSpeed's model-state memory estimators (estimate_zero2/3_model_states_mem_needs_all_live
and _all_cold), answered by strata's planner: what the engine allocates for each placement
(strata.plan, the layout the engine itself resolves), in 16-bit training with fp32 master and
Adam state."""
from __future__ import annotations

from ...config import plan

_CONFIG = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}}


def model_to_params(model) -> tuple[int, int]:
    """(total parameters, the largest module's own parameters), as DeepSpeed's: a tied
    parameter once, a ZeRO-3 partitioned one by its whole size (ds_numel)."""
    def numel(p):
        return int(getattr(p, "ds_numel", p.numel()))
    total = sum({id(p): numel(p) for p in model.parameters()}.values())
    largest = max((sum(numel(p) for p in m.parameters(recurse=False)) for m in model.modules()),
                  default=0)
    return total, largest


def estimate(stage: int, placements, total_params, largest_layer_params, num_gpus_per_node,
             num_nodes, additional_buffer_factor) -> list[dict]:
    """Prints DeepSpeed's table (per CPU, per GPU, options) for each (offload_param,
    offload_optimizer) of `placements` from strata's plan: per CPU what a node's host needs
    (not the cache of NVMe-homed blocks, which takes what the budget leaves), times
    additional_buffer_factor as DeepSpeed's; returns the rows."""
    nodes_str = "nodes" if num_nodes > 1 else "node"
    gpus_str = "GPUs" if num_gpus_per_node > 1 else "GPU"
    print("Estimated memory needed for params, optim states and gradients for a:\n"
          f"HW: Setup with {num_nodes} {nodes_str}, {num_gpus_per_node} {gpus_str} per node.\n"
          f"SW: Model with {int(total_params / 1e6)}M total params, "
          f"{int(largest_layer_params / 1e6)}M largest layer params (strata's plan, bf16).")
    print("  per CPU  |  per GPU |   Options")
    rows = []
    for param, opt in placements:
        p = plan(float(total_params), _CONFIG, stage=stage, offload_optimizer=opt,
                 offload_param=param, gpus=num_gpus_per_node, nodes=num_nodes,
                 largest_group=float(max(1, largest_layer_params)))["configured"]
        row = {"offload_param": param, "offload_optimizer": opt,
               "cpu_bytes": int((p["host_bytes_per_node"] - p["host_cache_bytes_per_node"]) *
                                additional_buffer_factor),
               "gpu_bytes": int(p["hbm_bytes_per_gpu"]),
               "nvme_bytes": int(p["nvme_bytes_per_node"])}
        rows.append(row)
        options = (f"offload_param={param:4}, " if stage == 3 else "") + \
            f"offload_optimizer={opt:4}"
        print(f" {row['cpu_bytes'] / 2**30:7.2f}GB | {row['gpu_bytes'] / 2**30:6.2f}GB | "
              f"{options}" + (f" ({row['nvme_bytes'] / 2**30:.2f}GB on NVMe per node)"
                              if row["nvme_bytes"] else ""))
    return rows
