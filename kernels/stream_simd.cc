// STREAM-like DRAM kernels (fill, copy, triad, non-temporal triad), compiled once per Highway
// target (contract in kernels/simd.h). Used by kernels/dram_bench.cc as the same-run reference
// the optimizer kernels are measured against.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/stream_simd.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep (must come before highway.h)

#include "hwy/cache_control.h"
#include "hwy/highway.h"
#include "kernels/simd.h"

HWY_BEFORE_NAMESPACE();
namespace strata::kernels::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;

void FillT(float* HWY_RESTRICT a, float value, size_t count) {
  const DF df;
  const size_t n = hn::Lanes(df);
  const auto v = hn::Set(df, value);
  size_t i = 0;
  for (; i + n <= count; i += n) hn::StoreU(v, df, a + i);
  for (; i < count; ++i) a[i] = value;
}

void CopyT(float* HWY_RESTRICT dst, const float* HWY_RESTRICT src, size_t count) {
  const DF df;
  const size_t n = hn::Lanes(df);
  size_t i = 0;
  for (; i + 2 * n <= count; i += 2 * n) {
    hn::StoreU(hn::LoadU(df, src + i), df, dst + i);
    hn::StoreU(hn::LoadU(df, src + i + n), df, dst + i + n);
  }
  for (; i < count; ++i) dst[i] = src[i];
}

void TriadT(float* HWY_RESTRICT a, const float* HWY_RESTRICT b, const float* HWY_RESTRICT c,
            float scalar, size_t count, bool nontemporal) {
  const DF df;
  const size_t n = hn::Lanes(df);
  const auto s = hn::Set(df, scalar);
  size_t i = 0;
  const bool stream =
      nontemporal && (reinterpret_cast<uintptr_t>(a) & (n * sizeof(float) - 1)) == 0;
  if (stream) {
    for (; i + 2 * n <= count; i += 2 * n) {
      hn::Stream(hn::MulAdd(s, hn::LoadU(df, c + i), hn::LoadU(df, b + i)), df, a + i);
      hn::Stream(hn::MulAdd(s, hn::LoadU(df, c + i + n), hn::LoadU(df, b + i + n)), df, a + i + n);
    }
    hwy::FlushStream();
  } else {
    for (; i + 2 * n <= count; i += 2 * n) {
      hn::StoreU(hn::MulAdd(s, hn::LoadU(df, c + i), hn::LoadU(df, b + i)), df, a + i);
      hn::StoreU(hn::MulAdd(s, hn::LoadU(df, c + i + n), hn::LoadU(df, b + i + n)), df, a + i + n);
    }
  }
  for (; i < count; ++i) a[i] = b[i] + scalar * c[i];
}

}  // namespace strata::kernels::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace strata::kernels {
HWY_EXPORT(FillT);
HWY_EXPORT(CopyT);
HWY_EXPORT(TriadT);
namespace simd {
void StreamFill(float* a, float value, size_t n) { HWY_DYNAMIC_DISPATCH(FillT)(a, value, n); }
void StreamCopy(float* dst, const float* src, size_t n) {
  HWY_DYNAMIC_DISPATCH(CopyT)(dst, src, n);
}
void StreamTriad(float* a, const float* b, const float* c, float scalar, size_t n,
                 bool nontemporal) {
  HWY_DYNAMIC_DISPATCH(TriadT)(a, b, c, scalar, n, nontemporal);
}
}  // namespace simd
}  // namespace strata::kernels
#endif  // HWY_ONCE
