#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/casts.h"
#include "kernels/pool.h"
#include "kernels_test_util.h"
#include "strata/dtype.h"

namespace strata::kernels {
namespace {

class CastTest : public TargetTest {};

// fp32 bit patterns that stress rounding: every bf16 value with low halves just below, at and
// above the tie, around every fp16 value and midpoint, specials, and random patterns.
std::vector<uint32_t> HardFloats() {
  std::vector<uint32_t> v;
  for (uint32_t hi = 0; hi < 0x10000u; ++hi) {
    for (uint32_t lo : {0x0000u, 0x0001u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu}) {
      v.push_back(hi << 16 | lo);
    }
  }
  for (uint32_t h = 0; h < 0x10000u; ++h) {  // around each half and the midpoint to the next
    const uint32_t f = std::bit_cast<uint32_t>(HalfToFloat(f16_t{static_cast<uint16_t>(h)}));
    const uint32_t g = std::bit_cast<uint32_t>(HalfToFloat(f16_t{static_cast<uint16_t>(h + 1)}));
    const float mid = (std::bit_cast<float>(f) + std::bit_cast<float>(g)) / 2;  // exact in fp32
    const uint32_t m = std::bit_cast<uint32_t>(mid);
    for (uint32_t x : {f, f - 1, f + 1, m, m - 1, m + 1}) v.push_back(x);
  }
  for (uint32_t x : {0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00001u, 0x7f800001u, 0xff80abcdu,
                     0x477fefffu, 0x477ff000u, 0x477ff001u, 0x33000000u, 0x33000001u, 0x387fffffu,
                     0x38800000u, 0x00000001u, 0x80000001u}) {
    v.push_back(x);
  }
  std::mt19937 rng(42);
  for (int i = 0; i < 100000; ++i) v.push_back(static_cast<uint32_t>(rng()));
  return v;
}

TEST_P(CastTest, F32ToBf16MatchesScalarRneBitForBit) {
  const std::vector<uint32_t> bits = HardFloats();
  std::vector<float> in(bits.size());
  std::memcpy(in.data(), bits.data(), bits.size() * 4);
  std::vector<bf16_t> out(in.size());
  CastF32ToBf16(in.data(), out.data(), in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    ASSERT_EQ(out[i].bits, FloatToBf16(in[i]).bits) << std::hex << "input 0x" << bits[i];
  }
}

TEST_P(CastTest, F32ToF16MatchesScalarRneBitForBit) {
  const std::vector<uint32_t> bits = HardFloats();
  std::vector<float> in(bits.size());
  std::memcpy(in.data(), bits.data(), bits.size() * 4);
  std::vector<f16_t> out(in.size());
  CastF32ToF16(in.data(), out.data(), in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    ASSERT_EQ(out[i].bits, FloatToHalf(in[i]).bits) << std::hex << "input 0x" << bits[i];
  }
}

TEST_P(CastTest, WideningIsExactForEvery16BitPattern) {
  std::vector<uint16_t> in(0x10000);
  for (uint32_t i = 0; i < 0x10000u; ++i) in[i] = static_cast<uint16_t>(i);
  std::vector<float> out(in.size());
  CastBf16ToF32(reinterpret_cast<const bf16_t*>(in.data()), out.data(), in.size());
  for (uint32_t i = 0; i < 0x10000u; ++i) {
    ASSERT_EQ(std::bit_cast<uint32_t>(out[i]), std::bit_cast<uint32_t>(Bf16ToFloat(bf16_t{in[i]})))
        << std::hex << "bf16 0x" << i;
  }
  CastF16ToF32(reinterpret_cast<const f16_t*>(in.data()), out.data(), in.size());
  for (uint32_t i = 0; i < 0x10000u; ++i) {
    ASSERT_EQ(std::bit_cast<uint32_t>(out[i]), std::bit_cast<uint32_t>(HalfToFloat(f16_t{in[i]})))
        << std::hex << "fp16 0x" << i;
  }
}

// Every size around the vector width, and nothing written past n.
TEST_P(CastTest, SizesAndBounds) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> dist(-70000.0f, 70000.0f);
  for (size_t n : Sizes()) {
    std::vector<float> in(n);
    for (float& x : in) x = dist(rng);
    std::vector<uint16_t> out(n + 8, 0xabcd);
    ASSERT_TRUE(Cast(in.data(), DType::kF32, out.data(), DType::kF16, n).ok());
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(out[i], FloatToHalf(in[i]).bits) << "n=" << n;
    for (size_t i = n; i < n + 8; ++i) ASSERT_EQ(out[i], 0xabcd) << "wrote past n=" << n;
    std::vector<float> back(n + 8, -1.0f);
    ASSERT_TRUE(Cast(out.data(), DType::kF16, back.data(), DType::kF32, n).ok());
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(back[i], HalfToFloat(f16_t{out[i]})) << "n=" << n;
    for (size_t i = n; i < n + 8; ++i) ASSERT_EQ(back[i], -1.0f) << "wrote past n=" << n;
  }
}

TEST_P(CastTest, PoolGivesTheSameBits) {
  const size_t n = 300001;
  std::vector<float> in(n);
  std::mt19937 rng(3);
  for (float& x : in) x = std::bit_cast<float>(static_cast<uint32_t>(rng()));
  std::vector<uint16_t> a(n), b(n);
  ASSERT_TRUE(Cast(in.data(), DType::kF32, a.data(), DType::kBF16, n).ok());
  auto pool = KernelPool::Create({.threads = 3, .tile_elems = 1024});
  ASSERT_TRUE(pool.ok());
  ASSERT_TRUE(Cast(**pool, in.data(), DType::kF32, b.data(), DType::kBF16, n).ok());
  EXPECT_EQ(a, b);
}

// The scalar formula of kernels/casts.h (a multiply, then an add with acc first; this file is
// built with -ffp-contract=off, so they do not fuse here either).
// `two_nans` (sized like acc) marks the elements where acc and the product are both NaN.
std::vector<float> AccumulateReference(const std::vector<float>& acc, const void* grad, DType t,
                                       float scale, bool overwrite, std::vector<bool>* two_nans) {
  std::vector<float> want = acc;
  two_nans->assign(acc.size(), false);
  for (size_t i = 0; i < acc.size(); ++i) {
    float g;
    if (t == DType::kF32) {
      g = static_cast<const float*>(grad)[i];
    } else if (t == DType::kBF16) {
      g = Bf16ToFloat(static_cast<const bf16_t*>(grad)[i]);
    } else {
      g = HalfToFloat(static_cast<const f16_t*>(grad)[i]);
    }
    const float prod = g * scale;
    want[i] = overwrite ? prod : acc[i] + prod;
    (*two_nans)[i] = !overwrite && std::isnan(acc[i]) && std::isnan(prod);
  }
  return want;
}

TEST_P(CastTest, AccumulateGradIsMulThenAddBitForBit) {
  std::mt19937 rng(11);
  for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{31}, size_t{33}, size_t{1000},
                   size_t{4097}}) {
    for (DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
      // Random bit patterns: NaNs with payloads, infinities, subnormals and -0 among them.
      std::vector<uint8_t> grad(n * DTypeSize(t));
      for (uint8_t& b : grad) b = static_cast<uint8_t>(rng());
      for (float scale : {1.0f, 0.1f, -3.0f, 65536.0f, 1e-30f, 0.0f}) {
        for (bool overwrite : {false, true}) {
          std::vector<float> acc(n);
          for (float& a : acc) {
            a = overwrite ? std::bit_cast<float>(0x7fbadbadu)  // never read
                          : std::bit_cast<float>(static_cast<uint32_t>(rng()));
          }
          std::vector<bool> two_nans;
          const std::vector<float> want =
              AccumulateReference(acc, grad.data(), t, scale, overwrite, &two_nans);
          std::vector<float> got = acc;
          ASSERT_TRUE(AccumulateGrad(got.data(), grad.data(), t, scale, overwrite, n).ok());
          for (size_t i = 0; i < n; ++i) {
            // NaN + NaN is one of the two NaNs, and which one is the compiler's choice: it may
            // commute an add's operands, in the kernel as in this reference (the sanitizer
            // build and the plain one pick differently). Any NaN is right there.
            if (two_nans[i]) {
              ASSERT_TRUE(std::isnan(got[i])) << "n=" << n << " element " << i;
              continue;
            }
            ASSERT_EQ(std::bit_cast<uint32_t>(got[i]), std::bit_cast<uint32_t>(want[i]))
                << "n=" << n << " " << DTypeName(t) << " scale=" << scale
                << (overwrite ? " overwrite" : "") << " element " << i;
          }
        }
      }
    }
  }
  // Overwriting with a -0 product gives -0 (not 0 + -0 = +0).
  const float neg_zero = -0.0f;
  float acc = 1.0f;
  ASSERT_TRUE(AccumulateGrad(&acc, &neg_zero, DType::kF32, 1.0f, true, 1).ok());
  EXPECT_EQ(std::bit_cast<uint32_t>(acc), 0x80000000u);
}

