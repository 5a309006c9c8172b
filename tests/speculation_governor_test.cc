// sched::SpeculationGovernor fed step times: a fixed mode never changes; the adaptive one warms
// up speculating, probes both ways alternately, keeps the faster, and probes again after its
// settle.
#include "sched/speculation_governor.h"

#include <gtest/gtest.h>

#include <vector>

namespace strata::sched {
namespace {

using Phase = SpeculationGovernor::Phase;

// Runs `steps` steps, each taking `on_s` speculating and `off_s` not; returns the modes used.
std::vector<bool> RunSteps(SpeculationGovernor& g, int steps, double on_s, double off_s) {
  std::vector<bool> modes;
  for (int i = 0; i < steps; ++i) {
    modes.push_back(g.Speculate());
    g.OnStep(g.Speculate() ? on_s : off_s);
  }
  return modes;
}

TEST(SpeculationGovernor, AConfiguredModeNeverChanges) {
  for (bool configured : {true, false}) {
    SpeculationGovernor g(configured, {.warmup = 1, .probe = 1, .settle = 2});
    EXPECT_EQ(g.phase(), Phase::kFixed);
    // The other mode would be much faster: not tried.
    const std::vector<bool> modes = RunSteps(g, 20, configured ? 9.0 : 1.0, configured ? 1.0 : 9.0);
    EXPECT_EQ(modes, std::vector<bool>(20, configured));
    EXPECT_EQ(g.verdict().probes, 0);
  }
}

TEST(SpeculationGovernor, KeepsTheFasterModeAfterAlternatingProbes) {
  // Speculation faster (a long backward hides the optimizer).
  SpeculationGovernor fast(std::nullopt, {.warmup = 2, .probe = 3, .settle = 4});
  EXPECT_EQ(fast.phase(), Phase::kWarmup);
  std::vector<bool> modes = RunSteps(fast, 2 + 6 + 4, 1.0, 1.2);
  const std::vector<bool> want = {true,  true,                            // warm-up
                                  false, true, false, true, false, true,  // probe, off first
                                  true,  true, true,  true};              // settled
  EXPECT_EQ(modes, want);
  EXPECT_EQ(fast.verdict().probes, 1);
  EXPECT_DOUBLE_EQ(fast.verdict().on_s, 1.0);
  EXPECT_DOUBLE_EQ(fast.verdict().off_s, 1.2);
  // Then it probes again.
  EXPECT_EQ(fast.phase(), Phase::kProbe);
  EXPECT_FALSE(fast.Speculate());

  // Speculation slower (a short backward on shared cores): off once probed.
  SpeculationGovernor slow(std::nullopt, {.warmup = 2, .probe = 3, .settle = 4});
  modes = RunSteps(slow, 2 + 6 + 4, 0.43, 0.30);
  EXPECT_EQ(std::vector<bool>(modes.begin() + 8, modes.end()), std::vector<bool>(4, false));
  EXPECT_DOUBLE_EQ(slow.verdict().on_s, 0.43);
  EXPECT_DOUBLE_EQ(slow.verdict().off_s, 0.30);
}

TEST(SpeculationGovernor, MediansIgnoreAnOutlierAndTiesSpeculate) {
  SpeculationGovernor g(std::nullopt, {.warmup = 0, .probe = 3, .settle = 100});
  EXPECT_EQ(g.phase(), Phase::kProbe);
  // off, on, off, on, off, on: one on-step took a checkpoint's 30 s; the medians are 1.0 / 1.1.
  for (double s : {1.1, 1.0, 1.1, 30.0, 1.1, 1.0}) g.OnStep(s);
  EXPECT_EQ(g.phase(), Phase::kSettled);
  EXPECT_TRUE(g.Speculate());
  EXPECT_DOUBLE_EQ(g.verdict().on_s, 1.0);

  SpeculationGovernor tie(std::nullopt, {.warmup = 0, .probe = 2, .settle = 100});
  for (int i = 0; i < 4; ++i) tie.OnStep(2.0);
  EXPECT_TRUE(tie.Speculate());
}

TEST(SpeculationGovernor, ReprobesAndFollowsAChange) {
  SpeculationGovernor g(std::nullopt, {.warmup = 1, .probe = 2, .settle = 3});
  RunSteps(g, 1 + 4, 1.0, 2.0);
  EXPECT_TRUE(g.Speculate());
  // The steps begin to clip, undoing every speculation: speculating is now slower.
  RunSteps(g, 3 + 4, 3.0, 2.0);
  EXPECT_EQ(g.verdict().probes, 2);
  EXPECT_EQ(g.phase(), Phase::kSettled);
  EXPECT_FALSE(g.Speculate());
}

}  // namespace
}  // namespace strata::sched
