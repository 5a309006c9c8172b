// The engine proven equivalent across placements (bit for bit) and close to a plain fp32 AdamW
// reference across world sizes; the ledger, budgets, semantics and faults. Model and harness:
// engine_test_model.h.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "engine_test_model.h"

namespace strata::testing {
namespace {

struct Placement {
  int stage;
  const char* opt;
  const char* param;
};

std::string Config(const Placement& pl, const std::string& precision, int gas = 1,
                   const std::string& extra_top = "", const std::string& extra_zero = "") {
  // No clipping (DeepSpeed's default clips at 1.0): the references (RunReference) do not clip.
  std::string s = R"({
  "train_micro_batch_size_per_gpu": 3, "gradient_clipping": 0,
  "gradient_accumulation_steps": )" +
                  std::to_string(gas) + R"(,
  "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
  "bf16": {"enabled": )" +
                  std::string(precision == "bf16" ? "true" : "false") + R"(},
  "fp16": {"enabled": )" +
                  std::string(precision == "fp16" ? "true" : "false") +
                  R"(, "initial_scale_power": 8},)" + extra_top + R"(
  "zero_optimization": {
    "stage": )" + std::to_string(pl.stage) +
                  R"(,
    "offload_optimizer": {"device": ")" +
                  pl.opt + R"(", "nvme_path": "/tmp"},
    "offload_param": {"device": ")" +
                  pl.param + R"(", "nvme_path": "/tmp"},
    "sub_group_size": 256,
    "stage3_param_persistence_threshold": 64)" +
                  extra_zero + R"(
  }
})";
  return s;
}

// Every placement of the matrix: stage 0; stages 1-2 x optimizer none/cpu/nvme (nvme runs as cpu
// below stage 3, DeepSpeed's rule); stage 3 x optimizer x params.
std::vector<Placement> AllPlacements() {
  std::vector<Placement> v = {{0, "none", "none"}};
  const char* devs[] = {"none", "cpu", "nvme"};
  for (int stage : {1, 2}) {
    for (const char* o : devs) v.push_back({stage, o, "none"});
  }
  for (const char* o : devs) {
    for (const char* p : devs) v.push_back({3, o, p});
  }
  return v;
}

std::string Name(const Placement& p) {
  return "stage" + std::to_string(p.stage) + "/opt=" + p.opt + "/param=" + p.param;
}

// Every rank's own status, for a failure message (a rank that refuses names why only in its own).
std::string RankStatuses(const std::vector<Status>& st) {
  std::string out;
  for (size_t i = 0; i < st.size(); ++i)
    out += "\n  rank " + std::to_string(i) + ": " + st[i].ToString();
  return out;
}

// ------------------------------------------------------------------------------------------------
// The matrix: for each world size and precision, every placement gives bit-identical master
// weights after 3 steps, and they are within tolerance of the fp32 reference.
// Full: 16 placements x world 1/2/4 x fp32/bf16/fp16, simulated IO backend.
// ------------------------------------------------------------------------------------------------

class EngineMatrix : public ::testing::TestWithParam<std::tuple<int, std::string>> {};