TEST_P(CastTest, AccumulateGradPoolGivesTheSameBits) {
  const size_t n = 300001;
  std::mt19937 rng(5);
  std::vector<uint16_t> grad(n);
  for (uint16_t& g : grad) g = static_cast<uint16_t>(rng());
  std::vector<float> a(n);
  for (float& x : a) x = static_cast<float>(rng() % 1000) / 7.0f;
  std::vector<float> b = a;
  ASSERT_TRUE(AccumulateGrad(a.data(), grad.data(), DType::kBF16, 0.25f, false, n).ok());
  auto pool = KernelPool::Create({.threads = 3, .tile_elems = 1024});
  ASSERT_TRUE(pool.ok());
  ASSERT_TRUE(AccumulateGrad(**pool, b.data(), grad.data(), DType::kBF16, 0.25f, false, n).ok());
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), n * sizeof(float)));
}

STRATA_INSTANTIATE_FOR_TARGETS(CastTest);

TEST(CastApiTest, RejectsUnsupportedPairsAndNulls) {
  float f = 1.0f;
  int8_t i8 = 0;
  Status s = Cast(&f, DType::kF32, &i8, DType::kI8, 1);
  EXPECT_TRUE(s.IsInvalidArgument());
  EXPECT_NE(s.message().find("fp32 -> int8"), std::string_view::npos) << s.ToString();
  uint16_t h = 0;
  EXPECT_TRUE(Cast(&h, DType::kBF16, &h, DType::kF16, 1).IsInvalidArgument());
  EXPECT_TRUE(Cast(nullptr, DType::kF32, &h, DType::kBF16, 1).IsInvalidArgument());
  EXPECT_TRUE(Cast(nullptr, DType::kF32, nullptr, DType::kBF16, 0).ok());
  float g = 0;
  ASSERT_TRUE(Cast(&f, DType::kF32, &g, DType::kF32, 1).ok());  // same dtype: a copy
  EXPECT_EQ(g, 1.0f);
}

