// Trace: the order in which a step gathers its groups, recorded in one step and replayed by the
// next ones so the prefetcher can look ahead.
//
// Step 0 records. Every later step replays the recorded order and checks each access against it;
// the first access that differs (or a step that ends early or runs long) marks the step diverged:
// from then on the step is only recorded, and at EndStep its order replaces the old trace. Nothing
// stalls on a divergence and correctness never depends on the trace: only prefetching does (a
// diverged step simply gets no lookahead until the new trace is in place).
//
// Thread safety: not thread-safe; its owner (core/store/gather_scheduler.h, driven by one thread)
// serializes calls.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <unordered_map>
#include <vector>

namespace strata::sched {

using GroupId = uint32_t;
inline constexpr size_t kNever = std::numeric_limits<size_t>::max();

class Trace {
 public:
  // Starts a step; replays the recorded trace when one exists.
  void BeginStep();
  // Records that `g` is gathered now. Returns true while the step still matches the recorded
  // trace (always false in a recording step).
  bool Record(GroupId g);
  // Ends the step. A recording or diverged step becomes the trace for the next steps.
  void EndStep();

  // A recorded trace exists and this step has matched it so far.
  bool replaying() const { return in_step_ && has_trace_ && !diverged_; }
  bool in_step() const { return in_step_; }
  // Accesses recorded in the current step; while replaying, the index in recorded() of the next
  // access expected.
  size_t position() const { return current_.size(); }
  const std::vector<GroupId>& recorded() const { return recorded_; }
  // Smallest index >= from of an access to `g` in recorded(), or kNever.
  size_t NextUse(GroupId g, size_t from) const;

  uint64_t divergences() const { return divergences_; }
  uint64_t steps() const { return steps_; }

 private:
  void Rebuild();

  bool in_step_ = false;
  bool has_trace_ = false;
  bool diverged_ = false;
  std::vector<GroupId> recorded_;
  std::vector<GroupId> current_;
  std::unordered_map<GroupId, std::vector<size_t>> uses_;  // positions of each group, ascending
  uint64_t divergences_ = 0;
  uint64_t steps_ = 0;
};

}  // namespace strata::sched
