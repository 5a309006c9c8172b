// The layout of a rank's model states: how a model's groups are cut into per-rank shards and
// optimizer sub-groups, and the bytes each state takes on its home tier. One rule for the engine
// (core/zero/engine.cc registers exactly these blocks and budgets these bytes) and the memory
// planner (core/plan/planner.cc), which lays out a model known by its size and its largest group.
//
//   shard     = ceil(numel / world), rounded up to the shard alignment (PlanPartition's rule)
//   param16   = the shard at stage 3, else the full padded group (shard x world): one block
//   sub-group = SubGroupElems elements of a shard (the last one shorter); never spans two groups.
//               A rank steps the sub-groups of its own shard when the optimizer is partitioned
//               (stage >= 1), else those of every rank's shard (stage 0: a full replica).
//   per sub-group: master32, exp_avg, exp_avg_sq and the gradient shard, one block each.
//   partial offload (placement.optimizer_ratio < 1): the first sub-groups in forward order that
//               DeviceResidentSubGroups keeps on the device have those four blocks there
//               (sched/placement.h); the count is the same rule, walked over the runs.
// Blocks homed on the host or NVMe take whole `block_align_bytes` units (the store carves 4 KiB
// IO-aligned units there); device blocks are exact. The planner passes alignments of 1 and its
// recipe's widths, the engine kShardAlignElems, kIoAlignment and StateElementBytes.
//
// Thread safety: pure functions.
#pragma once

#include <cstdint>
#include <vector>

#include "sched/placement.h"

namespace strata::sched {

// A rank's shard of a group of `numel` elements. REQUIRES: world >= 1, align >= 1.
uint64_t ShardElems(uint64_t numel, int world, uint64_t align);

// Elements per optimizer sub-group from DeepSpeed's zero_optimization.sub_group_size; 0 means one
// sub-group per parameter tensor, sized by the largest tensor (`largest_tensor_elems`; the
// planner, which does not know tensors, passes its largest group). Rounded down to `align`, at
// least `align`. REQUIRES: align >= 1.
uint64_t SubGroupElems(uint64_t sub_group_size, uint64_t largest_tensor_elems, uint64_t align);

// Sub-groups a shard of `shard_elems` is cut into. REQUIRES: sub_group_elems >= 1.
uint64_t SubGroupsOf(uint64_t shard_elems, uint64_t sub_group_elems);

// `count` groups of `numel` elements each (a model given group by group has counts of 1).
struct GroupRun {
  uint64_t numel = 0;
  uint64_t count = 1;
  bool trainable = true;  // false: frozen, its params only (no sub-groups, gradient or states)
};

// Bytes per element of each state.
struct StateWidths {
  double param = 2;
  double grad = 4;
  double master = 4;
  double exp_avg = 4;
  double exp_avg_sq = 4;
};

struct StateLayoutInput {
  int world = 1;
  std::vector<GroupRun> groups;
  uint64_t sub_group_elems = 1;  // SubGroupElems
  uint64_t shard_align_elems = 1;
  uint64_t block_align_bytes = 1;  // host- and NVMe-homed blocks
  StateWidths widths;
};

// A rank's states. Byte counts are exact integers below 2^53.
struct StateLayout {
  double param_bytes = 0;      // on placement.Home(kParam16)
  double grad_bytes = 0;       // the gradient shards the optimizer consumes, on Home(kGrad)
  double optimizer_bytes = 0;  // master32 + exp_avg + exp_avg_sq, on Home(kMaster32)
  // Partial offload: the part of grad_bytes and optimizer_bytes that stays on the device (the
  // device-resident sub-groups'); 0 at ratio 1.
  double device_grad_bytes = 0, device_optimizer_bytes = 0;
  PerTier<double> tier_bytes{};  // the three above, by their homes
  uint64_t sub_groups = 0;       // sub-groups this rank steps
  uint64_t sub_group_elems = 0;  // their elements
  // The device-resident ones (DeviceResidentSubGroups) and their elements.
  uint64_t device_sub_groups = 0, device_sub_group_elems = 0;
  uint64_t largest_numel = 0;    // the largest group, unpadded
  uint64_t largest_padded = 0;   // its shard x world
  uint64_t largest_shard = 0;    // the largest shard
  uint64_t largest_sub = 0;      // the largest sub-group
  uint64_t largest_trainable_padded = 0;  // the largest trainable group's shard x world
  uint64_t largest_trainable_shard = 0;   // and its shard (0, 0: every group frozen)
  uint64_t total_padded = 0;     // every group, padded
};

// REQUIRES: in.world >= 1, in.sub_group_elems, in.shard_align_elems, in.block_align_bytes >= 1.
StateLayout LayOutStates(const StatePlacement& placement, const StateLayoutInput& in);

}  // namespace strata::sched
