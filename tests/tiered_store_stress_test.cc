// Random concurrent access to a TieredStore with budgets of a few blocks, over the simulated IO
// backend (random latencies, reordered completions) and the HostDevice. Meant to run under TSan
// too (tools/sanitize.sh thread). Every wait is bounded; a failure prints the seed.
#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "nvme/sim_backend.h"
#include "strata/store.h"
#include "tests/io_test_util.h"

namespace strata::store {
namespace {

using namespace std::chrono_literals;
constexpr uint64_t kBlock = 8 << 10;
constexpr int kBlocks = 12;
constexpr int kThreads = 4;
constexpr int kOpsPerThread = 300;

TEST(StoreStress, RandomAccessWithTinyBudgets) {
  const uint64_t seed = 424242;
  strata::testing::TempDir dir("stress");
  auto dev = CreateHostDevice({.budget_bytes = 16 << 20});
  ASSERT_TRUE(dev.ok());
  nvme::SimOptions so;
  so.seed = seed;
  so.queue_depth = 4;
  so.max_latency_ns = 50'000;
  TieredStoreOptions o;
  o.device_budget_bytes = 3 * kBlock;  // each thread may hold one lease: 4 threads, 3 slots
  o.host_budget_bytes = 4 * kBlock;
  o.nvme_capacity_bytes = 2 * kBlocks * kBlock;
  o.device = dev->get();
  o.io = std::make_unique<nvme::SimBackend>(so);
  o.nvme_paths = {dir.path()};
  o.use_pinned_pool = false;
  auto opened = OpenTieredStore(std::move(o));
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  Store& store = **opened;

  std::vector<BlockId> ids;
  for (int i = 0; i < kBlocks; ++i) {
    auto id = store.Register(
        BlockSpec{"s" + std::to_string(i), kBlock, DType::kF32, StateKind::kMaster32, Tier::kNvme});
    ASSERT_TRUE(id.ok()) << id.status().ToString();
    ids.push_back(*id);
  }
  // The last value written to each block; writers hold the block's only write lease.
  std::vector<std::atomic<int>> last(kBlocks);
  for (auto& v : last) v = 0;
  std::atomic<int> torn_reads{0}, errors{0}, timeouts{0};
  std::mutex err_mu;
  std::string first_error;

  auto worker = [&](int tid) {
    std::mt19937 rng(static_cast<uint32_t>(seed + tid));
    for (int k = 0; k < kOpsPerThread; ++k) {
      const int i = static_cast<int>(rng() % kBlocks);
      const Tier tier = rng() % 3 == 0 ? Tier::kHost : Tier::kDevice;
      const int what = static_cast<int>(rng() % 10);
      if (what < 3) {  // write
        auto l = store.Acquire(ids[i], tier, Access::kWrite, 10s);
        if (!l.ok()) {
          (l.status().IsDeadlineExceeded() ? timeouts : errors)++;
          std::lock_guard<std::mutex> g(err_mu);
          if (first_error.empty()) first_error = l.status().ToString();
          continue;
        }
        const int v = static_cast<int>(rng() % 250) + 1;
        std::memset(l->data(), v, kBlock);
        l->MarkDirty();
        last[i] = v;
      } else if (what < 8) {  // read: every byte the same value
        auto l = store.Acquire(ids[i], tier, Access::kRead, 10s);
        if (!l.ok()) {
          (l.status().IsDeadlineExceeded() ? timeouts : errors)++;
          std::lock_guard<std::mutex> g(err_mu);
          if (first_error.empty()) first_error = l.status().ToString();
          continue;
        }
        const uint8_t* p = static_cast<const uint8_t*>(l->data());
        for (uint64_t b = 1; b < kBlock; b += 97) {
          if (p[b] != p[0]) {
            ++torn_reads;
            break;
          }
        }
      } else if (what == 8) {
        (void)store.WriteBack(ids[i]);
      } else {
        (void)store.Evict(ids[i], tier);
      }
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(worker, t);
  for (auto& t : threads) t.join();

  EXPECT_EQ(torn_reads.load(), 0) << "seed " << seed;
  EXPECT_EQ(errors.load(), 0) << first_error << " seed " << seed;
  EXPECT_EQ(timeouts.load(), 0) << first_error << " seed " << seed << "\n" << store.DebugString();
  ASSERT_TRUE(store.Flush(30s).ok());
  for (int i = 0; i < kBlocks; ++i) {
    ASSERT_TRUE(store.Evict(ids[i], Tier::kDevice).Wait(30s).ok());
    ASSERT_TRUE(store.Evict(ids[i], Tier::kHost).Wait(30s).ok());
    auto l = store.Acquire(ids[i], Tier::kHost, Access::kRead, 30s);
    ASSERT_TRUE(l.ok()) << l.status().ToString();
    EXPECT_EQ(static_cast<const uint8_t*>(l->data())[kBlock - 1], last[i].load())
        << "block " << i << " seed " << seed;
  }
  StoreStats s = store.TakeStats(false);
  for (Tier t : kAllTiers) EXPECT_LE(s.peak_bytes[t], s.budget_bytes[t]);
}

}  // namespace
}  // namespace strata::store
