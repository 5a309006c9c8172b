// Fused Adam/AdamW step, compiled once per Highway target (see kernels/adam.h for the formula and
// kernels/simd.h for the contract). One pass reads master, m, v and the gradient and writes
// master, m, v and optionally the 16-bit parameter copy: 24 + grad + out bytes per parameter.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/adam_simd.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep (must come before highway.h)

#include "hwy/cache_control.h"
#include "hwy/highway.h"
#include "kernels/adam_math.h"
#include "kernels/convert-inl.h"
#include "kernels/cuda_math.h"
#include "kernels/simd.h"

HWY_BEFORE_NAMESPACE();
namespace strata::kernels::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;

// The folded coefficients as scalars: Highway vectors may not live in structs (they are sizeless
// on SVE and RVV). Update broadcasts them into local vectors; Loop holds this struct as a local
// that nothing else can reach, so after inlining the compiler hoists the broadcasts out of the
// loop.
struct AdamCoeffs {
  float lerp_coeff, beta2, omb2, eps, bc2_sqrt, neg_step_size, decay, wd, gscale;
  bool lerp_from_end;
};

// adam_math::AdamElement on vectors, operation for operation (MulAdd is one FMA on the targets
// that run this: HWY_NATIVE_FMA).
template <bool kL2>
HWY_INLINE void Update(DF df, const AdamCoeffs& c, VF g, VF& p, VF& m, VF& v) {
  g = hn::Mul(g, hn::Set(df, c.gscale));
  if (kL2) g = hn::MulAdd(p, hn::Set(df, c.wd), g);
  p = hn::Mul(p, hn::Set(df, c.decay));
  m = hn::MulAdd(hn::Set(df, c.lerp_coeff), hn::Sub(g, m), c.lerp_from_end ? g : m);
  v = hn::MulAdd(hn::Mul(hn::Set(df, c.omb2), g), g, hn::Mul(v, hn::Set(df, c.beta2)));
  const VF denom = hn::Add(hn::Div(hn::Sqrt(v), hn::Set(df, c.bc2_sqrt)), hn::Set(df, c.eps));
  p = hn::Add(p, hn::Div(hn::Mul(hn::Set(df, c.neg_step_size), m), denom));
}

// Two fp32 vectors of gradient starting at element i.
template <int kGrad>
HWY_INLINE void LoadGrad(DF df, const void* HWY_RESTRICT grad, size_t i, VF& g0, VF& g1) {
  const size_t n = hn::Lanes(df);
  if constexpr (kGrad == simd::kElemF32) {
    const float* g = static_cast<const float*>(grad) + i;
    g0 = hn::LoadU(df, g);
    g1 = hn::LoadU(df, g + n);
  } else {
    Load16x2AsF32<kGrad == simd::kElemBF16>(df, static_cast<const uint16_t*>(grad) + i, g0, g1);
  }
}

template <int kOut>
HWY_INLINE void StoreOut(DF df, VF p0, VF p1, void* HWY_RESTRICT out, size_t i, bool stream) {
  if constexpr (kOut != simd::kElemNone) {
    StoreF32As16x2<kOut == simd::kElemBF16>(df, p0, p1, static_cast<uint16_t*>(out) + i, stream);
  }
}

// 2 * Lanes(df) elements at offset i of the given arrays.
template <int kGrad, int kOut, bool kL2>
HWY_INLINE void Body(DF df, const AdamCoeffs& c, float* HWY_RESTRICT master, float* HWY_RESTRICT m,
                     float* HWY_RESTRICT v, const void* HWY_RESTRICT grad, void* HWY_RESTRICT out,
                     size_t i, bool stream_state, bool stream_out) {
  const size_t n = hn::Lanes(df);
  VF g0, g1;
  LoadGrad<kGrad>(df, grad, i, g0, g1);
  VF p0 = hn::LoadU(df, master + i), p1 = hn::LoadU(df, master + i + n);
  VF m0 = hn::LoadU(df, m + i), m1 = hn::LoadU(df, m + i + n);
  VF v0 = hn::LoadU(df, v + i), v1 = hn::LoadU(df, v + i + n);
  Update<kL2>(df, c, g0, p0, m0, v0);
  Update<kL2>(df, c, g1, p1, m1, v1);
  StoreMaybeStream(df, p0, master + i, stream_state);
  StoreMaybeStream(df, p1, master + i + n, stream_state);
  StoreMaybeStream(df, m0, m + i, stream_state);
  StoreMaybeStream(df, m1, m + i + n, stream_state);
  StoreMaybeStream(df, v0, v + i, stream_state);
  StoreMaybeStream(df, v1, v + i + n, stream_state);
  StoreOut<kOut>(df, p0, p1, out, i, stream_out);
}

HWY_INLINE bool Aligned(const void* p, size_t bytes) {
  return (reinterpret_cast<uintptr_t>(p) & (bytes - 1)) == 0;
}

