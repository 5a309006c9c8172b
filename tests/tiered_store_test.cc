// TieredStore over the simulated IO backend (seeded latencies, reordered completions, injected
// faults) and the HostDevice. Every wait is bounded; a failing test prints its seed.
#include "strata/store.h"

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include "nvme/sim_backend.h"
#include "nvme/swap_space.h"
#include "tests/io_test_util.h"
#include "tests/store_test_util.h"

namespace strata::store {
namespace {

using namespace std::chrono_literals;
using testing::Budgets;
using testing::kBlock;
using testing::kWait;
using testing::StoreTest;

TEST_F(StoreTest, ChainsNvmeToHostToDeviceAndWritesBack) {
  Open({});
  BlockId b = Reg("layer0.master32", Tier::kNvme);
  EXPECT_EQ(store_->residency(b, Tier::kNvme), Residency::kValid);
  EXPECT_EQ(Read(b, Tier::kDevice), 0);  // registered zero-filled
  EXPECT_EQ(store_->residency(b, Tier::kHost), Residency::kValid);
  Write(b, Tier::kDevice, 0x5A);
  EXPECT_EQ(store_->residency(b, Tier::kDevice), Residency::kDirty);
  EXPECT_EQ(store_->residency(b, Tier::kHost), Residency::kAbsent);  // stale copy dropped
  EXPECT_EQ(store_->residency(b, Tier::kNvme), Residency::kStale);
  ASSERT_TRUE(store_->WriteBack(b).Wait(kWait).ok());
  EXPECT_EQ(store_->residency(b, Tier::kNvme), Residency::kValid);
  ASSERT_TRUE(store_->Evict(b, Tier::kDevice).Wait(kWait).ok());
  ASSERT_TRUE(store_->Evict(b, Tier::kHost).Wait(kWait).ok());
  EXPECT_EQ(store_->residency(b, Tier::kHost), Residency::kAbsent);
  EXPECT_EQ(Read(b, Tier::kHost), 0x5A);  // from NVMe, checksum verified
  StoreStats s = store_->TakeStats(false);
  EXPECT_EQ(s.bytes_moved[Tier::kNvme][Tier::kHost], 2 * kBlock);
  EXPECT_EQ(s.bytes_moved[Tier::kHost][Tier::kDevice], kBlock);
  EXPECT_EQ(s.bytes_moved[Tier::kDevice][Tier::kHost], kBlock);
  EXPECT_EQ(s.bytes_moved[Tier::kHost][Tier::kNvme], kBlock);
  EXPECT_EQ(s.copy_bytes, 2 * kBlock);  // one copy each way
  EXPECT_GT(s.copy_busy_ns, 0u);
  // One read, one write: the first fetch was of zeros never written (no IO).
  EXPECT_EQ(s.io_bytes, 2 * kBlock);
  EXPECT_GT(s.io_busy_ns, 0u);
  // Every byte written was hashed and every byte read verified, on the IO thread.
  EXPECT_EQ(s.checksum_bytes, 2 * kBlock);
  EXPECT_GT(s.checksum_ns, 0u);
  EXPECT_LE(s.checksum_idle_ns, s.checksum_ns);
}

TEST_F(StoreTest, EvictingTheOnlyNewestCopyWritesItBackFirst) {
  Open({});
  BlockId b = Reg("g", Tier::kNvme);
  Write(b, Tier::kHost, 9);
  ASSERT_TRUE(store_->Evict(b, Tier::kHost).Wait(kWait).ok());
  EXPECT_EQ(store_->residency(b, Tier::kNvme), Residency::kValid);
  EXPECT_EQ(Read(b, Tier::kDevice), 9);
  EXPECT_TRUE(store_->Evict(b, Tier::kNvme).Wait(kWait).code() ==
              Status::Code::kFailedPrecondition);
}

TEST_F(StoreTest, HostAndDeviceHomes) {
  Open({});
  BlockId h = Reg("grad.h", Tier::kHost);
  BlockId d = Reg("param.d", Tier::kDevice);
  Write(d, Tier::kHost, 3);  // host cache of a device-home block
  EXPECT_EQ(store_->residency(d, Tier::kDevice), Residency::kStale);
  ASSERT_TRUE(store_->WriteBack(d).Wait(kWait).ok());
  Write(h, Tier::kDevice, 4);
  ASSERT_TRUE(store_->Flush(kWait).ok());
  ASSERT_TRUE(store_->Evict(d, Tier::kHost).Wait(kWait).ok());
  ASSERT_TRUE(store_->Evict(h, Tier::kDevice).Wait(kWait).ok());
  EXPECT_EQ(Read(d, Tier::kDevice), 3);
  EXPECT_EQ(Read(h, Tier::kHost), 4);
}

TEST_F(StoreTest, TinyBudgetsNeverExceededAndNoDeadlock) {
  Open({.device_blocks = 2, .host_blocks = 2, .nvme_blocks = 32});
  std::vector<BlockId> ids;
  for (int i = 0; i < 16; ++i) ids.push_back(Reg("b" + std::to_string(i), Tier::kNvme));
  for (int round = 0; round < 3; ++round) {
    for (size_t i = 0; i < ids.size(); ++i) {
      Write(ids[i], Tier::kDevice, static_cast<uint8_t>(round * 16 + i + 1));
    }
  }
  for (size_t i = 0; i < ids.size(); ++i) {
    EXPECT_EQ(Read(ids[i], Tier::kDevice), static_cast<int>(2 * 16 + i + 1)) << "seed " << seed_;
  }
  ExpectWithinBudgets();
  EXPECT_GT(store_->TakeStats(false).evictions, 0u);
}

TEST_F(StoreTest, EveryReadSeesTheLastWriteUnderRandomOps) {
  for (uint64_t seed : {1u, 2u, 3u}) {
    store_.reset();
    Open({.device_blocks = 3, .host_blocks = 3, .nvme_blocks = 32}, seed);
    std::mt19937 rng(seed);
    std::vector<BlockId> ids;
    std::vector<int> model;
    const Tier homes[] = {Tier::kNvme, Tier::kNvme, Tier::kHost, Tier::kDevice};
    for (int i = 0; i < 8; ++i) {
      ids.push_back(Reg("r" + std::to_string(i), homes[i % 4]));
      model.push_back(0);
    }
    std::vector<Ticket> tickets;
    for (int step = 0; step < 400; ++step) {
      size_t i = rng() % ids.size();
      Tier t = static_cast<Tier>(rng() % 2);
      const int what = rng() % 5;
      if (getenv("STORE_TEST_VERBOSE"))
        printf("step %d block %zu tier %d op %d\n", step, i, int(t), what);
      switch (what) {
        case 0:
          model[i] = static_cast<uint8_t>(rng());
          Write(ids[i], t, static_cast<uint8_t>(model[i]));
          break;
        case 1:
          tickets.push_back(store_->WriteBack(ids[i]));
          break;
        case 2:
          tickets.push_back(store_->Evict(ids[i], t));
          break;
        case 3:
          tickets.push_back(store_->Fetch(ids[i], t));
          break;
        default:
          ASSERT_EQ(Read(ids[i], t), model[i]) << "step " << step << " seed " << seed;
      }
    }
    for (auto& t : tickets) {
      Status s = t.Wait(kWait);
      EXPECT_TRUE(s.ok() || s.code() == Status::Code::kFailedPrecondition) << s.ToString();
    }
    ASSERT_TRUE(store_->Flush(kWait).ok());
    for (size_t i = 0; i < ids.size(); ++i) EXPECT_EQ(Read(ids[i], Tier::kHost), model[i]);
    ExpectWithinBudgets();
  }
}

TEST_F(StoreTest, InjectedReadErrorReachesTheWaiterWithTheBlockName) {
  Open({});
  BlockId b = Reg("layer7.exp_avg", Tier::kNvme);
  Persist(b, 0x44);  // a block never written reads as zeros without IO
  sim_->InjectFault(IoOp::kRead, nvme::SimFault::kEio);
  auto l = store_->Acquire(b, Tier::kDevice, Access::kRead, kWait);
  ASSERT_FALSE(l.ok());
  EXPECT_TRUE(l.status().IsIOError()) << l.status().ToString();
  EXPECT_NE(l.status().ToString().find("layer7.exp_avg"), std::string::npos);
  EXPECT_EQ(store_->residency(b, Tier::kHost), Residency::kAbsent);
  EXPECT_EQ(store_->residency(b, Tier::kDevice), Residency::kAbsent);
  EXPECT_EQ(Read(b, Tier::kDevice), 0x44);  // the fault was used up: a retry works
}

TEST_F(StoreTest, BackgroundPrefetchErrorIsKeptForTheNextWaiter) {
  Open({});
  BlockId b = Reg("layer2.param16", Tier::kNvme);
  Persist(b, 0x55);
  sim_->InjectFault(IoOp::kRead, nvme::SimFault::kEio);
  (void)store_->Fetch(b, Tier::kDevice);  // ticket dropped: nobody waits
  const auto deadline = std::chrono::steady_clock::now() + kWait;
  while (store_->TakeStats(false).errors == 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(1ms);
  }
  auto l = store_->Acquire(b, Tier::kDevice, Access::kRead, kWait);
  ASSERT_FALSE(l.ok());
  EXPECT_NE(l.status().ToString().find("layer2.param16"), std::string::npos)
      << l.status().ToString();
  EXPECT_EQ(Read(b, Tier::kDevice), 0x55);  // delivered once, then a fresh fetch
  // An error that a Wait already returned is not delivered a second time.
  ASSERT_TRUE(store_->Evict(b, Tier::kDevice).Wait(kWait).ok());
  ASSERT_TRUE(store_->Evict(b, Tier::kHost).Wait(kWait).ok());
  sim_->InjectFault(IoOp::kRead, nvme::SimFault::kEio);
  EXPECT_TRUE(store_->Fetch(b, Tier::kHost).Wait(kWait).IsIOError());
  EXPECT_EQ(Read(b, Tier::kHost), 0x55);
}

TEST_F(StoreTest, ChecksumFailureIsCorruptionAndNeverValid) {
  Open({});
  BlockId b = Reg("layer1.master32", Tier::kNvme);
  Write(b, Tier::kHost, 0x11);
  ASSERT_TRUE(store_->Evict(b, Tier::kHost).Wait(kWait).ok());
  ASSERT_EQ(store_->nvme_files().size(), 1u);
  EXPECT_EQ(store_->nvme_files()[0], nvme::SwapFilePath(dir_.path(), 0));
  // A buffered descriptor on the swap file: O_DIRECT refuses 1-byte writes.
  int fd = open(store_->nvme_files()[0].c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  const char junk = 0x22;
  ASSERT_EQ(pwrite(fd, &junk, 1, 100), 1);  // block 0 lives at offset 0 of the swap file
  close(fd);
  auto l = store_->Acquire(b, Tier::kHost, Access::kRead, kWait);
  ASSERT_FALSE(l.ok());
  EXPECT_TRUE(l.status().IsCorruption()) << l.status().ToString();
  EXPECT_NE(l.status().ToString().find("layer1.master32"), std::string::npos);
  EXPECT_EQ(store_->residency(b, Tier::kHost), Residency::kAbsent);
}

TEST_F(StoreTest, FailedWriteKeepsTheNewestCopy) {
  Open({});
  BlockId b = Reg("g", Tier::kNvme);
  Write(b, Tier::kHost, 0x33);
  sim_->InjectFault(IoOp::kWrite, nvme::SimFault::kTorn);
  Status s = store_->WriteBack(b).Wait(kWait);
  EXPECT_TRUE(s.IsIOError()) << s.ToString();
  EXPECT_EQ(store_->residency(b, Tier::kNvme), Residency::kStale);
  EXPECT_EQ(store_->residency(b, Tier::kHost), Residency::kDirty);
  ASSERT_TRUE(store_->WriteBack(b).Wait(kWait).ok());  // retry
  ASSERT_TRUE(store_->Evict(b, Tier::kHost).Wait(kWait).ok());
  EXPECT_EQ(Read(b, Tier::kHost), 0x33);
}

TEST_F(StoreTest, LeasesPreventEviction) {
  Open({.device_blocks = 1, .host_blocks = 4, .nvme_blocks = 8});
  BlockId a = Reg("a", Tier::kNvme), b = Reg("b", Tier::kNvme);
  auto la = store_->Acquire(a, Tier::kDevice, Access::kRead, kWait);
  ASSERT_TRUE(la.ok());
  EXPECT_EQ(store_->Evict(a, Tier::kDevice).Wait(kWait).code(), Status::Code::kFailedPrecondition);
  // b cannot get device space while a is leased: the wait is bounded.
  auto lb = store_->Acquire(b, Tier::kDevice, Access::kRead, 200ms);
  EXPECT_TRUE(lb.status().IsDeadlineExceeded()) << lb.status().ToString();
  EXPECT_EQ(store_->residency(a, Tier::kDevice), Residency::kValid);
  la->Release();
  EXPECT_EQ(Read(b, Tier::kDevice), 0);
  EXPECT_EQ(store_->residency(a, Tier::kDevice), Residency::kAbsent);  // evicted for b
  ExpectWithinBudgets();
}

// room_wait_ns: the time an operation was parked for room on a tier, counted while it waits and
// frozen once it got the room; no other tier's clock runs.
TEST_F(StoreTest, RoomWaitCountsTheTimeAnOperationWasParkedForSpace) {
  Open({.device_blocks = 1, .host_blocks = 1, .nvme_blocks = 4});
  BlockId a = Reg("a", Tier::kNvme), b = Reg("b", Tier::kNvme);
  auto la = store_->Acquire(a, Tier::kHost, Access::kRead, kWait);
  ASSERT_TRUE(la.ok()) << la.status().ToString();
  EXPECT_EQ(store_->TakeStats(false).room_wait_ns[Tier::kHost], 0u);
  Ticket fb = store_->Fetch(b, Tier::kHost);  // parks: a holds the host's only block of room
  std::this_thread::sleep_for(50ms);
  EXPECT_FALSE(fb.ready());
  EXPECT_GE(store_->TakeStats(false).room_wait_ns[Tier::kHost], 50'000'000u);  // in progress
  la->Release();
  ASSERT_TRUE(fb.Wait(kWait).ok());
  const StoreStats s = store_->TakeStats(false);
  EXPECT_GE(s.room_wait_ns[Tier::kHost], 50'000'000u);
  EXPECT_EQ(s.room_wait_ns[Tier::kDevice], 0u);
  EXPECT_EQ(s.room_wait_ns[Tier::kNvme], 0u);
  std::this_thread::sleep_for(20ms);
  EXPECT_EQ(store_->TakeStats(false).room_wait_ns[Tier::kHost], s.room_wait_ns[Tier::kHost]);
}

TEST_F(StoreTest, ResourceExhaustedWhenNothingCanFree) {
  Open({.device_blocks = 1, .host_blocks = 2, .nvme_blocks = 4});
  BlockId big = Reg("big", Tier::kNvme, 2 * kBlock);
  auto r =
      store_->Register(BlockSpec{"huge", 8 * kBlock, DType::kF32, StateKind::kExpAvg, Tier::kNvme});
  EXPECT_TRUE(r.status().IsResourceExhausted()) << r.status().ToString();
  auto l = store_->Acquire(big, Tier::kDevice, Access::kRead, kWait);
  EXPECT_TRUE(l.status().IsResourceExhausted()) << l.status().ToString();
  EXPECT_NE(l.status().ToString().find("big"), std::string::npos);
  EXPECT_TRUE(store_->Register(BlockSpec{"big", kBlock}).status().IsInvalidArgument());
  EXPECT_TRUE(store_->Register(BlockSpec{"zero", 0}).status().IsInvalidArgument());
  EXPECT_TRUE(store_->Fetch(99, Tier::kHost).Wait(kWait).IsNotFound());
  EXPECT_TRUE(store_->Evict(99, Tier::kHost).Wait(kWait).IsNotFound());
  EXPECT_TRUE(store_->WriteBack(99).Wait(kWait).IsNotFound());
  EXPECT_TRUE(store_->Acquire(99, Tier::kHost, Access::kRead, kWait).status().IsNotFound());
}

// A device that refuses allocations with a given error once armed (as CUDA does when memory the
// budget counts as free is held outside strata's pool, or after a fault); otherwise the wrapped
// one.
class RefusingDevice final : public Device {
 public:
  explicit RefusingDevice(Device* inner) : inner_(inner) {}
  void Refuse(Status st) { refusal_ = std::move(st); }
  std::string name() const override { return inner_->name(); }
  bool host_addressable() const override { return inner_->host_addressable(); }
  Result<void*> Allocate(uint64_t n) override {
    if (!refusal_.ok()) return refusal_;
    return inner_->Allocate(n);
  }
  Status Free(void* p) override { return inner_->Free(p); }
  Status CopyAsync(CopyDir d, void* dst, const void* src, uint64_t n, CopyCallback done) override {
    return inner_->CopyAsync(d, dst, src, n, std::move(done));
  }
  Result<std::unique_ptr<DeviceEvent>> RecordEvent(CopyDir d) override {
    return inner_->RecordEvent(d);
  }
  Status Synchronize() override { return inner_->Synchronize(); }
  Status RegisterHost(void* p, uint64_t n) override { return inner_->RegisterHost(p, n); }
  Status UnregisterHost(void* p) override { return inner_->UnregisterHost(p); }
  DeviceStats stats() const override { return inner_->stats(); }

 private:
  Device* inner_;
  Status refusal_;
};

// The device refusing room the budget has: out of memory fails the operation with the device's
// own words beside the budget's figures; a fault fails it at once as that fault (not a wait, not
// "no room"); a home on the device is refused the same way at Register.
TEST_F(StoreTest, ADeviceRefusingRoomTheBudgetHasIsNamed) {
  std::unique_ptr<RefusingDevice> refusing;
  Open({.device_blocks = 4, .host_blocks = 4, .nvme_blocks = 8}, 7, [&](TieredStoreOptions& o) {
    refusing = std::make_unique<RefusingDevice>(o.device);
    o.device = refusing.get();
  });
  BlockId a = Reg("a", Tier::kHost), b = Reg("b", Tier::kHost);
  EXPECT_EQ(Read(a, Tier::kDevice), 0);
  refusing->Refuse(Status::ResourceExhausted("cudaErrorMemoryAllocation: out of memory"));
  auto lb = store_->Acquire(b, Tier::kDevice, Access::kRead, kWait);
  ASSERT_TRUE(lb.status().IsResourceExhausted()) << lb.status().ToString();
  const std::string m = lb.status().ToString();
  EXPECT_NE(m.find("'b'"), std::string::npos) << m;
  EXPECT_NE(m.find("the device itself refused it within the budget"), std::string::npos) << m;
  EXPECT_NE(m.find("out of memory"), std::string::npos) << m;
  EXPECT_EQ(store_->residency(a, Tier::kDevice), Residency::kAbsent);  // evicted to make room

  refusing->Refuse(Status::Internal("cudaErrorIllegalAddress: an illegal memory access"));
  const auto t0 = std::chrono::steady_clock::now();
  lb = store_->Acquire(b, Tier::kDevice, Access::kRead, kWait);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, kWait / 2);  // failed, not waited out
  ASSERT_EQ(lb.status().code(), Status::Code::kInternal) << lb.status().ToString();
  EXPECT_NE(lb.status().ToString().find("the device refused 16384 bytes on tier hbm: "
                                        "cudaErrorIllegalAddress"),
            std::string::npos)
      << lb.status().ToString();
  auto r =
      store_->Register(BlockSpec{"home", kBlock, DType::kF32, StateKind::kMaster32, Tier::kDevice});
  ASSERT_EQ(r.status().code(), Status::Code::kInternal) << r.status().ToString();
  EXPECT_NE(r.status().ToString().find("'home'"), std::string::npos) << r.status().ToString();

  refusing->Refuse(Status::OK());  // the device has room again: nothing was left behind
  EXPECT_EQ(Read(b, Tier::kDevice), 0);
  EXPECT_EQ(Read(a, Tier::kDevice), 0);
  ExpectWithinBudgets();
  store_.reset();  // before the device it uses
}

TEST_F(StoreTest, WritesToOneBlockApplyInOrder) {
  Open({});
  BlockId b = Reg("ordered", Tier::kNvme);
  std::vector<Ticket> t;
  for (uint8_t v = 1; v <= 20; ++v) {
    Write(b, Tier::kHost, v);  // a write lease waits for the block's queued operations
    t.push_back(store_->WriteBack(b));
    if (v % 3 == 0) t.push_back(store_->Evict(b, Tier::kHost));
  }
  for (auto& x : t) ASSERT_TRUE(x.Wait(kWait).ok());
  ASSERT_TRUE(store_->Evict(b, Tier::kHost).Wait(kWait).ok());
  EXPECT_EQ(Read(b, Tier::kHost), 20);
}

TEST_F(StoreTest, ThenRunsOnceTheOperationFinished) {
  Open({});
  BlockId b = Reg("then", Tier::kNvme);
  std::mutex mu;
  std::condition_variable cv;
  int calls = 0;
  Status seen = Status::Internal("not called");
  store_->Fetch(b, Tier::kDevice).Then([&](Status s) {
    std::lock_guard<std::mutex> l(mu);
    seen = s;
    ++calls;
    cv.notify_all();
  });
  {
    std::unique_lock<std::mutex> l(mu);
    ASSERT_TRUE(cv.wait_for(l, kWait, [&] { return calls == 1; }));
    EXPECT_TRUE(seen.ok()) << seen.ToString();
  }
  Ticket done = store_->Fetch(b, Tier::kDevice);
  ASSERT_TRUE(done.Wait(kWait).ok());
  bool ran_inline = false;
  done.Then([&](Status s) { ran_inline = s.ok(); });
  EXPECT_TRUE(ran_inline);
}

// The VMA of /proc/self/smaps holding `p`: its "Key:" values (kB, or 0/1 flags).
std::map<std::string, long> SmapsOf(const void* p) {
  std::ifstream in("/proc/self/smaps");
  std::string line;
  std::map<std::string, long> fields;
  bool inside = false;
  const auto a = reinterpret_cast<uintptr_t>(p);
  while (std::getline(in, line)) {
    unsigned long lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) == 2 && line.find(':') > line.find(' ')) {
      if (inside) break;
      inside = a >= lo && a < hi;
      continue;
    }
    if (!inside) continue;
    char key[64];
    long v = 0;
    if (std::sscanf(line.c_str(), "%63[^:]: %ld", key, &v) == 2) fields[key] = v;
  }
  return fields;
}

