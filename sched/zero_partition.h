// ZeRO partitioning: how each group's flat buffer is split into world_size padded shards, and how
// consecutive groups are bucketed for the coalesced all-gather / reduce-scatter. Pure arithmetic
// over sizes (no buffers), executed by core/zero/zero_collectives.h.
//
// Layouts (elements, one dtype):
//  - full buffer: groups back to back, group g occupying padded_elems = world * shard_elems at
//    full_offset; its numel real elements come first, the padding (< world * alignment) after.
//    Rank r's shard of g is [full_offset + r * shard_elems, + shard_elems).
//  - shard buffer (per rank): the rank's shards of all groups back to back, group g at
//    shard_offset. This is the layout of the local param16/grad partitions.
// Because each group's shards are contiguous in both layouts, one all-gather per group writes the
// full buffer in place, with no interleaving copy (DeepSpeed's torch.cat).
//
// Thread safety: values; pure functions.
#pragma once

#include <cstddef>
#include <span>
#include <vector>

#include "strata/status.h"

namespace strata::sched {

struct GroupShard {
  size_t numel = 0;         // real elements of the group
  size_t shard_elems = 0;   // per-rank shard, a multiple of the alignment (0 only if numel is 0)
  size_t shard_offset = 0;  // in the per-rank shard buffer
  size_t full_offset = 0;   // in the full buffer
  size_t padded_elems(int world) const { return shard_elems * static_cast<size_t>(world); }
  // The real elements of this group that rank r owns: [begin, end) in group-local indices.
  size_t OwnedBegin(int r) const;
  size_t OwnedEnd(int r) const;
};

struct PartitionPlan {
  int world_size = 1;
  size_t alignment_elems = 1;
  std::vector<GroupShard> groups;
  size_t shard_total_elems = 0;  // per-rank shard buffer size
  size_t full_total_elems = 0;   // full buffer size = world * shard_total
};

// REQUIRES nothing; kInvalidArgument when world_size < 1 or alignment_elems is 0.
Result<PartitionPlan> PlanPartition(std::span<const size_t> group_numels, int world_size,
                                    size_t alignment_elems);

// Groups [first, end) of one coalesced collective.
struct GroupBucket {
  size_t first = 0;
  size_t end = 0;
  size_t full_elems = 0;  // padded full elements the bucket gathers or reduces
};

// Consecutive groups of [first, end) packed greedily so each bucket's full (padded) element count
// stays <= bucket_elems (DeepSpeed's allgather_bucket_size / reduce_bucket_size, in elements). A
// group larger than bucket_elems gets a bucket of its own: its shards cannot be split without a
// strided copy. kInvalidArgument when bucket_elems is 0 or the range is out of bounds.
Result<std::vector<GroupBucket>> PlanBuckets(const PartitionPlan& plan, size_t first, size_t end,
                                             size_t bucket_elems);

}  // namespace strata::sched
