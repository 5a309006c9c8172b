// Host loops the Gloo communicator runs around its fp32 sums of 16-bit data (world size >= 2):
// widen bf16 / fp16 to fp32 (times a scale: the predivide), add a received fp32 partial sum, and
// round the fp32 result back once. SIMD with dynamic dispatch to the best Highway target of the
// running CPU (cpu/host_reduce_simd.cc, built on the exact conversions of kernels/convert-inl.h),
// because at Gloo's ring speeds on one host (shared memory / loopback) the scalar loops were a
// visible share of a 16-bit reduce-scatter.
//
// Exactness: every target gives the bits of the scalar reference (host_reduce_ref below, which
// the tests and the benchmark compare against): one fp32 multiply and one fp32 add per element,
// never fused into an FMA; widening is exact; rounding to bf16 / fp16 is to nearest, ties to
// even, fp16 overflow gives Inf; NaN stays NaN (quiet, sign and top payload bits kept) and Inf
// stays Inf. The one freedom: when both operands of the add are NaN, which payload survives (the
// scalar code leaves that to the compiler's operand order).
//
// Thread safety: pure functions over caller-owned buffers.
#pragma once

#include <cstddef>
#include <cstring>

#include "strata/dtype.h"

namespace strata {

// dst[i] = float(src[i]) * scale. src may alias dst when dtype is fp32.
void LoadScaled(DType dtype, const void* src, float* dst, size_t n, float scale);
// acc[i] = partial[i] + float(src[i]) * scale. partial may alias acc.
void AccumulateScaled(DType dtype, const void* src, const float* partial, float* acc, size_t n,
                      float scale);
// dst[i] = dtype(src[i]), rounded to nearest even. dst may alias src when dtype is fp32.
void StoreFloat(DType dtype, const float* src, void* dst, size_t n);

// The scalar reference (the loops the SIMD code replaces), for tests and the benchmark.
namespace host_reduce_ref {

inline float Widen(DType dtype, const void* src, size_t i) {
  switch (dtype) {
    case DType::kBF16:
      return Bf16ToFloat(static_cast<const bf16_t*>(src)[i]);
    case DType::kF16:
      return HalfToFloat(static_cast<const f16_t*>(src)[i]);
    default:
      return static_cast<const float*>(src)[i];
  }
}

// (LoadScaled of fp32 by 1 is a copy in both: not a widening, left out here.)
inline void LoadScaled(DType dtype, const void* src, float* dst, size_t n, float scale) {
  for (size_t i = 0; i < n; ++i) dst[i] = Widen(dtype, src, i) * scale;
}

inline void AccumulateScaled(DType dtype, const void* src, const float* partial, float* acc,
                             size_t n, float scale) {
  for (size_t i = 0; i < n; ++i) acc[i] = partial[i] + Widen(dtype, src, i) * scale;
}

inline void StoreFloat(DType dtype, const float* src, void* dst, size_t n) {
  if (dtype == DType::kF32) {
    if (src != dst) std::memmove(dst, src, n * sizeof(float));
  } else if (dtype == DType::kBF16) {
    auto* d = static_cast<bf16_t*>(dst);
    for (size_t i = 0; i < n; ++i) d[i] = FloatToBf16(src[i]);
  } else {
    auto* d = static_cast<f16_t*>(dst);
    for (size_t i = 0; i < n; ++i) d[i] = FloatToHalf(src[i]);
  }
}

}  // namespace host_reduce_ref
}  // namespace strata
