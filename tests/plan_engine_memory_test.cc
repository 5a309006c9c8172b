// The planner against the engine (issue 10): for the same config, the peak memory the engine
// measures per tier matches what the planner places there within 10 %. Both count the states by
// the rules of sched/placement.h (fp32 gradients, the swap buffers of the step pipeline), so
// this fails when either side changes a rule alone. Run as a user would: `offloadctl bench
// engine --sweep --json` prints the engine's peak and `Place()`'s bytes for each setting.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "sched/placement.h"
#include "tests/io_test_util.h"
#include "tests/test_util.h"

namespace {

std::string Ctl() {
  const char* bin = std::getenv("STRATA_OFFLOADCTL");
  return bin != nullptr ? bin : STRATA_OFFLOADCTL_PATH;
}

// |a - b| within `tol` of the larger.
bool Near(double a, double b, double tol) {
  return std::fabs(a - b) <= tol * std::max(std::fabs(a), std::fabs(b));
}

TEST(PlanEngineMemory, SharedRules) {
  using strata::DType;
  using strata::StateKind;
  namespace sc = strata::sched;
  // Gradients and optimizer states fp32 whatever the working dtype; params in it.
  for (DType dt : {DType::kBF16, DType::kF16, DType::kF32}) {
    EXPECT_EQ(sc::StateElementBytes(StateKind::kGrad, dt), 4u);
    EXPECT_EQ(sc::StateElementBytes(StateKind::kMaster32, dt), 4u);
    EXPECT_EQ(sc::StateElementBytes(StateKind::kParam16, dt), strata::DTypeSize(dt));
  }
  // (buffer_count + 1) sub-groups of four fp32 blocks, each in whole pages; counts clamped.
  EXPECT_EQ(sc::OptimizerSwapBufferBytes(4, 1024), 5u * 4 * 4096);
  EXPECT_EQ(sc::OptimizerSwapBufferBytes(4, 1025), 5u * 4 * 8192);
  EXPECT_EQ(sc::OptimizerSwapBufferBytes(0, 1024), 2u * 4 * 4096);
  // Never more sub-groups than the rank has (0: not known).
  EXPECT_EQ(sc::OptimizerSwapBufferBytes(4, 1024, 3), 3u * 4 * 4096);
  EXPECT_EQ(sc::OptimizerSwapBufferBytes(4, 1024, 9), 5u * 4 * 4096);
  EXPECT_EQ(sc::ParamSwapBufferBytes(5, 4096, DType::kBF16), 5u * 8192);
  EXPECT_EQ(sc::ParamSwapBufferBytes(1, 4096, DType::kBF16), 2u * 8192);
}

// Every tier of every setting of `sweep_args`' sweep: the engine's measured peak and the planner's
// figure within 10 %. Returns the number of (setting, tier) pairs compared.
// `host_slack_bytes` is allowed on top of the host figure (see the two-rank test).
int ExpectPeaksMatchThePlanner(const std::string& json, int world, double host_slack_bytes = 0) {
  const auto j = nlohmann::json::parse(json, nullptr, false);
  EXPECT_FALSE(j.is_discarded()) << json;
  if (j.is_discarded()) return 0;
  int checked = 0;
  for (const auto& v : j["variants"]) {
    const std::string name = v["variant"].get<std::string>() + " on " + std::to_string(world);
    EXPECT_TRUE(v["fits"].get<bool>()) << name;
    if (!v["fits"].get<bool>() || v["planner_bytes"].is_null()) {
      ADD_FAILURE() << name << ": no planner figure";
      continue;
    }
    for (const char* tier : {"device", "host", "nvme"}) {
      const double peak = v["peak_bytes"][tier].get<double>();
      const double plan = v["planner_bytes"][tier].get<double>();
      if (peak == 0 && plan == 0) continue;
      const double slack = std::string(tier) == "host" ? host_slack_bytes : 0;
      EXPECT_TRUE(Near(peak, plan, 0.10) || (peak > plan && Near(peak - slack, plan, 0.10)))
          << name << ", " << tier << ": engine peak " << peak << " B, planner " << plan << " B";
      ++checked;
    }
  }
  return checked;
}

// Device: the states plus the engine's working set (sched::DeviceWorkingSet: per-group gradient
// buffers, stage 3's gathered groups and cached param shards) on both sides. Before that rule
// was shared the planner counted DeepSpeed's buckets, at this size +19 % at stage 2, +12 % at
// stage 3 and +45 % with the optimizer offloaded. Host and NVMe: the states and swap buffers
// (the shared rules above). 8 sub-groups cover the step pipeline's buffer_count + 1, and the
// budget's 16 MiB slack is small next to the 360 MB of swap buffers.
TEST(PlanEngineMemory, MeasuredPeakMatchesThePlannerPerTier) {
  strata::testing::TempDir dir("plan-engine-memory");
  const auto r =
      strata::testing::RunShell("timeout 300 " + Ctl() +
                                " bench engine --params 32M --layers 8 --sweep --steps 1 "
                                "--warmup-steps 1 --disk-size 0 --json --nvme-path " +
                                dir.path() + " 2>/dev/null");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  // Device for all 6 settings; host for the 3 offloaded ones; NVMe for the all-NVMe one.
  EXPECT_EQ(ExpectPeaksMatchThePlanner(r.out, 1), 10) << r.out;
}

// Two ranks: shards are half a group, the optimizer partition is read back through an fp32
// buffer, and the stage-3 limits are divided among the ranks' shards. Host, params on NVMe: the
// prefetcher also stages upcoming param shards into host memory, which fills the host budget's
// 16 MiB slack over the planned swap buffers (+16 MB at this size, -15 % against the plan; not
// in the shared rules yet), so up to that much more is allowed there.

TEST(PlanEngineMemory, MeasuredPeakMatchesThePlannerOnTwoRanks) {
  strata::testing::TempDir dir("plan-engine-memory-2");
  const auto r = strata::testing::RunShell(
      "timeout 300 " + Ctl() + " launch -n 2 -- " + Ctl() +
      " bench engine --params 16M --layers 8 --sweep --steps 1 --warmup-steps 1 --disk-size 0 "
      "--json --nvme-path " +
      dir.path() + " 2>/dev/null");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  // Rank 0's lines, without their "[rank 0] " prefix.
  std::string json;
  const std::string tag = "[rank 0] ";
  for (size_t at = 0; at < r.out.size();) {
    size_t end = r.out.find('\n', at);
    if (end == std::string::npos) end = r.out.size();
    const std::string line = r.out.substr(at, end - at);
    if (line.rfind(tag, 0) == 0) json += line.substr(tag.size()) + "\n";
    at = end + 1;
  }
  EXPECT_EQ(ExpectPeaksMatchThePlanner(json, 2, 16 << 20), 10) << r.out;
}

}  // namespace
