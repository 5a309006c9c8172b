// The per-element arithmetic of the CUDA quantize kernels (quantize_cuda.cu), written once for
// both sides as kernels/cuda_math.h is: nvcc compiles it into the kernels, and
// tests/cuda_kernels_test.cc compiles it for the host and checks it against the CPU reference
// (QuantizeInt8Reference) bit for bit without a GPU. Each primitive is one IEEE operation, round
// to nearest even. A host file that includes this builds with -ffp-contract=off.
//
// Thread safety: pure functions.
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/cuda_math.h"
#include "kernels/quantize.h"

namespace strata::kernels::quantize_math {

// |x| as fp32 bits: magnitudes order as these integers, NaN and Inf at >= 0x7f800000.
STRATA_HD uint32_t AbsBits(float x) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(x) & 0x7fffffffu;
#else
  return std::bit_cast<uint32_t>(x) & 0x7fffffffu;
#endif
}

// Round to nearest integer, ties to even. REQUIRES: |t| <= 127.
STRATA_HD int RoundEven(float t) {
#ifdef __CUDA_ARCH__
  return __float2int_rn(t);
#else
  return static_cast<int>(std::nearbyint(t));  // the default rounding mode: nearest even
#endif
}

// q of one element of a block with `scale` (quantize.h): 0 unless scale > 0 (zero, underflowed
// and NaN scales), else round_half_even(clamp(x / scale, -127, 127)).
STRATA_HD int8_t QuantizeElement(float x, float scale) {
  if (!(scale > 0.0f)) return 0;
  float t = cuda_math::Div(x, scale);
  t = t < -127.0f ? -127.0f : (t > 127.0f ? 127.0f : t);
  return static_cast<int8_t>(RoundEven(t));
}

// NaN bits follow the CPU's (x86) rule, which the reference's results carry: an operation with a
// NaN operand returns that operand (the first one, if both are NaN). The device's multiply and add
// would return their own NaN (0x7fffffff) instead.

// deq = float(q) * scale, one rounding. A non-finite block's scale (the quiet NaN 0x7fc00000)
// comes out as itself.
STRATA_HD float DequantizeElement(int8_t q, float scale) {
  if (scale != scale) return scale;
  return cuda_math::Mul(static_cast<float>(q), scale);
}

// acc + deq, one rounding, for the accumulating dequantize.
STRATA_HD float AccumulateElement(float acc, float deq) {
  if (acc != acc) return acc;
  if (deq != deq) return deq;
  return cuda_math::Add(acc, deq);
}

}  // namespace strata::kernels::quantize_math
