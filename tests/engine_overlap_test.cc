// EngineOptions::overlap_step: the optimizer step runs behind the next forward. Proven here:
// the same bits as the step run inside Step (every stage-3 offload placement, world 1 and 2,
// each precision, accumulation, the io_uring backend), Step really returns before its Adam, a
// failure of the step running behind comes back named from the next call and fails the engine,
// and where it does not apply the engine says so and runs as without. Harness:
// engine_test_model.h.
#include <gtest/gtest.h>

#include <string>
#include <tuple>
#include <vector>

#include "device_equivalence.h"

namespace strata::testing {
namespace {

// The device-equivalence cases' config (sub-groups of 256, persistence 64), clipping at 1.0.
std::string Config(const char* opt, const char* param, const std::string& precision, int stage = 3,
                   int gas = 1) {
  return DeviceCaseConfig(stage, opt, param, precision, 1.0, gas);
}

RunResult RunOverlap(const std::string& config, int world, bool overlap, int steps = 3, int gas = 1,
              IoBackendKind io = IoBackendKind::kSimulated) {
  RunSpec spec;
  spec.config_json = config;
  spec.world = world;
  spec.steps = steps;
  spec.gas = gas;
  spec.io = io;
  spec.tweak = [overlap](int, EngineOptions& eo) { eo.overlap_step = overlap; };
  return RunEngine(spec);
}

bool Applied(const RunResult& r) {
  for (const std::string& n : r.layouts[0].notes) {
    if (n.find("overlap_step") != std::string::npos) return false;
  }
  return true;
}

class EngineOverlapStep : public ::testing::TestWithParam<std::tuple<int, std::string>> {};

// Every stage-3 placement with the optimizer offloaded: the same master weights, bit for bit, and
// the same reports (norm, clipping, loss scale, skipped steps) as Step running the Adam itself.
TEST_P(EngineOverlapStep, SameBitsAsTheStepInsideStep) {
  const auto [world, precision] = GetParam();
  for (const char* opt : {"cpu", "nvme"}) {
    for (const char* param : {"none", "cpu", "nvme"}) {
      const std::string name = std::string("opt=") + opt + "/param=" + param;
      const std::string config = Config(opt, param, precision);
      RunResult plain = RunOverlap(config, world, false);
      ASSERT_TRUE(plain.status.ok()) << name << ": " << plain.status.ToString();
      RunResult over = RunOverlap(config, world, true);
      ASSERT_TRUE(over.status.ok()) << name << ": " << over.status.ToString();
      EXPECT_TRUE(Applied(over)) << name;
      EXPECT_TRUE(BitEqual(over.master, plain.master))
          << name << " differs by " << MaxAbsDiff(over.master, plain.master);
      ASSERT_EQ(over.reports.size(), plain.reports.size()) << name;
      for (size_t i = 0; i < plain.reports.size(); ++i) {
        EXPECT_EQ(over.reports[i].grad_norm, plain.reports[i].grad_norm) << name << " step " << i;
        EXPECT_EQ(over.reports[i].skipped, plain.reports[i].skipped) << name << " step " << i;
        EXPECT_EQ(over.reports[i].loss_scale, plain.reports[i].loss_scale) << name;
        EXPECT_EQ(over.reports[i].clip_coefficient, plain.reports[i].clip_coefficient) << name;
      }
      // The weights moved (bit equality would hold vacuously otherwise).
      const auto init = RunReference(world, 0, 1, 0.01f, 0.01f);
      EXPECT_GT(MaxAbsDiff(over.master, init), 5e-3) << name;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(WorldAndPrecision, EngineOverlapStep,
                         ::testing::Combine(::testing::Values(1, 2),
                                            ::testing::Values("fp32", "bf16", "fp16")),
                         [](const auto& info) {
                           return "World" + std::to_string(std::get<0>(info.param)) + "_" +
                                  std::get<1>(info.param);
                         });

// Pairwise: everything on NVMe through io_uring (posix where refused), with accumulation.
TEST(EngineOverlapStepPairwise, IoUringAndAccumulationSameBits) {
  const std::string config = Config("nvme", "nvme", "bf16", 3, 2);
  RunResult plain = RunOverlap(config, 2, false, 3, 2, IoBackendKind::kAuto);
  ASSERT_TRUE(plain.status.ok()) << plain.status.ToString();
  RunResult over = RunOverlap(config, 2, true, 3, 2, IoBackendKind::kAuto);
  ASSERT_TRUE(over.status.ok()) << over.status.ToString();
  EXPECT_TRUE(BitEqual(over.master, plain.master)) << MaxAbsDiff(over.master, plain.master);
}

// Step returns before its Adam: its report carries no optimizer time of its own (the step before
// it, joined during this step's backward, is what a later report carries), where Step without
// overlap reports the Adam it ran.
TEST(EngineOverlapStepTiming, StepReturnsBeforeItsAdamRuns) {
  const std::string config = Config("nvme", "nvme", "fp32");
  RunResult plain = RunOverlap(config, 1, false, 2);
  ASSERT_TRUE(plain.status.ok()) << plain.status.ToString();
  ASSERT_EQ(plain.reports.size(), 2u);
  EXPECT_GT(plain.reports[0].timings.optimizer_ns, 0u);
  RunResult over = RunOverlap(config, 1, true, 2);
  ASSERT_TRUE(over.status.ok()) << over.status.ToString();
  ASSERT_EQ(over.reports.size(), 2u);
  EXPECT_EQ(over.reports[0].timings.optimizer_ns, 0u);
  EXPECT_GT(over.reports[1].timings.optimizer_ns, 0u);  // step 0's, joined in step 1
}

// A failure of the step running behind: Step has returned its report, the next call that waits
// for the step (here Synchronize, then the next Gather) gets the error naming the block, and the
// engine stays failed: nothing of the failed step is silently taken as applied.
TEST(EngineOverlapStepFaults, IoErrorComesBackNamedFromTheNextCallAndFailsTheEngine) {
  RunSpec spec;
  spec.config_json = Config("nvme", "none", "fp32");
  spec.steps = 3;
  spec.timeout = std::chrono::milliseconds(20000);
  spec.budgets[Tier::kHost] = 96 << 10;  // tight: the optimizer pages its state from NVMe
  spec.tweak = [](int, EngineOptions& eo) { eo.overlap_step = true; };
  spec.before_engine_step = [](int, int step, Engine&, nvme::SimBackend* sim) {
    // After step 1's backward: the reads that fail are the Adam's, running behind Step.
    if (step == 1) sim->InjectFault(IoOp::kRead, nvme::SimFault::kEio, 1000);
  };
  Status synced, health_after;
  spec.before_step = [&](int, int step, Engine& e) {
    if (step != 2) return;
    synced = e.Synchronize();
    health_after = e.health();
  };
  RunResult r = RunEngine(spec);
  // Steps 0 and 1 reported: Step 1 returned before its Adam failed.
  EXPECT_EQ(r.reports.size(), 2u);
  ASSERT_FALSE(synced.ok());
  EXPECT_EQ(synced.code(), Status::Code::kIOError) << synced.ToString();
  EXPECT_NE(synced.message().find("optimizer step"), std::string::npos) << synced.ToString();
  EXPECT_NE(synced.message().find("[r0"), std::string::npos) << synced.ToString();
  EXPECT_EQ(health_after.ToString(), synced.ToString());
  // Step 2's first Gather finds the engine failed, quoting the error.
  ASSERT_FALSE(r.rank_status[0].ok());
  EXPECT_EQ(r.rank_status[0].code(), Status::Code::kFailedPrecondition)
      << r.rank_status[0].ToString();
  EXPECT_NE(r.rank_status[0].message().find("optimizer step"), std::string::npos)
      << r.rank_status[0].ToString();
}

// Without Synchronize, the first Gather after the failure is the call that reports it.
TEST(EngineOverlapStepFaults, TheNextGatherReportsTheFailure) {
  RunSpec spec;
  spec.config_json = Config("nvme", "nvme", "fp32");
  spec.steps = 3;
  spec.timeout = std::chrono::milliseconds(20000);
  spec.budgets[Tier::kHost] = 128 << 10;  // params on NVMe too: 120 KiB of working set
  spec.tweak = [](int, EngineOptions& eo) { eo.overlap_step = true; };
  spec.before_engine_step = [](int, int step, Engine&, nvme::SimBackend* sim) {
    if (step == 1) sim->InjectFault(IoOp::kRead, nvme::SimFault::kEio, 1000);
  };
  RunResult r = RunEngine(spec);
  EXPECT_EQ(r.reports.size(), 2u);
  ASSERT_FALSE(r.rank_status[0].ok());
  const std::string msg = r.rank_status[0].ToString();
  EXPECT_EQ(r.rank_status[0].code(), Status::Code::kIOError) << msg;
  EXPECT_NE(msg.find("optimizer step"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[r0"), std::string::npos) << msg;
}

// Where it does not apply (stage 2: the step all-gathers the params it publishes; optimizer on the
// device at stage 3), a layout note says so and the run is the one without.
TEST(EngineOverlapStepNotApplied, NotesItAndRunsAsWithout) {
  for (const auto& [stage, opt] : {std::pair<int, const char*>{2, "cpu"}, {3, "none"}}) {
    const std::string config = Config(opt, "none", "bf16", stage);
    RunResult plain = RunOverlap(config, 2, false);
    ASSERT_TRUE(plain.status.ok()) << plain.status.ToString();
    RunResult over = RunOverlap(config, 2, true);
    ASSERT_TRUE(over.status.ok()) << over.status.ToString();
    EXPECT_FALSE(Applied(over)) << "stage " << stage << " opt=" << opt;
    EXPECT_TRUE(Applied(plain));
    EXPECT_TRUE(BitEqual(over.master, plain.master));
    // Step ran the Adam itself.
    EXPECT_GT(over.reports[0].timings.optimizer_ns, 0u);
  }
}

}  // namespace
}  // namespace strata::testing
