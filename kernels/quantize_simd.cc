// Block INT8 quantize / dequantize, compiled once per Highway target (contract in kernels/simd.h,
// format in kernels/quantize.h). Tails run the vector code on a zero-padded copy, so every element
// sees the same operations as in the body: bit-identical to QuantizeInt8Reference on every target.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/quantize_simd.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep (must come before highway.h)

#include <algorithm>
#include <bit>
#include <cstring>
#include <type_traits>

#include "hwy/highway.h"
#include "kernels/convert-inl.h"
#include "kernels/quantize.h"
#include "kernels/simd.h"

HWY_BEFORE_NAMESPACE();
namespace strata::kernels::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using DU = hn::RebindToUnsigned<DF>;
using DI = hn::RebindToSigned<DF>;
using D8 = hn::Rebind<int8_t, DF>;
using VF = hn::Vec<DF>;
constexpr size_t kMaxF32 = 2 * HWY_MAX_BYTES / sizeof(float);

// Loads 2 * Lanes(df) source values at p (element type kElem) as fp32, exactly.
template <int kElem>
HWY_INLINE void Load2(DF df, const void* HWY_RESTRICT p, VF& a, VF& b) {
  if constexpr (kElem == simd::kElemF32) {
    a = hn::LoadU(df, static_cast<const float*>(p));
    b = hn::LoadU(df, static_cast<const float*>(p) + hn::Lanes(df));
  } else {
    Load16x2AsF32<kElem == simd::kElemBF16>(df, static_cast<const uint16_t*>(p), a, b);
  }
}

template <int kElem>
using Src = std::conditional_t<kElem == simd::kElemF32, float, uint16_t>;

// Largest magnitude's bits over src[0, count) (count may be any size).
template <int kElem>
uint32_t AmaxBits(const Src<kElem>* HWY_RESTRICT src, size_t count) {
  const DF df;
  const DU du;
  const size_t n2 = 2 * hn::Lanes(df);
  const auto mask = hn::Set(du, 0x7fffffffu);
  auto m0 = hn::Zero(du), m1 = hn::Zero(du);
  VF a, b;
  size_t i = 0;
  for (; i + n2 <= count; i += n2) {
    Load2<kElem>(df, src + i, a, b);
    m0 = hn::Max(m0, hn::And(hn::BitCast(du, a), mask));
    m1 = hn::Max(m1, hn::And(hn::BitCast(du, b), mask));
  }
  if (i < count) {
    HWY_ALIGN Src<kElem> buf[kMaxF32] = {};
    std::memcpy(buf, src + i, (count - i) * sizeof(Src<kElem>));
    Load2<kElem>(df, buf, a, b);
    m0 = hn::Max(m0, hn::And(hn::BitCast(du, a), mask));
    m1 = hn::Max(m1, hn::And(hn::BitCast(du, b), mask));
  }
  return hn::GetLane(hn::MaxOfLanes(du, hn::Max(m0, m1)));
}

HWY_INLINE void QuantizeVec(DF df, VF x, VF scale, int8_t* HWY_RESTRICT q) {
  const D8 d8;
  const VF lim = hn::Set(df, 127.0f);
  const VF t = hn::Min(hn::Max(hn::Div(x, scale), hn::Neg(lim)), lim);
  hn::StoreU(hn::DemoteTo(d8, hn::NearestInt(t)), d8, q);
}

template <int kElem>
void QuantizeBlock(const Src<kElem>* HWY_RESTRICT src, size_t count, float scale,
                   int8_t* HWY_RESTRICT q) {
  const DF df;
  const size_t n = hn::Lanes(df), n2 = 2 * n;
  const VF s = hn::Set(df, scale);
  VF a, b;
  size_t i = 0;
  for (; i + n2 <= count; i += n2) {
    Load2<kElem>(df, src + i, a, b);
    QuantizeVec(df, a, s, q + i);
    QuantizeVec(df, b, s, q + i + n);
  }
  if (i < count) {
    HWY_ALIGN Src<kElem> buf[kMaxF32] = {};
    HWY_ALIGN int8_t out[kMaxF32] = {};
    std::memcpy(buf, src + i, (count - i) * sizeof(Src<kElem>));
    Load2<kElem>(df, buf, a, b);
    QuantizeVec(df, a, s, out);
    QuantizeVec(df, b, s, out + n);
    std::memcpy(q + i, out, count - i);
  }
}

template <int kElem>
size_t Quantize(const void* src_v, size_t begin, size_t end, size_t block, int8_t* q,
                float* scales) {
  const auto* src = static_cast<const Src<kElem>*>(src_v);
  size_t nonfinite = 0;
  for (size_t bb = begin; bb < end; bb += block) {
    const size_t count = std::min(block, end - bb);
    const uint32_t amax_bits = AmaxBits<kElem>(src + bb, count);
    const float scale = Int8BlockScale(amax_bits);
    if (amax_bits >= 0x7f800000u) ++nonfinite;
    scales[bb / block] = scale;
    if (scale > 0.0f) {
      QuantizeBlock<kElem>(src + bb, count, scale, q + bb);
    } else {
      std::memset(q + bb, 0, count);
    }
  }
  return nonfinite;
}

