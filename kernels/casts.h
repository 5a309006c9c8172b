// Casts between fp32 and the 16-bit float formats (bf16, fp16) on the CPU, SIMD with dynamic
// dispatch. fp32 -> 16-bit rounds to nearest, ties to even; NaN stays a quiet NaN with its sign;
// fp16 overflow gives +-Inf. Widening is exact. Results equal strata::FloatToBf16 / FloatToHalf /
// Bf16ToFloat / HalfToFloat (include/strata/dtype.h) bit for bit on every target.
//
// Thread safety: pure functions; distinct output ranges may be written concurrently.
#pragma once

#include <cstddef>

#include "strata/dtype.h"
#include "strata/status.h"

namespace strata::kernels {

class KernelPool;

void CastF32ToBf16(const float* in, bf16_t* out, size_t n);
void CastF32ToF16(const float* in, f16_t* out, size_t n);
void CastBf16ToF32(const bf16_t* in, float* out, size_t n);
void CastF16ToF32(const f16_t* in, float* out, size_t n);

// n elements from `in` (of in_dtype) to `out` (of out_dtype). Supported: fp32 -> bf16/fp16,
// bf16/fp16 -> fp32, and same dtype (a copy). InvalidArgument for any other pair or a null
// pointer with n > 0. REQUIRES: in and out do not overlap.
Status Cast(const void* in, DType in_dtype, void* out, DType out_dtype, size_t n);
// The same over the pool's tiles.
Status Cast(KernelPool& pool, const void* in, DType in_dtype, void* out, DType out_dtype, size_t n);

// Gradient accumulation, the widening cast fused with a scale and an add (one pass over memory):
//   overwrite == false:  acc[i] = acc[i] + float(grad[i]) * scale
//   overwrite == true:   acc[i] = float(grad[i]) * scale   (acc is not read; a -0 product stays -0)
// One multiply, then one add with acc first, never fused: the same bits on every target as that
// scalar formula, and as CudaAccumulateGrad (kernels/cuda_kernels.h). NaN/Inf propagate.
// grad_dtype: fp32, bf16 or fp16. REQUIRES: acc and grad do not overlap.
// InvalidArgument: another grad_dtype; scale not finite; acc or grad null with n > 0.
Status AccumulateGrad(float* acc, const void* grad, DType grad_dtype, float scale, bool overwrite,
                      size_t n);
// AccumulateGrad's argument checks alone (the errors above): the kernels' element code of
// grad_dtype (kernels/simd.h), for callers that run the SIMD body themselves.
Result<int> CheckAccumulateGrad(const float* acc, const void* grad, DType grad_dtype, float scale,
                                size_t n);
// The same over the pool's tiles (element-wise: the same bits for any thread count).
Status AccumulateGrad(KernelPool& pool, float* acc, const void* grad, DType grad_dtype,
                      float scale, bool overwrite, size_t n);

}  // namespace strata::kernels
