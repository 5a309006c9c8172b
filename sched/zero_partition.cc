#include "sched/zero_partition.h"

#include <algorithm>
#include <string>

namespace strata::sched {

size_t GroupShard::OwnedBegin(int r) const {
  return std::min(numel, static_cast<size_t>(r) * shard_elems);
}

size_t GroupShard::OwnedEnd(int r) const {
  return std::min(numel, static_cast<size_t>(r + 1) * shard_elems);
}

Result<PartitionPlan> PlanPartition(std::span<const size_t> group_numels, int world_size,
                                    size_t alignment_elems) {
  if (world_size < 1) {
    return Status::InvalidArgument("partition: world_size " + std::to_string(world_size) +
                                   " must be >= 1");
  }
  if (alignment_elems == 0) return Status::InvalidArgument("partition: alignment must be >= 1");
  PartitionPlan plan;
  plan.world_size = world_size;
  plan.alignment_elems = alignment_elems;
  const size_t w = static_cast<size_t>(world_size);
  for (size_t numel : group_numels) {
    GroupShard g;
    g.numel = numel;
    const size_t per_rank = (numel + w - 1) / w;
    g.shard_elems = (per_rank + alignment_elems - 1) / alignment_elems * alignment_elems;
    g.shard_offset = plan.shard_total_elems;
    g.full_offset = plan.full_total_elems;
    plan.shard_total_elems += g.shard_elems;
    plan.full_total_elems += g.padded_elems(world_size);
    plan.groups.push_back(g);
  }
  return plan;
}

Result<std::vector<GroupBucket>> PlanBuckets(const PartitionPlan& plan, size_t first, size_t end,
                                             size_t bucket_elems) {
  if (bucket_elems == 0)
    return Status::InvalidArgument("buckets: bucket size must be >= 1 element");
  if (first > end || end > plan.groups.size()) {
    return Status::InvalidArgument("buckets: group range [" + std::to_string(first) + ", " +
                                   std::to_string(end) + ") out of bounds for " +
                                   std::to_string(plan.groups.size()) + " groups");
  }
  std::vector<GroupBucket> out;
  for (size_t g = first; g < end; ++g) {
    const size_t e = plan.groups[g].padded_elems(plan.world_size);
    if (out.empty() || out.back().full_elems + e > bucket_elems) {
      out.push_back(GroupBucket{g, g + 1, e});
    } else {
      out.back().end = g + 1;
      out.back().full_elems += e;
    }
  }
  return out;
}

}  // namespace strata::sched
