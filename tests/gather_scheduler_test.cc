// GatherScheduler: the ZeRO-3 gather / release flow over the TieredStore (simulated IO,
// HostDevice): data is always right, budgets hold, prefetch is issued while the trace replays,
// a diverging step is handled (no prefetch, re-recorded, replayed afterwards), held groups are
// never prefetched, a group in use is never planned for eviction, the policy reads one snapshot
// per call, and every ticket the scheduler issues is checked.
#include "core/store/gather_scheduler.h"
#include "strata/store.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <random>
#include <thread>

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
    auto sim = std::make_unique<nvme::SimBackend>(so);
    sim_ = sim.get();
    o.io = std::move(sim);
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
    pc_.prefetch_bucket_bytes = 2 * kGroup;
    pc_.max_live_bytes = 3 * kGroup;
    pc_.max_reuse_distance_bytes = 0;
    pc_.host_lookahead_bytes = 2 * kGroup;
    gather_ = std::make_unique<GatherScheduler>(store_.get(), ids_, pc_);
  }
  // Runs one step in `order`; every gathered copy must hold its group's bytes.
  void Step(const std::vector<sched::GroupId>& order) { Step(*gather_, order); }
  void Step(GatherScheduler& gather, const std::vector<sched::GroupId>& order) {
    gather.BeginStep();
    for (sched::GroupId g : order) {
      auto l = gather.Gather(g, 20s);
      ASSERT_TRUE(l.ok()) << l.status().ToString() << "\n" << store_->DebugString();
      ExpectGroupBytes(*l, g);
      gather.Release(g, std::move(l).value());
    }
    gather.EndStep();
  }
  static void ExpectGroupBytes(const Lease& l, sched::GroupId g) {
    const uint8_t* p = static_cast<const uint8_t*>(l.data());
    ASSERT_EQ(p[0], g + 1);
    ASSERT_EQ(p[kGroup - 1], g + 1);
  }

  strata::testing::TempDir dir_{"gather"};
  std::unique_ptr<Device> device_;
  nvme::SimBackend* sim_ = nullptr;
  std::unique_ptr<Store> store_;
  std::vector<BlockId> ids_;
  sched::PrefetchConfig pc_;
  std::unique_ptr<GatherScheduler> gather_;
};

// Forwards to a real store, counting what the scheduler asks of it: snapshots, single-block
// reads, and every Evict aimed at a copy that is leased at that moment (the store refuses it).
class CountingStore final : public Store {
 public:
  explicit CountingStore(Store* inner) : s_(inner) {}
  Result<BlockId> Register(const BlockSpec& spec) override { return s_->Register(spec); }
  Status OpenNvme() override { return s_->OpenNvme(); }
  bool nvme_open() const override { return s_->nvme_open(); }
  std::vector<std::string> nvme_files() const override { return s_->nvme_files(); }
  Ticket Fetch(BlockId id, Tier tier) override { return s_->Fetch(id, tier); }
  Ticket WriteBack(BlockId id) override { return s_->WriteBack(id); }
  Ticket Evict(BlockId id, Tier tier) override {
    BlockView v;
    s_->Snapshot({&id, 1}, {&v, 1});
    if (v.leases[tier] > 0) ++leased_evictions;
    return s_->Evict(id, tier);
  }
  Result<Lease> Acquire(BlockId id, Tier tier, Access access,
                        std::chrono::nanoseconds timeout) override {
    return s_->Acquire(id, tier, access, timeout);
  }
  Status Flush(std::chrono::nanoseconds timeout) override { return s_->Flush(timeout); }
  void Snapshot(std::span<const BlockId> ids, std::span<BlockView> out) const override {
    ++snapshots;
    s_->Snapshot(ids, out);
  }
  Residency residency(BlockId id, Tier tier) const override {
    ++single_reads;
    return s_->residency(id, tier);
  }
  const BlockSpec& spec(BlockId id) const override {
    ++single_reads;
    return s_->spec(id);
  }
  size_t num_blocks() const override { return s_->num_blocks(); }
  StoreStats TakeStats(bool reset) override { return s_->TakeStats(reset); }
  std::string DebugString() const override { return s_->DebugString(); }
  std::string note() const override { return s_->note(); }

  uint64_t leased_evictions = 0;
  mutable uint64_t snapshots = 0;
  mutable uint64_t single_reads = 0;

 protected:
  void ReleaseLease(Lease&) override {}  // every lease comes from the inner store

