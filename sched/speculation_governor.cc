#include "sched/speculation_governor.h"

#include <algorithm>

namespace strata::sched {
namespace {

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace

SpeculationGovernor::SpeculationGovernor(std::optional<bool> configured, const Options& options)
    : options_(options),
      phase_(configured ? Phase::kFixed : Phase::kWarmup),
      speculate_(configured.value_or(true)) {
  options_.warmup = std::max(0, options_.warmup);
  options_.probe = std::max(1, options_.probe);
  options_.settle = std::max(1, options_.settle);
  left_ = options_.warmup;
  if (phase_ == Phase::kWarmup && left_ == 0) StartProbe();
}

void SpeculationGovernor::OnStep(double seconds) {
  switch (phase_) {
    case Phase::kFixed:
      return;
    case Phase::kWarmup:
      if (--left_ <= 0) StartProbe();
      return;
    case Phase::kProbe:
      (speculate_ ? on_ : off_).push_back(seconds);
      if (--left_ <= 0) {
        Decide();
      } else {
        speculate_ = !speculate_;
      }
      return;
    case Phase::kSettled:
      if (--left_ <= 0) StartProbe();
      return;
  }
}

void SpeculationGovernor::StartProbe() {
  phase_ = Phase::kProbe;
  left_ = 2 * options_.probe;
  on_.clear();
  off_.clear();
  speculate_ = false;
}

void SpeculationGovernor::Decide() {
  verdict_.on_s = Median(on_);
  verdict_.off_s = Median(off_);
  ++verdict_.probes;
  speculate_ = verdict_.on_s <= verdict_.off_s;
  phase_ = Phase::kSettled;
  left_ = options_.settle;
}

}  // namespace strata::sched
