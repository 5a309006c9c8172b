// PinnedPool: alignment, budget (never exceeded, also under concurrent use), reuse, RAII,
// graceful degradation when mlock or a registrar is refused; Topology basics.
#include <linux/capability.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "cpu/pinned_pool.h"
#include "cpu/topology.h"

namespace strata::cpu {
namespace {

constexpr size_t kMiB = size_t{1} << 20;

std::unique_ptr<PinnedPool> MakePool(size_t budget, std::vector<HostMemoryRegistrar*> regs = {}) {
  PinnedPoolOptions o;
  o.budget_bytes = budget;
  o.registrars = std::move(regs);
  auto p = PinnedPool::Create(o);
  EXPECT_TRUE(p.ok()) << p.status().ToString();
  return std::move(p).value();
}

TEST(PinnedPool, BuffersAre2MiBAlignedRoundedAndWritable) {
  auto pool = MakePool(16 * kMiB);
  auto b = pool->Allocate(3 * kMiB + 5);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b->data()) % kHugePageBytes, 0u);
  EXPECT_EQ(b->size_bytes(), 3 * kMiB + 5);
  EXPECT_EQ(b->capacity_bytes(), 4 * kMiB);
  EXPECT_TRUE(b->locked()) << "running as root, mlock should work: " << pool->note();
  std::memset(b->data(), 0xab, b->capacity_bytes());
  EXPECT_EQ(pool->in_use_bytes(), 4 * kMiB);
  EXPECT_TRUE(pool->Allocate(0).status().IsInvalidArgument());
}

TEST(PinnedPool, OverBudgetIsResourceExhaustedAndReleaseMakesRoom) {
  auto pool = MakePool(8 * kMiB);
  auto a = pool->Allocate(4 * kMiB);
  auto b = pool->Allocate(4 * kMiB);
  ASSERT_TRUE(a.ok() && b.ok());
  auto c = pool->Allocate(1);
  ASSERT_TRUE(c.status().IsResourceExhausted()) << c.status().ToString();
  EXPECT_NE(c.status().message().find("budget"), std::string_view::npos);
  a->Reset();
  EXPECT_EQ(pool->in_use_bytes(), 4 * kMiB);
  // A different size: the cached 4 MiB mapping is dropped to make room.
  auto d = pool->Allocate(2 * kMiB);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_LE(pool->mapped_bytes(), 8 * kMiB);
  EXPECT_LE(pool->peak_mapped_bytes(), 8 * kMiB);
  EXPECT_TRUE(PinnedPool::Create(PinnedPoolOptions{}).status().IsInvalidArgument());
}

TEST(PinnedPool, ReleasedBuffersAreReusedWithoutRemapping) {
  auto pool = MakePool(8 * kMiB);
  void* first = nullptr;
  {
    auto a = pool->Allocate(2 * kMiB);
    ASSERT_TRUE(a.ok());
    first = a->data();
    PinnedBuffer moved = std::move(*a);  // move keeps ownership; the source is empty
    EXPECT_FALSE(*a);
    EXPECT_EQ(moved.data(), first);
  }
  EXPECT_EQ(pool->in_use_bytes(), 0u);
  EXPECT_EQ(pool->mapped_bytes(), 2 * kMiB);
  auto again = pool->Allocate(kMiB);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->data(), first);
  again->Reset();
  pool->Trim();
  EXPECT_EQ(pool->mapped_bytes(), 0u);
}

