// The Gloo communicator's widen / accumulate / round loops (cpu/host_reduce.h), compiled once per
// Highway target and dispatched at run time. Built with -ffp-contract=off: the multiply and the
// add stay two roundings, as in the scalar reference.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/host_reduce_simd.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep (must come before highway.h)

#include "cpu/host_reduce.h"
#include "hwy/highway.h"
#include "kernels/convert-inl.h"

HWY_BEFORE_NAMESPACE();
namespace strata::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
namespace kc = strata::kernels::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using V = hn::Vec<DF>;
constexpr size_t kMaxF32 = 2 * HWY_MAX_BYTES / sizeof(float);

// Element codes (no DType in the per-target signatures: they are plain ints).
enum : int { kF32 = 0, kBf16 = 1, kF16 = 2 };

// 2 * Lanes(df) elements of `src` (element code kElem) from index i, widened exactly.
template <int kElem>
HWY_INLINE void Load2(DF df, const void* HWY_RESTRICT src, size_t i, V& lo, V& hi) {
  if constexpr (kElem == kF32) {
    const float* s = static_cast<const float*>(src) + i;
    lo = hn::LoadU(df, s);
    hi = hn::LoadU(df, s + hn::Lanes(df));
  } else {
    kc::Load16x2AsF32<kElem == kBf16>(df, static_cast<const uint16_t*>(src) + i, lo, hi);
  }
}

// Runs body(src, partial, out, i) over blocks of 2 * Lanes(df) elements; the tail goes through
// zero-padded stack buffers with the same body, so every element sees the same operations.
// `out` is fp32 (Load / Accumulate).
template <int kElem, class Body>
HWY_INLINE void ForBlocks(const void* src, const float* partial, float* out, size_t n,
                          const Body& body) {
  const DF df;
  const size_t n2 = 2 * hn::Lanes(df);
  size_t i = 0;
  for (; i + n2 <= n; i += n2) body(df, src, partial, out, i);
  if (i == n) return;
  const size_t elt = kElem == kF32 ? 4 : 2;
  HWY_ALIGN uint8_t s[kMaxF32 * 4] = {};
  HWY_ALIGN float p[kMaxF32] = {};
  HWY_ALIGN float o[kMaxF32] = {};
  std::memcpy(s, static_cast<const uint8_t*>(src) + i * elt, (n - i) * elt);
  if (partial) std::memcpy(p, partial + i, (n - i) * sizeof(float));
  body(df, s, partial ? p : nullptr, o, 0);
  std::memcpy(out + i, o, (n - i) * sizeof(float));
}

template <int kElem>
void LoadScaledE(const void* src, float* dst, size_t n, float scale) {
  ForBlocks<kElem>(src, nullptr, dst, n,
                   [scale](DF df, const void* s, const float*, float* o, size_t i) {
                     V lo, hi;
                     Load2<kElem>(df, s, i, lo, hi);
                     const V k = hn::Set(df, scale);
                     hn::StoreU(hn::Mul(lo, k), df, o + i);
                     hn::StoreU(hn::Mul(hi, k), df, o + i + hn::Lanes(df));
                   });
}

template <int kElem>
void AccumulateScaledE(const void* src, const float* partial, float* acc, size_t n, float scale) {
  ForBlocks<kElem>(src, partial, acc, n,
                   [scale](DF df, const void* s, const float* p, float* o, size_t i) {
                     V lo, hi;
                     Load2<kElem>(df, s, i, lo, hi);
                     const V k = hn::Set(df, scale);
                     const size_t n1 = hn::Lanes(df);
                     // partial + (x * scale): the scalar reference's operand order.
                     const V a = hn::Add(hn::LoadU(df, p + i), hn::Mul(lo, k));
                     const V b = hn::Add(hn::LoadU(df, p + i + n1), hn::Mul(hi, k));
                     hn::StoreU(a, df, o + i);
                     hn::StoreU(b, df, o + i + n1);
                   });
}

template <bool kIsBf16>
void Narrow(const float* src, uint16_t* dst, size_t n) {
  const DF df;
  const size_t n1 = hn::Lanes(df), n2 = 2 * n1;
  size_t i = 0;
  for (; i + n2 <= n; i += n2) {
    kc::StoreF32As16x2<kIsBf16>(df, hn::LoadU(df, src + i), hn::LoadU(df, src + i + n1), dst + i,
                                false);
  }
  if (i < n) {
    HWY_ALIGN float s[kMaxF32] = {};
    HWY_ALIGN uint16_t o[kMaxF32] = {};
    std::memcpy(s, src + i, (n - i) * sizeof(float));
    kc::StoreF32As16x2<kIsBf16>(df, hn::LoadU(df, s), hn::LoadU(df, s + n1), o, false);
    std::memcpy(dst + i, o, (n - i) * sizeof(uint16_t));
  }
}

void LoadScaledT(int elem, const void* src, float* dst, size_t n, float scale) {
  if (elem == kBf16) return LoadScaledE<kBf16>(src, dst, n, scale);
  if (elem == kF16) return LoadScaledE<kF16>(src, dst, n, scale);
  LoadScaledE<kF32>(src, dst, n, scale);
}

void AccumulateScaledT(int elem, const void* src, const float* partial, float* acc, size_t n,
                       float scale) {
  if (elem == kBf16) return AccumulateScaledE<kBf16>(src, partial, acc, n, scale);
  if (elem == kF16) return AccumulateScaledE<kF16>(src, partial, acc, n, scale);
  AccumulateScaledE<kF32>(src, partial, acc, n, scale);
}

void NarrowT(int elem, const float* src, void* dst, size_t n) {
  if (elem == kBf16) return Narrow<true>(src, static_cast<uint16_t*>(dst), n);
  Narrow<false>(src, static_cast<uint16_t*>(dst), n);
}

}  // namespace strata::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace strata {
namespace cpu {
HWY_EXPORT(LoadScaledT);
HWY_EXPORT(AccumulateScaledT);
HWY_EXPORT(NarrowT);
}  // namespace cpu

namespace {
int Elem(DType dtype) { return dtype == DType::kBF16 ? 1 : dtype == DType::kF16 ? 2 : 0; }
}  // namespace

void LoadScaled(DType dtype, const void* src, float* dst, size_t n, float scale) {
  if (dtype == DType::kF32 && scale == 1.0f) {
    if (src != dst) std::memmove(dst, src, n * sizeof(float));
    return;
  }
  HWY_DYNAMIC_DISPATCH(cpu::LoadScaledT)(Elem(dtype), src, dst, n, scale);
}

void AccumulateScaled(DType dtype, const void* src, const float* partial, float* acc, size_t n,
                      float scale) {
  HWY_DYNAMIC_DISPATCH(cpu::AccumulateScaledT)(Elem(dtype), src, partial, acc, n, scale);
}

void StoreFloat(DType dtype, const float* src, void* dst, size_t n) {
  if (dtype == DType::kF32) {
    if (src != dst) std::memmove(dst, src, n * sizeof(float));
    return;
  }
  HWY_DYNAMIC_DISPATCH(cpu::NarrowT)(Elem(dtype), src, dst, n);
}

}  // namespace strata
#endif  // HWY_ONCE
