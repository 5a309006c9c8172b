// Block INT8 quantization: argument checks, the scalar reference and the pooled split. The SIMD
// bodies are in quantize_simd.cc.
//
// Why the bound in quantize.h holds (u = 2^-24, the fp32 unit roundoff; s = fl(amax / 127) > 0):
//   t = fl(x / s) = (x / s)(1 + d1), |d1| <= u.  Not clamped: q = rne(t), |t - q| <= 1/2, and
//   deq = fl(q * s) is within u * |q * s| (+ 2^-150 when subnormal) of q * s. So
//     |x - deq| <= s |x/s - t| + s |t - q| + |q s - deq| <= u |x| + s/2 + u * 127 s + 2^-150,
//   and 127 s <= amax (1 + u) + 127 * 2^-150 (s is amax / 127 rounded, absolute error at most
//   max(u * amax / 127, 2^-150)). Clamped (t > 127, possible only by that rounding of s):
//   |x - 127 s| <= amax - 127 s <= u * amax + 127 * 2^-150. Both are below
//   s/2 + 2^-22 amax + 2^-142. (When Int8BlockScale steps s down one ulp to keep 127 s finite,
//   s is within 2^-23 relative of amax / 127: the clamped case's 2^-23 amax, still inside.) With s
//   == 0 and amax > 0, amax < 127 * 2^-150 < 2^-142 and deq = 0.
#include "kernels/quantize.h"

#include <bit>
#include <cmath>
#include <new>
#include <string>
#include <type_traits>

#include "kernels/elem.h"
#include "kernels/pool.h"
#include "kernels/simd.h"