 private:
  Store* s_;
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

TEST_F(GatherTest, HeldGroupsAreNeverPrefetched) {
  // overlap_step's hold: while a group's update is being written, no prefetch touches it. Every
  // group held: a replayed step issues no prefetch at all, and still gathers the right bytes.
  Step(FwdBwd());
  gather_->set_held([](sched::GroupId) { return true; });
  Step(FwdBwd());
  EXPECT_EQ(gather_->prefetches_issued(), 0u);
  // Released: the same replay prefetches again.
  gather_->set_held({});
  Step(FwdBwd());
  EXPECT_GT(gather_->prefetches_issued(), 0u);
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

// Before: Views() never set in_use, so the plan evicted a group the trainer still held (the
// store refused, and the ticket was dropped unread).
TEST_F(GatherTest, NeverPlansToEvictAGroupInUse) {
  CountingStore counting(store_.get());
  sched::PrefetchConfig pc = pc_;
  pc.max_live_bytes = 2 * kGroup;  // holding group 0 leaves room for one more
  GatherScheduler gather(&counting, ids_, pc);
  const std::vector<sched::GroupId> order = FwdBwd();
  Step(gather, order);
  gather.BeginStep();
  auto held = gather.Gather(order[0], 20s);  // kept through the whole step
  ASSERT_TRUE(held.ok()) << held.status().ToString();
  for (size_t i = 1; i < order.size(); ++i) {
    auto l = gather.Gather(order[i], 20s);
    ASSERT_TRUE(l.ok()) << l.status().ToString() << "\n" << store_->DebugString();
    ExpectGroupBytes(*l, order[i]);
    gather.Release(order[i], std::move(l).value());
  }
  gather.Release(order[0], std::move(held).value());
  gather.EndStep();
  EXPECT_GT(gather.prefetches_issued(), 0u);
  EXPECT_EQ(counting.leased_evictions, 0u);
  EXPECT_EQ(gather.failed_ops(), 0u) << gather.last_error().ToString();
}

// Before: three single-block reads per group per Gather (spec, two residencies), each a lock
// round trip, and no consistent view across groups.
TEST_F(GatherTest, ReadsTheStoreThroughOneSnapshotPerCall) {
  CountingStore counting(store_.get());
  GatherScheduler gather(&counting, ids_, pc_);
  const std::vector<sched::GroupId> order = FwdBwd();
  Step(gather, order);
  Step(gather, order);
  EXPECT_EQ(counting.single_reads, 0u);
  // One at construction (are all homes the device?), then one per Gather and one per Release.
  EXPECT_EQ(counting.snapshots, 1 + 2 * 2 * order.size());
}

// Groups whose home is the device leave nothing to plan: after the construction's snapshot no
// Gather or Release reads the store's state, and nothing is prefetched or evicted; the trace is
// still recorded (the engine's reuse distance reads it).
TEST_F(GatherTest, DeviceHomedGroupsPlanNothingAndReadNoSnapshot) {
  std::vector<BlockId> on_device;
  constexpr int kOnDevice = 3;  // what the device budget holds
  for (int g = 0; g < kOnDevice; ++g) {
    auto id = store_->Register({"dev" + std::to_string(g) + ".param16", kGroup, DType::kBF16,
                                StateKind::kParam16, Tier::kDevice});
    ASSERT_TRUE(id.ok()) << id.status().ToString();
    on_device.push_back(*id);
    auto l = store_->Acquire(*id, Tier::kDevice, Access::kWrite, 20s);
    ASSERT_TRUE(l.ok()) << l.status().ToString();
    std::memset(l->data(), g + 1, kGroup);
    l->MarkDirty();
  }
  CountingStore counting(store_.get());
  GatherScheduler gather(&counting, on_device, pc_);
  const std::vector<sched::GroupId> order = {0, 1, 2, 2, 1, 0};
  Step(gather, order);
  Step(gather, order);
  EXPECT_EQ(counting.snapshots, 1u);
  EXPECT_EQ(gather.prefetches_issued(), 0u);
  EXPECT_EQ(gather.evictions_issued(), 0u);
  EXPECT_EQ(gather.trace().recorded(), order);
  for (int g = 0; g < kOnDevice; ++g) {
    EXPECT_EQ(store_->residency(on_device[g], Tier::kDevice), Residency::kValid) << g;
  }
}

TEST_F(GatherTest, FailedPrefetchIsCountedAndReachesTheNextGatherOfItsGroup) {
  const std::vector<sched::GroupId> order = FwdBwd();
  Step(order);
  // The step left groups 0-3 staged on the host (the last four gathered). Without group 1's,
  // the next plan's only IO is group 1's prefetch (0-1 to the device, 2-3 staged already).
  ASSERT_TRUE(store_->Evict(ids_[1], Tier::kHost).Wait(20s).ok());
  for (int g : {0, 2, 3}) ASSERT_EQ(store_->residency(ids_[g], Tier::kHost), Residency::kValid);
  sim_->InjectFault(IoOp::kRead, nvme::SimFault::kEio);
  gather_->BeginStep();
  auto l0 = gather_->Gather(0, 20s);
  ASSERT_TRUE(l0.ok()) << l0.status().ToString();
  gather_->Release(0, std::move(l0).value());
  // The prefetch of group 1 fails in the background (the trainer does not wait for it).
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  while (gather_->failed_ops() == 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(1ms);
  }
  auto l1 = gather_->Gather(1, 20s);
  EXPECT_TRUE(l1.status().IsIOError()) << l1.status().ToString();
  EXPECT_EQ(gather_->failed_ops(), 1u);
  EXPECT_TRUE(gather_->last_error().IsIOError()) << gather_->last_error().ToString();
  auto again = gather_->Gather(1, 20s);  // reported once; the next Gather fetches afresh
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  ExpectGroupBytes(*again, 1);
  gather_->Release(1, std::move(again).value());
  gather_->EndStep();
}

TEST_F(GatherTest, UnknownGroupIsInvalidArgument) {
  EXPECT_TRUE(gather_->Gather(kGroups, 1s).status().IsInvalidArgument());
}

}  // namespace
}  // namespace strata::store
