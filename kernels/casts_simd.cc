// fp32 <-> bf16 / fp16 casts, compiled once per Highway target (contract in kernels/simd.h).
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/casts_simd.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep (must come before highway.h)

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
}  // namespace simd
}  // namespace strata::kernels
#endif  // HWY_ONCE
