// The Gloo communicator's SIMD widen / accumulate / round loops (cpu/host_reduce.h) against their
// scalar reference, bit for bit, on every compiled Highway target this CPU supports: every bf16 and
// fp16 bit pattern widened (scaled by 1 and by values that round), fp32 edge values rounded (ties,
// subnormals, overflow, NaN payloads, Inf), and sizes around the vector width (0, 1, N-1, N, N+1
// for N in 4..64) with a fixed seed.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "cpu/host_reduce.h"
#include "kernels/targets.h"

namespace strata {
namespace {

using kernels::KernelTargetName;
using kernels::SupportedKernelTargets;

float Bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint32_t BitsOf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// Each test runs its body once per supported target, then restores normal dispatch.
class HostReduceTargets : public ::testing::Test {
 protected:
  template <class F>
  void ForEachTarget(const F& body) {
    const auto targets = SupportedKernelTargets();
    ASSERT_FALSE(targets.empty());
    for (int64_t t : targets) {
      kernels::ForceTargetForTest(t);
      SCOPED_TRACE(KernelTargetName(t));
      body();
    }
    kernels::ForceTargetForTest(0);
  }
};

// fp32 values that stress rounding to bf16 and fp16 and the special cases.
std::vector<float> EdgeFloats() {
  std::vector<float> v = {0.0f,
                          -0.0f,
                          1.0f,
                          -1.0f,
                          std::numeric_limits<float>::denorm_min(),
                          -std::numeric_limits<float>::denorm_min(),
                          std::numeric_limits<float>::min(),
                          std::numeric_limits<float>::max(),
                          -std::numeric_limits<float>::max(),
                          std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity(),
                          Bits(0x7fc00000u),
                          Bits(0xffc00001u),  // quiet NaN, payloads
                          Bits(0x7f800001u),
                          Bits(0xff812345u),  // signaling NaN, payloads
                          Bits(0x3f808000u),
                          Bits(0x3f818000u),  // bf16 ties: to even down / up
                          Bits(0x3f808001u),
                          Bits(0x3f807fffu),  // just above / below a tie
                          Bits(0x7f7f8000u),  // bf16 rounds up to Inf
                          65504.0f,
                          65519.99f,
                          65520.0f,
                          1e6f,  // fp16 max, overflow edge
                          0x1p-24f,
                          0x1p-25f,
                          0x1.8p-25f,
                          0x1p-14f,
                          0x1.ffcp-15f,  // fp16 subnormals
                          1.0f + 0x1p-11f,
                          1.0f + 0x3p-11f};  // fp16 ties
  // And random bit patterns (fixed seed), NaNs included.
  std::mt19937 rng(20261201);
  for (int i = 0; i < 4000; ++i) v.push_back(Bits(static_cast<uint32_t>(rng())));
  return v;
}

// Every 16-bit pattern, as the raw bits of bf16 or fp16.
std::vector<uint16_t> AllHalfPatterns() {
  std::vector<uint16_t> v(65536);
  for (uint32_t i = 0; i < 65536; ++i) v[i] = static_cast<uint16_t>(i);
  return v;
}

void ExpectSameBits(const float* got, const float* want, size_t n, const std::string& what) {
  for (size_t i = 0; i < n; ++i) {
    ASSERT_EQ(BitsOf(got[i]), BitsOf(want[i]))
        << what << " element " << i << ": " << got[i] << " vs reference " << want[i];
  }
}

TEST_F(HostReduceTargets, LoadScaledWidensEveryPatternLikeTheReference) {
  const std::vector<uint16_t> src = AllHalfPatterns();
  ForEachTarget([&] {
    for (DType dt : {DType::kBF16, DType::kF16}) {
      for (float scale : {1.0f, 0.5f, 1.0f / 3.0f, 3.0f, 0x1p-100f}) {
        std::vector<float> got(src.size()), want(src.size());
        LoadScaled(dt, src.data(), got.data(), src.size(), scale);
        host_reduce_ref::LoadScaled(dt, src.data(), want.data(), src.size(), scale);
        ExpectSameBits(got.data(), want.data(), src.size(),
                       std::string(DTypeName(dt)) + " scale " + std::to_string(scale));
      }
    }
    // fp32, scaled (the unscaled path is a copy).
    const std::vector<float> f = EdgeFloats();
    std::vector<float> got(f.size()), want(f.size());
    LoadScaled(DType::kF32, f.data(), got.data(), f.size(), 0.1f);
    host_reduce_ref::LoadScaled(DType::kF32, f.data(), want.data(), f.size(), 0.1f);
    ExpectSameBits(got.data(), want.data(), f.size(), "fp32 scale 0.1");
  });
}

TEST_F(HostReduceTargets, AccumulateScaledAddsLikeTheReference) {
  const std::vector<uint16_t> src = AllHalfPatterns();
  // Partial sums: finite edge values cycled (a NaN partial plus a NaN element may keep either
  // payload, see host_reduce.h), so every element sees a distinct pairing.
  std::vector<float> finite;
  for (float x : EdgeFloats()) {
    if (!std::isnan(x)) finite.push_back(x);
  }
  std::vector<float> partial(src.size());
  for (size_t i = 0; i < partial.size(); ++i) partial[i] = finite[(i * 7) % finite.size()];
  ForEachTarget([&] {
    for (DType dt : {DType::kBF16, DType::kF16}) {
      for (float scale : {1.0f, 0.25f, 1.0f / 3.0f}) {
        std::vector<float> got(src.size()), want(src.size());
        AccumulateScaled(dt, src.data(), partial.data(), got.data(), src.size(), scale);
        host_reduce_ref::AccumulateScaled(dt, src.data(), partial.data(), want.data(), src.size(),
                                          scale);
        ExpectSameBits(got.data(), want.data(), src.size(),
                       std::string(DTypeName(dt)) + " scale " + std::to_string(scale));
        // In place (partial == acc), as a ring step may run it.
        std::vector<float> inplace = partial;
        AccumulateScaled(dt, src.data(), inplace.data(), inplace.data(), src.size(), scale);
        ExpectSameBits(inplace.data(), want.data(), src.size(), "in place");
      }
    }
    std::vector<float> f32(finite.begin(), finite.end());
    std::vector<float> p(f32.rbegin(), f32.rend()), got(f32.size()), want(f32.size());
    AccumulateScaled(DType::kF32, f32.data(), p.data(), got.data(), f32.size(), 0.5f);
    host_reduce_ref::AccumulateScaled(DType::kF32, f32.data(), p.data(), want.data(), f32.size(),
                                      0.5f);
    ExpectSameBits(got.data(), want.data(), f32.size(), "fp32");
  });
}

TEST_F(HostReduceTargets, StoreFloatRoundsLikeTheReference) {
  const std::vector<float> f = EdgeFloats();
  ForEachTarget([&] {
    for (DType dt : {DType::kBF16, DType::kF16}) {
      std::vector<uint16_t> got(f.size()), want(f.size());
      StoreFloat(dt, f.data(), got.data(), f.size());
      host_reduce_ref::StoreFloat(dt, f.data(), want.data(), f.size());
      for (size_t i = 0; i < f.size(); ++i) {
        ASSERT_EQ(got[i], want[i]) << DTypeName(dt) << " of fp32 bits 0x" << std::hex
                                   << BitsOf(f[i]) << " (element " << std::dec << i << ")";
      }
    }
  });
}

// Sizes around every vector width: 0, 1, N-1, N, N+1 for N = 4 .. 64 (the tail and the body run
// the same operations; no element outside [0, n) is touched).
TEST_F(HostReduceTargets, SizesAroundTheVectorWidthTouchOnlyTheirRange) {
  const std::vector<float> f = EdgeFloats();
  std::vector<uint16_t> h(f.size());
  host_reduce_ref::StoreFloat(DType::kBF16, f.data(), h.data(), h.size());
  std::vector<float> partial;  // no NaN: NaN + NaN may keep either payload (host_reduce.h)
  for (float x : f) {
    if (!std::isnan(x)) partial.push_back(x);
  }
  std::vector<size_t> sizes = {0, 1};
  for (size_t n : {4, 8, 16, 32, 64}) {
    for (size_t d : {n - 1, n, n + 1}) sizes.push_back(d);
  }
  ForEachTarget([&] {
    for (size_t n : sizes) {
      SCOPED_TRACE("n = " + std::to_string(n));
      std::vector<float> got(n + 8, 7.0f), want(n + 8, 7.0f);
      LoadScaled(DType::kBF16, h.data() + 3, got.data(), n, 0.75f);
      host_reduce_ref::LoadScaled(DType::kBF16, h.data() + 3, want.data(), n, 0.75f);
      ExpectSameBits(got.data(), want.data(), n + 8, "load");
      AccumulateScaled(DType::kF16, h.data() + 1, partial.data() + 5, got.data(), n, 2.0f);
      host_reduce_ref::AccumulateScaled(DType::kF16, h.data() + 1, partial.data() + 5, want.data(),
                                        n, 2.0f);
      ExpectSameBits(got.data(), want.data(), n + 8, "accumulate");
      std::vector<uint16_t> g16(n + 8, 0xabcd), w16(n + 8, 0xabcd);
      StoreFloat(DType::kF16, f.data() + 2, g16.data(), n);
      host_reduce_ref::StoreFloat(DType::kF16, f.data() + 2, w16.data(), n);
      EXPECT_EQ(g16, w16);
    }
  });
}

}  // namespace
}  // namespace strata
