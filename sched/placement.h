// Placement rules: where each model state of a rank lives (its home tier) and which states are
// partitioned, from the ZeRO stage and the config's offload devices, with DeepSpeed's rules for
// the combinations it does not run as written. One pure function, shared by the memory planner
// (core/plan) and the engine (core/zero), so the plan `offloadctl plan` prints is the placement
// the engine builds.
//
// Rules (DeepSpeed stage_1_and_2.py / stage3.py behaviour), applied in this order:
//   - offload_optimizer at stage 0 is ignored (there is no optimizer partition to offload).
//   - offload_optimizer to nvme below stage 3 becomes cpu (DeepSpeed swaps optimizer state to
//     NVMe only in stage 3).
//   - offload_param below stage 3 is ignored (only stage 3 partitions parameters).
// Each rule that changes the request adds a note in words. Homes that follow:
//   - param16: the param offload device at stage 3 (cpu -> host, nvme -> nvme), else device.
//   - grad (the reduced gradient shard handed to the optimizer), master32, exp_avg, exp_avg_sq:
//     the optimizer offload device (cpu -> host, nvme -> nvme), else device. Gradient shards live
//     with the optimizer that consumes them.
//   - partitioned: optimizer state from stage 1, gradients from stage 2, parameters at stage 3;
//     a state that is not partitioned is a full replica on every rank.
//
// Thread safety: pure functions.
#pragma once

#include <string>
#include <vector>

#include "strata/config.h"
#include "strata/store.h"

namespace strata::sched {

struct StatePlacement {
  int stage = 0;
  // The offload devices after the rules (what actually runs).
  OffloadDevice offload_optimizer = OffloadDevice::kNone;
  OffloadDevice offload_param = OffloadDevice::kNone;
  bool params_partitioned = false;
  bool grads_partitioned = false;
  bool optimizer_partitioned = false;
  // One sentence per rule that changed the request.
  std::vector<std::string> notes;

  // The home tier of a rank's copy of `kind`.
  Tier Home(StateKind kind) const;
};

// The tier an offload device puts a state on (none -> device, cpu -> host, nvme -> nvme).
Tier OffloadTier(OffloadDevice d);

// REQUIRES: 0 <= stage <= 3 (the config reader and the planner validate it first).
StatePlacement ResolvePlacement(int stage, OffloadDevice optimizer, OffloadDevice param);

}  // namespace strata::sched
