#include "sched/prefetcher.h"

#include <algorithm>
#include <functional>
#include <unordered_set>

namespace strata::sched {

PrefetchConfig PrefetchConfig::FromNumel(uint64_t prefetch_bucket_numel, uint64_t max_live_numel,
                                         uint64_t max_reuse_distance_numel,
                                         uint64_t bytes_per_param) {
  PrefetchConfig c;
  c.prefetch_bucket_bytes = prefetch_bucket_numel * bytes_per_param;
  c.max_live_bytes = max_live_numel * bytes_per_param;
  c.max_reuse_distance_bytes = max_reuse_distance_numel * bytes_per_param;
  c.host_lookahead_bytes = 2 * c.prefetch_bucket_bytes;
  return c;
}

std::vector<PrefetchAction> Prefetcher::Plan(const Trace& trace,
                                             std::span<const GroupView> groups) const {
  std::vector<PrefetchAction> evictions, fetches;
  if (!trace.replaying()) return {};
  const auto& order = trace.recorded();
  const size_t pos = trace.position();

  uint64_t live = 0;
  std::vector<bool> evicted(groups.size(), false);
  for (const GroupView& v : groups) {
    if (v.device != Residency::kAbsent) live += v.size_bytes;
  }
  // Evicts resident groups needed after `needed_at`, farthest next use first, until `need` more
  // bytes fit under max_live. Returns false (evicting nothing) when that is impossible.
  auto make_room = [&](uint64_t need, size_t needed_at) {
    if (live + need <= config_.max_live_bytes) return true;
    std::vector<std::pair<size_t, GroupId>> victims;  // (next use, group)
    for (GroupId g = 0; g < groups.size(); ++g) {
      const GroupView& v = groups[g];
      if (!IsResident(v.device) || v.in_use || evicted[g] || IsPersistent(v)) continue;
      size_t next = trace.NextUse(g, pos);
      if (next != kNever && next <= needed_at) continue;  // needed sooner: Belady keeps it
      victims.emplace_back(next, g);
    }
    std::sort(victims.begin(), victims.end(), std::greater<>());
    uint64_t freed = 0;
    size_t k = 0;
    while (live - freed + need > config_.max_live_bytes && k < victims.size()) {
      freed += groups[victims[k++].second].size_bytes;
    }
    if (live - freed + need > config_.max_live_bytes) return false;
    for (size_t i = 0; i < k; ++i) {
      evicted[victims[i].second] = true;
      evictions.push_back({PrefetchAction::Kind::kEvictFromDevice, victims[i].second, kNever});
    }
    live -= freed;
    return true;
  };

  std::unordered_set<GroupId> seen;
  uint64_t window = 0;
  bool device_window_open = true;
  for (size_t i = pos; i < order.size(); ++i) {
    GroupId g = order[i];
    if (!seen.insert(g).second) continue;
    const GroupView& v = groups[g];
    window += v.size_bytes;
    if (device_window_open && window > config_.prefetch_bucket_bytes && i > pos) {
      device_window_open = false;
      window = v.size_bytes;  // the host window starts here
    }
    if (v.held) continue;  // its bytes count in the window; no fetch of a copy being replaced
    if (device_window_open) {
      if (v.device != Residency::kAbsent && !evicted[g]) continue;
      if (!make_room(v.size_bytes, i)) {
        device_window_open = false;
        window = v.size_bytes;
      } else {
        live += v.size_bytes;
        fetches.push_back({PrefetchAction::Kind::kFetchToDevice, g, i});
        continue;
      }
    }
    if (window > config_.host_lookahead_bytes) break;
    if (v.home == Tier::kNvme && v.host == Residency::kAbsent && v.device == Residency::kAbsent) {
      fetches.push_back({PrefetchAction::Kind::kStageToHost, g, i});
    }
  }
  evictions.insert(evictions.end(), fetches.begin(), fetches.end());
  return evictions;
}

bool Prefetcher::KeepAfterRelease(GroupId g, const Trace& trace,
                                  std::span<const GroupView> groups) const {
  if (IsPersistent(groups[g])) return true;
  if (!trace.replaying()) return false;
  const size_t pos = trace.position();
  const auto& order = trace.recorded();
  size_t next = trace.NextUse(g, pos);
  uint64_t distance = 0;
  auto add = [&](size_t from, size_t to) {
    for (size_t i = from; i < to; ++i) {
      distance += groups[order[i]].size_bytes;
      if (distance > config_.max_reuse_distance_bytes) return false;
    }
    return true;
  };
  if (next != kNever) return add(pos, next);
  // Steps repeat: the next use may be early in the next step (the first layer of forward,
  // released last in backward).
  next = trace.NextUse(g, 0);
  if (next == kNever) return false;
  return add(pos, order.size()) && add(0, next);
}

std::vector<GroupId> Prefetcher::OverMaxLive(const Trace& trace,
                                             std::span<const GroupView> groups) const {
  uint64_t live = 0;  // as Plan counts it
  for (const GroupView& v : groups) {
    if (v.device != Residency::kAbsent) live += v.size_bytes;
  }
  if (live <= config_.max_live_bytes) return {};
  const bool replaying = trace.replaying();
  const size_t pos = replaying ? trace.position() : 0;
  std::vector<std::pair<size_t, GroupId>> victims;  // (next use, group)
  for (GroupId g = 0; g < groups.size(); ++g) {
    const GroupView& v = groups[g];
    if (!IsResident(v.device) || v.in_use || IsPersistent(v)) continue;
    victims.emplace_back(replaying ? trace.NextUse(g, pos) : kNever, g);
  }
  std::sort(victims.begin(), victims.end(), std::greater<>());
  std::vector<GroupId> out;
  for (const auto& [next, g] : victims) {
    if (live <= config_.max_live_bytes) break;
    live -= groups[g].size_bytes;
    out.push_back(g);
  }
  return out;
}

}  // namespace strata::sched
