// The optimizer flow: StepPipeline over NVMe-homed sub-groups in a TieredStore (simulated IO):
// read-ahead fetches to host, compute through a write lease, write-behind eviction. With fewer
// host blocks than pipeline slots it must still finish, and every sub-group must end up updated
// exactly once per pass on NVMe.
#include <chrono>
#include <cstring>

#include <gtest/gtest.h>

#include "nvme/sim_backend.h"
#include "sched/step_pipeline.h"
#include "strata/store.h"
#include "tests/io_test_util.h"

namespace strata::store {
namespace {

using namespace std::chrono_literals;
constexpr uint64_t kSub = 32 << 10;
constexpr int kSubs = 10;

struct Case {
  uint32_t read_ahead, write_behind, host_blocks;
};

class StorePipelineTest : public ::testing::TestWithParam<Case> {};

TEST_P(StorePipelineTest, EverySubGroupUpdatedOncePerPass) {
  const Case c = GetParam();
  strata::testing::TempDir dir("pipeline");
  nvme::SimOptions so;
  so.seed = 77;
  TieredStoreOptions o;
  o.host_budget_bytes = c.host_blocks * kSub;
  o.nvme_capacity_bytes = kSubs * kSub;
  o.io = std::make_unique<nvme::SimBackend>(so);
  o.nvme_paths = {dir.path()};
  o.use_pinned_pool = false;
  auto opened = OpenTieredStore(std::move(o));
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  Store& store = **opened;
  std::vector<BlockId> subs;
  for (int i = 0; i < kSubs; ++i) {
    auto id = store.Register(
        {"sub" + std::to_string(i) + ".adam", kSub, DType::kF32, StateKind::kExpAvg, Tier::kNvme});
    ASSERT_TRUE(id.ok());
    subs.push_back(*id);
  }
  sched::PipelineStages st;
  st.read = [&](size_t i, uint32_t, sched::StageDone done) {
    store.Fetch(subs[i], Tier::kHost).Then(std::move(done));
    return Status::OK();
  };
  st.compute = [&](size_t i, uint32_t) -> Status {
    STRATA_ASSIGN_OR_RETURN(auto l, store.Acquire(subs[i], Tier::kHost, Access::kWrite, 20s));
    auto* p = static_cast<uint8_t*>(l.data());
    for (uint64_t b = 0; b < kSub; ++b) p[b] = static_cast<uint8_t>(p[b] + 1 + i);
    l.MarkDirty();
    return Status::OK();
  };
  st.write = [&](size_t i, uint32_t, sched::StageDone done) {
    store.Evict(subs[i], Tier::kHost).Then(std::move(done));
    return Status::OK();
  };
  sched::StepPipeline pipe({c.read_ahead, c.write_behind, c.read_ahead + 1 + c.write_behind});
  for (int pass = 0; pass < 3; ++pass) {
    sched::PipelineStats ps;
    Status s = pipe.Run(kSubs, st, &ps);
    ASSERT_TRUE(s.ok()) << s.ToString() << "\n" << store.DebugString();
  }
  for (int i = 0; i < kSubs; ++i) {
    EXPECT_EQ(store.residency(subs[i], Tier::kHost), Residency::kAbsent);
    EXPECT_EQ(store.residency(subs[i], Tier::kNvme), Residency::kValid);
    auto l = store.Acquire(subs[i], Tier::kHost, Access::kRead, 20s);
    ASSERT_TRUE(l.ok());
    const auto* p = static_cast<const uint8_t*>(l->data());
    EXPECT_EQ(p[0], 3 * (1 + i));
    EXPECT_EQ(p[kSub - 1], 3 * (1 + i));
  }
  StoreStats s = store.TakeStats(false);
  EXPECT_LE(s.peak_bytes[Tier::kHost], s.budget_bytes[Tier::kHost]);
}

INSTANTIATE_TEST_SUITE_P(Depths, StorePipelineTest,
                         ::testing::Values(Case{2, 2, 5}, Case{2, 2, 2}, Case{3, 1, 1},
                                           Case{0, 0, 1}, Case{1, 3, 3}));

}  // namespace
}  // namespace strata::store
