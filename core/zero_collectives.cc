#include "core/zero_collectives.h"

#include <string>

namespace strata {

Status ZeroCollectives::Check() const {
  if (plan_->world_size != comm_->world_size()) {
    return Status::InvalidArgument("zero collectives: plan is for world size " +
                                   std::to_string(plan_->world_size) + ", communicator has " +
                                   std::to_string(comm_->world_size()));
  }
  return Status::OK();
}

Result<std::vector<CommHandle>> ZeroCollectives::AllGatherGroups(const void* shard_buf,
                                                                 void* full_buf, size_t first,
                                                                 size_t end, size_t bucket_elems) {
  STRATA_RETURN_IF_ERROR(Check());
  STRATA_ASSIGN_OR_RETURN(auto buckets, PlanBuckets(*plan_, first, end, bucket_elems));
  const size_t elt = DTypeSize(dtype_);
  std::vector<CommHandle> handles;
  std::vector<AllGatherPart> parts;
  for (const GroupBucket& b : buckets) {
    parts.clear();
    for (size_t g = b.first; g < b.end; ++g) {
      const GroupShard& s = plan_->groups[g];
      parts.push_back(AllGatherPart{static_cast<const char*>(shard_buf) + s.shard_offset * elt,
                                    static_cast<char*>(full_buf) + s.full_offset * elt,
                                    s.shard_elems});
    }
    STRATA_ASSIGN_OR_RETURN(CommHandle h, comm_->AllGatherCoalesced(parts, dtype_));
    handles.push_back(std::move(h));
  }
  return handles;
}

Result<std::vector<CommHandle>> ZeroCollectives::ReduceScatterGroups(const void* full_grads,
                                                                     void* shard_grads,
                                                                     size_t first, size_t end,
                                                                     size_t bucket_elems,
                                                                     ReduceOptions options) {
  STRATA_RETURN_IF_ERROR(Check());
  STRATA_ASSIGN_OR_RETURN(auto buckets, PlanBuckets(*plan_, first, end, bucket_elems));
  const size_t elt = DTypeSize(dtype_);
  std::vector<CommHandle> handles;
  std::vector<ReduceScatterPart> parts;
  for (const GroupBucket& b : buckets) {
    parts.clear();
    for (size_t g = b.first; g < b.end; ++g) {
      const GroupShard& s = plan_->groups[g];
      parts.push_back(ReduceScatterPart{static_cast<const char*>(full_grads) + s.full_offset * elt,
                                        static_cast<char*>(shard_grads) + s.shard_offset * elt,
                                        s.shard_elems});
    }
    STRATA_ASSIGN_OR_RETURN(CommHandle h, comm_->ReduceScatterCoalesced(parts, dtype_, options));
    handles.push_back(std::move(h));
  }
  return handles;
}

Status WaitAll(const std::vector<CommHandle>& handles,
               std::chrono::steady_clock::time_point deadline) {
  Status first;
  for (const CommHandle& h : handles) {
    Status st = h.WaitUntil(deadline);
    if (!st.ok() && first.ok()) first = std::move(st);
  }
  return first;
}

}  // namespace strata
