#include "core/store/gather_scheduler.h"

#include <string>

namespace strata::store {
GatherScheduler::GatherScheduler(Store* store, std::vector<BlockId> groups,
                                 const sched::PrefetchConfig& config)
    : store_(store), groups_(std::move(groups)), prefetcher_(config) {}

void GatherScheduler::BeginStep() { trace_.BeginStep(); }

void GatherScheduler::EndStep() { trace_.EndStep(); }

std::vector<sched::GroupView> GatherScheduler::Views() const {
  std::vector<sched::GroupView> v(groups_.size());
  for (size_t i = 0; i < groups_.size(); ++i) {
    const BlockSpec& s = store_->spec(groups_[i]);
    v[i].size_bytes = s.size_bytes;
    v[i].device = store_->residency(groups_[i], Tier::kDevice);
    v[i].host = store_->residency(groups_[i], Tier::kHost);
    v[i].home = s.home;
  }
  return v;
}

Result<Lease> GatherScheduler::Gather(sched::GroupId g, std::chrono::nanoseconds timeout) {
  if (g >= groups_.size()) {
    return Status::InvalidArgument("GatherScheduler::Gather: no group " + std::to_string(g));
  }
  if (!trace_.in_step()) trace_.BeginStep();
  // Plan from this access on (before recording it): the group needed now comes first, so its
  // fetch is queued ahead of the lookahead's. A diverging access yields an empty plan.
  const bool matches = trace_.replaying() && trace_.position() < trace_.recorded().size() &&
                       trace_.recorded()[trace_.position()] == g;
  if (matches) {
    for (const sched::PrefetchAction& a : prefetcher_.Plan(trace_, Views())) {
      const BlockId b = groups_[a.group];
      switch (a.kind) {
        case sched::PrefetchAction::Kind::kEvictFromDevice:
          if (store_->spec(b).home != Tier::kDevice) {
            (void)store_->Evict(b, Tier::kDevice);
            ++evictions_;
          }
          break;
        case sched::PrefetchAction::Kind::kFetchToDevice:
          (void)store_->Fetch(b, Tier::kDevice);
          ++prefetches_;
          break;
        case sched::PrefetchAction::Kind::kStageToHost:
          (void)store_->Fetch(b, Tier::kHost);
          ++prefetches_;
          break;
      }
    }
  }
  trace_.Record(g);
  return store_->Acquire(groups_[g], Tier::kDevice, Access::kRead, timeout);
}

void GatherScheduler::Release(sched::GroupId g, Lease lease) {
  lease.Release();
  if (g >= groups_.size() || store_->spec(groups_[g]).home == Tier::kDevice) return;
  if (!prefetcher_.KeepAfterRelease(g, trace_, Views())) {
    (void)store_->Evict(groups_[g], Tier::kDevice);
    ++evictions_;
  }
}

}  // namespace strata::store
