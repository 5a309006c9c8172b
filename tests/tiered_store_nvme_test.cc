// TieredStore's NVMe tier over nvme::SwapSpace (simulated IO backend, HostDevice): the
// register-then-open phase, striping over several nvme paths, crash-leftover detection; and
// write-lease exclusion (a writer waits for readers, new readers queue behind a waiting writer).
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include <gtest/gtest.h>

#include "nvme/sim_backend.h"
#include "nvme/swap_space.h"
#include "strata/store.h"
#include "tests/io_test_util.h"
#include "tests/store_test_util.h"

namespace strata::store {
namespace {

using namespace std::chrono_literals;
constexpr auto kWait = 20s;
constexpr uint64_t kBlock = 16 << 10;

struct Fixture {
  std::unique_ptr<Device> device;
  std::unique_ptr<Store> store;
};

Result<Fixture> OpenStore(std::vector<std::string> paths, size_t stripe = 4096,
                          uint64_t host_blocks = 8) {
  Fixture f;
  STRATA_ASSIGN_OR_RETURN(f.device, CreateHostDevice({.budget_bytes = 16 << 20}));
  nvme::SimOptions so;
  so.seed = 11;
  so.queue_depth = 8;
  TieredStoreOptions o;
  o.device_budget_bytes = 8 * kBlock;
  o.host_budget_bytes = host_blocks * kBlock;
  o.nvme_capacity_bytes = 64 * kBlock;
  o.device = f.device.get();
  o.io = std::make_unique<nvme::SimBackend>(so);
  o.nvme_paths = std::move(paths);
  o.stripe_unit_bytes = stripe;
  o.use_pinned_pool = false;
  STRATA_ASSIGN_OR_RETURN(f.store, OpenTieredStore(std::move(o)));
  return f;
}

BlockSpec Spec(const std::string& name, Tier home, uint64_t size = kBlock) {
  return BlockSpec{name, size, DType::kF32, StateKind::kMaster32, home};
}

void Fill(Store& s, BlockId id, uint8_t v) {
  auto l = s.Acquire(id, Tier::kHost, Access::kWrite, kWait);
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  std::memset(l->data(), v, l->size_bytes());
  l->MarkDirty();
}

int Value(Store& s, BlockId id, Tier tier) {
  auto l = s.Acquire(id, tier, Access::kRead, kWait);
  EXPECT_TRUE(l.ok()) << l.status().ToString();
  if (!l.ok()) return -2;
  const uint8_t* p = static_cast<const uint8_t*>(l->data());
  for (uint64_t i = 1; i < l->size_bytes(); ++i) {
    if (p[i] != p[0]) return -1;
  }
  return p[0];
}

TEST(StoreNvme, RegisteringAnNvmeBlockAfterTheTierOpenedIsFailedPrecondition) {
  strata::testing::TempDir dir("store-nvme");
  auto f = OpenStore({dir.path()});
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  Store& s = *f->store;
  auto a = s.Register(Spec("a", Tier::kNvme));
  ASSERT_TRUE(a.ok());
  EXPECT_FALSE(s.nvme_open());
  EXPECT_TRUE(s.nvme_files().empty());
  EXPECT_FALSE(std::filesystem::exists(nvme::SwapFilePath(dir.path(), 0)));
  EXPECT_EQ(Value(s, *a, Tier::kHost), 0);  // first NVMe use opens the tier
  EXPECT_TRUE(s.nvme_open());
  EXPECT_TRUE(std::filesystem::exists(nvme::SwapFilePath(dir.path(), 0)));
  auto late = s.Register(Spec("late", Tier::kNvme));
  ASSERT_EQ(late.status().code(), Status::Code::kFailedPrecondition) << late.status().ToString();
  EXPECT_NE(late.status().ToString().find("'late'"), std::string::npos);
  // Other tiers can still be registered; OpenNvme is idempotent.
  EXPECT_TRUE(s.Register(Spec("h", Tier::kHost)).ok());
  EXPECT_TRUE(s.OpenNvme().ok());
  f->store.reset();  // a clean close removes the swap file
  EXPECT_FALSE(std::filesystem::exists(nvme::SwapFilePath(dir.path(), 0)));
}

TEST(StoreNvme, BlocksAreStripedOverEveryPathAndReadBackIntact) {
  strata::testing::TempDir d0("store-p0"), d1("store-p1");
  auto f = OpenStore({d0.path(), d1.path()}, /*stripe=*/4096);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  Store& s = *f->store;
  std::vector<BlockId> ids;
  for (int i = 0; i < 4; ++i) {
    auto id = s.Register(Spec("sg" + std::to_string(i), Tier::kNvme));
    ASSERT_TRUE(id.ok());
    ids.push_back(*id);
  }
  ASSERT_TRUE(s.OpenNvme().ok());
  auto files = s.nvme_files();
  ASSERT_EQ(files.size(), 2u);
  // 4 blocks of 4 stripe units each, alternating paths: half the bytes on each file.
  EXPECT_EQ(std::filesystem::file_size(files[0]), 8 * kBlock / 4);
  EXPECT_EQ(std::filesystem::file_size(files[1]), 8 * kBlock / 4);
  for (size_t i = 0; i < ids.size(); ++i) Fill(s, ids[i], static_cast<uint8_t>(0x10 + i));
  ASSERT_TRUE(s.Flush(kWait).ok());
  for (BlockId id : ids) ASSERT_TRUE(s.Evict(id, Tier::kHost).Wait(kWait).ok());
  for (size_t i = 0; i < ids.size(); ++i) {
    EXPECT_EQ(Value(s, ids[i], Tier::kDevice), static_cast<int>(0x10 + i));
  }
  EXPECT_EQ(s.TakeStats(false).io_bytes, 2 * ids.size() * kBlock);  // one write, one read each
}

// An NVMe tier that cannot open (here: a directory under this rank's swap file name, which is
// not strata's to use) fails every NVMe operation with the reason; other tiers keep working.
TEST(StoreNvme, UnusableSwapPathIsReportedToEveryNvmeOperation) {
  strata::testing::TempDir dir("store-unusable");
  std::filesystem::create_directory(nvme::SwapFilePath(dir.path(), 0));
  auto f = OpenStore({dir.path()});
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  Store& s = *f->store;
  auto a = s.Register(Spec("layer0.master32", Tier::kNvme));
  auto h = s.Register(Spec("grad", Tier::kHost));
  ASSERT_TRUE(a.ok() && h.ok());
  auto l = s.Acquire(*a, Tier::kHost, Access::kRead, kWait);
  ASSERT_EQ(l.status().code(), Status::Code::kFailedPrecondition) << l.status().ToString();
  EXPECT_NE(l.status().ToString().find("layer0.master32"), std::string::npos);
  EXPECT_NE(l.status().ToString().find("strata-swap-rank0.swp' is a directory"), std::string::npos)
      << l.status().ToString();
  Status again = s.Fetch(*a, Tier::kHost).Wait(kWait);
  EXPECT_EQ(again.code(), Status::Code::kFailedPrecondition) << again.ToString();
  EXPECT_EQ(s.OpenNvme().code(), Status::Code::kFailedPrecondition);
  EXPECT_EQ(Value(s, *h, Tier::kDevice), 0);  // blocks on other tiers keep working
  EXPECT_TRUE(std::filesystem::is_directory(nvme::SwapFilePath(dir.path(), 0)));
}

// A crashed run's swap file is reclaimed when the tier opens, and the store's note says so.
TEST(StoreNvme, CrashLeftoverIsReclaimedAndNoted) {
  strata::testing::TempDir dir("store-crash");
  const std::string leftover = nvme::SwapFilePath(dir.path(), 0);
  { std::ofstream(leftover) << "left by a crashed run"; }
  auto f = OpenStore({dir.path()});
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  Store& s = *f->store;
  auto a = s.Register(Spec("layer0.master32", Tier::kNvme));
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(s.OpenNvme().ok());
  EXPECT_NE(s.note().find("reclaimed 1 file(s) left by a run that did not close cleanly"),
            std::string::npos)
      << s.note();
  EXPECT_NE(s.note().find("'" + leftover + "'"), std::string::npos) << s.note();
  Fill(s, *a, 0x5a);
  ASSERT_TRUE(s.Flush(kWait).ok());
  ASSERT_TRUE(s.Evict(*a, Tier::kHost).Wait(kWait).ok());
  EXPECT_EQ(Value(s, *a, Tier::kDevice), 0x5a);
}

TEST(StoreNvme, MissingPathIsNotFoundNamingIt) {
  auto f = OpenStore({"/nonexistent/strata-nvme"});
  ASSERT_TRUE(f.ok());
  auto a = f->store->Register(Spec("x", Tier::kNvme));
  ASSERT_TRUE(a.ok());
  Status s = f->store->Fetch(*a, Tier::kHost).Wait(kWait);
  EXPECT_TRUE(s.IsNotFound()) << s.ToString();
  EXPECT_NE(s.ToString().find("/nonexistent/strata-nvme"), std::string::npos);
}

using testing::Eventually;  // waits (bounded) until a predicate holds

TEST(StoreLeases, WriteLeaseWaitsForReadersAndLaterReadersQueueBehindIt) {
  strata::testing::TempDir dir("store-lease");
  auto f = OpenStore({dir.path()});
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  Store& s = *f->store;
  auto id = s.Register(Spec("layer5.master32", Tier::kHost));
  ASSERT_TRUE(id.ok());
  Fill(s, *id, 1);
  auto r1 = s.Acquire(*id, Tier::kHost, Access::kRead, kWait);
  ASSERT_TRUE(r1.ok());
  // A reader holds the block: no write lease, on this tier or another.
  EXPECT_TRUE(s.Acquire(*id, Tier::kHost, Access::kWrite, 50ms).status().IsDeadlineExceeded());
  EXPECT_TRUE(s.Acquire(*id, Tier::kDevice, Access::kWrite, 50ms).status().IsDeadlineExceeded());
  // A second reader shares it while no writer waits.
  EXPECT_TRUE(s.Acquire(*id, Tier::kHost, Access::kRead, kWait).ok());

  std::atomic<bool> wrote{false};
  std::thread writer([&] {
    auto w = s.Acquire(*id, Tier::kHost, Access::kWrite, kWait);
    ASSERT_TRUE(w.ok()) << w.status().ToString();
    std::memset(w->data(), 7, w->size_bytes());
    w->MarkDirty();
    wrote = true;
  });
  // The writer is queued (its fetch is the block's only operation)...
  ASSERT_TRUE(Eventually([&] {
    return s.DebugString().find("ops=fetch:host,") != std::string::npos;
  })) << s.DebugString();
  EXPECT_FALSE(wrote.load());
  // ...so a new reader does not overtake it, although the copy is valid and only read-leased.
  auto r2 = s.Acquire(*id, Tier::kHost, Access::kRead, 50ms);
  EXPECT_TRUE(r2.status().IsDeadlineExceeded()) << r2.status().ToString();
  int seen = -3;
  std::thread reader([&] { seen = Value(s, *id, Tier::kHost); });
  std::this_thread::sleep_for(20ms);
  EXPECT_FALSE(wrote.load());  // still held by r1
  r1->Release();
  writer.join();
  reader.join();
  EXPECT_TRUE(wrote.load());
  EXPECT_EQ(seen, 7);  // the reader queued behind the writer sees its bytes
  EXPECT_EQ(s.TakeStats(false).acquire_timeouts, 3u);
}

TEST(StoreLeases, TimedOutAcquireCancelsItsFetch) {
  strata::testing::TempDir dir("store-cancel");
  auto f = OpenStore({dir.path()}, 4096, /*host_blocks=*/1);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  Store& s = *f->store;
  auto a = s.Register(Spec("a", Tier::kNvme));
  auto b = s.Register(Spec("b", Tier::kNvme));
  ASSERT_TRUE(a.ok() && b.ok());
  auto la = s.Acquire(*a, Tier::kHost, Access::kRead, kWait);  // fills the host tier
  ASSERT_TRUE(la.ok());
  auto lb = s.Acquire(*b, Tier::kHost, Access::kRead, 50ms);  // waits for space, times out
  EXPECT_TRUE(lb.status().IsDeadlineExceeded()) << lb.status().ToString();
  StoreStats st = s.TakeStats(false);
  EXPECT_EQ(st.acquire_timeouts, 1u);
  EXPECT_EQ(st.cancelled_fetches, 1u);
  la->Release();
  // Nothing of b's fetch is left to run: a's copy stays, b stays absent.
  EXPECT_EQ(s.residency(*b, Tier::kHost), Residency::kAbsent);
  EXPECT_EQ(s.residency(*a, Tier::kHost), Residency::kValid);
  EXPECT_EQ(s.DebugString().find("ops=fetch"), std::string::npos) << s.DebugString();
  EXPECT_EQ(Value(s, *b, Tier::kHost), 0);  // a later Acquire fetches afresh (evicting a)
}

}  // namespace
}  // namespace strata::store
