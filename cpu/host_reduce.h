// Scalar host loops used by the Gloo communicator to widen 16-bit floats to fp32 for summing and to
// round the fp32 result back once (round to nearest even, via the reference conversions in
// include/strata/dtype.h). Not a hot kernel: the wire dominates on the CPU backend.
//
// Thread safety: pure functions over caller-owned buffers.
#pragma once

#include <cstddef>
#include <cstring>

#include "strata/dtype.h"

namespace strata {

// dst[i] = scale * float(src[i]). src may alias dst when dtype is fp32.
inline void LoadScaled(DType dtype, const void* src, float* dst, size_t n, float scale) {
  if (dtype == DType::kF32) {
    const auto* s = static_cast<const float*>(src);
    if (scale == 1.0f) {
      if (s != dst) std::memmove(dst, s, n * sizeof(float));
      return;
    }
    for (size_t i = 0; i < n; ++i) dst[i] = s[i] * scale;
  } else if (dtype == DType::kBF16) {
    const auto* s = static_cast<const bf16_t*>(src);
    for (size_t i = 0; i < n; ++i) dst[i] = Bf16ToFloat(s[i]) * scale;
  } else {
    const auto* s = static_cast<const f16_t*>(src);
    for (size_t i = 0; i < n; ++i) dst[i] = HalfToFloat(s[i]) * scale;
  }
}

// acc[i] = partial[i] + scale * float(src[i]).
inline void AccumulateScaled(DType dtype, const void* src, const float* partial, float* acc,
                             size_t n, float scale) {
  if (dtype == DType::kF32) {
    const auto* s = static_cast<const float*>(src);
    for (size_t i = 0; i < n; ++i) acc[i] = partial[i] + s[i] * scale;
  } else if (dtype == DType::kBF16) {
    const auto* s = static_cast<const bf16_t*>(src);
    for (size_t i = 0; i < n; ++i) acc[i] = partial[i] + Bf16ToFloat(s[i]) * scale;
  } else {
    const auto* s = static_cast<const f16_t*>(src);
    for (size_t i = 0; i < n; ++i) acc[i] = partial[i] + HalfToFloat(s[i]) * scale;
  }
}

// dst[i] = dtype(src[i]), rounded to nearest even.
inline void StoreFloat(DType dtype, const float* src, void* dst, size_t n) {
  if (dtype == DType::kF32) {
    if (src != dst) std::memcpy(dst, src, n * sizeof(float));
  } else if (dtype == DType::kBF16) {
    auto* d = static_cast<bf16_t*>(dst);
    for (size_t i = 0; i < n; ++i) d[i] = FloatToBf16(src[i]);
  } else {
    auto* d = static_cast<f16_t*>(dst);
    for (size_t i = 0; i < n; ++i) d[i] = FloatToHalf(src[i]);
  }
}

}  // namespace strata
