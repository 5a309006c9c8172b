// The per-element arithmetic of the CUDA kernels (cuda_kernels.cu), written once for both sides:
// nvcc compiles it into the kernels, and tests/cuda_kernels_test.cc compiles it for the host,
// where it is checked bit for bit against the CPU SIMD kernels without a GPU. So the only thing
// a GPU run has left to show is that the device primitives below round as IEEE says.
//
// Primitives: each is one IEEE-754 operation, round to nearest even, subnormals kept. On the
// device they are the _rn intrinsics, which nvcc never contracts into an FMA nor reassociates
// (strata_kernels_cuda also builds with -fmad=false -ftz=false -prec-div=true -prec-sqrt=true).
// On the host they are plain operators and std::fma/std::sqrt; a host file that includes this
// must build with -ffp-contract=off so that Mul followed by Add stays two roundings.
//
// Thread safety: pure functions.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "kernels/simd.h"
#include "strata/dtype.h"

#if defined(__CUDACC__)
#define STRATA_HD __host__ __device__ __forceinline__
#else
#define STRATA_HD inline
#endif

namespace strata::kernels::cuda_math {

STRATA_HD float Mul(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
STRATA_HD float Add(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
STRATA_HD float Sub(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
// a * b + c, one rounding.
STRATA_HD float Fma(float a, float b, float c) {
#ifdef __CUDA_ARCH__
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}
STRATA_HD float Div(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
STRATA_HD float Sqrt(float a) {
#ifdef __CUDA_ARCH__
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}
STRATA_HD double AddD(double a, double b) {
#ifdef __CUDA_ARCH__
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}
STRATA_HD double FmaD(double a, double b, double c) {
#ifdef __CUDA_ARCH__
  return __fma_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

// Element i of a gradient of element code kElem (simd::Elem), widened exactly to fp32 by integer
// code (strata/dtype.h), so NaN payloads survive as on the CPU.
template <int kElem>
STRATA_HD float LoadElem(const void* p, size_t i) {
  if constexpr (kElem == simd::kElemF32) {
    return static_cast<const float*>(p)[i];
  } else if constexpr (kElem == simd::kElemBF16) {
    return Bf16ToFloat(bf16_t{static_cast<const uint16_t*>(p)[i]});
  } else {
    return HalfToFloat(f16_t{static_cast<const uint16_t*>(p)[i]});
  }
}

// fp32 -> 16-bit bits (kOut: simd::kElemBF16 or kElemF16), round to nearest even, NaN kept.
template <int kOut>
STRATA_HD uint16_t Narrow(float x) {
  if constexpr (kOut == simd::kElemBF16) {
    return FloatToBf16(x).bits;
  } else {
    return FloatToHalf(x).bits;
  }
}

// Gradient accumulation (cuda_kernels.h): a product and a sum, each rounded once.
STRATA_HD float AccumulateElement(float acc, float g, float scale) {
  return Add(acc, Mul(g, scale));
}
STRATA_HD float OverwriteElement(float g, float scale) { return Mul(g, scale); }

// Chunk sum of squares in the AVX2 target's order (stats_simd.cc with 8 fp32 lanes, Highway
// 1.0.3): 16 double accumulators, lane j summing x^2 over the chunk's elements j, j + 16, ... in
// order (x^2 is exact in double, so the FMA there is a plain add); the zero padding of its tail
// adds +0 and changes nothing. Then the four 4-lane accumulators are added as
// (acc0 + acc1) + (acc2 + acc3) and Highway's SumOfLanes folds the 4 lanes as
// (s0 + s2) + (s1 + s3).
inline constexpr int kChunkLanes = 16;

template <int kElem>
STRATA_HD double ChunkLaneSum(const void* grad, size_t chunk_begin, size_t count, int lane) {
  double acc = 0.0;
  for (size_t k = static_cast<size_t>(lane); k < count; k += kChunkLanes) {
    const double x = LoadElem<kElem>(grad, chunk_begin + k);
    acc = FmaD(x, x, acc);
  }
  return acc;
}

STRATA_HD double CombineChunkLanes(const double* lane) {
  double s[4];
  for (int k = 0; k < 4; ++k) {
    s[k] = AddD(AddD(lane[k], lane[4 + k]), AddD(lane[8 + k], lane[12 + k]));
  }
  return AddD(AddD(s[0], s[2]), AddD(s[1], s[3]));
}

}  // namespace strata::kernels::cuda_math