TEST(StoreOptionsTest, HostSlabIsOnHugePagesAndLockedOnlyWhenAsked) {
  // DeepSpeed's pin_memory decides locking; huge pages are for the disk's sake either way (a
  // 1 MiB O_DIRECT IO from 4 KiB pages is two requests on a virtio disk).
  std::ifstream thp("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string mode((std::istreambuf_iterator<char>(thp)), std::istreambuf_iterator<char>());
  const bool thp_possible = !mode.empty() && mode.find("[never]") == std::string::npos;
  for (bool lock : {false, true}) {
    TieredStoreOptions o;
    o.host_budget_bytes = 8 << 20;
    o.use_pinned_pool = true;
    o.lock_host_memory = lock;
    auto s = OpenTieredStore(std::move(o));
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    auto id = (*s)->Register(
        BlockSpec{"slab.probe", 1 << 20, DType::kF32, StateKind::kMaster32, Tier::kHost});
    ASSERT_TRUE(id.ok()) << id.status().ToString();
    auto lease = (*s)->Acquire(*id, Tier::kHost, Access::kOverwrite, kWait);
    ASSERT_TRUE(lease.ok()) << lease.status().ToString();
    const std::map<std::string, long> vma = SmapsOf(lease->data());
    ASSERT_TRUE(vma.count("Locked")) << "no smaps entry for the slab";
    if (thp_possible && vma.count("THPeligible")) {
      EXPECT_EQ(vma.at("THPeligible"), 1) << "lock " << lock;
    }
    if (lock) {
#if !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
      // Locked, or mlock refused (RLIMIT_MEMLOCK) and said so. (The sanitizers' runtimes turn
      // mlock into a no-op that succeeds.)
      EXPECT_TRUE(vma.at("Locked") > 0 || (*s)->note().find("mlock") != std::string::npos)
          << (*s)->note();
#endif
    } else {
      EXPECT_EQ(vma.at("Locked"), 0) << "pin_memory false must not lock";
    }
  }
}

TEST(StoreOptionsTest, InvalidOptionsAreNamed) {
  TieredStoreOptions o;
  EXPECT_TRUE(OpenTieredStore(std::move(o)).status().IsInvalidArgument());
  TieredStoreOptions p;
  p.host_budget_bytes = 1 << 20;
  p.device_budget_bytes = 1 << 20;
  auto s = OpenTieredStore(std::move(p));
  EXPECT_TRUE(s.status().IsInvalidArgument());
  EXPECT_NE(s.status().ToString().find("device"), std::string::npos);
}

}  // namespace
}  // namespace strata::store