size_t QuantizeInt8T(const void* src, int elem, size_t begin, size_t end, size_t block, int8_t* q,
                     float* scales) {
  switch (elem) {
    case simd::kElemBF16:
      return Quantize<simd::kElemBF16>(src, begin, end, block, q, scales);
    case simd::kElemF16:
      return Quantize<simd::kElemF16>(src, begin, end, block, q, scales);
    default:
      return Quantize<simd::kElemF32>(src, begin, end, block, q, scales);
  }
}

HWY_INLINE VF Deq(DF df, const int8_t* HWY_RESTRICT q, VF scale) {
  const DI di;
  const D8 d8;
  return hn::Mul(hn::ConvertTo(df, hn::PromoteTo(di, hn::LoadU(d8, q))), scale);
}

// 2 * Lanes(df) elements: q -> out (element type kOut, or fp32 accumulate when kAdd).
template <int kOut, bool kAdd>
HWY_INLINE void DeqStore(DF df, const int8_t* HWY_RESTRICT q, VF s, void* HWY_RESTRICT out) {
  const size_t n = hn::Lanes(df);
  const VF a = Deq(df, q, s), b = Deq(df, q + n, s);
  if constexpr (kAdd) {
    float* acc = static_cast<float*>(out);
    hn::StoreU(hn::Add(hn::LoadU(df, acc), a), df, acc);
    hn::StoreU(hn::Add(hn::LoadU(df, acc + n), b), df, acc + n);
  } else if constexpr (kOut == simd::kElemF32) {
    hn::StoreU(a, df, static_cast<float*>(out));
    hn::StoreU(b, df, static_cast<float*>(out) + n);
  } else {
    StoreF32As16x2<kOut == simd::kElemBF16>(df, a, b, static_cast<uint16_t*>(out), false);
  }
}

template <int kOut, bool kAdd>
void Dequantize(const int8_t* HWY_RESTRICT q, const float* HWY_RESTRICT scales, size_t begin,
                size_t end, size_t block, void* HWY_RESTRICT dst_v) {
  using T = std::conditional_t<kOut == simd::kElemF32 || kAdd, float, uint16_t>;
  T* dst = static_cast<T*>(dst_v);
  const DF df;
  const size_t n2 = 2 * hn::Lanes(df);
  for (size_t seg = begin; seg < end;) {
    const size_t b = seg / block;
    const size_t seg_end = std::min(end, (b + 1) * block);
    const VF s = hn::Set(df, scales[b]);
    size_t i = seg;
    for (; i + n2 <= seg_end; i += n2) DeqStore<kOut, kAdd>(df, q + i, s, dst + i);
    if (i < seg_end) {
      const size_t rest = seg_end - i;
      HWY_ALIGN int8_t qb[kMaxF32] = {};
      HWY_ALIGN T ob[kMaxF32] = {};
      std::memcpy(qb, q + i, rest);
      if constexpr (kAdd) std::memcpy(ob, dst + i, rest * sizeof(T));
      DeqStore<kOut, kAdd>(df, qb, s, ob);
      std::memcpy(dst + i, ob, rest * sizeof(T));
    }
    seg = seg_end;
  }
}

void DequantizeInt8T(const int8_t* q, const float* scales, size_t begin, size_t end, size_t block,
                     int elem, void* dst, bool add) {
  if (add) return Dequantize<simd::kElemF32, true>(q, scales, begin, end, block, dst);
  switch (elem) {
    case simd::kElemBF16:
      return Dequantize<simd::kElemBF16, false>(q, scales, begin, end, block, dst);
    case simd::kElemF16:
      return Dequantize<simd::kElemF16, false>(q, scales, begin, end, block, dst);
    default:
      return Dequantize<simd::kElemF32, false>(q, scales, begin, end, block, dst);
  }
}

}  // namespace strata::kernels::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace strata::kernels {
HWY_EXPORT(QuantizeInt8T);
HWY_EXPORT(DequantizeInt8T);
namespace simd {
size_t QuantizeInt8(const void* src, int elem, size_t begin, size_t end, size_t block, int8_t* q,
                    float* scales) {
  return HWY_DYNAMIC_DISPATCH(QuantizeInt8T)(src, elem, begin, end, block, q, scales);
}
void DequantizeInt8(const int8_t* q, const float* scales, size_t begin, size_t end, size_t block,
                    int elem, void* dst, bool add) {
  HWY_DYNAMIC_DISPATCH(DequantizeInt8T)(q, scales, begin, end, block, elem, dst, add);
}
}  // namespace simd
}  // namespace strata::kernels
#endif  // HWY_ONCE
