// LrSchedule (core/zero/lr_schedule.h): DeepSpeed 0.19.8's WarmupLR, WarmupDecayLR,
// WarmupCosineLR, OneCycle (lr and momentum) and LRRangeTest at chosen t against closed forms
// worked out independently, the t each applied step uses (t = -1 first; skipped steps do not
// advance), and config errors naming their paths.
#include "core/zero/lr_schedule.h"

#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <string>

namespace strata::zero {
namespace {

EngineConfig Sched(SchedulerType type, const std::string& name,
                   std::map<std::string, std::string> params, double lr = 1e-3) {
  EngineConfig c;
  c.optimizer.lr = lr;
  c.scheduler.type = type;
  c.scheduler.type_name = name;
  c.scheduler.params = std::move(params);
  return c;
}

LrSchedule Make(const EngineConfig& c) {
  Result<LrSchedule> s = LrSchedule::FromConfig(c);
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  return std::move(s).value();
}

// Relative tolerance of a few ulps: DeepSpeed's and the closed form's rounding differ.
void ExpectLr(const LrSchedule& s, int64_t t, double want) {
  EXPECT_NEAR(s.LrAt(t), want, 1e-14 * std::abs(want)) << "t = " << t;
}

TEST(LrSchedule, NoSchedulerIsTheConstantOptimizerLr) {
  LrSchedule s = Make(Sched(SchedulerType::kNone, "", {}, 3e-4));
  for (int64_t t : {-1, 0, 1, 1000000}) EXPECT_EQ(s.LrAt(t), 3e-4);
  EXPECT_EQ(s.Describe(), "constant lr 0.0003");
}

TEST(LrSchedule, WarmupLrLog) {
  LrSchedule s = Make(
      Sched(SchedulerType::kWarmupLR, "WarmupLR",
            {{"warmup_min_lr", "1e-4"}, {"warmup_max_lr", "1e-3"}, {"warmup_num_steps", "100"}}));
  ExpectLr(s, -1, 1e-4);              // before the first scheduler step: min
  ExpectLr(s, 0, 1e-4);               // ln(1) = 0
  ExpectLr(s, 9, 1e-4 + 9e-4 * 0.5);  // ln 10 / ln 100
  ExpectLr(s, 49, 1e-4 + 9e-4 * std::log10(50.0) / 2);
  ExpectLr(s, 99, 1e-3);  // ln 100 / ln 100: max one step before W
  ExpectLr(s, 100, 1e-3);
  ExpectLr(s, 1000000, 1e-3);
  EXPECT_EQ(s.Describe(), "WarmupLR(min 0.0001, max 0.001, 100 steps, log)");
  EXPECT_TRUE(s.notes().empty());
}

TEST(LrSchedule, WarmupLrLinearDefaultsToOptimizerLr) {
  LrSchedule s = Make(Sched(SchedulerType::kWarmupLR, "WarmupLR",
                            {{"warmup_num_steps", "10"}, {"warmup_type", "\"linear\""}}, 2e-3));
  ExpectLr(s, -1, 0);
  ExpectLr(s, 3, 6e-4);
  ExpectLr(s, 9, 1.8e-3);
  ExpectLr(s, 10, 2e-3);
  EXPECT_EQ(s.Describe(), "WarmupLR(min 0, max 0.002, 10 steps, linear)");
}

TEST(LrSchedule, WarmupLrDefaults) {
  LrSchedule s = Make(Sched(SchedulerType::kWarmupLR, "WarmupLR", {}));
  EXPECT_EQ(s.Describe(), "WarmupLR(min 0, max 0.001, 1000 steps, log)");
  ExpectLr(s, 30, 1e-3 * std::log10(31.0) / 3);  // ln 31 / ln 1000
}

TEST(LrSchedule, WarmupDecayLr) {
  LrSchedule s = Make(Sched(SchedulerType::kWarmupDecayLR, "WarmupDecayLR",
                            {{"total_num_steps", "1000"},
                             {"warmup_max_lr", "0.01"},
                             {"warmup_num_steps", "100"},
                             {"warmup_type", "\"linear\""}}));
  ExpectLr(s, 50, 0.005);
  ExpectLr(s, 100, 0.01);  // (1000 - 100) / 900
  ExpectLr(s, 550, 0.005);
  ExpectLr(s, 1000, 0);
  ExpectLr(s, 5000, 0);  // clamped at 0, not negative
  EXPECT_EQ(s.Describe(), "WarmupDecayLR(min 0, max 0.01, 100 steps, linear, 1000 total steps)");

  LrSchedule floor = Make(Sched(SchedulerType::kWarmupDecayLR, "WarmupDecayLR",
                                {{"total_num_steps", "1000"},
                                 {"warmup_min_lr", "0.001"},
                                 {"warmup_max_lr", "0.01"},
                                 {"warmup_num_steps", "100"}}));
  ExpectLr(floor, -1, 0.001);
  ExpectLr(floor, 550, 0.001 + 0.009 * 0.5);
  ExpectLr(floor, 1000, 0.001);
}

// total_num_steps as a script computes it (1e4, epochs * len(loader) / gas): DeepSpeed takes any
// number and computes in floats, so 1e4 is 10000 and 2500.5 decays over 2400.5 steps.
TEST(LrSchedule, TotalStepsMayBeAnyNumberAsDeepSpeedComputesInFloats) {
  const auto decay = [](const std::string& total) {
    return Make(Sched(SchedulerType::kWarmupDecayLR, "WarmupDecayLR",
                      {{"total_num_steps", total},
                       {"warmup_max_lr", "0.01"},
                       {"warmup_num_steps", "100"},
                       {"warmup_type", "\"linear\""}}));
  };
  const LrSchedule integral = decay("10000"), written_float = decay("1e4");
  for (int64_t t : {-1, 0, 50, 100, 5050, 10000, 20000}) {
    EXPECT_EQ(written_float.LrAt(t), integral.LrAt(t)) << t;
  }
  EXPECT_EQ(written_float.Describe(), integral.Describe());
  ExpectLr(decay("2500.5"), 1000, 0.01 * (2500.5 - 1000) / 2400.5);
  const LrSchedule cosine = Make(Sched(
      SchedulerType::kWarmupCosineLR, "WarmupCosineLR",
      {{"total_num_steps", "300.5"}, {"warmup_num_steps", "100"}, {"cos_min_ratio", "0"}}, 0.01));
  ExpectLr(cosine, 150, 0.01 * (1 + std::cos(M_PI * std::min(1.0, 51 / 200.5))) / 2);
}

TEST(LrSchedule, WarmupDecayLrMaxDefaultsTo0001NotOptimizerLr) {
  LrSchedule s = Make(
      Sched(SchedulerType::kWarmupDecayLR, "WarmupDecayLR", {{"total_num_steps", "10"}}, 0.05));
  EXPECT_EQ(s.Describe(), "WarmupDecayLR(min 0, max 0.001, 1000 steps, log, 10 total steps)");
  ExpectLr(s, 999, 0.001);          // end of warmup
  ASSERT_EQ(s.notes().size(), 1u);  // total_num_steps < warmup_num_steps, as DeepSpeed warns
  EXPECT_NE(s.notes()[0].find("scheduler.params.total_num_steps"), std::string::npos);
}

TEST(LrSchedule, WarmupCosineLr) {
  LrSchedule s = Make(Sched(SchedulerType::kWarmupCosineLR, "WarmupCosineLR",
                            {{"total_num_steps", "1100"},
                             {"warmup_num_steps", "100"},
                             {"warmup_type", "\"linear\""},
                             {"warmup_min_ratio", "0.1"},
                             {"cos_min_ratio", "0.01"}},
                            0.002));
  ExpectLr(s, -1, 0);  // DeepSpeed's value before the first step: 0, not 0.1 * lr
  ExpectLr(s, 0, 0.002 * 0.1);
  ExpectLr(s, 50, 0.002 * (0.1 + 0.5 * 0.9));
  ExpectLr(s, 99, 0.002 * (0.1 + 0.99 * 0.9));
  // After warmup p = (t - 99) / 1000.
  ExpectLr(s, 349, 0.002 * (0.01 + 0.99 * (2 + std::sqrt(2.0)) / 4));  // p = 1/4
  ExpectLr(s, 599, 0.002 * (0.01 + 0.99 / 2));                         // p = 1/2
  ExpectLr(s, 1099, 0.002 * 0.01);                                     // p = 1
  ExpectLr(s, 5000, 0.002 * 0.01);  // clamped, does not swing back up
  EXPECT_EQ(s.Describe(),
            "WarmupCosineLR(lr 0.002, min ratio 0.1, 100 steps, linear, cos min ratio 0.01, "
            "1100 total steps)");
}

TEST(LrSchedule, WarmupCosineLrShorterThanWarmupStaysAtTheFloor) {
  LrSchedule s = Make(Sched(SchedulerType::kWarmupCosineLR, "WarmupCosineLR",
                            {{"total_num_steps", "50"}, {"warmup_num_steps", "100"}}));
  ExpectLr(s, 100, 1e-3 * 1e-4);  // default cos_min_ratio
  ExpectLr(s, 101, 1e-3 * 1e-4);
  EXPECT_EQ(s.notes().size(), 1u);
}

// An optimizer group with its own lr (param_groups[i]["lr"]), as DeepSpeed's schedulers treat
// it: the constant schedule keeps it, WarmupCosineLR scales it, WarmupLR without warmup_max_lr
// (or with null) warms up to it; an explicit warmup_max_lr, WarmupDecayLR's 0.001 default,
// OneCycle and LRRangeTest give every group the same lr.
TEST(LrSchedule, GroupsWithTheirOwnLr) {
  const double own = 1e-2;
  auto lr = [&](const LrSchedule& s, int64_t t) { return s.LrAt(t, own); };
  EXPECT_EQ(lr(Make(Sched(SchedulerType::kNone, "", {}, 1e-3)), 7), own);

  const LrSchedule cosine = Make(Sched(
      SchedulerType::kWarmupCosineLR, "WarmupCosineLR",
      {{"total_num_steps", "20"}, {"warmup_num_steps", "10"}, {"warmup_type", "\"linear\""}}));
  for (int64_t t : {-1, 0, 3, 9, 14, 30}) {
    EXPECT_NEAR(lr(cosine, t), cosine.LrAt(t) * (own / 1e-3), 1e-15) << "t = " << t;
  }

  for (const char* max : {"", "null"}) {
    std::map<std::string, std::string> params{{"warmup_num_steps", "10"},
                                              {"warmup_type", "\"linear\""}};
    if (*max) params["warmup_max_lr"] = max;
    const LrSchedule warm = Make(Sched(SchedulerType::kWarmupLR, "WarmupLR", params));
    EXPECT_NEAR(lr(warm, 3), own * 0.3, 1e-17) << max;
    EXPECT_EQ(lr(warm, 50), own) << max;
    EXPECT_NEAR(warm.LrAt(3), 1e-3 * 0.3, 1e-18) << max;  // optimizer.lr's group
  }
  const LrSchedule fixed_max = Make(Sched(SchedulerType::kWarmupLR, "WarmupLR",
                                          {{"warmup_max_lr", "2e-3"}, {"warmup_num_steps", "10"}}));
  EXPECT_EQ(lr(fixed_max, 50), 2e-3);
  const LrSchedule decay = Make(Sched(SchedulerType::kWarmupDecayLR, "WarmupDecayLR",
                                      {{"total_num_steps", "100"}, {"warmup_num_steps", "10"}}));
  EXPECT_EQ(lr(decay, 10), decay.LrAt(10));
  EXPECT_EQ(lr(decay, 10), 1e-3 * 90 / 90);
  const LrSchedule decay_null = Make(
      Sched(SchedulerType::kWarmupDecayLR, "WarmupDecayLR",
            {{"total_num_steps", "100"}, {"warmup_num_steps", "10"}, {"warmup_max_lr", "null"}}));
  EXPECT_EQ(lr(decay_null, 10), own);  // None: WarmupLR's default, each group's lr
  EXPECT_EQ(decay_null.LrAt(10), 1e-3);
}

// The engine asks for the lr of each applied step; a skipped (overflow) step does not advance
// DeepSpeed's scheduler, so its retry gets the same lr.
TEST(LrSchedule, StepsMapToIterations) {
  EXPECT_EQ(LrSchedule::IterationForStep(0), -1);
  EXPECT_EQ(LrSchedule::IterationForStep(5), 4);
  LrSchedule s = Make(Sched(SchedulerType::kWarmupLR, "WarmupLR",
                            {{"warmup_min_lr", "0.5"},
                             {"warmup_max_lr", "1.5"},
                             {"warmup_num_steps", "4"},
                             {"warmup_type", "\"linear\""}}));
  // Outcomes of 7 engine steps; lr used by each applied one: t = -1, 0, 1, 2, 3, 4.
  const bool overflow[] = {false, true, false, true, false, false, false};
  const double want[] = {0.5, 0.5, 0.75, 1.0, 1.25, 1.5};
  int64_t applied = 0;
  for (bool o : overflow) {
    if (o) continue;
    EXPECT_DOUBLE_EQ(s.LrForStep(applied), want[applied]) << "applied step " << applied;
    ++applied;
  }
  EXPECT_EQ(applied, 5);  // the sixth want is the next step's
  EXPECT_DOUBLE_EQ(s.LrForStep(applied), want[5]);
}

TEST(LrSchedule, UnknownWarmupTypeFallsBackToLogWithANote) {
  const auto cfg = [](const std::string& type) {
    return Sched(SchedulerType::kWarmupLR, "WarmupLR",
                 {{"warmup_num_steps", "100"}, {"warmup_type", type}});
  };
  LrSchedule odd = Make(cfg("\"cosine\""));
  LrSchedule log = Make(cfg("\"log\""));
  ASSERT_EQ(odd.notes().size(), 1u);
  EXPECT_NE(odd.notes()[0].find("scheduler.params.warmup_type"), std::string::npos);
  EXPECT_NE(odd.notes()[0].find("\"cosine\""), std::string::npos);
  for (int64_t t : {0, 9, 50, 99}) EXPECT_EQ(odd.LrAt(t), log.LrAt(t));
}

TEST(LrSchedule, OneWarmupStepRunsAsTwo) {
  LrSchedule s = Make(Sched(SchedulerType::kWarmupLR, "WarmupLR",
                            {{"warmup_num_steps", "1"}, {"warmup_type", "\"linear\""}}));
  ExpectLr(s, 1, 0.5e-3);  // 1 / max(2, 1)
  EXPECT_EQ(s.notes().size(), 1u);
}

void ExpectBad(const EngineConfig& c, const std::string& path) {
  Result<LrSchedule> s = LrSchedule::FromConfig(c);
  ASSERT_FALSE(s.ok()) << path;
  EXPECT_TRUE(s.status().IsInvalidArgument()) << s.status().ToString();
  EXPECT_EQ(s.status().message().substr(0, path.size() + 1), path + ":") << s.status().ToString();
}

void ExpectBetas(const LrSchedule& s, int64_t t, double beta1) {
  const auto b = s.BetasAt(t);
  ASSERT_TRUE(b.has_value()) << "t = " << t;
  EXPECT_NEAR(b->first, beta1, 1e-15) << "t = " << t;
  EXPECT_EQ(b->second, 0.99) << "t = " << t;
}

EngineConfig OneCycle(std::map<std::string, std::string> p) {
  p.emplace("cycle_min_lr", "1e-4");
  p.emplace("cycle_max_lr", "1e-3");
  p.emplace("cycle_first_step_size", "10");
  p.emplace("cycle_min_mom", "0.85");
  p.emplace("cycle_max_mom", "0.95");
  return Sched(SchedulerType::kOneCycle, "OneCycle", std::move(p));
}

// lr rises over the first half while beta1 falls, both return over the second, then hold.
TEST(LrSchedule, OneCycleCyclesLrAndMomentumInversely) {
  LrSchedule s = Make(OneCycle({}));
  EXPECT_EQ(s.kind(), LrSchedule::Kind::kOneCycle);
  ExpectLr(s, -1, 1e-4);  // the constructor's: cycle_min_lr and cycle_min_mom
  ExpectBetas(s, -1, 0.85);
  ExpectLr(s, 0, 1e-4 + 9e-4 * 0.1);  // b = 1 of a 20-step cycle: scale 1 / 10
  ExpectBetas(s, 0, 0.95 - 0.1 * 0.1);
  ExpectLr(s, 9, 1e-3);  // b = 10: the peak
  ExpectBetas(s, 9, 0.85);
  ExpectLr(s, 14, 1e-4 + 9e-4 * 0.5);  // b = 15: halfway down
  ExpectBetas(s, 14, 0.9);
  ExpectLr(s, 19, 1e-4);  // b = 20: the cycle's end
  ExpectBetas(s, 19, 0.95);
  ExpectLr(s, 20, 1e-4);  // no decay configured: cycle_min_lr and cycle_max_mom from now on
  ExpectBetas(s, 1000, 0.95);
  ExpectLr(s, 1000, 1e-4);
  // beta2 is 0.99 whatever the optimizer's (DeepSpeed's (momentum, 0.99)): a note says so.
  ASSERT_EQ(s.notes().size(), 1u);
  EXPECT_NE(s.notes()[0].find("0.99"), std::string::npos) << s.notes()[0];
  EXPECT_EQ(s.Describe(), "OneCycle(lr 0.0001..0.001, 10+10 steps, momentum 0.95..0.85)");
}

TEST(LrSchedule, OneCycleDecayStairsAndAsymmetricHalves) {
  LrSchedule d = Make(
      OneCycle({{"decay_step_size", "5"}, {"decay_lr_rate", "0.5"}, {"decay_mom_rate", "0.01"}}));
  ExpectLr(d, 20, 1e-4 / (1 + 0.5 * 0.2));  // d = 1 step after the 20-step cycle
  ExpectLr(d, 24, 1e-4 / (1 + 0.5 * 1.0));
  ExpectBetas(d, 24, 0.95 * (1 + 0.01 * 1.0));
  EXPECT_EQ(d.notes().size(), 2u);  // beta2, and beta1 growing after the cycle
  // beta1 = 0.95 * (1 + 0.01 * (t - 19) / 5) first reaches 1 at t = 46 (0.9994 at t = 45): the
  // applied step with 47 before it, step 48. The check warns naming it; that step's error names
  // the key, where Adam's kernel named only beta1.
  ASSERT_EQ(d.warnings().size(), 1u);
  EXPECT_NE(d.warnings()[0].find("scheduler.params.decay_mom_rate: "), std::string::npos);
  EXPECT_NE(d.warnings()[0].find("reaches 1 at optimizer step 48,"), std::string::npos)
      << d.warnings()[0];
  EXPECT_LT(d.BetasForStep(46)->first, 1.0);
  EXPECT_GE(d.BetasForStep(47)->first, 1.0);
  EXPECT_TRUE(d.CheckBetasForStep(46).ok());
  Status past = d.CheckBetasForStep(47);
  EXPECT_EQ(past.code(), Status::Code::kInvalidArgument);
  EXPECT_NE(past.message().find("scheduler.params.decay_mom_rate: OneCycle's beta1 has grown to "
                                "1.001"),
            std::string::npos)
      << past.message();
  EXPECT_NE(past.message().find(" at optimizer step 48 "), std::string::npos) << past.message();
  EXPECT_TRUE(Make(OneCycle({})).warnings().empty());  // no decay: beta1 stays cycle_max_mom
  // A negative decay_step_size shrinks beta1 (DeepSpeed's formula): it never reaches 1.
  LrSchedule shrinking = Make(OneCycle({{"decay_step_size", "-5"}, {"decay_mom_rate", "0.01"}}));
  EXPECT_TRUE(shrinking.warnings().empty());
  EXPECT_LT(shrinking.BetasForStep(1000)->first, 0.95);

  LrSchedule st = Make(OneCycle({{"cycle_first_stair_count", "2"}}));
  ExpectLr(st, 0, 1e-4);               // b = 1: floor(1 * 2 / 10) / 2 = 0
  ExpectLr(st, 4, 1e-4 + 9e-4 * 0.5);  // b = 5: one stair of two
  ExpectBetas(st, 4, 0.9);
  ExpectLr(st, 9, 1e-3);
  ExpectLr(st, 14, 1e-4 + 9e-4 * 0.5);  // the second half counts its stairs from the end
  ExpectLr(st, 16, 1e-4);               // b = 17: floor(3 * 2 / 10) = 0

  LrSchedule asym = Make(OneCycle({{"cycle_first_step_size", "4"},
                                   {"cycle_second_step_size", "12"},
                                   {"cycle_momentum", "false"}}));
  ExpectLr(asym, 3, 1e-3);                    // b = 4: the peak after the short first half
  ExpectLr(asym, 9, 1e-4 + 9e-4 * 0.5);       // b = 10: 6 of the 12 down
  EXPECT_FALSE(asym.BetasAt(3).has_value());  // cycle_momentum false: the optimizer's betas
  EXPECT_TRUE(asym.notes().empty());

  LrSchedule null_second = Make(OneCycle({{"cycle_second_step_size", "null"}}));
  ExpectLr(null_second, 14, 1e-4 + 9e-4 * 0.5);  // null: the first half's size
}

TEST(LrSchedule, LrRangeTestGrowsLinearlyOrInStairs) {
  LrSchedule s = Make(Sched(SchedulerType::kLRRangeTest, "LRRangeTest",
                            {{"lr_range_test_min_lr", "1e-3"},
                             {"lr_range_test_step_size", "10"},
                             {"lr_range_test_step_rate", "0.5"}}));
  ExpectLr(s, -1, 1e-3);
  ExpectLr(s, 0, 1e-3 * (1 + 0.5 * 0.1));
  ExpectLr(s, 19, 1e-3 * 2);
  EXPECT_FALSE(s.BetasAt(0).has_value());
  LrSchedule stairs =
      Make(Sched(SchedulerType::kLRRangeTest, "LRRangeTest",
                 {{"lr_range_test_step_size", "10"}, {"lr_range_test_staircase", "true"}}));
  ExpectLr(stairs, 8, 1e-3);  // defaults: min 1e-3, rate 1
  ExpectLr(stairs, 9, 2e-3);
  ExpectLr(stairs, 29, 4e-3);
  EXPECT_EQ(stairs.Describe(), "LRRangeTest(min 0.001, rate 1 per 10 steps, staircase)");
}

TEST(LrSchedule, OneCycleAndRangeTestParamsNameTheirPath) {
  ExpectBad(Sched(SchedulerType::kOneCycle, "OneCycle", {{"cycle_max_lr", "1e-3"}}),
            "scheduler.params.cycle_min_lr");
  ExpectBad(Sched(SchedulerType::kOneCycle, "OneCycle", {{"cycle_min_lr", "1e-3"}}),
            "scheduler.params.cycle_max_lr");
  ExpectBad(OneCycle({{"warmup_num_steps", "10"}}), "scheduler.params.warmup_num_steps");
  ExpectBad(OneCycle({{"cycle_first_step_size", "0"}}), "scheduler.params.cycle_first_step_size");
  ExpectBad(OneCycle({{"cycle_second_step_size", "-1"}}),
            "scheduler.params.cycle_second_step_size");
  ExpectBad(OneCycle({{"cycle_max_mom", "1.0"}}), "scheduler.params.cycle_max_mom");
  ExpectBad(OneCycle({{"cycle_min_mom", "-0.1"}}), "scheduler.params.cycle_min_mom");
  ExpectBad(OneCycle({{"cycle_momentum", "\"yes\""}}), "scheduler.params.cycle_momentum");
  ExpectBad(OneCycle({{"cycle_min_lr", "[1e-4, 1e-4]"}}), "scheduler.params.cycle_min_lr");
  ExpectBad(OneCycle({{"last_batch_iteration", "3"}}), "scheduler.params.last_batch_iteration");
  // Momenta outside [0, 1) are fine when they are not written (cycle_momentum false).
  EXPECT_TRUE(
      LrSchedule::FromConfig(OneCycle({{"cycle_momentum", "false"}, {"cycle_max_mom", "1.5"}}))
          .ok());
  const auto range = [](std::map<std::string, std::string> p) {
    return Sched(SchedulerType::kLRRangeTest, "LRRangeTest", std::move(p));
  };
  ExpectBad(range({{"lr_range_test_step_size", "0"}}), "scheduler.params.lr_range_test_step_size");
  ExpectBad(range({{"lr_range_test_step_size", "2.5"}}),
            "scheduler.params.lr_range_test_step_size");
  ExpectBad(range({{"lr_range_test_staircase", "1"}}), "scheduler.params.lr_range_test_staircase");
  ExpectBad(range({{"cycle_min_lr", "1"}}), "scheduler.params.cycle_min_lr");
}

TEST(LrSchedule, UnsupportedSchedulersNameTheSupportedOnes) {
  for (auto [type, name] : {std::pair{SchedulerType::kOther, "ReduceLROnPlateau"},
                            std::pair{SchedulerType::kOther, "StepLR"}}) {
    Result<LrSchedule> s = LrSchedule::FromConfig(Sched(type, name, {}));
    ASSERT_FALSE(s.ok());
    const std::string m(s.status().message());
    EXPECT_TRUE(s.status().IsInvalidArgument());
    EXPECT_EQ(m.rfind("scheduler.type:", 0), 0u) << m;
    EXPECT_NE(m.find(name), std::string::npos) << m;
    EXPECT_NE(m.find("WarmupCosineLR"), std::string::npos) << m;
    EXPECT_NE(m.find("OneCycle"), std::string::npos) << m;
  }
}

TEST(LrSchedule, BadParamsNameTheirPath) {
  const auto warmup = [](std::map<std::string, std::string> p) {
    return Sched(SchedulerType::kWarmupLR, "WarmupLR", std::move(p));
  };
  ExpectBad(Sched(SchedulerType::kWarmupDecayLR, "WarmupDecayLR", {}),
            "scheduler.params.total_num_steps");
  ExpectBad(Sched(SchedulerType::kWarmupCosineLR, "WarmupCosineLR", {}),
            "scheduler.params.total_num_steps");
  ExpectBad(Sched(SchedulerType::kWarmupCosineLR, "WarmupCosineLR",
                  {{"total_num_steps", "100"}, {"warmup_min_lr", "0"}}),  // not a cosine param
            "scheduler.params.warmup_min_lr");
  ExpectBad(warmup({{"total_num_steps", "100"}}), "scheduler.params.total_num_steps");
  ExpectBad(warmup({{"warmup_max_lr", "\"auto\""}}), "scheduler.params.warmup_max_lr");
  ExpectBad(warmup({{"warmup_num_steps", "0"}}), "scheduler.params.warmup_num_steps");
  ExpectBad(warmup({{"warmup_num_steps", "10.5"}}), "scheduler.params.warmup_num_steps");
  ExpectBad(warmup({{"warmup_num_steps", "\"100\""}}), "scheduler.params.warmup_num_steps");
  ExpectBad(warmup({{"warmup_min_lr", "-1"}}), "scheduler.params.warmup_min_lr");
  ExpectBad(warmup({{"warmup_min_lr", "[0, 0]"}}), "scheduler.params.warmup_min_lr");
  ExpectBad(warmup({{"warmup_min_lr", "{oops"}}), "scheduler.params.warmup_min_lr");
  ExpectBad(warmup({{"last_batch_iteration", "5"}}), "scheduler.params.last_batch_iteration");
  EXPECT_TRUE(LrSchedule::FromConfig(warmup({{"last_batch_iteration", "-1"}})).ok());
  ExpectBad(Sched(SchedulerType::kWarmupDecayLR, "WarmupDecayLR", {{"total_num_steps", "-1"}}),
            "scheduler.params.total_num_steps");

  EngineConfig auto_lr = warmup({});
  auto_lr.optimizer.lr = AutoOr<double>::Auto();
  ExpectBad(auto_lr, "optimizer.lr");
  EngineConfig listed = warmup({{"warmup_num_steps", "100"}});
  listed.unresolved_auto.push_back("scheduler.params.warmup_num_steps");
  ExpectBad(listed, "scheduler.params.warmup_num_steps");
}

// Through the config reader: "auto" params stay unresolved until the trainer supplies them.
TEST(LrSchedule, FromParsedConfig) {
  const char* text = R"({"optimizer": {"type": "AdamW", "params": {"lr": 2e-3}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto",
      "warmup_max_lr": "auto", "warmup_num_steps": 10, "warmup_type": "linear"}}})";
  Result<ParsedConfig> parsed = ParseDeepSpeedConfig(text);
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  ExpectBad(parsed->config, "scheduler.params.total_num_steps");

  ParseOptions options;
  options.auto_values = {{"scheduler.params.total_num_steps", "110"},
                         {"scheduler.params.warmup_max_lr", "2e-3"}};
  Result<ParsedConfig> resolved = ParseDeepSpeedConfig(text, options);
  ASSERT_TRUE(resolved.ok()) << resolved.status().ToString();
  LrSchedule s = Make(resolved->config);
  ExpectLr(s, 5, 1e-3);
  ExpectLr(s, 60, 1e-3);  // (110 - 60) / 100
}

}  // namespace
}  // namespace strata::zero
