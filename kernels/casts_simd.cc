// fp32 <-> bf16 / fp16 casts, compiled once per Highway target (contract in kernels/simd.h).
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/casts_simd.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep (must come before highway.h)

#include <cstring>

#include "hwy/highway.h"
#include "kernels/convert-inl.h"
#include "kernels/simd.h"

HWY_BEFORE_NAMESPACE();
namespace strata::kernels::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
constexpr size_t kMaxF32 = 2 * HWY_MAX_BYTES / sizeof(float);

template <bool kBf16>
HWY_INLINE void NarrowBlock(DF df, const float* HWY_RESTRICT in, uint16_t* HWY_RESTRICT out) {
  const size_t n = hn::Lanes(df);
  const auto a = hn::LoadU(df, in), b = hn::LoadU(df, in + n);
  StoreF32As16x2<kBf16>(df, a, b, out, false);
}

template <bool kBf16>
void Narrow(const float* HWY_RESTRICT in, uint16_t* HWY_RESTRICT out, size_t count) {
  const DF df;
  const size_t n2 = 2 * hn::Lanes(df);
  size_t i = 0;
  for (; i + n2 <= count; i += n2) NarrowBlock<kBf16>(df, in + i, out + i);
  if (i < count) {
    HWY_ALIGN float buf[kMaxF32] = {};
    HWY_ALIGN uint16_t o[kMaxF32] = {};
    for (size_t k = 0; i + k < count; ++k) buf[k] = in[i + k];
    NarrowBlock<kBf16>(df, buf, o);
    for (size_t k = 0; i + k < count; ++k) out[i + k] = o[k];
  }
}

template <bool kBf16>
HWY_INLINE void WidenBlock(DF df, const uint16_t* HWY_RESTRICT in, float* HWY_RESTRICT out) {
  const size_t n = hn::Lanes(df);
  hn::Vec<DF> lo, hi;
  Load16x2AsF32<kBf16>(df, in, lo, hi);
  hn::StoreU(lo, df, out);
  hn::StoreU(hi, df, out + n);
}

template <bool kBf16>
void Widen(const uint16_t* HWY_RESTRICT in, float* HWY_RESTRICT out, size_t count) {
  const DF df;
  const size_t n2 = 2 * hn::Lanes(df);
  size_t i = 0;
  for (; i + n2 <= count; i += n2) WidenBlock<kBf16>(df, in + i, out + i);
  if (i < count) {
    HWY_ALIGN uint16_t buf[kMaxF32] = {};
    HWY_ALIGN float o[kMaxF32] = {};
    for (size_t k = 0; i + k < count; ++k) buf[k] = in[i + k];
    WidenBlock<kBf16>(df, buf, o);
    for (size_t k = 0; i + k < count; ++k) out[i + k] = o[k];
  }
}

// acc = (kOverwrite ? nothing : acc +) widen(grad) * scale on 2 * Lanes(df) elements: one Mul,
// then one Add with acc as the first operand (NaN payloads as the scalar `a + g * s`); this file
// is built with -ffp-contract=off, so the two never fuse.
template <int kElem, bool kOverwrite>
HWY_INLINE void AccumulateBlock(DF df, const uint8_t* HWY_RESTRICT grad, float* HWY_RESTRICT acc,
                                hn::Vec<DF> scale) {
  const size_t n = hn::Lanes(df);
  hn::Vec<DF> lo, hi;
  if constexpr (kElem == simd::kElemF32) {
    const float* g = reinterpret_cast<const float*>(grad);
    lo = hn::LoadU(df, g);
    hi = hn::LoadU(df, g + n);
  } else {
    Load16x2AsF32<kElem == simd::kElemBF16>(df, reinterpret_cast<const uint16_t*>(grad), lo, hi);
  }
  lo = hn::Mul(lo, scale);
  hi = hn::Mul(hi, scale);
  if constexpr (!kOverwrite) {
    lo = hn::Add(hn::LoadU(df, acc), lo);
    hi = hn::Add(hn::LoadU(df, acc + n), hi);
  }
  hn::StoreU(lo, df, acc);
  hn::StoreU(hi, df, acc + n);
}