TEST_P(EngineMatrix, FullEveryPlacementBitIdentical) {
  const auto [world, precision] = GetParam();
  const int steps = 3;
  std::vector<std::vector<float>> baseline;
  for (const Placement& pl : AllPlacements()) {
    RunSpec spec;
    spec.config_json = Config(pl, precision);
    spec.world = world;
    spec.steps = steps;
    RunResult r = RunEngine(spec);
    ASSERT_TRUE(r.status.ok()) << Name(pl) << ": " << r.status.ToString()
                               << RankStatuses(r.rank_status);
    ASSERT_EQ(r.reports.size(), static_cast<size_t>(steps));
    for (const StepReport& rep : r.reports) EXPECT_FALSE(rep.skipped) << Name(pl);
    if (baseline.empty()) {
      baseline = r.master;
      // Within tolerance of the plain fp32 AdamW reference, measured as the error relative to
      // the distance training moved the weights: fp32 1e-4 (summation order only), bf16 / fp16
      // 0.1 (16-bit working params and gradients; Adam's m / sqrt(v) turns a sign flip of a tiny
      // gradient into a whole lr-sized step, so the max error alone says little).
      const auto ref = RunReference(world, steps, 1, 0.01f, 0.01f);
      const auto init = RunReference(world, 0, 1, 0.01f, 0.01f);
      const double tol = precision == "fp32" ? 1e-4 : 0.1;
      const double err = RelativeUpdateError(baseline, ref, init);
      std::printf("world %d %s: relative error against the reference %.3g, max %.3g\n", world,
                  precision.c_str(), err, MaxAbsDiff(baseline, ref));
      EXPECT_LT(err, tol) << "against the reference";
      // The weights moved (the test would pass vacuously otherwise).
      EXPECT_GT(MaxAbsDiff(baseline, init), 5e-3);
    } else {
      EXPECT_TRUE(BitEqual(r.master, baseline))
          << Name(pl) << " differs from stage 0 by " << MaxAbsDiff(r.master, baseline);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(WorldAndPrecision, EngineMatrix,
                         ::testing::Combine(::testing::Values(1, 2, 4),
                                            ::testing::Values("fp32", "bf16", "fp16")),
                         [](const auto& info) {
                           return "World" + std::to_string(std::get<0>(info.param)) + "_" +
                                  std::get<1>(info.param);
                         });

// Pairwise: the io_uring backend (or posix where io_uring is refused) with everything on NVMe,
// against stage 0, with gradient accumulation, for each precision on 2 ranks.
TEST(EngineMatrixPairwise, IoUringNvmeAndAccumulationMatchStage0) {
  for (const std::string precision : {"fp32", "bf16", "fp16"}) {
    RunSpec a;
    a.config_json = Config({0, "none", "none"}, precision, 2);
    a.world = 2;
    a.gas = 2;
    RunResult base = RunEngine(a);
    ASSERT_TRUE(base.status.ok()) << base.status.ToString();
    RunSpec b = a;
    b.config_json = Config({3, "nvme", "nvme"}, precision, 2);
    b.io = IoBackendKind::kAuto;
    RunResult nvme = RunEngine(b);
    ASSERT_TRUE(nvme.status.ok()) << nvme.status.ToString();
    EXPECT_TRUE(BitEqual(nvme.master, base.master)) << precision;
    if (precision == "fp32") {
      EXPECT_LT(MaxAbsDiff(base.master, RunReference(2, 3, 2, 0.01f, 0.01f)), 2e-5);
    }
  }
}

// One rank: the reduction and the stage-3 all-gather are identities, so the engine runs them
// without the communicator (Accumulate reads the trainer's buffer; the gather copies the shard).
// No reduce-scatter or all-gather reaches it, and the weights stay bit-identical to stage 0's,
// with gradient accumulation (first and later micro-steps) and params on NVMe.
TEST(EngineOneRank, ReducesAndGathersWithoutTheCommunicator) {
  RunSpec a;
  a.config_json = Config({0, "none", "none"}, "bf16", 2);
  a.gas = 2;
  a.steps = 2;
  RunResult base = RunEngine(a);
  ASSERT_TRUE(base.status.ok()) << base.status.ToString();
  for (const Placement& pl : {Placement{2, "cpu", "none"}, Placement{3, "nvme", "nvme"}}) {
    RunSpec b = a;
    b.config_json = Config(pl, "bf16", 2);
    RunResult r = RunEngine(b);
    ASSERT_TRUE(r.status.ok()) << Name(pl) << ": " << r.status.ToString();
    EXPECT_TRUE(BitEqual(r.master, base.master)) << Name(pl);
    const CommStats& c = r.stats[0].comm;
    EXPECT_EQ(c.of(CommOp::kReduceScatter).calls, 0u) << Name(pl);
    EXPECT_EQ(c.of(CommOp::kAllGather).calls, 0u) << Name(pl);
  }
}

}  // namespace
}  // namespace strata::testing