TEST(CastApiTest, AccumulateGradRejectsBadArguments) {
  float f = 1.0f;
  EXPECT_TRUE(AccumulateGrad(&f, &f, DType::kI8, 1.0f, false, 1).IsInvalidArgument());
  EXPECT_TRUE(AccumulateGrad(&f, &f, DType::kF32, NAN, false, 1).IsInvalidArgument());
  EXPECT_TRUE(AccumulateGrad(&f, &f, DType::kF32, INFINITY, true, 1).IsInvalidArgument());
  EXPECT_TRUE(AccumulateGrad(nullptr, &f, DType::kF32, 1.0f, false, 1).IsInvalidArgument());
  EXPECT_TRUE(AccumulateGrad(&f, nullptr, DType::kF32, 1.0f, false, 1).IsInvalidArgument());
  EXPECT_TRUE(AccumulateGrad(nullptr, nullptr, DType::kF32, 1.0f, false, 0).ok());
  const Status st = AccumulateGrad(&f, &f, DType::kI8, 1.0f, false, 1);
  EXPECT_NE(st.message().find("int8"), std::string::npos) << st.ToString();
}

TEST(TargetsTest, AtLeastOneTargetAndNamesKnown) {
  const auto targets = SupportedKernelTargets();
  ASSERT_FALSE(targets.empty());
  for (int64_t t : targets) EXPECT_FALSE(KernelTargetName(t).empty());
  EXPECT_EQ(ActiveKernelTarget(), targets.front());
}

}  // namespace
}  // namespace strata::kernels
