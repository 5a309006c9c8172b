// The placement rules shared by the planner and the engine (sched/placement.h): every stage and
// offload combination against a table written from DeepSpeed's behaviour.
#include "sched/placement.h"

#include <gtest/gtest.h>

#include <string>

#include "strata/planner.h"

namespace strata::sched {
namespace {

constexpr auto N = OffloadDevice::kNone;
constexpr auto C = OffloadDevice::kCpu;
constexpr auto V = OffloadDevice::kNvme;
constexpr auto D = Tier::kDevice;
constexpr auto H = Tier::kHost;
constexpr auto S = Tier::kNvme;  // storage

struct Row {
  int stage;
  OffloadDevice opt_in, param_in;
  OffloadDevice opt_out, param_out;
  Tier param16, optimizer;  // homes of param16 and of grad/master/m/v
  size_t notes;
};

// 4 stages x 3 optimizer devices x 3 param devices.
constexpr Row kTable[] = {
    {0, N, N, N, N, D, D, 0}, {0, N, C, N, N, D, D, 1}, {0, N, V, N, N, D, D, 1},
    {0, C, N, N, N, D, D, 1}, {0, C, C, N, N, D, D, 2}, {0, C, V, N, N, D, D, 2},
    {0, V, N, N, N, D, D, 1}, {0, V, C, N, N, D, D, 2}, {0, V, V, N, N, D, D, 2},
    {1, N, N, N, N, D, D, 0}, {1, N, C, N, N, D, D, 1}, {1, N, V, N, N, D, D, 1},
    {1, C, N, C, N, D, H, 0}, {1, C, C, C, N, D, H, 1}, {1, C, V, C, N, D, H, 1},
    {1, V, N, C, N, D, H, 1}, {1, V, C, C, N, D, H, 2}, {1, V, V, C, N, D, H, 2},
    {2, N, N, N, N, D, D, 0}, {2, N, C, N, N, D, D, 1}, {2, N, V, N, N, D, D, 1},
    {2, C, N, C, N, D, H, 0}, {2, C, C, C, N, D, H, 1}, {2, C, V, C, N, D, H, 1},
    {2, V, N, C, N, D, H, 1}, {2, V, C, C, N, D, H, 2}, {2, V, V, C, N, D, H, 2},
    {3, N, N, N, N, D, D, 0}, {3, N, C, N, C, H, D, 0}, {3, N, V, N, V, S, D, 0},
    {3, C, N, C, N, D, H, 0}, {3, C, C, C, C, H, H, 0}, {3, C, V, C, V, S, H, 0},
    {3, V, N, V, N, D, S, 0}, {3, V, C, V, C, H, S, 0}, {3, V, V, V, V, S, S, 0},
};

TEST(Placement, EveryStageAndOffloadCombination) {
  for (const Row& r : kTable) {
    const std::string where = "stage " + std::to_string(r.stage) + " optimizer " +
                              std::string(OffloadDeviceName(r.opt_in)) + " param " +
                              std::string(OffloadDeviceName(r.param_in));
    const StatePlacement p = ResolvePlacement(r.stage, r.opt_in, r.param_in);
    EXPECT_EQ(p.offload_optimizer, r.opt_out) << where;
    EXPECT_EQ(p.offload_param, r.param_out) << where;
    EXPECT_EQ(p.Home(StateKind::kParam16), r.param16) << where;
    for (StateKind k :
         {StateKind::kGrad, StateKind::kMaster32, StateKind::kExpAvg, StateKind::kExpAvgSq}) {
      EXPECT_EQ(p.Home(k), r.optimizer) << where << " " << StateKindName(k);
    }
    EXPECT_EQ(p.notes.size(), r.notes) << where;
    EXPECT_EQ(p.optimizer_partitioned, r.stage >= 1) << where;
    EXPECT_EQ(p.grads_partitioned, r.stage >= 2) << where;
    EXPECT_EQ(p.params_partitioned, r.stage >= 3) << where;
  }
}

TEST(Placement, NotesSayWhatChanged) {
  const StatePlacement p = ResolvePlacement(2, V, C);
  ASSERT_EQ(p.notes.size(), 2u);
  EXPECT_NE(p.notes[0].find("nvme needs stage 3"), std::string::npos) << p.notes[0];
  EXPECT_NE(p.notes[1].find("offload_param needs stage 3"), std::string::npos) << p.notes[1];
}

// The planner takes its offload devices and notes from the same rules.
TEST(Placement, PlannerAppliesTheSameRules) {
  PlanInput in;
  in.params = 1e9;
  for (const Row& r : kTable) {
    const Placement plan = Place(in, r.stage, r.opt_in, r.param_in);
    const StatePlacement rules = ResolvePlacement(r.stage, r.opt_in, r.param_in);
    EXPECT_EQ(plan.offload_optimizer, rules.offload_optimizer) << r.stage;
    EXPECT_EQ(plan.offload_param, rules.offload_param) << r.stage;
    // The rules' notes come first; the planner may add its own (swap buffer sizes) after them.
    ASSERT_GE(plan.notes.size(), rules.notes.size()) << r.stage;
    for (size_t i = 0; i < rules.notes.size(); ++i) EXPECT_EQ(plan.notes[i], rules.notes[i]);
  }
}

}  // namespace
}  // namespace strata::sched
