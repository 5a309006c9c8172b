#include "kernels/casts.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#include "kernels/elem.h"
#include "kernels/pool.h"
#include "kernels/simd.h"

namespace strata::kernels {

void CastF32ToBf16(const float* in, bf16_t* out, size_t n) {
  simd::CastF32ToBf16(in, reinterpret_cast<uint16_t*>(out), n);
}
void CastF32ToF16(const float* in, f16_t* out, size_t n) {
  simd::CastF32ToF16(in, reinterpret_cast<uint16_t*>(out), n);
}
void CastBf16ToF32(const bf16_t* in, float* out, size_t n) {
  simd::CastBf16ToF32(reinterpret_cast<const uint16_t*>(in), out, n);
}
void CastF16ToF32(const f16_t* in, float* out, size_t n) {
  simd::CastF16ToF32(reinterpret_cast<const uint16_t*>(in), out, n);
}

namespace {

using RangeFn = void (*)(const void* in, void* out, size_t begin, size_t end);

template <class In, class Out, void (*F)(const In*, Out*, size_t)>
void Apply(const void* in, void* out, size_t begin, size_t end) {
  F(static_cast<const In*>(in) + begin, static_cast<Out*>(out) + begin, end - begin);
}

Result<RangeFn> Pick(const void* in, DType in_dtype, const void* out, DType out_dtype, size_t n,
                     size_t* copy_elem_bytes) {
  *copy_elem_bytes = 0;
  if (n > 0 && (in == nullptr || out == nullptr)) {
    return Status::InvalidArgument("cast: null input or output with n > 0");
  }
  if (in_dtype == out_dtype) {
    *copy_elem_bytes = DTypeSize(in_dtype);
    return RangeFn{nullptr};
  }
  if (in_dtype == DType::kF32 && out_dtype == DType::kBF16) {
    return RangeFn{&Apply<float, bf16_t, CastF32ToBf16>};
  }
  if (in_dtype == DType::kF32 && out_dtype == DType::kF16) {
    return RangeFn{&Apply<float, f16_t, CastF32ToF16>};
  }
  if (in_dtype == DType::kBF16 && out_dtype == DType::kF32) {
    return RangeFn{&Apply<bf16_t, float, CastBf16ToF32>};
  }
  if (in_dtype == DType::kF16 && out_dtype == DType::kF32) {
    return RangeFn{&Apply<f16_t, float, CastF16ToF32>};
  }
  return Status::InvalidArgument("cast: unsupported conversion " +
                                 std::string(DTypeName(in_dtype)) + " -> " +
                                 std::string(DTypeName(out_dtype)));
}

}  // namespace

Status Cast(const void* in, DType in_dtype, void* out, DType out_dtype, size_t n) {
  size_t copy_bytes = 0;
  STRATA_ASSIGN_OR_RETURN(RangeFn fn, Pick(in, in_dtype, out, out_dtype, n, &copy_bytes));
  if (n == 0) return Status::OK();
  if (fn == nullptr) {
    std::memcpy(out, in, n * copy_bytes);
  } else {
    fn(in, out, 0, n);
  }
  return Status::OK();
}

Status Cast(KernelPool& pool, const void* in, DType in_dtype, void* out, DType out_dtype,
            size_t n) {
  size_t copy_bytes = 0;
  STRATA_ASSIGN_OR_RETURN(RangeFn fn, Pick(in, in_dtype, out, out_dtype, n, &copy_bytes));
  auto body = [&](int /*slot*/, size_t b, size_t e) {
    if (fn == nullptr) {
      std::memcpy(static_cast<char*>(out) + b * copy_bytes,
                  static_cast<const char*>(in) + b * copy_bytes, (e - b) * copy_bytes);
    } else {
      fn(in, out, b, e);
    }
  };
  pool.ForEachTile(n, 0, body);
  return Status::OK();
}

Result<int> CheckAccumulateGrad(const float* acc, const void* grad, DType grad_dtype, float scale,
                                size_t n) {
  const int elem = ElemOf(grad_dtype);
  if (elem < 0) {
    return Status::InvalidArgument("AccumulateGrad: gradient dtype " +
                                   std::string(DTypeName(grad_dtype)) +
                                   " (fp32, bf16 or fp16)");
  }
  if (!std::isfinite(scale)) {
    return Status::InvalidArgument("AccumulateGrad: scale " + std::to_string(scale) +
                                   " is not finite");
  }
  if (n > 0 && (acc == nullptr || grad == nullptr)) {
    return Status::InvalidArgument("AccumulateGrad: null accumulator or gradient with n > 0");
  }
  return elem;
}

Status AccumulateGrad(float* acc, const void* grad, DType grad_dtype, float scale, bool overwrite,
                      size_t n) {
  STRATA_ASSIGN_OR_RETURN(int elem, CheckAccumulateGrad(acc, grad, grad_dtype, scale, n));
  if (n > 0) simd::AccumulateGrad(grad, elem, acc, scale, overwrite, n);
  return Status::OK();
}

Status AccumulateGrad(KernelPool& pool, float* acc, const void* grad, DType grad_dtype,
                      float scale, bool overwrite, size_t n) {
  STRATA_ASSIGN_OR_RETURN(int elem, CheckAccumulateGrad(acc, grad, grad_dtype, scale, n));
  const size_t bytes = DTypeSize(grad_dtype);
  auto body = [&](int /*slot*/, size_t b, size_t e) {
    simd::AccumulateGrad(static_cast<const uint8_t*>(grad) + b * bytes, elem, acc + b, scale,
                         overwrite, e - b);
  };
  pool.ForEachTile(n, 0, body);
  return Status::OK();
}

}  // namespace strata::kernels
