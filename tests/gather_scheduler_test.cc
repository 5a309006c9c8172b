// GatherScheduler: the ZeRO-3 gather / release flow over the TieredStore (simulated IO,
// HostDevice): data is always right, budgets hold, prefetch is issued while the trace replays,
// and a diverging step is handled (no prefetch, re-recorded, replayed afterwards).
#include "core/store/gather_scheduler.h"
#include "strata/store.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <random>

#include <gtest/gtest.h>

#include "nvme/sim_backend.h"
#include "tests/io_test_util.h"

namespace strata::store {
namespace {

using namespace std::chrono_literals;
constexpr uint64_t kGroup = 16 << 10;
constexpr int kGroups = 8;

class GatherTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto dev = CreateHostDevice({.budget_bytes = 16 << 20});
    ASSERT_TRUE(dev.ok());
    device_ = std::move(dev).value();
    nvme::SimOptions so;
    so.seed = 11;
    TieredStoreOptions o;
    o.device_budget_bytes = 3 * kGroup;
    o.host_budget_bytes = 4 * kGroup;
    o.nvme_capacity_bytes = kGroups * kGroup;
    o.device = device_.get();
    o.io = std::make_unique<nvme::SimBackend>(so);
    o.nvme_paths = {dir_.path()};
    o.use_pinned_pool = false;
    auto s = OpenTieredStore(std::move(o));
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    store_ = std::move(s).value();
    for (int g = 0; g < kGroups; ++g) {
      auto id = store_->Register({"layer" + std::to_string(g) + ".param16", kGroup, DType::kBF16,
                                  StateKind::kParam16, Tier::kNvme});
      ASSERT_TRUE(id.ok());
      ids_.push_back(*id);
    }
    // Every NVMe block is registered before the first use opens the NVMe tier.
    for (int g = 0; g < kGroups; ++g) {
      const BlockId* id = &ids_[g];
      auto l = store_->Acquire(*id, Tier::kHost, Access::kWrite, 20s);
      ASSERT_TRUE(l.ok());
      std::memset(l->data(), g + 1, kGroup);
      l->MarkDirty();
      l->Release();
      ASSERT_TRUE(store_->Evict(*id, Tier::kHost).Wait(20s).ok());
    }
    sched::PrefetchConfig pc;
    pc.prefetch_bucket_bytes = 2 * kGroup;
    pc.max_live_bytes = 3 * kGroup;
    pc.max_reuse_distance_bytes = 0;
    pc.persistence_threshold_bytes = 0;
    pc.host_lookahead_bytes = 2 * kGroup;
    gather_ = std::make_unique<GatherScheduler>(store_.get(), ids_, pc);
  }
  // Runs one step in `order`; every gathered copy must hold its group's bytes.
  void Step(const std::vector<sched::GroupId>& order) {
    gather_->BeginStep();
    for (sched::GroupId g : order) {
      auto l = gather_->Gather(g, 20s);
      ASSERT_TRUE(l.ok()) << l.status().ToString() << "\n" << store_->DebugString();
      const uint8_t* p = static_cast<const uint8_t*>(l->data());
      ASSERT_EQ(p[0], g + 1);
      ASSERT_EQ(p[kGroup - 1], g + 1);
      gather_->Release(g, std::move(l).value());
    }
    gather_->EndStep();
  }

  strata::testing::TempDir dir_{"gather"};
  std::unique_ptr<Device> device_;
  std::unique_ptr<Store> store_;
  std::vector<BlockId> ids_;
  std::unique_ptr<GatherScheduler> gather_;
};

std::vector<sched::GroupId> FwdBwd() {
  std::vector<sched::GroupId> o;
  for (int g = 0; g < kGroups; ++g) o.push_back(g);
  for (int g = kGroups; g-- > 0;) o.push_back(g);
  return o;
}

TEST_F(GatherTest, ReplayedStepsPrefetchWithinBudgets) {
  Step(FwdBwd());
  EXPECT_EQ(gather_->prefetches_issued(), 0u);  // the recording step has no lookahead
  Step(FwdBwd());
  Step(FwdBwd());
  EXPECT_GT(gather_->prefetches_issued(), 0u);
  EXPECT_EQ(gather_->trace().divergences(), 0u);
  StoreStats s = store_->TakeStats(false);
  for (Tier t : kAllTiers) EXPECT_LE(s.peak_bytes[t], s.budget_bytes[t]);
}

TEST_F(GatherTest, DivergentStepIsHandledAndReRecorded) {
  Step(FwdBwd());
  Step(FwdBwd());
  std::vector<sched::GroupId> other = FwdBwd();
  std::shuffle(other.begin(), other.end(), std::mt19937(5));
  const uint64_t before = gather_->prefetches_issued();
  // Diverges at the first access that differs; data stays right.
  Step(other);
  EXPECT_EQ(gather_->trace().divergences(), 1u);
  EXPECT_EQ(gather_->trace().recorded(), other);
  const uint64_t during = gather_->prefetches_issued() - before;
  Step(other);  // the new order replays
  EXPECT_EQ(gather_->trace().divergences(), 1u);
  EXPECT_GT(gather_->prefetches_issued() - before, during);
}

TEST_F(GatherTest, UnknownGroupIsInvalidArgument) {
  EXPECT_TRUE(gather_->Gather(kGroups, 1s).status().IsInvalidArgument());
}

}  // namespace
}  // namespace strata::store
