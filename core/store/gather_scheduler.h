// GatherScheduler: runs the ZeRO-3 gather / release flow of DESIGN.md's step walk-through on a
// TieredStore, executing the plans of the pure sched/ policy (Trace + Prefetcher).
//
// Gather(g) records g in the trace, asks the Prefetcher for a plan from this point (the group
// needed now first, then the lookahead in bytes, Belady evictions, NVMe -> host staging), issues
// it as store Fetch/Evict operations, and returns a device lease on g. Release(g) drops the lease
// and evicts g's device copy unless the Prefetcher keeps it (reuse distance, persistence).
// Correctness never depends on the trace: a diverging step just gets no prefetch until the trace
// has been re-recorded. Prefetch tickets are not waited on; a failed prefetch's error reaches
// the next Gather of that group through the store.
//
// Thread safety: one thread drives a GatherScheduler (the trainer's); the store is thread-safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <vector>

#include "sched/prefetcher.h"
#include "sched/trace.h"
#include "strata/store.h"

namespace strata::store {

class GatherScheduler {
 public:
  // `groups[g]` is the param16 block of group g. REQUIRES: `store` outlives this object.
  GatherScheduler(Store* store, std::vector<BlockId> groups, const sched::PrefetchConfig& config);

  void BeginStep();
  // A read lease on group g's device copy. InvalidArgument for an unknown group; the store's
  // errors (with the block's name) otherwise; DeadlineExceeded after `timeout`.
  Result<Lease> Gather(sched::GroupId g, std::chrono::nanoseconds timeout);
  // Releases `lease` (from Gather(g)) and evicts the device copy unless it should stay.
  void Release(sched::GroupId g, Lease lease);
  void EndStep();

  const sched::Trace& trace() const { return trace_; }
  uint64_t prefetches_issued() const { return prefetches_; }
  uint64_t evictions_issued() const { return evictions_; }

 private:
  std::vector<sched::GroupView> Views() const;

  Store* store_;
  std::vector<BlockId> groups_;
  sched::Prefetcher prefetcher_;
  sched::Trace trace_;
  uint64_t prefetches_ = 0;
  uint64_t evictions_ = 0;
};

}  // namespace strata::store