template <int kElem, bool kOverwrite>
void Accumulate(const uint8_t* HWY_RESTRICT grad, float* HWY_RESTRICT acc, float scale,
                size_t count) {
  constexpr size_t kBytes = kElem == simd::kElemF32 ? 4 : 2;
  const DF df;
  const size_t n2 = 2 * hn::Lanes(df);
  const auto s = hn::Set(df, scale);
  size_t i = 0;
  for (; i + n2 <= count; i += n2) AccumulateBlock<kElem, kOverwrite>(df, grad + i * kBytes, acc + i, s);
  if (i < count) {
    HWY_ALIGN uint8_t g[kMaxF32 * 4] = {};
    HWY_ALIGN float a[kMaxF32] = {};
    const size_t left = count - i;
    std::memcpy(g, grad + i * kBytes, left * kBytes);
    if (!kOverwrite) std::memcpy(a, acc + i, left * 4);
    AccumulateBlock<kElem, kOverwrite>(df, g, a, s);
    std::memcpy(acc + i, a, left * 4);
  }
}

template <bool kOverwrite>
void AccumulateAs(const void* grad, int elem, float* acc, float scale, size_t count) {
  const auto* g = static_cast<const uint8_t*>(grad);
  switch (elem) {
    case simd::kElemF32:
      return Accumulate<simd::kElemF32, kOverwrite>(g, acc, scale, count);
    case simd::kElemBF16:
      return Accumulate<simd::kElemBF16, kOverwrite>(g, acc, scale, count);
    default:
      return Accumulate<simd::kElemF16, kOverwrite>(g, acc, scale, count);
  }
}

void AccumulateGradT(const void* grad, int elem, float* acc, float scale, bool overwrite,
                     size_t count) {
  if (overwrite) return AccumulateAs<true>(grad, elem, acc, scale, count);
  AccumulateAs<false>(grad, elem, acc, scale, count);
}

void F32ToBf16T(const float* in, uint16_t* out, size_t n) { Narrow<true>(in, out, n); }
void F32ToF16T(const float* in, uint16_t* out, size_t n) { Narrow<false>(in, out, n); }
void Bf16ToF32T(const uint16_t* in, float* out, size_t n) { Widen<true>(in, out, n); }
void F16ToF32T(const uint16_t* in, float* out, size_t n) { Widen<false>(in, out, n); }

}  // namespace strata::kernels::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace strata::kernels {
HWY_EXPORT(F32ToBf16T);
HWY_EXPORT(F32ToF16T);
HWY_EXPORT(Bf16ToF32T);
HWY_EXPORT(F16ToF32T);
HWY_EXPORT(AccumulateGradT);

namespace simd {
void CastF32ToBf16(const float* in, uint16_t* out, size_t n) {
  HWY_DYNAMIC_DISPATCH(F32ToBf16T)(in, out, n);
}
void CastF32ToF16(const float* in, uint16_t* out, size_t n) {
  HWY_DYNAMIC_DISPATCH(F32ToF16T)(in, out, n);
}
void CastBf16ToF32(const uint16_t* in, float* out, size_t n) {
  HWY_DYNAMIC_DISPATCH(Bf16ToF32T)(in, out, n);
}
void CastF16ToF32(const uint16_t* in, float* out, size_t n) {
  HWY_DYNAMIC_DISPATCH(F16ToF32T)(in, out, n);
}
void AccumulateGrad(const void* grad, int elem, float* acc, float scale, bool overwrite,
                    size_t n) {
  HWY_DYNAMIC_DISPATCH(AccumulateGradT)(grad, elem, acc, scale, overwrite, n);
}
}  // namespace simd
}  // namespace strata::kernels
#endif  // HWY_ONCE
