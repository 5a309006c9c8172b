// LossScaler (core/zero/loss_scaler.h) against sequences worked out by hand from DeepSpeed
// 0.19.8's DynamicLossScaler.update_scale: hysteresis, the growth window, consecutive hysteresis,
// the minimum, static and no scaling, config errors and checkpoint restore.
#include "core/zero/loss_scaler.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

namespace strata::zero {
namespace {

EngineConfig Fp16(int64_t power, int64_t window, int64_t hysteresis, bool consecutive = false,
                  double min_scale = 1, int stage = 3) {
  EngineConfig c;
  c.zero.stage = stage;  // stages 1-3: DynamicLossScaler; 0: FP16_Optimizer's rule
  c.fp16.enabled = true;
  c.fp16.initial_scale_power = power;
  c.fp16.loss_scale_window = window;
  c.fp16.hysteresis = hysteresis;
  c.fp16.consecutive_hysteresis = consecutive;
  c.fp16.min_loss_scale = min_scale;
  return c;
}

LossScaler Make(const EngineConfig& c) {
  Result<LossScaler> s = LossScaler::FromConfig(c);
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  return std::move(s).value();
}

struct Expect {
  bool overflow;
  double scale;             // after the update
  int64_t hysteresis_left;  // after the update
};

// Feeds each outcome and checks scale and hysteresis after it; `i` is DeepSpeed's cur_iter.
void Feed(LossScaler& s, const std::vector<Expect>& steps) {
  for (size_t i = 0; i < steps.size(); ++i) {
    ASSERT_TRUE(s.Update(steps[i].overflow).ok()) << "iteration " << i;
    EXPECT_EQ(s.scale(), steps[i].scale) << "iteration " << i;
    EXPECT_EQ(s.state().hysteresis_left, steps[i].hysteresis_left) << "iteration " << i;
  }
}

TEST(LossScaler, DefaultsAreDeepSpeeds) {
  EngineConfig c;
  c.zero.stage = 2;
  c.fp16.enabled = true;
  LossScaler s = Make(c);
  EXPECT_TRUE(s.dynamic());
  EXPECT_EQ(s.scale(), 65536.0);
  EXPECT_EQ(s.state(), (LossScalerState{65536.0, 0, -1, 2}));
  EXPECT_EQ(s.Describe(), "dynamic loss scale 65536 (window 1000, hysteresis 2/2, min 1)");
}

// hysteresis 2, window 3, start 2^4. stable = iteration - last_overflow - 1 must be a positive
// multiple of 3 to double; without consecutive hysteresis only a doubling refills it.
TEST(LossScaler, HysteresisTwoWindowThree) {
  LossScaler s = Make(Fp16(4, 3, 2));
  Feed(s, {
              {false, 16, 2},  // it 0: stable 0
              {false, 16, 2},  // it 1: stable 1
              {false, 16, 2},  // it 2: stable 2
              {false, 32, 2},  // it 3: stable 3 -> double
              {true, 32, 1},   // it 4: hysteresis 2 -> 1, scale kept
              {false, 32, 1},  // it 5: stable 0; not refilled
              {true, 16, 1},   // it 6: hysteresis spent -> halve
              {false, 16, 1},  // it 7: stable 0
              {false, 16, 1},  // it 8: stable 1
              {false, 16, 1},  // it 9: stable 2
              {false, 32, 2},  // it 10: stable 3 -> double, refill
              {true, 32, 1},   // it 11
              {true, 16, 1},   // it 12
              {true, 8, 1},    // it 13
          });
  EXPECT_EQ(s.state(), (LossScalerState{8, 14, 13, 1}));
}

TEST(LossScaler, ConsecutiveHysteresisRefillsOnEveryGoodStep) {
  LossScaler on = Make(Fp16(4, 3, 2, /*consecutive=*/true));
  Feed(on, {
               {true, 16, 1},   // it 0
               {false, 16, 2},  // it 1: refilled
               {true, 16, 1},   // it 2: so this one is absorbed too
               {false, 16, 2},  // it 3
               {true, 16, 1},   // it 4
               {true, 8, 1},    // it 5: two in a row -> halve
               {false, 8, 2},   // it 6: stable 0
               {false, 8, 2},   // it 7
               {false, 8, 2},   // it 8
               {false, 16, 2},  // it 9: stable 3 -> double
           });
  // The same outcomes without it: the overflow at it 2 halves.
  LossScaler off = Make(Fp16(4, 3, 2, /*consecutive=*/false));
  Feed(off, {{true, 16, 1}, {false, 16, 1}, {true, 8, 1}, {false, 8, 1}});
}

TEST(LossScaler, WindowOneDoublesFromTheSecondStep) {
  LossScaler s = Make(Fp16(0, 1, 2));
  Feed(s, {{false, 1, 2}, {false, 2, 2}, {false, 4, 2}, {false, 8, 2}, {false, 16, 2}});
}

TEST(LossScaler, AtMinimumAnOverflowIsAnErrorAndChangesNothing) {
  LossScaler s = Make(Fp16(2, 1000, 1));
  Feed(s, {{true, 2, 1}, {true, 1, 1}});
  const LossScalerState before = s.state();
  Status st = s.Update(true);
  EXPECT_EQ(st.code(), Status::Code::kFailedPrecondition) << st.ToString();
  EXPECT_NE(st.message().find("already at minimum"), std::string::npos) << st.ToString();
  EXPECT_NE(st.message().find("fp16.min_loss_scale"), std::string::npos) << st.ToString();
  EXPECT_EQ(s.state(), before);
  // A good step still counts.
  ASSERT_TRUE(s.Update(false).ok());
  EXPECT_EQ(s.state(), (LossScalerState{1, 3, 1, 1}));
}

// ZeRO stage 0: DeepSpeed's FP16_Optimizer (fused_optimizer.py _update_scale): every overflow
// halves (hysteresis unused), the scale stays at min_loss_scale instead of ending the run, and
// doubles on the same stable-interval rule. 2^4, hysteresis 2 (ignored), window 2, min 1.
TEST(LossScaler, StageZeroHasNoHysteresisAndStaysAtTheMinimum) {
  LossScaler s = Make(Fp16(4, 2, 2, false, 1, /*stage=*/0));
  EXPECT_EQ(s.Describe(), "dynamic loss scale 16 (window 2, no hysteresis at stage 0, min 1)");
  Feed(s, {
              {false, 16, 2},  // it 0: stable 0
              {false, 16, 2},  // it 1: stable 1
              {false, 32, 2},  // it 2: stable 2 -> double
              {true, 16, 2},   // it 3: halved at once (stages 1-3 would keep 32)
              {true, 8, 2},    // it 4
              {true, 4, 2},    // it 5
              {true, 2, 2},    // it 6
              {true, 1, 2},    // it 7: at the minimum
              {true, 1, 2},    // it 8: stays there (stages 1-3: FailedPrecondition)
              {false, 1, 2},   // it 9: stable 0
              {false, 1, 2},   // it 10: stable 1
              {false, 2, 2},   // it 11: stable 2 -> double
          });
  EXPECT_EQ(s.state(), (LossScalerState{2, 12, 8, 2}));
}

TEST(LossScaler, MinimumClampsAndIsComparedExactly) {
  LossScaler s = Make(Fp16(3, 1000, 1, false, /*min_scale=*/3));
  Feed(s, {{true, 4, 1}, {true, 3, 1}});  // 8 -> 4 -> max(2, 3)
  EXPECT_EQ(s.Update(true).code(), Status::Code::kFailedPrecondition);

  // A start below the minimum is not "at" it: DeepSpeed raises it to the minimum.
  LossScaler low = Make(Fp16(0, 1000, 1, false, /*min_scale=*/2));
  Feed(low, {{true, 2, 1}});
  EXPECT_EQ(low.Update(true).code(), Status::Code::kFailedPrecondition);
}

TEST(LossScaler, HysteresisOneIgnoresHysteresisLeft) {
  // DeepSpeed halves when the configured hysteresis is 1, whatever cur_hysteresis says.
  LossScaler s = Make(Fp16(4, 1000, 1));
  Feed(s, {{true, 8, 1}, {true, 4, 1}});
}

TEST(LossScaler, StaticScaleNeverMoves) {
  EngineConfig c = Fp16(16, /*window=*/0, /*hysteresis=*/0);  // not validated when static
  c.fp16.loss_scale = 128;
  LossScaler s = Make(c);
  EXPECT_FALSE(s.dynamic());
  EXPECT_EQ(s.mode(), LossScaleMode::kStatic);
  for (bool overflow : {true, true, false, true, false}) {
    ASSERT_TRUE(s.Update(overflow).ok());
    EXPECT_EQ(s.scale(), 128);
  }
  EXPECT_EQ(s.state(), (LossScalerState{128, 5, 3, 0}));
  EXPECT_EQ(s.Describe(), "static loss scale 128");
}

TEST(LossScaler, Bf16AndFp32AreUnscaled) {
  EngineConfig bf16;
  bf16.bf16.enabled = true;
  bf16.fp16.initial_scale_power = 99;  // fp16 settings are ignored when fp16 is off
  for (const EngineConfig& c : {bf16, EngineConfig{}}) {
    LossScaler s = Make(c);
    EXPECT_EQ(s.mode(), LossScaleMode::kNone);
    EXPECT_EQ(s.scale(), 1);
    ASSERT_TRUE(s.Update(true).ok());  // the engine skips the step; the scale stays
    ASSERT_TRUE(s.Update(true).ok());
    EXPECT_EQ(s.state(), (LossScalerState{1, 2, 1, 0}));
  }
}

void ExpectBad(const EngineConfig& c, const std::string& path) {
  Result<LossScaler> s = LossScaler::FromConfig(c);
  ASSERT_FALSE(s.ok()) << path;
  EXPECT_TRUE(s.status().IsInvalidArgument()) << s.status().ToString();
  EXPECT_EQ(s.status().message().substr(0, path.size() + 1), path + ":") << s.status().ToString();
}

TEST(LossScaler, ConfigErrorsNameThePath) {
  const double inf = std::numeric_limits<double>::infinity();
  EngineConfig c = Fp16(16, 1000, 2);
  c.fp16.enabled = AutoOr<bool>::Auto();
  ExpectBad(c, "fp16.enabled");
  c = Fp16(16, 1000, 2);
  c.fp16.loss_scale = -1;
  ExpectBad(c, "fp16.loss_scale");
  c.fp16.loss_scale = std::nan("");
  ExpectBad(c, "fp16.loss_scale");
  ExpectBad(Fp16(-1, 1000, 2), "fp16.initial_scale_power");
  ExpectBad(Fp16(65, 1000, 2), "fp16.initial_scale_power");
  ExpectBad(Fp16(16, 0, 2), "fp16.loss_scale_window");
  ExpectBad(Fp16(16, 1000, 0), "fp16.hysteresis");
  ExpectBad(Fp16(16, 1000, 2, false, 0), "fp16.min_loss_scale");
  ExpectBad(Fp16(16, 1000, 2, false, -1), "fp16.min_loss_scale");
  ExpectBad(Fp16(16, 1000, 2, false, inf), "fp16.min_loss_scale");
  EXPECT_EQ(Make(Fp16(64, 1, 1)).scale(), std::ldexp(1.0, 64));
}

TEST(LossScaler, RestoreResumesBitForBit) {
  const std::vector<bool> before = {false, true, false, false, false, true, true, false};
  const std::vector<bool> after = {false, false, false, true, false, false, false, false};
  LossScaler a = Make(Fp16(10, 3, 2));
  for (bool o : before) ASSERT_TRUE(a.Update(o).ok());
  LossScaler b = Make(Fp16(10, 3, 2));
  ASSERT_TRUE(b.Restore(a.state()).ok());
  EXPECT_EQ(b.state(), a.state());
  for (bool o : after) {
    ASSERT_TRUE(a.Update(o).ok());
    ASSERT_TRUE(b.Update(o).ok());
    EXPECT_EQ(b.state(), a.state());
  }
}

TEST(LossScaler, RestoreRefusesNonsense) {
  LossScaler s = Make(Fp16(4, 3, 2));
  const LossScalerState good{8, 10, 7, 1};
  ASSERT_TRUE(s.Restore(good).ok());
  const double nan = std::nan("");
  for (const LossScalerState& bad :
       std::vector<LossScalerState>{{0, 10, 7, 1},
                                    {-8, 10, 7, 1},
                                    {nan, 10, 7, 1},  // scale
                                    {8, -1, -1, 1},   // iteration
                                    {8, 10, 10, 1},
                                    {8, 10, -2, 1},  // last overflow
                                    {8, 10, 7, 0},
                                    {8, 10, 7, 3}}) {  // hysteresis outside [1, 2]
    Status st = s.Restore(bad);
    EXPECT_TRUE(st.IsInvalidArgument()) << st.ToString();
    EXPECT_EQ(s.state(), good);
  }
  EngineConfig c;
  c.fp16.enabled = true;
  c.fp16.loss_scale = 64;
  LossScaler fixed = Make(c);
  EXPECT_TRUE(fixed.Restore({64, 5, 2, 0}).ok());
  EXPECT_TRUE(fixed.Restore({128, 5, 2, 0}).IsInvalidArgument());  // another config's scale
  EXPECT_TRUE(fixed.Restore({64, 5, 2, 2}).IsInvalidArgument());   // a dynamic scaler's state
}

// A checkpoint resumed under another fp16 loss scaling (static <-> dynamic, another fixed scale,
// a smaller hysteresis) is fitted to the config before Restore, which refused it after the whole
// load had streamed in (and the engine stayed failed); the same scaling resumes bit for bit.
TEST(LossScaler, FitResumesUnderAChangedScalingAsTheConfigSays) {
  EngineConfig c;
  c.fp16.enabled = true;
  c.fp16.loss_scale = 1024;
  const LossScaler fixed = Make(c);
  const LossScaler dynamic = Make(Fp16(16, 3, 2));
  const LossScaler dynamic1 = Make(Fp16(16, 3, 1));
  const LossScalerState saved_fixed{1024, 5, -1, 0};
  const LossScalerState saved_dynamic{131072, 9, 3, 2};
  EXPECT_EQ(fixed.Fit(saved_fixed), saved_fixed);
  EXPECT_EQ(dynamic.Fit(saved_dynamic), saved_dynamic);
  EXPECT_EQ(dynamic.Fit(saved_fixed), dynamic.state());  // static -> dynamic: 2^16, fresh
  EXPECT_EQ(fixed.Fit(saved_dynamic), fixed.state());    // dynamic -> static: 1024
  c.fp16.loss_scale = 512;
  EXPECT_EQ(Make(c).Fit(saved_fixed).scale, 512);  // another fixed scale: the config's
  const LossScalerState capped = dynamic1.Fit(saved_dynamic);
  EXPECT_EQ(capped.scale, 131072);
  EXPECT_EQ(capped.iteration, 9);
  EXPECT_EQ(capped.hysteresis_left, 1);
  for (const LossScaler* s : {&fixed, &dynamic, &dynamic1}) {
    LossScaler to = *s;
    for (const LossScalerState& saved : {saved_fixed, saved_dynamic}) {
      EXPECT_TRUE(to.Restore(s->Fit(saved)).ok());
    }
  }
}

}  // namespace
}  // namespace strata::zero
