// offload_optimizer.speculative_step: each group's Adam runs during the backward once its
// gradient is final, and is undone exactly when the step turns out to be clipped, skipped or
// given another learning rate. Proven here against the same run with the key off: the same
// master weights bit for bit and the same reports, for stages 1-3, the optimizer on cpu and nvme,
// world 1 and 2, each precision, accumulation, overlap_step on top, a bounded rollback buffer,
// and every validation failure; and that the speculation really ran (or was undone) where the
// test says so. Harness: engine_test_model.h.
#include <gtest/gtest.h>

#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "device_equivalence.h"
#include "sched/placement.h"

namespace strata::testing {
namespace {

// The device-equivalence config with `keys` added to offload_optimizer.
std::string Config(int stage, const char* opt, const char* param, const std::string& precision,
                   double clip, int gas, const std::string& keys) {
  std::string c = DeviceCaseConfig(stage, opt, param, precision, clip, gas);
  const std::string anchor = R"("offload_optimizer": {)";
  const size_t at = c.find(anchor);
  if (!keys.empty()) c.insert(at + anchor.size(), keys + ", ");
  return c;
}

struct Pair {
  RunResult off, on;
};

const char kOff[] = R"("speculative_step": false)";
// Room for every sub-group's copies (as the default has for this small model; explicit, so that
// the tests do not depend on the default).
const char kAll[] = R"("speculation_buffer_size": 1000000000)";
// On (the key given: not timed both ways, every step speculates) with that room.
const char kOn[] = R"("speculative_step": true, "speculation_buffer_size": 1000000000)";

void ExpectSameRun(const RunResult& off, const RunResult& on, const std::string& name) {
  ASSERT_TRUE(off.status.ok()) << name << ": " << off.status.ToString();
  ASSERT_TRUE(on.status.ok()) << name << ": " << on.status.ToString();
  EXPECT_TRUE(BitEqual(on.master, off.master))
      << name << " differs by " << MaxAbsDiff(on.master, off.master);
  ASSERT_EQ(on.reports.size(), off.reports.size()) << name;
  for (size_t i = 0; i < off.reports.size(); ++i) {
    EXPECT_EQ(on.reports[i].grad_norm, off.reports[i].grad_norm) << name << " step " << i;
    EXPECT_EQ(on.reports[i].skipped, off.reports[i].skipped) << name << " step " << i;
    EXPECT_EQ(on.reports[i].loss_scale, off.reports[i].loss_scale) << name << " step " << i;
    EXPECT_EQ(on.reports[i].clip_coefficient, off.reports[i].clip_coefficient) << name;
    EXPECT_EQ(off.reports[i].speculated_sub_groups, 0u) << name;
    EXPECT_EQ(off.reports[i].rolled_back_sub_groups, 0u) << name;
  }
}

// Runs `spec` with the key off and with `on_keys`.
Pair Both(RunSpec spec, int stage, const char* opt, const char* param, const std::string& precision,
          double clip, int gas, const std::string& on_keys = kOn) {
  Pair p;
  spec.config_json = Config(stage, opt, param, precision, clip, gas, kOff);
  p.off = RunEngine(spec);
  spec.config_json = Config(stage, opt, param, precision, clip, gas, on_keys);
  p.on = RunEngine(spec);
  return p;
}

RunSpec Plain(int world, int gas = 1, int steps = 3) {
  RunSpec spec;
  spec.world = world;
  spec.gas = gas;
  spec.steps = steps;
  return spec;
}

size_t TrainableSubGroups(const RunResult& r) { return r.layouts[0].sub_groups; }

// Whether rank 0's layout has a note containing `text`.
bool HasNote(const RunResult& r, const std::string& text) {
  for (const std::string& n : r.layouts[0].notes) {
    if (n.find(text) != std::string::npos) return true;
  }
  return false;
}

class EngineSpeculation : public ::testing::TestWithParam<std::tuple<int, std::string>> {};

// No clipping (the threshold far above the norm): every step keeps the whole speculation, and
// the run is the run without it, bit for bit, for the optimizer on cpu and nvme and the params on
// the device, the host and NVMe.
TEST_P(EngineSpeculation, KeptEveryStepSameBits) {
  const auto [world, precision] = GetParam();
  struct Case {
    int stage;
    const char* opt;
    const char* param;
  };
  for (const Case& c : {Case{3, "cpu", "none"}, Case{3, "cpu", "cpu"}, Case{3, "nvme", "none"},
                        Case{3, "nvme", "cpu"}, Case{3, "nvme", "nvme"}}) {
    const std::string name =
        "stage " + std::to_string(c.stage) + " opt=" + c.opt + " param=" + c.param;
    Pair p = Both(Plain(world), c.stage, c.opt, c.param, precision, 1e6, 1);
    ExpectSameRun(p.off, p.on, name);
    if (!p.on.status.ok()) continue;
    for (size_t i = 0; i < p.on.reports.size(); ++i) {
      // fp16's first steps may overflow (the scaler's start): those are undone, not kept.
      if (p.on.reports[i].skipped) continue;
      EXPECT_EQ(p.on.reports[i].speculated_sub_groups, TrainableSubGroups(p.on))
          << name << " step " << i;
    }
    // The weights moved (bit equality would hold vacuously otherwise).
    EXPECT_GT(MaxAbsDiff(p.on.master, RunReference(world, 0, 1, 0.01f, 0.01f)), 5e-3) << name;
  }
}

INSTANTIATE_TEST_SUITE_P(WorldAndPrecision, EngineSpeculation,
                         ::testing::Combine(::testing::Values(1, 2),
                                            ::testing::Values("fp32", "bf16", "fp16")),
                         [](const auto& info) {
                           return "World" + std::to_string(std::get<0>(info.param)) + "_" +
                                  std::get<1>(info.param);
                         });

// Clipping every step: the first step's speculation is undone and redone with the clip
// coefficient; after a clipped step the next does not speculate (nothing to undo).
TEST(EngineSpeculationRollback, ClippedStepIsUndoneAndRedone) {
  Pair p = Both(Plain(2, 1, 4), 3, "nvme", "cpu", "bf16", 1e-3, 1);
  ExpectSameRun(p.off, p.on, "clip");
  ASSERT_TRUE(p.on.status.ok());
  ASSERT_GT(p.on.reports[0].clip_coefficient, 1.0);
  EXPECT_EQ(p.on.reports[0].rolled_back_sub_groups, TrainableSubGroups(p.on));
  EXPECT_EQ(p.on.reports[0].speculated_sub_groups, 0u);
  for (size_t i = 1; i < p.on.reports.size(); ++i) {
    EXPECT_EQ(p.on.reports[i].rolled_back_sub_groups, 0u) << i;
    EXPECT_EQ(p.on.reports[i].speculated_sub_groups, 0u) << i;
  }
}

// fp16 overflow at step 1 (an inf in a gradient): the speculated step is undone and skipped; the
// step after it does not speculate, the one after that does again.
TEST(EngineSpeculationRollback, OverflowIsUndoneAndSkipped) {
  RunSpec spec = Plain(2, 1, 5);
  spec.tamper = [](int rank, int step, int, Grads* g) {
    if (step == 1 && rank == 1) g->W2[3] = std::numeric_limits<float>::infinity();
  };
  Pair p = Both(spec, 3, "cpu", "none", "fp16", 1e6, 1);
  ExpectSameRun(p.off, p.on, "overflow");
  ASSERT_TRUE(p.on.status.ok());
  const auto& r = p.on.reports;
  ASSERT_EQ(r.size(), 5u);
  const size_t all = TrainableSubGroups(p.on);
  ASSERT_TRUE(r[1].skipped);
  EXPECT_EQ(r[1].rolled_back_sub_groups, all);
  EXPECT_EQ(r[1].speculated_sub_groups, 0u);
  EXPECT_EQ(r[2].speculated_sub_groups + r[2].rolled_back_sub_groups, 0u);
  ASSERT_FALSE(r[3].skipped);
  EXPECT_EQ(r[3].speculated_sub_groups, all);
}

// A learning rate set after the backward began (a client scheduler stepping late): the
// speculation used the old one, so it is undone and the step redone with the new one.
TEST(EngineSpeculationRollback, LearningRateChangedAfterBackwardIsRedone) {
  RunSpec spec = Plain(1, 1, 3);
  spec.before_engine_step = [](int, int step, Engine& e, nvme::SimBackend*) {
    if (step == 1) ASSERT_TRUE(e.SetLearningRates(std::vector<double>{0.003}).ok());
  };
  Pair p = Both(spec, 3, "cpu", "cpu", "fp32", 1e6, 1);
  ExpectSameRun(p.off, p.on, "lr");
  ASSERT_TRUE(p.on.status.ok());
  EXPECT_EQ(p.on.reports[0].speculated_sub_groups, TrainableSubGroups(p.on));
  EXPECT_EQ(p.on.reports[1].rolled_back_sub_groups, TrainableSubGroups(p.on));
  EXPECT_EQ(p.on.reports[1].lr, 0.003);
  EXPECT_EQ(p.on.reports[2].speculated_sub_groups, TrainableSubGroups(p.on));
}

// A Gather of a speculated group before Step sees the params from before the step (the
// speculation is cancelled and undone), and the step is the one without speculation.
TEST(EngineSpeculationRollback, GatherBeforeStepSeesTheOldParams) {
  std::vector<std::vector<float>> seen[2];
  int run = 0;
  RunSpec spec = Plain(1, 1, 2);
  spec.before_engine_step = [&](int, int step, Engine& e, nvme::SimBackend*) {
    if (step != 1) return;
    Result<GatheredGroup> gg = e.Gather(kTop);
    ASSERT_TRUE(gg.ok()) << gg.status().ToString();
    const float* f = static_cast<const float*>(gg->data());
    seen[run].emplace_back(f, f + gg->numel());
    e.Release(std::move(*gg));
  };
  Pair p;
  spec.config_json = Config(3, "cpu", "none", "fp32", 1e6, 1, kOff);
  p.off = RunEngine(spec);
  run = 1;
  spec.config_json = Config(3, "cpu", "none", "fp32", 1e6, 1, kOn);
  p.on = RunEngine(spec);
  ExpectSameRun(p.off, p.on, "gather");
  ASSERT_TRUE(p.on.status.ok());
  ASSERT_EQ(seen[0].size(), 1u);
  ASSERT_EQ(seen[1].size(), 1u);
  EXPECT_EQ(seen[1][0], seen[0][0]);
  // The groups whose accumulation still ran behind the backward at the Gather (overlap_comm: up
  // to two) had not started their Adam: the rest were undone.
  EXPECT_GT(p.on.reports[1].rolled_back_sub_groups, 0u);
  EXPECT_LE(p.on.reports[1].rolled_back_sub_groups, TrainableSubGroups(p.on));
  EXPECT_EQ(p.on.reports[1].speculated_sub_groups, 0u);
}

// A group the trainer still holds gathered when its gradient becomes final (one rank, where the
// gathered copy is the scheduler's copy of the param block the speculative Adam rewrites): its
// Adam waits for the release instead of for the trainer's lease, so holding it past the engine's
// timeout fails nothing, and the run is the run without the speculation.
TEST(EngineSpeculationCombined, AGroupHeldGatheredStartsItsAdamAtItsRelease) {
  RunSpec spec = Plain(1, 1, 2);
  spec.hold_gathered = kTop;
  spec.timeout = std::chrono::milliseconds(300);
  spec.hold_for = std::chrono::milliseconds(900);
  Pair p = Both(spec, 3, "cpu", "none", "fp32", 1e6, 1);
  ExpectSameRun(p.off, p.on, "held");
  ASSERT_TRUE(p.on.status.ok());
  EXPECT_EQ(p.on.reports[1].speculated_sub_groups, TrainableSubGroups(p.on));
}

// Accumulation over 3 micro-steps (a group is final only in the last), with overlap_step on top
// (asked for explicitly: off by default there; the groups not speculated step behind the next
// forward), the optimizer and params on NVMe.
TEST(EngineSpeculationCombined, AccumulationAndOverlapStep) {
  RunSpec spec = Plain(2, 3, 3);
  spec.tweak = [](int, EngineOptions& eo) { eo.overlap_step = true; };
  Pair p = Both(spec, 3, "nvme", "nvme", "bf16", 1e6, 3);
  ExpectSameRun(p.off, p.on, "gas3+overlap_step");
  ASSERT_TRUE(p.on.status.ok());
  for (const StepReport& r : p.on.reports) {
    EXPECT_EQ(r.speculated_sub_groups, TrainableSubGroups(p.on));
  }
  // Unset, the key is off beside overlap_step: nothing speculated, a note says why.
  spec.config_json = Config(3, "nvme", "nvme", "bf16", 1e6, 3, kAll);
  const RunResult unset = RunEngine(spec);
  ASSERT_TRUE(unset.status.ok()) << unset.status.ToString();
  for (const StepReport& r : unset.reports) EXPECT_EQ(r.speculated_sub_groups, 0u);
  EXPECT_TRUE(HasNote(unset, "speculative_step: off by default"));
}

// overlap_step with the speculation on: a kept speculation's worker goes behind the next
// forward (the deferred step joins it before stepping the rest, and the forward's Gather waits
// for it), an overflow's or a clip's is undone in Step as without overlap_step; the same bits.
TEST(EngineSpeculationCombined, OverlapStepKeepsOrUndoesAsWithout) {
  const std::string on = kOn;
  RunSpec spec = Plain(2, 1, 5);
  spec.tweak = [](int, EngineOptions& eo) { eo.overlap_step = true; };
  spec.tamper = [](int rank, int step, int, Grads* g) {
    if (step == 1 && rank == 1) g->W2[3] = std::numeric_limits<float>::infinity();
  };
  Pair p = Both(spec, 3, "nvme", "cpu", "fp16", 1e6, 1, on);
  ExpectSameRun(p.off, p.on, "overlap_step+overflow");
  ASSERT_TRUE(p.on.status.ok());
  const auto& r = p.on.reports;
  const size_t all = TrainableSubGroups(p.on);
  ASSERT_TRUE(r[1].skipped);
  EXPECT_EQ(r[1].rolled_back_sub_groups, all);
  EXPECT_EQ(r[2].speculated_sub_groups + r[2].rolled_back_sub_groups, 0u);
  for (size_t i = 3; i < r.size(); ++i) {
    ASSERT_FALSE(r[i].skipped) << i;
    EXPECT_EQ(r[i].speculated_sub_groups, all) << i;
  }

  spec.tamper = nullptr;
  p = Both(spec, 3, "cpu", "none", "bf16", 1e-3, 1, on);
  ExpectSameRun(p.off, p.on, "overlap_step+clip");
  ASSERT_TRUE(p.on.status.ok());
  ASSERT_GT(p.on.reports[0].clip_coefficient, 1.0);
  EXPECT_EQ(p.on.reports[0].rolled_back_sub_groups, TrainableSubGroups(p.on));
}

// A partial offload (offload_optimizer.ratio 0.5): the offloaded sub-groups are speculated, the
// device-resident ones step in Step; the same bits.
TEST(EngineSpeculationCombined, PartialOffloadSpeculatesTheOffloadedSubGroups) {
  const std::string keys = std::string(kOn) + R"(, "ratio": 0.5)";
  RunSpec spec = Plain(2);
  Pair p;
  spec.config_json =
      Config(3, "nvme", "cpu", "bf16", 1e6, 1, std::string(kOff) + R"(, "ratio": 0.5)");
  p.off = RunEngine(spec);
  spec.config_json = Config(3, "nvme", "cpu", "bf16", 1e6, 1, keys);
  p.on = RunEngine(spec);
  ExpectSameRun(p.off, p.on, "ratio 0.5");
  ASSERT_TRUE(p.on.status.ok());
  const size_t all = TrainableSubGroups(p.on);
  for (const StepReport& r : p.on.reports) {
    EXPECT_GT(r.speculated_sub_groups, 0u);
    EXPECT_LT(r.speculated_sub_groups, all);
  }
}

// A rollback buffer smaller than the optimizer: the groups whose copies fit (in the backward's
// order) are speculated, the rest step in Step; the layout counts the buffer's bytes.
TEST(EngineSpeculationCombined, BoundedBufferSpeculatesWhatFits) {
  const std::string keys = R"("speculative_step": true, "speculation_buffer_size": 600)";
  Pair p = Both(Plain(1), 3, "cpu", "none", "bf16", 1e6, 1, keys);
  ExpectSameRun(p.off, p.on, "bounded");
  ASSERT_TRUE(p.on.status.ok());
  const size_t all = TrainableSubGroups(p.on);
  for (const StepReport& r : p.on.reports) {
    EXPECT_GT(r.speculated_sub_groups, 0u);
    EXPECT_LT(r.speculated_sub_groups, all);
  }
  // 600 elements of copies: 12 bytes of fp32 state and 2 of bf16 param each.
  EXPECT_EQ(
      p.on.layouts[0].working_bytes[Tier::kHost] - p.off.layouts[0].working_bytes[Tier::kHost],
      600u * 14u);
}

// The default: room for a quarter of the rank's offloaded elements, or for all of them up to
// sched::kSpeculationFloorBytes of copies: this small model's whole optimizer; and the key unset,
// the steps timed both ways (sched::SpeculationGovernor): the first three speculate (the first
// is not timed, the next two are the warm-up), the next six alternate, off first, then the
// faster mode holds. The same bits throughout.
TEST(EngineSpeculationCombined, DefaultHoldsASmallModelsWholeOptimizerAndTimesBothWays) {
  Pair p = Both(Plain(1, 1, 11), 3, "nvme", "none", "fp32", 1e6, 1, "");
  ExpectSameRun(p.off, p.on, "default");
  ASSERT_TRUE(p.on.status.ok());
  const uint64_t extra =
      p.on.layouts[0].working_bytes[Tier::kHost] - p.off.layouts[0].working_bytes[Tier::kHost];
  EXPECT_GT(extra, 0u);
  EXPECT_LE(extra, sched::kSpeculationFloorBytes);
  EXPECT_EQ(extra % 16, 0u);  // 12 bytes of fp32 state and 4 of fp32 param per element
  const size_t all = TrainableSubGroups(p.on);
  ASSERT_EQ(p.on.reports.size(), 11u);
  const bool probe[] = {true, true, true, false, true, false, true, false, true};
  for (size_t i = 0; i < std::size(probe); ++i) {
    EXPECT_EQ(p.on.reports[i].speculated_sub_groups, probe[i] ? all : 0) << "step " << i;
  }
  const SpeculationStats& sp = p.on.stats[0].speculation;
  EXPECT_TRUE(sp.applies);
  EXPECT_TRUE(sp.adaptive);
  EXPECT_EQ(sp.probes, 1);
  EXPECT_GT(sp.on_s, 0);
  EXPECT_GT(sp.off_s, 0);
  // Settled: the last two steps ran as the probe chose.
  for (size_t i : {9, 10}) {
    EXPECT_EQ(p.on.reports[i].speculated_sub_groups, sp.next ? all : 0) << "step " << i;
  }
  // The key given: not timed.
  EXPECT_FALSE(p.off.stats[0].speculation.applies);
  const RunResult on = RunEngine([] {
    RunSpec spec = Plain(1, 1, 4);
    spec.config_json = Config(3, "nvme", "none", "fp32", 1e6, 1, kOn);
    return spec;
  }());
  ASSERT_TRUE(on.status.ok()) << on.status.ToString();
  EXPECT_FALSE(on.stats[0].speculation.adaptive);
  EXPECT_TRUE(on.stats[0].speculation.next);
  EXPECT_EQ(on.stats[0].speculation.probes, 0);
}

// The key off, super_offload (DeepSpeed's) read as it, contradictions refused, and where it does
// not apply (the optimizer on the device) a note when it was asked for.
TEST(EngineSpeculationConfig, KeysAndNotes) {
  auto parsed =
      ParseDeepSpeedConfig(Config(3, "cpu", "none", "fp32", 1.0, 1, R"("super_offload": false)"));
  ASSERT_TRUE(parsed.ok());
  EXPECT_EQ(parsed->config.zero.offload_optimizer.speculative_step, std::optional<bool>(false));
  auto conflict = ParseDeepSpeedConfig(Config(
      3, "cpu", "none", "fp32", 1.0, 1, R"("super_offload": true, "speculative_step": false)"));
  ASSERT_FALSE(conflict.ok());
  EXPECT_NE(conflict.status().message().find("super_offload"), std::string::npos)
      << conflict.status().ToString();
  // Not applied: the optimizer on the device, and stages 1-2 (their param replica is the
  // trainer's).
  for (const auto& [stage, opt] :
       {std::pair<int, const char*>{3, "none"}, {2, "cpu"}, {1, "cpu"}}) {
    RunSpec spec = Plain(1, 1, 2);
    spec.config_json = Config(stage, opt, "none", "fp32", 1.0, 1, R"("speculative_step": true)");
    RunResult r = RunEngine(spec);
    ASSERT_TRUE(r.status.ok()) << r.status.ToString();
    EXPECT_TRUE(HasNote(r, "speculative_step: not applied")) << stage << " " << opt;
    for (const StepReport& rep : r.reports) EXPECT_EQ(rep.speculated_sub_groups, 0u);
  }
}

}  // namespace
}  // namespace strata::testing
