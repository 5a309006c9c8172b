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

// Memory rules shared by the engine's layout (core/zero/engine.cc) and the planner's memory
// items (core/plan/planner.cc): one formula each, so `offloadctl plan` and the engine's peak
// agree.
//
// Bytes per element of a rank's copy of `kind`: param16 in the working dtype; the gradient shard
// handed to the optimizer and the optimizer states (master32, exp_avg, exp_avg_sq) in fp32. The
// gradient is kept in fp32 wherever it lives (device, host or NVMe) because it is accumulated
// there across micro-steps: a 16-bit accumulator would round every partial sum, and one width on
// every tier is what makes the placements bit-identical. DeepSpeed does the same on its offload
// path (fp32 gradient partitions on the CPU, swapped to NVMe in fp32); only the reduction on the
// wire is in the working dtype (the planner's recipe grad_bytes).
uint64_t StateElementBytes(StateKind kind, DType working);

// Host memory the optimizer step pages NVMe-homed optimizer state through: `buffer_count`
// (offload_optimizer.buffer_count, clamped to [1, 64]) sub-groups in the step pipeline plus the
// one being accumulated, each four fp32 blocks (master32, exp_avg, exp_avg_sq, grad) of
// `sub_group_elems` elements in whole 4 KiB pages (the store's IO alignment). Not DeepSpeed's
// buffer_count x sub_group x 4 B: strata's buffers hold whole sub-groups, gradient included.
uint64_t OptimizerSwapBufferBytes(int64_t buffer_count, uint64_t sub_group_elems);

// Host memory NVMe-homed parameter shards are staged through: `buffer_count`
// (offload_param.buffer_count, clamped to [2, 64]) shards of the largest group, in whole 4 KiB
// pages. strata keeps no other parameter cache in DRAM (DeepSpeed's max_in_cpu is not used).
uint64_t ParamSwapBufferBytes(int64_t buffer_count, uint64_t largest_shard_elems, DType working);

}  // namespace strata::sched
