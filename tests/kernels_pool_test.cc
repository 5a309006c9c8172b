#include <atomic>
#include <mutex>
#include <set>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/buffer.h"
#include "kernels/pool.h"

namespace strata::kernels {
namespace {

TEST(KernelPoolTest, RejectsBadOptions) {
  EXPECT_TRUE(KernelPool::Create({.threads = -1}).status().IsInvalidArgument());
  EXPECT_TRUE(KernelPool::Create({.tile_elems = 0}).status().IsInvalidArgument());
}

TEST(KernelPoolTest, TilesCoverTheRangeExactlyOnceWithValidSlots) {
  for (int threads : {1, 2, 3}) {
    auto pool = KernelPool::Create({.threads = threads, .tile_elems = 1000});
    ASSERT_TRUE(pool.ok());
    EXPECT_EQ((*pool)->threads(), threads);
    EXPECT_EQ((*pool)->tile_elems(), 1024u);  // rounded up to the alignment unit
    for (size_t n : {size_t{0}, size_t{1}, size_t{1024}, size_t{1025}, size_t{100000}}) {
      std::vector<std::atomic<int>> hits(n);
      std::atomic<bool> bad_slot{false}, bad_tile{false};
      auto body = [&](int slot, size_t b, size_t e) {
        if (slot < 0 || slot >= threads) bad_slot = true;
        if (b % 1024 != 0 || e > n || b >= e) bad_tile = true;
        for (size_t i = b; i < e; ++i) hits[i].fetch_add(1);
      };
      (*pool)->ForEachTile(n, 0, body);
      EXPECT_FALSE(bad_slot);
      EXPECT_FALSE(bad_tile);
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << "n=" << n << " i=" << i;
    }
  }
}

TEST(KernelPoolTest, ThreadLadderDoublesUpToMax) {
  EXPECT_EQ(ThreadLadder(1), (std::vector<int>{1}));
  EXPECT_EQ(ThreadLadder(2), (std::vector<int>{1, 2}));
  EXPECT_EQ(ThreadLadder(6), (std::vector<int>{1, 2, 4, 6}));
  EXPECT_EQ(ThreadLadder(8), (std::vector<int>{1, 2, 4, 8}));
  EXPECT_GE(ThreadLadder(0).back(), 1);
}

// hwloc binding: workers run (bound where the OS lets us) and the work is the same.
TEST(KernelPoolTest, BoundWorkersStillCoverEverything) {
  auto pool = KernelPool::Create({.threads = 2, .bind_threads = true, .tile_elems = 1024});
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  std::atomic<size_t> sum{0};
  auto body = [&](int, size_t b, size_t e) {
    for (size_t i = b; i < e; ++i) sum.fetch_add(i, std::memory_order_relaxed);
  };
  (*pool)->ForEachTile(1 << 16, 0, body);
  EXPECT_EQ(sum.load(), size_t{1 << 16} * ((1 << 16) - 1) / 2);
  EXPECT_EQ((*pool)->bind_failures(), 0);
}

TEST(HugeBufferTest, AlignedRoundedMovable) {
  auto b = HugeBuffer::Allocate((size_t{3} << 20) + 1);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_EQ(b->size(), size_t{4} << 20);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b->data()) % (size_t{2} << 20), 0u);
  b->as<char>()[b->size() - 1] = 7;  // the whole rounded size is usable
  HugeBuffer moved = std::move(b).value();
  EXPECT_EQ(moved.as<char>()[moved.size() - 1], 7);
  auto empty = HugeBuffer::Allocate(0);
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(empty->data(), nullptr);
}

}  // namespace
}  // namespace strata::kernels