namespace strata::kernels {
namespace {

constexpr uint32_t kAbsMask = 0x7fffffffu;
constexpr uint32_t kInfBits = 0x7f800000u;

float Load(DType t, const void* p, size_t i) {
  switch (t) {
    case DType::kBF16:
      return Bf16ToFloat(static_cast<const bf16_t*>(p)[i]);
    case DType::kF16:
      return HalfToFloat(static_cast<const f16_t*>(p)[i]);
    default:
      return static_cast<const float*>(p)[i];
  }
}

void Store(DType t, void* p, size_t i, float v) {
  switch (t) {
    case DType::kBF16:
      static_cast<bf16_t*>(p)[i] = FloatToBf16(v);
      break;
    case DType::kF16:
      static_cast<f16_t*>(p)[i] = FloatToHalf(v);
      break;
    default:
      static_cast<float*>(p)[i] = v;
  }
}

Status CheckBlock(size_t n, size_t block, const void* a, const void* b, const void* c,
                  const char* what) {
  if (block == 0) return Status::InvalidArgument(std::string(what) + ": block must be > 0");
  if (n > 0 && (a == nullptr || b == nullptr || c == nullptr)) {
    return Status::InvalidArgument(std::string(what) + ": null pointer with n > 0");
  }
  return Status::OK();
}

Status CheckDType(DType t, const char* what) {
  if (ElemOf(t) < 0) {
    return Status::InvalidArgument(std::string(what) + ": dtype must be fp32, bf16 or fp16, not " +
                                   std::string(DTypeName(t)));
  }
  return Status::OK();
}

// Whole blocks per pool tile: the pool's tile rounded up to a multiple of `block`.
size_t TileOf(const KernelPool& pool, size_t block) {
  return (pool.tile_elems() + block - 1) / block * block;
}

}  // namespace

size_t QuantizeInt8Reference(DType src_dtype, const void* src, size_t n, size_t block, int8_t* q,
                             float* scales) {
  size_t nonfinite = 0;
  for (size_t b = 0; b * block < n; ++b) {
    const size_t begin = b * block, end = std::min(n, begin + block);
    uint32_t amax_bits = 0;  // magnitudes compare as integers; NaN/Inf are >= kInfBits
    for (size_t i = begin; i < end; ++i) {
      amax_bits = std::max(amax_bits, std::bit_cast<uint32_t>(Load(src_dtype, src, i)) & kAbsMask);
    }
    const float scale = Int8BlockScale(amax_bits);
    if (amax_bits >= kInfBits) ++nonfinite;
    scales[b] = scale;
    for (size_t i = begin; i < end; ++i) {
      int8_t v = 0;
      if (scale > 0.0f) {  // false for 0 and NaN
        float t = Load(src_dtype, src, i) / scale;
        t = t < -127.0f ? -127.0f : (t > 127.0f ? 127.0f : t);
        v = static_cast<int8_t>(std::nearbyint(t));  // default rounding: nearest, ties to even
      }
      q[i] = v;
    }
  }
  return nonfinite;
}

void DequantizeInt8Reference(const int8_t* q, const float* scales, size_t n, size_t block,
                             DType dst_dtype, void* dst) {
  for (size_t i = 0; i < n; ++i) {
    Store(dst_dtype, dst, i, static_cast<float>(q[i]) * scales[i / block]);
  }
}

void DequantizeAddInt8Reference(const int8_t* q, const float* scales, size_t n, size_t block,
                                float* acc) {
  for (size_t i = 0; i < n; ++i) {
    const float d = static_cast<float>(q[i]) * scales[i / block];
    acc[i] = acc[i] + d;
  }
}

Result<size_t> QuantizeInt8(DType src_dtype, const void* src, size_t n, size_t block, int8_t* q,
                            float* scales) {
  STRATA_RETURN_IF_ERROR(CheckDType(src_dtype, "quantize int8"));
  STRATA_RETURN_IF_ERROR(CheckBlock(n, block, src, q, scales, "quantize int8"));
  return simd::QuantizeInt8(src, ElemOf(src_dtype), 0, n, block, q, scales);
}

Result<size_t> QuantizeInt8(KernelPool& pool, DType src_dtype, const void* src, size_t n,
                            size_t block, int8_t* q, float* scales) {
  STRATA_RETURN_IF_ERROR(CheckDType(src_dtype, "quantize int8"));
  STRATA_RETURN_IF_ERROR(CheckBlock(n, block, src, q, scales, "quantize int8"));
  const int elem = ElemOf(src_dtype);
  KernelPool::Scratch scratch = pool.AcquireScratch();
  for (int i = 0; i < pool.threads(); ++i) new (scratch.slot(i)) size_t(0);
  auto count = [&](int i) { return std::launder(static_cast<size_t*>(scratch.slot(i))); };
  auto body = [&](int slot, size_t b, size_t e) {
    *count(slot) += simd::QuantizeInt8(src, elem, b, e, block, q, scales);
  };
  pool.ForEachTile(n, TileOf(pool, block), body);
  size_t total = 0;
  for (int i = 0; i < pool.threads(); ++i) total += *count(i);
  return total;
}

Status DequantizeInt8(const int8_t* q, const float* scales, size_t n, size_t block, DType dst_dtype,
                      void* dst) {
  STRATA_RETURN_IF_ERROR(CheckDType(dst_dtype, "dequantize int8"));
  STRATA_RETURN_IF_ERROR(CheckBlock(n, block, q, scales, dst, "dequantize int8"));
  simd::DequantizeInt8(q, scales, 0, n, block, ElemOf(dst_dtype), dst, false);
  return Status::OK();
}

Status DequantizeInt8(KernelPool& pool, const int8_t* q, const float* scales, size_t n,
                      size_t block, DType dst_dtype, void* dst) {
  STRATA_RETURN_IF_ERROR(CheckDType(dst_dtype, "dequantize int8"));
  STRATA_RETURN_IF_ERROR(CheckBlock(n, block, q, scales, dst, "dequantize int8"));
  const int elem = ElemOf(dst_dtype);
  auto body = [&](int, size_t b, size_t e) {
    simd::DequantizeInt8(q, scales, b, e, block, elem, dst, false);
  };
  pool.ForEachTile(n, TileOf(pool, block), body);
  return Status::OK();
}

Status DequantizeAddInt8(const int8_t* q, const float* scales, size_t n, size_t block, float* acc) {
  STRATA_RETURN_IF_ERROR(CheckBlock(n, block, q, scales, acc, "dequantize-add int8"));
  simd::DequantizeInt8(q, scales, 0, n, block, simd::kElemF32, acc, true);
  return Status::OK();
}

Status DequantizeAddInt8(KernelPool& pool, const int8_t* q, const float* scales, size_t n,
                         size_t block, float* acc) {
  STRATA_RETURN_IF_ERROR(CheckBlock(n, block, q, scales, acc, "dequantize-add int8"));
  auto body = [&](int, size_t b, size_t e) {
    simd::DequantizeInt8(q, scales, b, e, block, simd::kElemF32, acc, true);
  };
  pool.ForEachTile(n, TileOf(pool, block), body);
  return Status::OK();
}

}  // namespace strata::kernels