// Targets without a fused multiply-add (SSE4, SSSE3, SCALAR, ...): torch's formula needs three
// single-rounding FMAs, which MulAdd would split, so these run the shared element code, whose
// std::fma is exact on any CPU.
template <int kGrad, int kOut, bool kL2>
void ElementLoop(const simd::AdamArgs& a, size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) {
    adam_math::AdamElement<kL2>(a, cuda_math::LoadElem<kGrad>(a.grad, i), a.master[i],
                                a.exp_avg[i], a.exp_avg_sq[i]);
    if constexpr (kOut != simd::kElemNone) {
      static_cast<uint16_t*>(a.param_out)[i] = cuda_math::Narrow<kOut>(a.master[i]);
    }
  }
}

template <int kGrad, int kOut, bool kL2>
void VectorLoop(const simd::AdamArgs& a, size_t begin, size_t end) {
  const DF df;
  const size_t n = hn::Lanes(df);
  const AdamCoeffs c{a.lerp_coeff, a.beta2,           a.one_minus_beta2,  a.eps,
                     a.bc2_sqrt,   a.neg_step_size,   a.decay,            a.l2_weight_decay,
                     a.grad_scale, a.lerp_from_end};
  const size_t vec_bytes = n * sizeof(float);  // a u16 vector of 2n lanes has the same size
  const bool stream_state = a.stream_state && Aligned(a.master + begin, vec_bytes) &&
                            Aligned(a.exp_avg + begin, vec_bytes) &&
                            Aligned(a.exp_avg_sq + begin, vec_bytes);
  const bool stream_out =
      kOut != simd::kElemNone && Aligned(static_cast<uint16_t*>(a.param_out) + begin, vec_bytes);
  size_t i = begin;
  for (; i + 2 * n <= end; i += 2 * n) {
    Body<kGrad, kOut, kL2>(df, c, a.master, a.exp_avg, a.exp_avg_sq, a.grad, a.param_out, i,
                           stream_state, stream_out);
  }
  if (i < end) {
    // Tail: the same vector code over zero-padded copies, so an element's result never depends
    // on where a range boundary falls.
    constexpr size_t kMax = 2 * HWY_MAX_BYTES / sizeof(float);
    HWY_ALIGN float p[kMax] = {}, m[kMax] = {}, v[kMax] = {}, g32[kMax] = {};
    HWY_ALIGN uint16_t g16[kMax] = {}, o16[kMax] = {};
    const size_t rest = end - i;
    for (size_t k = 0; k < rest; ++k) {
      p[k] = a.master[i + k];
      m[k] = a.exp_avg[i + k];
      v[k] = a.exp_avg_sq[i + k];
      if constexpr (kGrad == simd::kElemF32) {
        g32[k] = static_cast<const float*>(a.grad)[i + k];
      } else {
        g16[k] = static_cast<const uint16_t*>(a.grad)[i + k];
      }
    }
    const void* g = kGrad == simd::kElemF32 ? static_cast<const void*>(g32) : g16;
    Body<kGrad, kOut, kL2>(df, c, p, m, v, g, o16, 0, false, false);
    for (size_t k = 0; k < rest; ++k) {
      a.master[i + k] = p[k];
      a.exp_avg[i + k] = m[k];
      a.exp_avg_sq[i + k] = v[k];
      if constexpr (kOut != simd::kElemNone) static_cast<uint16_t*>(a.param_out)[i + k] = o16[k];
    }
  }
  if (stream_state || stream_out) hwy::FlushStream();
}

template <int kGrad, int kOut, bool kL2>
void Loop(const simd::AdamArgs& a, size_t begin, size_t end) {
#if HWY_NATIVE_FMA
  VectorLoop<kGrad, kOut, kL2>(a, begin, end);
#else
  ElementLoop<kGrad, kOut, kL2>(a, begin, end);
#endif
}

template <int kGrad, int kOut>
void LoopL2(const simd::AdamArgs& a, size_t begin, size_t end) {
  if (a.l2) {
    Loop<kGrad, kOut, true>(a, begin, end);
  } else {
    Loop<kGrad, kOut, false>(a, begin, end);
  }
}

template <int kGrad>
void LoopOut(const simd::AdamArgs& a, size_t begin, size_t end) {
  switch (a.out_elem) {
    case simd::kElemBF16:
      return LoopL2<kGrad, simd::kElemBF16>(a, begin, end);
    case simd::kElemF16:
      return LoopL2<kGrad, simd::kElemF16>(a, begin, end);
    default:
      return LoopL2<kGrad, simd::kElemNone>(a, begin, end);
  }
}

void AdamRangeT(const simd::AdamArgs& a, size_t begin, size_t end) {
  switch (a.grad_elem) {
    case simd::kElemBF16:
      return LoopOut<simd::kElemBF16>(a, begin, end);
    case simd::kElemF16:
      return LoopOut<simd::kElemF16>(a, begin, end);
    default:
      return LoopOut<simd::kElemF32>(a, begin, end);
  }
}

size_t LanesF32T() { return hn::Lanes(DF()); }

}  // namespace strata::kernels::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace strata::kernels {
HWY_EXPORT(AdamRangeT);
HWY_EXPORT(LanesF32T);

namespace simd {
void AdamRange(const AdamArgs& a, size_t begin, size_t end) {
  HWY_DYNAMIC_DISPATCH(AdamRangeT)(a, begin, end);
}
size_t LanesF32() { return HWY_DYNAMIC_DISPATCH(LanesF32T)(); }
}  // namespace simd
}  // namespace strata::kernels
#endif  // HWY_ONCE
