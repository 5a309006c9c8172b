#include "sched/trace.h"

#include <algorithm>

namespace strata::sched {

void Trace::BeginStep() {
  if (in_step_) EndStep();
  in_step_ = true;
  diverged_ = false;
  current_.clear();
}

bool Trace::Record(GroupId g) {
  if (!in_step_) BeginStep();
  size_t pos = current_.size();
  current_.push_back(g);
  if (!has_trace_ || diverged_) return false;
  if (pos >= recorded_.size() || recorded_[pos] != g) {
    diverged_ = true;
    ++divergences_;
    return false;
  }
  return true;
}

void Trace::EndStep() {
  if (!in_step_) return;
  in_step_ = false;
  ++steps_;
  if (has_trace_ && !diverged_ && current_.size() != recorded_.size()) {
    diverged_ = true;  // ended early
    ++divergences_;
  }
  if (!has_trace_ || diverged_) {
    recorded_ = current_;
    has_trace_ = !recorded_.empty();
    Rebuild();
  }
  current_.clear();
}

void Trace::Rebuild() {
  uses_.clear();
  for (size_t i = 0; i < recorded_.size(); ++i) uses_[recorded_[i]].push_back(i);
}

size_t Trace::NextUse(GroupId g, size_t from) const {
  auto it = uses_.find(g);
  if (it == uses_.end()) return kNever;
  auto p = std::lower_bound(it->second.begin(), it->second.end(), from);
  return p == it->second.end() ? kNever : *p;
}

}  // namespace strata::sched
