// Gradient sum of squares in double, compiled once per Highway target (contract in
// kernels/simd.h). Squares of fp32 values are exact in double and cannot overflow it, so a
// non-finite gradient is exactly what makes the sum non-finite.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/stats_simd.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep (must come before highway.h)

#include <type_traits>

#include "hwy/highway.h"
#include "kernels/convert-inl.h"
#include "kernels/simd.h"

HWY_BEFORE_NAMESPACE();
namespace strata::kernels::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;
#if HWY_TARGET == HWY_SCALAR
using DD = hn::Sisd<double>;
#else
using DD = hn::Repartition<double, DF>;
#endif
using VD = hn::Vec<DD>;

// Adds the squares of one fp32 vector into two double accumulators.
HWY_INLINE void Accumulate(DF df, VF x, VD& acc_lo, VD& acc_hi) {
  const DD dd;
#if HWY_TARGET == HWY_SCALAR
  (void)acc_hi;
  const VD lo = hn::PromoteTo(dd, x);
  acc_lo = hn::MulAdd(lo, lo, acc_lo);
#else
  const hn::Half<DF> dh;
  const VD lo = hn::PromoteTo(dd, hn::LowerHalf(dh, x));
  const VD hi = hn::PromoteTo(dd, hn::UpperHalf(dh, x));
  acc_lo = hn::MulAdd(lo, lo, acc_lo);
  acc_hi = hn::MulAdd(hi, hi, acc_hi);
#endif
}

template <int kElem>
HWY_INLINE void Load2(DF df, const void* HWY_RESTRICT g, size_t i, VF& a, VF& b) {
  const size_t n = hn::Lanes(df);
  if constexpr (kElem == simd::kElemF32) {
    a = hn::LoadU(df, static_cast<const float*>(g) + i);
    b = hn::LoadU(df, static_cast<const float*>(g) + i + n);
  } else {
    Load16x2AsF32<kElem == simd::kElemBF16>(df, static_cast<const uint16_t*>(g) + i, a, b);
  }
}

template <int kElem>
double Sum(const void* HWY_RESTRICT g, size_t begin, size_t count) {
  using T = std::conditional_t<kElem == simd::kElemF32, float, uint16_t>;
  const DF df;
  const DD dd;
  const size_t n2 = 2 * hn::Lanes(df);
  VD acc0 = hn::Zero(dd), acc1 = hn::Zero(dd), acc2 = hn::Zero(dd), acc3 = hn::Zero(dd);
  const T* p = static_cast<const T*>(g) + begin;
  size_t i = 0;
  VF a, b;
  for (; i + n2 <= count; i += n2) {
    Load2<kElem>(df, p, i, a, b);
    Accumulate(df, a, acc0, acc1);
    Accumulate(df, b, acc2, acc3);
  }
  if (i < count) {
    HWY_ALIGN T buf[2 * HWY_MAX_BYTES / sizeof(float)] = {};
    for (size_t k = 0; i + k < count; ++k) buf[k] = p[i + k];
    Load2<kElem>(df, buf, 0, a, b);
    Accumulate(df, a, acc0, acc1);
    Accumulate(df, b, acc2, acc3);
  }
  const VD sum = hn::Add(hn::Add(acc0, acc1), hn::Add(acc2, acc3));
  return hn::GetLane(hn::SumOfLanes(dd, sum));
}

double SumSquaresT(const void* g, int elem, size_t begin, size_t count) {
  switch (elem) {
    case simd::kElemBF16:
      return Sum<simd::kElemBF16>(g, begin, count);
    case simd::kElemF16:
      return Sum<simd::kElemF16>(g, begin, count);
    default:
      return Sum<simd::kElemF32>(g, begin, count);
  }
}

}  // namespace strata::kernels::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace strata::kernels {
HWY_EXPORT(SumSquaresT);
namespace simd {
double SumSquares(const void* grad, int elem, size_t begin, size_t count) {
  return HWY_DYNAMIC_DISPATCH(SumSquaresT)(grad, elem, begin, count);
}
}  // namespace simd
}  // namespace strata::kernels
#endif  // HWY_ONCE
