#include "core/zero/zero_collectives.h"

#include <string>

#include "kernels/quantize.h"

namespace strata::zero {

// A bucket could not be submitted after earlier ones were: those still use the caller's buffers,
// so they must finish before the error returns. The ranks' collective sequences now differ (this
// rank skips buckets its peers run), so the communicator is aborted first, which makes queued
// buckets fail fast and bounds a running one by the backend's transport timeout.
Status ZeroCollectives::FailAfterSubmitted(const std::vector<CommHandle>& submitted,
                                           const char* kind, size_t bucket, size_t buckets,
                                           const Status& error) {
  const Status st = error.WithContext("zero collectives: " + std::string(kind) + " bucket " +
                                      std::to_string(bucket) + " of " + std::to_string(buckets) +
                                      " could not be submitted");
  if (submitted.empty()) return st;
  comm_->Abort(st.ToString());
  for (const CommHandle& h : submitted) {
    (void)h.WaitUntil(std::chrono::steady_clock::time_point::max());
  }
  return st;
}

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
  STRATA_ASSIGN_OR_RETURN(auto buckets, sched::PlanBuckets(*plan_, first, end, bucket_elems));
  const size_t elt = DTypeSize(dtype_);
  std::vector<CommHandle> handles;
  std::vector<AllGatherPart> parts;
  for (const sched::GroupBucket& b : buckets) {
    parts.clear();
    for (size_t g = b.first; g < b.end; ++g) {
      const sched::GroupShard& s = plan_->groups[g];
      parts.push_back(AllGatherPart{static_cast<const char*>(shard_buf) + s.shard_offset * elt,
                                    static_cast<char*>(full_buf) + s.full_offset * elt,
                                    s.shard_elems});
    }
    Result<CommHandle> h = comm_->AllGatherCoalesced(parts, dtype_);
    if (!h.ok()) {
      return FailAfterSubmitted(handles, "all-gather", handles.size(), buckets.size(), h.status());
    }
    handles.push_back(std::move(*h));
  }
  return handles;
}

Result<std::vector<CommHandle>> ZeroCollectives::ReduceScatterGroups(const void* full_grads,
                                                                     void* shard_grads,
                                                                     size_t first, size_t end,
                                                                     size_t bucket_elems,
                                                                     ReduceOptions options) {
  STRATA_RETURN_IF_ERROR(Check());
  STRATA_ASSIGN_OR_RETURN(auto buckets, sched::PlanBuckets(*plan_, first, end, bucket_elems));
  const size_t elt = DTypeSize(dtype_);
  std::vector<CommHandle> handles;
  std::vector<ReduceScatterPart> parts;
  for (const sched::GroupBucket& b : buckets) {
    parts.clear();
    for (size_t g = b.first; g < b.end; ++g) {
      const sched::GroupShard& s = plan_->groups[g];
      parts.push_back(ReduceScatterPart{static_cast<const char*>(full_grads) + s.full_offset * elt,
                                        static_cast<char*>(shard_grads) + s.shard_offset * elt,
                                        s.shard_elems});
    }
    Result<CommHandle> h = comm_->ReduceScatterCoalesced(parts, dtype_, options);
    if (!h.ok()) {
      return FailAfterSubmitted(handles, "reduce-scatter", handles.size(), buckets.size(),
                                h.status());
    }
    handles.push_back(std::move(*h));
  }
  return handles;
}

ZppWorkingBytes ZppWorking(bool qwz, bool qgz, int world, int nodes, uint64_t shard_elems,
                           uint64_t padded_elems, size_t elt, bool host_addressable) {
  ZppWorkingBytes w;
  const uint64_t chunk = kernels::Int8WireLayout(shard_elems, kernels::kQuantBlock).total_bytes;
  const auto n = static_cast<uint64_t>(world), m = static_cast<uint64_t>(nodes);
  if (qwz) w.device += (n + 1) * chunk;
  if (qgz) {
    w.device += 2 * n * chunk + 2 * m * chunk;
    w.host += (m + 1) * shard_elems * 4;
  }
  if (!host_addressable && (qwz || qgz)) w.host += w.device + padded_elems * elt;
  return w;
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

}  // namespace strata::zero
