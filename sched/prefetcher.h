// Prefetcher: which groups to fetch ahead of the consumer, and which released groups to keep,
// decided from the recorded trace. Pure policy: state in (trace position, per-group residency),
// plan out; the tiered store executes the plan and enforces the hard byte budgets.
//
// Rules (DeepSpeed ZeRO-3 semantics, with its limits lifted):
//   - Lookahead is measured in bytes: walking the trace from the consumer's position, groups are
//     fetched to the device until the upcoming bytes exceed `prefetch_bucket_bytes`
//     (stage3_prefetch_bucket_size) and the device-live bytes stay within `max_live_bytes`
//     (stage3_max_live_parameters). Outstanding fetches are bounded by those bytes only.
//   - NVMe-home groups chain NVMe -> host -> device: the walk continues past the device window
//     for `host_lookahead_bytes` more, staging those groups into pinned host memory.
//   - Belady: to make room for a group needed at trace index i, only resident groups whose next
//     use is later than i (farthest first) are evicted; never a group in use, in flight or
//     persistent. If no such victim exists the walk stops: a prefetch never evicts something
//     needed sooner than what it brings in.
//   - A released group stays resident when it is persistent (GroupView::persistent: the engine's
//     sched::PersistentGroups), or when its next use is within `max_reuse_distance_bytes`
//     (stage3_max_reuse_distance, bytes gathered in between; the trace is taken as repeating, so
//     a use early in the next step counts). Where the live bytes then pass `max_live_bytes`
//     (OverMaxLive), the resident groups neither in use nor persistent go, farthest next use
//     first: Plan's make_room evicts only to fetch, and cannot for a group larger than the cap.
//   - A step that does not replay the trace (first step, diverged) gets no prefetch at all.
//   - A held group (GroupView::held: its update has not been written yet) is never fetched or
//     staged; the lookahead walks past it.
//
// Thread safety: const methods are pure; concurrent calls are safe.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "sched/trace.h"
#include "strata/store.h"

namespace strata::sched {

struct PrefetchConfig {
  // Upcoming bytes the device lookahead may cover. DeepSpeed default 5e7 params (x2 bytes).
  uint64_t prefetch_bucket_bytes = 100'000'000;
  // Cap on device-resident plus in-flight gathered bytes. DeepSpeed default 1e9 params (x2).
  uint64_t max_live_bytes = 2'000'000'000;
  // A released group whose next use comes within this many gathered bytes stays resident.
  uint64_t max_reuse_distance_bytes = 2'000'000'000;
  // Extra lookahead past the device window for staging NVMe-home groups into host memory.
  // Trade-off: deeper hides NVMe latency, costs pinned memory.
  uint64_t host_lookahead_bytes = 200'000'000;

  // DeepSpeed gives these in parameters (numel); bytes = numel * bytes_per_param.
  static PrefetchConfig FromNumel(uint64_t prefetch_bucket_numel, uint64_t max_live_numel,
                                  uint64_t max_reuse_distance_numel, uint64_t bytes_per_param);
};

// What the store knows of one group now. Indexed by GroupId.
struct GroupView {
  uint64_t size_bytes = 0;
  // The store's residency of the group's copies (include/strata/store.h): kValid or kDirty
  // count as resident (IsResident), kInFlight as coming.
  Residency device = Residency::kAbsent;
  Residency host = Residency::kAbsent;  // staged copy of an NVMe-home group
  Tier home = Tier::kHost;
  // Gathered and not yet released, or its device copy leased by anyone: never evicted (the store
  // would refuse). The executor must fill it (GatherScheduler does, from its own leases and the
  // store's lease counts).
  bool in_use = false;
  // Its params are being rewritten (the optimizer step running behind the forward,
  // EngineOptions::overlap_step): whatever copy a fetch brought now would be replaced, so the plan
  // neither fetches nor stages it; the walk passes over it (its bytes still count in the windows).
  bool held = false;
  // Kept resident for the whole run (stage3_param_persistence_threshold and
  // stage3_model_persistence_threshold, decided once by sched::PersistentGroups).
  bool persistent = false;
};

struct PrefetchAction {
  enum class Kind : uint8_t { kEvictFromDevice, kFetchToDevice, kStageToHost };
  Kind kind;
  GroupId group;
  size_t needed_at;  // trace index of the use it prepares (kNever for evictions)
  friend bool operator==(const PrefetchAction&, const PrefetchAction&) = default;
};

class Prefetcher {
 public:
  explicit Prefetcher(const PrefetchConfig& config) : config_(config) {}

  // The plan for the consumer at trace.position(): evictions first, then fetches and stagings in
  // the order they are needed. Empty unless trace.replaying(). REQUIRES: every GroupId in the
  // trace indexes `groups`.
  std::vector<PrefetchAction> Plan(const Trace& trace, std::span<const GroupView> groups) const;

  // Whether group `g`, released now (at trace.position()), should stay on the device.
  bool KeepAfterRelease(GroupId g, const Trace& trace, std::span<const GroupView> groups) const;
  // The groups to evict so that the live bytes (every group resident or in flight, as Plan
  // counts them) come within max_live_bytes: resident, not in use, not persistent, the farthest
  // next use first (by id when the trace is not replaying). Empty when within.
  std::vector<GroupId> OverMaxLive(const Trace& trace, std::span<const GroupView> groups) const;

  static bool IsPersistent(const GroupView& v) { return v.persistent; }
  const PrefetchConfig& config() const { return config_; }

 private:
  PrefetchConfig config_;
};

}  // namespace strata::sched