TEST(PinnedPool, ConcurrentUseNeverExceedsTheBudget) {
  constexpr size_t kBudget = 12 * kMiB;
  auto pool = MakePool(kBudget);
  std::atomic<int> ok{0}, refused{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 50; ++i) {
        auto b = pool->Allocate(((i + t) % 3 + 1) * 2 * kMiB);
        if (b.ok()) {
          static_cast<char*>(b->data())[0] = 1;
          ++ok;
        } else {
          EXPECT_TRUE(b.status().IsResourceExhausted()) << b.status().ToString();
          ++refused;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_GT(ok.load(), 0);
  EXPECT_EQ(ok.load() + refused.load(), 200);
  EXPECT_LE(pool->peak_mapped_bytes(), kBudget);
  EXPECT_EQ(pool->in_use_bytes(), 0u);
}

class RefusingRegistrar : public HostMemoryRegistrar {
 public:
  std::string_view name() const override { return "test-dma"; }
  Status Register(void*, size_t) override {
    ++calls;
    return Status::Unavailable("no device");
  }
  void Unregister(void*) override { ++unregisters; }
  int calls = 0, unregisters = 0;
};

class CountingRegistrar : public HostMemoryRegistrar {
 public:
  std::string_view name() const override { return "counting"; }
  Status Register(void*, size_t) override {
    ++live;
    return Status::OK();
  }
  void Unregister(void*) override { --live; }
  int live = 0;
};

TEST(PinnedPool, RefusedRegistrationDegradesAndIsNotedOnce) {
  RefusingRegistrar refusing;
  CountingRegistrar counting;
  {
    auto pool = MakePool(8 * kMiB, {&counting, &refusing});
    auto a = pool->Allocate(2 * kMiB);
    auto b = pool->Allocate(2 * kMiB);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_FALSE(a->registered());
    EXPECT_EQ(refusing.calls, 1);  // not asked again after refusing
    EXPECT_EQ(counting.live, 2);
    const std::string note = pool->note();
    EXPECT_NE(note.find("test-dma registration refused"), std::string::npos) << note;
    EXPECT_EQ(note.find("test-dma", note.find("test-dma") + 1), std::string::npos) << note;
  }
  EXPECT_EQ(counting.live, 0);  // every mapping unregistered before unmapping
  EXPECT_EQ(refusing.unregisters, 0);
}

// Drops CAP_IPC_LOCK from the effective set and sets RLIMIT_MEMLOCK to 64 KiB: the position of
// a non-root user on these machines (8 MiB there).
bool BecomeUnprivilegedForLocking() {
  __user_cap_header_struct hdr{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct data[2]{};
  if (syscall(SYS_capget, &hdr, data) != 0) return false;
  data[CAP_IPC_LOCK / 32].effective &= ~(1u << (CAP_IPC_LOCK % 32));
  if (syscall(SYS_capset, &hdr, data) != 0) return false;
  rlimit rl{64 << 10, 64 << 10};
  return setrlimit(RLIMIT_MEMLOCK, &rl) == 0;
}

void ChildAllocatesWithoutLocking() {
  if (!BecomeUnprivilegedForLocking()) {
    std::fprintf(stderr, "FAILED: could not drop CAP_IPC_LOCK\n");
    std::_Exit(1);
  }
  PinnedPoolOptions o;
  o.budget_bytes = 8 * kMiB;
  auto created = PinnedPool::Create(o);
  if (!created.ok()) {
    std::fprintf(stderr, "FAILED: %s\n", created.status().ToString().c_str());
    std::_Exit(1);
  }
  auto& pool = *created;
  auto a = pool->Allocate(4 * kMiB);
  auto b = pool->Allocate(2 * kMiB);
  if (!a.ok() || !b.ok() || a->locked() || b->locked()) {
    std::fprintf(stderr, "FAILED: expected unlocked buffers: %s %s\n",
                 a.status().ToString().c_str(), b.status().ToString().c_str());
    std::_Exit(1);
  }
  std::memset(a->data(), 1, a->capacity_bytes());
  std::fprintf(stderr, "degraded: %s\n", pool->note().c_str());
  a->Reset();
  b->Reset();
  std::_Exit(0);
}

TEST(PinnedPool, RefusedMlockDegradesToUnlockedBuffers) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "sanitizers intercept mlock() as a successful no-op; refusal is untestable here";
#endif
  EXPECT_EXIT(ChildAllocatesWithoutLocking(), ::testing::ExitedWithCode(0),
              "degraded: mlock: errno .*RLIMIT_MEMLOCK 65536 bytes");
}

TEST(Topology, DetectsCoresAndNodesAndBindsMemory) {
  auto t = Topology::Detect();
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_GE((*t)->cores(), 1);
  EXPECT_GE((*t)->hardware_threads(), (*t)->cores());
  EXPECT_GE((*t)->numa_nodes(), 1);
  EXPECT_TRUE((*t)->BindMemory(nullptr, 0, (*t)->numa_nodes()).IsInvalidArgument());

  PinnedPoolOptions o;
  o.budget_bytes = 4 * kMiB;
  o.numa_node = 0;
  o.topology = t->get();
  auto pool = PinnedPool::Create(o);
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  auto b = (*pool)->Allocate(2 * kMiB);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  o.numa_node = (*t)->numa_nodes();
  EXPECT_TRUE(PinnedPool::Create(o).status().IsInvalidArgument());
  o.numa_node = -7;
  EXPECT_TRUE(PinnedPool::Create(o).status().IsInvalidArgument());
  o.numa_node = PinnedPoolOptions::kNumaNodeOfCreator;
  auto local = PinnedPool::Create(o);
  ASSERT_TRUE(local.ok()) << local.status().ToString();
  EXPECT_TRUE((*local)->Allocate(kMiB).ok());
  o.topology = nullptr;
  EXPECT_TRUE(PinnedPool::Create(o).status().IsInvalidArgument());
}

}  // namespace
}  // namespace strata::cpu
