#include "strata/dtype.h"

#include <cmath>
#include <cstring>
#include <limits>

#include <gtest/gtest.h>

namespace strata {
namespace {

TEST(DTypeTest, SizesAndNames) {
  EXPECT_EQ(DTypeSize(DType::kF32), 4u);
  EXPECT_EQ(DTypeSize(DType::kBF16), 2u);
  EXPECT_EQ(DTypeSize(DType::kF16), 2u);
  EXPECT_EQ(DTypeSize(DType::kI8), 1u);
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16, DType::kI8}) {
    EXPECT_EQ(ParseDType(DTypeName(t)), t);
  }
  EXPECT_EQ(ParseDType("bfloat16"), DType::kBF16);
  EXPECT_FALSE(ParseDType("fp8").has_value());
}


TEST(DTypeTest, Bf16RoundsToNearestEven) {
  // 1.0 + half an ulp of bf16 (2^-8) is a tie: stays at the even 1.0.
  EXPECT_EQ(FloatToBf16(std::bit_cast<float>(0x3f808000u)).bits, 0x3f80);
  // 1.0078125 (odd last bit 0x3f81) + half ulp ties up to the even 0x3f82.
  EXPECT_EQ(FloatToBf16(std::bit_cast<float>(0x3f818000u)).bits, 0x3f82);
  // Just above the tie rounds up; just below rounds down.
  EXPECT_EQ(FloatToBf16(std::bit_cast<float>(0x3f808001u)).bits, 0x3f81);
  EXPECT_EQ(FloatToBf16(std::bit_cast<float>(0x3f807fffu)).bits, 0x3f80);
  // Largest finite rounds to Inf, as IEEE says.
  EXPECT_EQ(FloatToBf16(std::numeric_limits<float>::max()).bits, 0x7f80);
  EXPECT_EQ(FloatToBf16(-std::numeric_limits<float>::infinity()).bits, 0xff80);
  // NaN stays NaN even when its payload is only in the low bits.
  bf16_t n = FloatToBf16(std::bit_cast<float>(0x7f800001u));
  EXPECT_TRUE(std::isnan(Bf16ToFloat(n)));
  EXPECT_TRUE(std::signbit(Bf16ToFloat(FloatToBf16(-std::numeric_limits<float>::quiet_NaN()))));
}

TEST(DTypeTest, Bf16RoundTripIsExactForAllBf16Values) {
  for (uint32_t b = 0; b < 0x10000u; ++b) {
    bf16_t v{static_cast<uint16_t>(b)};
    float f = Bf16ToFloat(v);
    if (std::isnan(f)) continue;
    ASSERT_EQ(FloatToBf16(f).bits, v.bits) << std::hex << b;
  }
}

// Reference: round through double, which represents every half and float exactly.
uint16_t HalfReference(float f) {
  if (std::isnan(f)) return 0x7e00;
  double best_err = INFINITY;
  uint16_t best = 0;
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  double a = std::fabs(static_cast<double>(f));
  if (a >= 65520.0) return sign | 0x7c00;
  for (uint32_t b = 0; b < 0x7c00u; ++b) {
    double v = HalfToFloat(f16_t{static_cast<uint16_t>(b)});
    double err = std::fabs(v - a);
    if (err < best_err || (err == best_err && (b & 1u) == 0)) {
      best_err = err;
      best = static_cast<uint16_t>(b);
    }
  }
  return sign | best;
}

TEST(DTypeTest, HalfRoundTripAndSpecials) {
  for (uint32_t b = 0; b < 0x10000u; ++b) {
    f16_t v{static_cast<uint16_t>(b)};
    float f = HalfToFloat(v);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(f))));
      continue;
    }
    ASSERT_EQ(FloatToHalf(f).bits, v.bits) << std::hex << b;
  }
  EXPECT_EQ(HalfToFloat(f16_t{0x3c00}), 1.0f);
  EXPECT_EQ(HalfToFloat(f16_t{0x0001}), std::ldexp(1.0f, -24));
  EXPECT_EQ(FloatToHalf(65504.0f).bits, 0x7bff);
  EXPECT_EQ(FloatToHalf(65520.0f).bits, 0x7c00);  // tie rounds to even = Inf
  EXPECT_EQ(FloatToHalf(65519.99f).bits, 0x7bff);
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -25)).bits, 0x0000);  // tie to even zero
  EXPECT_EQ(FloatToHalf(std::ldexp(1.5f, -25)).bits, 0x0001);
}

TEST(DTypeTest, HalfMatchesBruteForceReference) {
  uint32_t x = 12345;
  for (int i = 0; i < 3000; ++i) {
    x = x * 1664525u + 1013904223u;
    // Spread over the half range: exponents 2^-26 .. 2^17.
    float f = std::ldexp(1.0f + (x >> 9) / 8388608.0f, static_cast<int>(x % 44) - 26);
    if (x & 1) f = -f;
    ASSERT_EQ(FloatToHalf(f).bits, HalfReference(f)) << f;
  }
  // Exact ties between halves.
  for (uint32_t b = 0; b < 0x7bff; b += 97) {
    double lo = HalfToFloat(f16_t{static_cast<uint16_t>(b)});
    double hi = HalfToFloat(f16_t{static_cast<uint16_t>(b + 1)});
    float mid = static_cast<float>((lo + hi) / 2);
    ASSERT_EQ(FloatToHalf(mid).bits, HalfReference(mid)) << b;
  }
}

}  // namespace
}  // namespace strata
