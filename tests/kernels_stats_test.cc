#include <algorithm>
#include <utility>
#include <vector>
#include <string>
#include <random>
#include <cstring>
#include <bit>
#include <atomic>
#include <cmath>
#include <functional>
#include <limits>
#include <thread>

#include "kernels/casts.h"
#include "kernels/grad_stats.h"
#include "kernels/pool.h"
#include "kernels_test_util.h"
#include "strata/dtype.h"

namespace strata::kernels {
namespace {

class GradStatsTest : public TargetTest {};

struct Grads {
  Grads(size_t n, DType t, uint32_t seed) : t(t), f(n), h(n) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> u(-3.0f, 3.0f);
    for (size_t i = 0; i < n; ++i) Set(i, u(rng));
  }
  void Set(size_t i, float x) { StoreAs(t, x, &h[i], &f[i]); }
  const void* data() const {
    return t == DType::kF32 ? static_cast<const void*>(f.data()) : h.data();
  }
  long double RefSumSq() const {
    long double s = 0;
    for (float x : f) s += static_cast<long double>(x) * x;
    return s;
  }
  DType t;
  std::vector<float> f;
  std::vector<uint16_t> h;
};

const DType kTypes[] = {DType::kF32, DType::kBF16, DType::kF16};

TEST_P(GradStatsTest, SumOfSquaresMatchesReferenceAllSizes) {
  std::vector<size_t> sizes = Sizes();
  sizes.push_back(kStatsChunk - 1);
  sizes.push_back(kStatsChunk);
  sizes.push_back(kStatsChunk + 1);
  for (DType t : kTypes) {
    for (size_t n : sizes) {
      Grads g(n, t, static_cast<uint32_t>(n + 3));
      auto r = ComputeGradStats(g.data(), t, n);
      ASSERT_TRUE(r.ok());
      EXPECT_FALSE(r->nonfinite);
      const long double ref = g.RefSumSq();
      EXPECT_NEAR(r->sum_sq, static_cast<double>(ref), 1e-13 * static_cast<double>(ref) + 1e-300)
          << DTypeName(t) << " n=" << n;
    }
  }
}

TEST_P(GradStatsTest, FlagsNaNAndInfAnywhere) {
  const size_t n = 3 * simd::LanesF32() + 2 + kStatsChunk;
  for (DType t : kTypes) {
    for (float bad : {std::nanf(""), std::numeric_limits<float>::infinity(),
                      -std::numeric_limits<float>::infinity()}) {
      for (size_t where : {size_t{0}, n / 2, kStatsChunk, n - 1}) {
        Grads g(n, t, 5);
        g.Set(where, bad);
        auto r = ComputeGradStats(g.data(), t, n);
        ASSERT_TRUE(r.ok());
        EXPECT_TRUE(r->nonfinite) << DTypeName(t) << " at " << where;
        EXPECT_TRUE(std::isinf(r->sum_sq));
      }
    }
  }
  // fp16 overflow: 70000 becomes Inf in fp16 (the loss-scale overflow case).
  Grads g(100, DType::kF16, 1);
  g.Set(50, 70000.0f);
  EXPECT_TRUE(ComputeGradStats(g.data(), DType::kF16, 100)->nonfinite);
  // The largest finite values are finite: squares in double do not overflow.
  Grads big(kStatsChunk, DType::kF32, 1);
  std::fill(big.f.begin(), big.f.end(), std::numeric_limits<float>::max());
  auto r = ComputeGradStats(big.data(), DType::kF32, kStatsChunk);
  EXPECT_FALSE(r->nonfinite);
  EXPECT_NEAR(
      r->sum_sq,
      4096.0 * double{std::numeric_limits<float>::max()} * std::numeric_limits<float>::max(),
      1e-12 * r->sum_sq);
}

TEST_P(GradStatsTest, BitwiseIdenticalForAnyThreadsAndTiles) {
  const size_t n = 1000003;
  for (DType t : kTypes) {
    Grads g(n, t, 99);
    // Spread magnitudes over many binades so rounding order would show.
    for (size_t i = 0; i < n; i += 7) g.Set(i, std::ldexp(g.f[i], static_cast<int>(i % 41) - 20));
    auto one = ComputeGradStats(g.data(), t, n);
    ASSERT_TRUE(one.ok());
    const std::pair<int, size_t> configs[] = {{1, 4096}, {2, 4096}, {3, 12288}, {4, 65536}};
    for (auto [threads, tile] : configs) {
      auto pool = KernelPool::Create({.threads = threads, .tile_elems = tile});
      ASSERT_TRUE(pool.ok());
      auto r = ComputeGradStats(**pool, g.data(), t, n);
      ASSERT_TRUE(r.ok());
      EXPECT_EQ(std::bit_cast<uint64_t>(r->sum_sq), std::bit_cast<uint64_t>(one->sum_sq))
          << DTypeName(t) << " threads=" << threads << " tile=" << tile;
    }
  }
}

// AccumulateGradWithStats: one walk, the bits of AccumulateGrad then ComputeGradStats, for any
// pool; a NaN in the gradient shows in the stats of the accumulator it reached.
TEST_P(GradStatsTest, AccumulateWithStatsIsAccumulateThenStatsBitForBit) {
  for (size_t n : {size_t{0}, size_t{5}, size_t{4096}, size_t{4097}, size_t{100003}}) {
    for (DType t : kTypes) {
      Grads g(n, t, static_cast<uint32_t>(n + 1));
      for (size_t i = 0; i < n; i += 7) g.Set(i, std::ldexp(g.f[i], static_cast<int>(i % 41) - 20));
      for (bool overwrite : {false, true}) {
        std::vector<float> start(n);
        std::mt19937 rng(7);
        std::uniform_real_distribution<float> u(-2.0f, 2.0f);
        for (float& x : start) x = u(rng);
        std::vector<float> want = start;
        ASSERT_TRUE(AccumulateGrad(want.data(), g.data(), t, 0.37f, overwrite, n).ok());
        auto want_stats = ComputeGradStats(want.data(), DType::kF32, n);
        ASSERT_TRUE(want_stats.ok());
        for (auto [threads, tile] : {std::pair<int, size_t>{1, 4096}, {3, 12288}}) {
          auto pool = KernelPool::Create({.threads = threads, .tile_elems = tile});
          ASSERT_TRUE(pool.ok());
          std::vector<float> got = start;
          auto st = AccumulateGradWithStats(**pool, got.data(), g.data(), t, 0.37f, overwrite, n);
          ASSERT_TRUE(st.ok()) << st.status().ToString();
          const std::string what = "n=" + std::to_string(n) + " " + std::string(DTypeName(t)) +
                                   (overwrite ? " overwrite" : "") + " threads=" +
                                   std::to_string(threads);
          EXPECT_TRUE(n == 0 || std::memcmp(got.data(), want.data(), n * sizeof(float)) == 0)
              << what;  // (memcmp of an empty vector's null data is undefined)
          EXPECT_EQ(std::bit_cast<uint64_t>(st->sum_sq), std::bit_cast<uint64_t>(want_stats->sum_sq))
              << what;
          EXPECT_EQ(st->nonfinite, want_stats->nonfinite) << what;
        }
      }
    }
  }
  auto pool = KernelPool::Create({.threads = 2, .tile_elems = 4096});
  ASSERT_TRUE(pool.ok());
  std::vector<float> acc(10000, 1.0f), grad(10000, 0.5f);
  grad[9999] = std::numeric_limits<float>::quiet_NaN();
  auto st = AccumulateGradWithStats(**pool, acc.data(), grad.data(), DType::kF32, 1.0f, false,
                                    acc.size());
  ASSERT_TRUE(st.ok());
  EXPECT_TRUE(st->nonfinite);
  float f = 0;
  EXPECT_TRUE(AccumulateGradWithStats(**pool, &f, &f, DType::kI8, 1.0f, false, 1)
                  .status()
                  .IsInvalidArgument());
  EXPECT_TRUE(AccumulateGradWithStats(**pool, nullptr, &f, DType::kF32, 1.0f, false, 1)
                  .status()
                  .IsInvalidArgument());
  EXPECT_TRUE(AccumulateGradWithStats(**pool, &f, &f, DType::kF32, INFINITY, false, 1)
                  .status()
                  .IsInvalidArgument());
}

// AccumulateGradAddStats: a shard walked in pieces on kStatsChunk boundaries (the engine's
// staged gradients, a piece copied while the one before is accumulated) gives the whole walk's
// accumulator and sum_sq bits once every piece is added; a NaN in any piece marks the sum.
TEST_P(GradStatsTest, PiecesOnChunkBoundariesAddUpToTheWholeWalkBitForBit) {
  const size_t n = 10 * kStatsChunk + 123;
  auto pool = KernelPool::Create({.threads = 3, .tile_elems = 8192});
  ASSERT_TRUE(pool.ok());
  for (DType t : kTypes) {
    Grads g(n, t, 11);
    for (size_t i = 0; i < n; i += 5) g.Set(i, std::ldexp(g.f[i], static_cast<int>(i % 37) - 18));
    const size_t bytes = DTypeSize(t);
    for (bool overwrite : {false, true}) {
      std::vector<float> want(n, 0.25f);
      auto whole = AccumulateGradWithStats(**pool, want.data(), g.data(), t, 0.5f, overwrite, n);
      ASSERT_TRUE(whole.ok());
      for (size_t piece : {kStatsChunk, 3 * kStatsChunk, n}) {
        std::vector<float> got(n, 0.25f);
        ExactSum sum;
        for (size_t at = 0; at < n; at += piece) {
          const size_t m = std::min(piece, n - at);
          ASSERT_TRUE(AccumulateGradAddStats(**pool, got.data() + at,
                                             static_cast<const uint8_t*>(g.data()) + at * bytes, t,
                                             0.5f, overwrite, m, &sum)
                          .ok());
        }
        const std::string what = std::string(DTypeName(t)) + " piece=" + std::to_string(piece) +
                                 (overwrite ? " overwrite" : "");
        EXPECT_EQ(std::memcmp(got.data(), want.data(), n * sizeof(float)), 0) << what;
        EXPECT_EQ(std::bit_cast<uint64_t>(sum.Stats().sum_sq),
                  std::bit_cast<uint64_t>(whole->sum_sq))
            << what;
        EXPECT_EQ(sum.Stats().nonfinite, whole->nonfinite) << what;
      }
    }
  }
  std::vector<float> acc(2 * kStatsChunk, 1.0f), grad(2 * kStatsChunk, 0.5f);
  grad[kStatsChunk + 7] = std::numeric_limits<float>::quiet_NaN();
  ExactSum sum;
  for (size_t at = 0; at < acc.size(); at += kStatsChunk) {
    ASSERT_TRUE(AccumulateGradAddStats(**pool, acc.data() + at, grad.data() + at, DType::kF32, 1.0f,
                                       false, kStatsChunk, &sum)
                    .ok());
  }
  EXPECT_TRUE(sum.Stats().nonfinite);
  EXPECT_TRUE(std::isinf(sum.Stats().sum_sq));
  EXPECT_TRUE(
      AccumulateGradAddStats(**pool, acc.data(), grad.data(), DType::kF32, 1.0f, false, 1, nullptr)
          .IsInvalidArgument());
}

STRATA_INSTANTIATE_FOR_TARGETS(GradStatsTest);

// The pooled call keeps its partials in the pool's preallocated scratch: calls in a row must
// start from fresh partials, and concurrent calls on one pool (one gets a private copy) must
// not mix their sums.
TEST(GradStatsScratch, RepeatedAndConcurrentPooledCallsAgreeWithSerial) {
  const size_t n = 300001;
  Grads a(n, DType::kF32, 5), b(n, DType::kF32, 6);
  auto ra = ComputeGradStats(a.data(), DType::kF32, n);
  auto rb = ComputeGradStats(b.data(), DType::kF32, n);
  ASSERT_TRUE(ra.ok() && rb.ok());
  auto pool = KernelPool::Create({.threads = 3, .tile_elems = 4096});
  ASSERT_TRUE(pool.ok());
  for (int rep = 0; rep < 3; ++rep) {
    auto r = ComputeGradStats(**pool, a.data(), DType::kF32, n);
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(std::bit_cast<uint64_t>(r->sum_sq), std::bit_cast<uint64_t>(ra->sum_sq)) << rep;
  }
  std::atomic<int> mismatches{0};
  auto run = [&](const Grads& g, double want) {
    for (int rep = 0; rep < 20; ++rep) {
      auto r = ComputeGradStats(**pool, g.data(), DType::kF32, n);
      if (!r.ok() || std::bit_cast<uint64_t>(r->sum_sq) != std::bit_cast<uint64_t>(want)) {
        mismatches.fetch_add(1);
      }
    }
  };
  std::thread t1(run, std::cref(a), ra->sum_sq), t2(run, std::cref(b), rb->sum_sq);
  t1.join();
  t2.join();
  EXPECT_EQ(mismatches.load(), 0);
}

TEST(ExactSumTest, OrderIndependentAndExact) {
  std::mt19937 rng(1);
  std::vector<double> xs;
  for (int i = 0; i < 10000; ++i) {
    xs.push_back(std::ldexp(std::uniform_real_distribution<double>(0, 1)(rng),
                            static_cast<int>(rng() % 400) - 200));
  }
  ExactSum a;
  for (double x : xs) a.Add(x);
  std::shuffle(xs.begin(), xs.end(), rng);
  ExactSum b, c;
  for (size_t i = 0; i < xs.size(); ++i) (i % 3 ? b : c).Add(xs[i]);
  b.Merge(c);
  EXPECT_EQ(std::bit_cast<uint64_t>(a.Value()), std::bit_cast<uint64_t>(b.Value()));
  // Small integers and a huge + tiny pair are summed exactly.
  ExactSum e;
  e.Add(0x1p250);
  e.Add(1.0);
  e.Add(0x1p-300);
  e.Add(0x1p250);
  EXPECT_EQ(e.Value(), 0x1p251);  // the tiny terms are kept but vanish in the rounding
  ExactSum f;
  f.Add(0x1p-300);
  f.Add(0x1p-300);
  EXPECT_EQ(f.Value(), 0x1p-299);
  ExactSum huge;  // beyond the documented range (2^300): reported, not wrapped
  huge.Add(0x1p301);
  EXPECT_TRUE(huge.nonfinite());
  ExactSum s;
  for (int i = 1; i <= 1000; ++i) s.Add(i);
  EXPECT_EQ(s.Value(), 500500.0);
  ExactSum bad;
  bad.Add(-1.0);
  EXPECT_TRUE(bad.nonfinite());
  EXPECT_TRUE(std::isinf(bad.Value()));
}

TEST(GradStatsApiTest, RejectsBadInput) {
  EXPECT_TRUE(ComputeGradStats(nullptr, DType::kF32, 3).status().IsInvalidArgument());
  int8_t x = 0;
  auto r = ComputeGradStats(&x, DType::kI8, 1);
  EXPECT_TRUE(r.status().IsInvalidArgument());
  EXPECT_NE(r.status().message().find("int8"), std::string_view::npos);
  auto z = ComputeGradStats(nullptr, DType::kBF16, 0);
  ASSERT_TRUE(z.ok());
  EXPECT_EQ(z->sum_sq, 0.0);
  EXPECT_FALSE(z->nonfinite);
}

}  // namespace
}  // namespace strata::kernels
