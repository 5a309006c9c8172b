#include "core/store/gather_scheduler.h"

#include <mutex>
#include <string>

namespace strata::store {

struct GatherScheduler::Failures {
  std::mutex mu;
  uint64_t count = 0;
  Status last;
  std::vector<Status> prefetch;  // per group: a failed prefetch's error not yet returned

  explicit Failures(size_t groups) : prefetch(groups) {}
};

GatherScheduler::GatherScheduler(Store* store, std::vector<BlockId> groups,
                                 const sched::PrefetchConfig& config,
                                 const std::vector<bool>& persistent)
    : store_(store),
      groups_(std::move(groups)),
      prefetcher_(config),
      gathered_(groups_.size(), 0),
      blocks_(groups_.size()),
      views_(groups_.size()),
      failures_(std::make_shared<Failures>(groups_.size())) {
  store_->Snapshot(groups_, blocks_);
  for (const BlockView& b : blocks_) all_home_device_ = all_home_device_ && b.home == Tier::kDevice;
  for (size_t g = 0; g < views_.size() && g < persistent.size(); ++g) {
    views_[g].persistent = persistent[g];
  }
}

GatherScheduler::~GatherScheduler() = default;

void GatherScheduler::BeginStep() { trace_.BeginStep(); }

void GatherScheduler::EndStep() { trace_.EndStep(); }

uint64_t GatherScheduler::failed_ops() const {
  std::lock_guard<std::mutex> l(failures_->mu);
  return failures_->count;
}

Status GatherScheduler::last_error() const {
  std::lock_guard<std::mutex> l(failures_->mu);
  return failures_->last;
}

void GatherScheduler::Refresh() {
  store_->Snapshot(groups_, blocks_);
  for (size_t i = 0; i < groups_.size(); ++i) {
    const BlockView& b = blocks_[i];
    sched::GroupView& v = views_[i];
    v.size_bytes = b.size_bytes;
    v.device = b.residency[Tier::kDevice];
    v.host = b.residency[Tier::kHost];
    v.home = b.home;
    v.in_use = gathered_[i] > 0 || b.leases[Tier::kDevice] > 0;
    v.held = held_ && held_(static_cast<sched::GroupId>(i));
  }
}

void GatherScheduler::Track(const Ticket& ticket, sched::GroupId g, bool prefetch) {
  // Runs on a store thread with the store's lock held: record, nothing more.
  ticket.Then([f = failures_, g, prefetch](Status s) {
    if (s.ok()) return;
    std::lock_guard<std::mutex> l(f->mu);
    ++f->count;
    f->last = s;
    if (prefetch) f->prefetch[g] = std::move(s);
  });
}

Result<Lease> GatherScheduler::Gather(sched::GroupId g, std::chrono::nanoseconds timeout) {
  if (g >= groups_.size()) {
    return Status::InvalidArgument("GatherScheduler::Gather: no group " + std::to_string(g));
  }
  if (!trace_.in_step()) trace_.BeginStep();
  if (all_home_device_) {
    // Every group lives on the device: nothing to prefetch, stage or evict, so no snapshot and
    // no plan (both cost in the number of groups, at every Gather).
    trace_.Record(g);
    auto lease = store_->Acquire(groups_[g], Tier::kDevice, Access::kRead, timeout);
    if (lease.ok()) ++gathered_[g];
    return lease;
  }
  Refresh();
  {
    std::lock_guard<std::mutex> l(failures_->mu);
    Status failed = std::move(failures_->prefetch[g]);
    failures_->prefetch[g] = Status::OK();
    if (!failed.ok() && !IsResident(views_[g].device)) return failed;
  }
  // Plan from this access on (before recording it): the group needed now comes first, so its
  // fetch is queued ahead of the lookahead's. A diverging access yields an empty plan.
  const bool matches = trace_.replaying() && trace_.position() < trace_.recorded().size() &&
                       trace_.recorded()[trace_.position()] == g;
  if (matches) {
    for (const sched::PrefetchAction& a : prefetcher_.Plan(trace_, views_)) {
      const BlockId b = groups_[a.group];
      switch (a.kind) {
        case sched::PrefetchAction::Kind::kEvictFromDevice:
          if (views_[a.group].home != Tier::kDevice) {
            Track(store_->Evict(b, Tier::kDevice), a.group, /*prefetch=*/false);
            ++evictions_;
          }
          break;
        case sched::PrefetchAction::Kind::kFetchToDevice:
          Track(store_->Fetch(b, Tier::kDevice), a.group, /*prefetch=*/true);
          ++prefetches_;
          break;
        case sched::PrefetchAction::Kind::kStageToHost:
          Track(store_->Fetch(b, Tier::kHost), a.group, /*prefetch=*/true);
          ++prefetches_;
          break;
      }
    }
  }
  trace_.Record(g);
  auto lease = store_->Acquire(groups_[g], Tier::kDevice, Access::kRead, timeout);
  if (lease.ok()) ++gathered_[g];
  // Resident now, or this Acquire returned the failed fetch's error (it joined that fetch, or
  // its own failed for the same reason): either way nothing is left to report.
  std::lock_guard<std::mutex> l(failures_->mu);
  failures_->prefetch[g] = Status::OK();
  return lease;
}

void GatherScheduler::Release(sched::GroupId g, Lease lease) {
  lease.Release();
  if (g >= groups_.size()) return;
  if (gathered_[g] > 0) --gathered_[g];
  if (all_home_device_) return;  // never evicted
  Refresh();
  if (views_[g].home == Tier::kDevice || views_[g].in_use) return;
  if (!prefetcher_.KeepAfterRelease(g, trace_, views_)) {
    Track(store_->Evict(groups_[g], Tier::kDevice), g, /*prefetch=*/false);
    ++evictions_;
    return;
  }
  // Kept: stage3_max_live_parameters still holds, the copies needed last going first.
  for (sched::GroupId v : prefetcher_.OverMaxLive(trace_, views_)) {
    Track(store_->Evict(groups_[v], Tier::kDevice), v, /*prefetch=*/false);
    ++evictions_;
  }
}

}  // namespace strata::store
