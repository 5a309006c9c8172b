// GatherScheduler: runs the ZeRO-3 gather / release flow of docs/design.md's step walk-through on a
// Store, executing the plans of the pure sched/ policy (Trace + Prefetcher).
//
// Gather(g) records g in the trace, asks the Prefetcher for a plan from this point (the group
// needed now first, then the lookahead in bytes, Belady evictions, NVMe -> host staging), issues
// it as store Fetch/Evict operations, and returns a device lease on g. Release(g) drops the lease
// and evicts g's device copy unless the Prefetcher keeps it (reuse distance, persistence) or the
// copy is still in use. Correctness never depends on the trace: a diverging step just gets no
// prefetch until the trace has been re-recorded.
//
// The policy sees one consistent snapshot of every group (one Store::Snapshot per Gather and per
// Release; none where every group's home is the device, which leaves nothing to plan), with
// `in_use` set for groups this scheduler has handed out and not yet released and for device copies
// anyone else leases, so it never plans to evict a copy in use. Every ticket it issues is checked
// when it completes (Ticket::Then, without waiting): failures are counted (failed_ops, last_error),
// and a failed prefetch's error is returned by the next Gather of that group unless the group
// became resident on the device since.
//
// Thread safety: one thread drives a GatherScheduler (the trainer's); the store is thread-safe.
// failed_ops() and last_error() may be read from any thread. Ticket callbacks may outlive the
// scheduler (they hold only its shared failure record).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "sched/prefetcher.h"
#include "sched/trace.h"
#include "strata/store.h"

namespace strata::store {

class GatherScheduler {
 public:
  // `groups[g]` is the param16 block of group g; `persistent[g]` says it stays on the device for
  // the whole run (sched::PersistentGroups; empty: none). REQUIRES: `store` outlives this object
  // and every block in `groups` is registered.
  GatherScheduler(Store* store, std::vector<BlockId> groups, const sched::PrefetchConfig& config,
                  const std::vector<bool>& persistent = {});
  ~GatherScheduler();

  void BeginStep();
  // A read lease on group g's device copy; g counts as in use until Release(g). InvalidArgument
  // for an unknown group; the error of a failed prefetch of g (see above); the store's errors
  // (with the block's name) otherwise; DeadlineExceeded after `timeout`.
  Result<Lease> Gather(sched::GroupId g, std::chrono::nanoseconds timeout);
  // Releases `lease` (from Gather(g)) and evicts the device copy unless it should stay or is
  // still in use.
  void Release(sched::GroupId g, Lease lease);
  void EndStep();
  // Groups for which `held(g)` is true are neither prefetched nor staged (sched::GroupView::held:
  // their params are being rewritten). Asked at every Gather and Release, on the driving thread;
  // `held` must be safe to call there while others change what it reports. Empty: none held.
  void set_held(std::function<bool(sched::GroupId)> held) { held_ = std::move(held); }

  const sched::Trace& trace() const { return trace_; }
  uint64_t prefetches_issued() const { return prefetches_; }
  uint64_t evictions_issued() const { return evictions_; }
  // Operations this scheduler issued on its own (prefetches, evictions) that failed, and the
  // last such error (OK when none). A fetch that two plans joined counts twice.
  uint64_t failed_ops() const;
  Status last_error() const;

 private:
  struct Failures;  // shared with the ticket callbacks

  // Refreshes views_ from one Store::Snapshot of every group.
  void Refresh();
  // Checks `ticket` when it completes; `prefetch` errors are kept for the next Gather(g).
  void Track(const Ticket& ticket, sched::GroupId g, bool prefetch);

  Store* store_;
  std::vector<BlockId> groups_;
  sched::Prefetcher prefetcher_;
  sched::Trace trace_;
  std::vector<uint32_t> gathered_;  // per group: leases handed out by Gather, not yet released
  std::vector<BlockView> blocks_;   // the last snapshot, per group
  std::vector<sched::GroupView> views_;
  std::shared_ptr<Failures> failures_;
  std::function<bool(sched::GroupId)> held_;
  bool all_home_device_ = true;  // every group's home is the device: Gather plans nothing
  uint64_t prefetches_ = 0;
  uint64_t evictions_ = 0;
};

}  // namespace strata::store
