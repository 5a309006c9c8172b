// DType: the element types strata stores and moves (fp32, bf16, fp16, int8), their sizes and
// names, and exact scalar conversions between fp32 and the 16-bit float formats.
//
// The scalar conversions are the reference that the SIMD kernels (kernels/) are tested against
// bit for bit: fp32 -> bf16/fp16 rounds to nearest, ties to even; NaN stays NaN (quiet, sign
// kept); overflow to fp16 gives +-Inf. They are also used where a few elements are converted
// outside a hot loop (collectives on the CPU, tests).
//
// Thread safety: everything here is a pure function.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace strata {

enum class DType : uint8_t { kF32 = 0, kBF16, kF16, kI8 };

constexpr size_t DTypeSize(DType t) noexcept {
  switch (t) {
    case DType::kF32: return 4;
    case DType::kBF16: return 2;
    case DType::kF16: return 2;
    case DType::kI8: return 1;
  }
  return 0;
}

constexpr std::string_view DTypeName(DType t) noexcept {
  switch (t) {
    case DType::kF32: return "fp32";
    case DType::kBF16: return "bf16";
    case DType::kF16: return "fp16";
    case DType::kI8: return "int8";
  }
  return "?";
}

// Accepts the names DTypeName prints plus the usual aliases (float32, bfloat16, half, ...).
constexpr std::optional<DType> ParseDType(std::string_view s) noexcept {
  if (s == "fp32" || s == "float32" || s == "f32" || s == "float") return DType::kF32;
  if (s == "bf16" || s == "bfloat16") return DType::kBF16;
  if (s == "fp16" || s == "float16" || s == "f16" || s == "half") return DType::kF16;
  if (s == "int8" || s == "i8") return DType::kI8;
  return std::nullopt;
}

// Storage types for 16-bit floats: plain bits, no arithmetic.
struct bf16_t {
  uint16_t bits;
};
struct f16_t {
  uint16_t bits;
};

constexpr float Bf16ToFloat(bf16_t v) noexcept {
  return std::bit_cast<float>(static_cast<uint32_t>(v.bits) << 16);
}

// Round to nearest even; NaN stays a quiet NaN with its sign.
constexpr bf16_t FloatToBf16(float f) noexcept {
  uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN
    return bf16_t{static_cast<uint16_t>((u >> 16) | 0x0040u)};
  }
  const uint32_t lsb = (u >> 16) & 1u;
  u += 0x7fffu + lsb;
  return bf16_t{static_cast<uint16_t>(u >> 16)};
}

constexpr float HalfToFloat(f16_t h) noexcept {
  const uint32_t sign = static_cast<uint32_t>(h.bits & 0x8000u) << 16;
  const uint32_t exp = (h.bits >> 10) & 0x1fu;
  uint32_t mant = h.bits & 0x3ffu;
  if (exp == 0x1f) {  // Inf / NaN
    return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13));
  }
  if (exp == 0) {
    if (mant == 0) return std::bit_cast<float>(sign);
    // Subnormal: normalize.
    int e = -1;
    do {
      ++e;
      mant <<= 1;
    } while ((mant & 0x400u) == 0);
    mant &= 0x3ffu;
    const uint32_t fexp = static_cast<uint32_t>(127 - 15 - e);
    return std::bit_cast<float>(sign | (fexp << 23) | (mant << 13));
  }
  return std::bit_cast<float>(sign | ((exp + 127 - 15) << 23) | (mant << 13));
}

// Round to nearest even; overflow -> Inf; NaN stays a quiet NaN with its sign.
constexpr f16_t FloatToHalf(float f) noexcept {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) {  // NaN: keep top mantissa bits, force quiet
    return f16_t{static_cast<uint16_t>(sign | 0x7e00u | ((abs >> 13) & 0x3ffu))};
  }
  if (abs >= 0x477ff000u) {  // rounds to >= 65520 -> Inf (and Inf itself)
    return f16_t{static_cast<uint16_t>(sign | 0x7c00u)};
  }
  if (abs < 0x38800000u) {  // below the smallest normal half (2^-14): subnormal or zero
    if (abs < 0x33000000u) return f16_t{sign};  // < 2^-25 rounds to zero (2^-25 ties to 0)
    const uint32_t exp = abs >> 23;
    const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    // value = mant * 2^(exp - 150) and a half subnormal is q * 2^-24, so q = mant >> (126 - exp).
    const uint32_t drop = 126u - exp;
    uint32_t q = mant >> drop;
    const uint32_t rem = mant & ((1u << drop) - 1u);
    const uint32_t half = 1u << (drop - 1u);
    if (rem > half || (rem == half && (q & 1u))) ++q;
    return f16_t{static_cast<uint16_t>(sign | q)};
  }
  // Normal: rebias exponent, round mantissa from 23 to 10 bits.
  uint32_t v = abs - ((127u - 15u) << 23);
  const uint32_t lsb = (v >> 13) & 1u;
  v += 0xfffu + lsb;
  return f16_t{static_cast<uint16_t>(sign | (v >> 13))};
}

}  // namespace strata
