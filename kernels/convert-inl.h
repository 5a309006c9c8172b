// Per-target helpers shared by the SIMD kernels: exact fp32 <-> bf16 / fp16 conversions that give
// the same bits on every Highway target.
//
// They match strata::FloatToBf16 / FloatToHalf / HalfToFloat (include/strata/dtype.h) bit for bit:
// round to nearest, ties to even; NaN stays a quiet NaN with its sign and top payload bits (a
// widened fp16 NaN keeps its payload as is, signaling or not); fp16 overflow gives Inf. They
// assume the default floating-point environment (round to nearest, no flush-to-zero), as every
// strata thread has.
//
// How: bf16 by hand everywhere, from integer and plain float operations (Highway 1.0.3's
// DemoteTo(bf16) truncates). fp16 in hardware where the target has it (F16C with AVX2, AVX-512F:
// Highway's f16 PromoteTo / DemoteTo are vcvtph2ps / vcvtps2ph with round to nearest even), by
// hand below that (Highway's emulation there truncates and loses Inf and NaN). vcvtps2ph gives
// FloatToHalf's bits exactly; vcvtph2ps quiets a signaling NaN, so its NaN lanes are fixed up.
//
// Included by kernels/*_simd.cc after hwy/highway.h, once per target (the guard toggles).
#if defined(STRATA_KERNELS_CONVERT_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef STRATA_KERNELS_CONVERT_INL_H_
#undef STRATA_KERNELS_CONVERT_INL_H_
#else
#define STRATA_KERNELS_CONVERT_INL_H_
#endif

#include "hwy/highway.h"

// 1 where this target converts fp16 in hardware (see the top); redefined for each target.
#undef STRATA_KERNELS_HW_F16
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2 && !defined(HWY_DISABLE_F16C)
#define STRATA_KERNELS_HW_F16 1
#else
#define STRATA_KERNELS_HW_F16 0
#endif

HWY_BEFORE_NAMESPACE();
namespace strata::kernels::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// u32 lanes holding bf16 bits (0..0xffff) -> fp32. Exact.
template <class DF>
HWY_INLINE hn::Vec<DF> Bf16BitsToF32(DF df, hn::Vec<hn::RebindToUnsigned<DF>> h) {
  return hn::BitCast(df, hn::ShiftLeft<16>(h));
}

// fp32 -> u32 lanes holding bf16 bits, round to nearest even, NaN quieted.
template <class DF>
HWY_INLINE hn::Vec<hn::RebindToUnsigned<DF>> F32ToBf16Bits(DF df, hn::Vec<DF> f) {
  const hn::RebindToUnsigned<DF> du;
  const hn::RebindToSigned<DF> di;
  const auto u = hn::BitCast(du, f);
  const auto abs = hn::And(u, hn::Set(du, 0x7fffffffu));
  const auto is_nan = hn::RebindMask(du, hn::Gt(hn::BitCast(di, abs), hn::Set(di, 0x7f800000)));
  const auto hi = hn::ShiftRight<16>(u);
  const auto lsb = hn::And(hi, hn::Set(du, 1u));
  const auto rounded = hn::ShiftRight<16>(hn::Add(u, hn::Add(hn::Set(du, 0x7fffu), lsb)));
  return hn::IfThenElse(is_nan, hn::Or(hi, hn::Set(du, 0x40u)), rounded);
}

// u32 lanes holding fp16 bits -> fp32. Exact (subnormals, Inf and NaN payloads included).
template <class DF>
HWY_INLINE hn::Vec<DF> F16BitsToF32(DF df, hn::Vec<hn::RebindToUnsigned<DF>> h) {
  const hn::RebindToUnsigned<DF> du;
  const auto w = hn::ShiftLeft<16>(h);
  const auto sign = hn::And(w, hn::Set(du, 0x80000000u));
  const auto two_w = hn::Add(w, w);
  // Normal: move exponent and mantissa into place, rebias by multiplying with 2^-112.
  const auto normalized =
      hn::Mul(hn::BitCast(df, hn::Add(hn::ShiftRight<4>(two_w), hn::Set(du, 0x70000000u))),
              hn::Set(df, 0x1.0p-112f));
  // Subnormal: mantissa * 2^-24, formed exactly as (0.5 + mant * 2^-24) - 0.5.
  const auto denormalized =
      hn::Sub(hn::BitCast(df, hn::Or(hn::ShiftRight<17>(two_w), hn::Set(du, 126u << 23))),
              hn::Set(df, 0.5f));
  const auto exp = hn::And(h, hn::Set(du, 0x7c00u));
  const auto is_sub = hn::Eq(exp, hn::Zero(du));
  const auto is_infnan = hn::Eq(exp, hn::Set(du, 0x7c00u));
  const auto infnan =
      hn::Or(hn::Set(du, 0x7f800000u), hn::ShiftLeft<13>(hn::And(h, hn::Set(du, 0x3ffu))));
  auto mag = hn::IfThenElse(is_sub, hn::BitCast(du, denormalized), hn::BitCast(du, normalized));
  mag = hn::IfThenElse(is_infnan, infnan, mag);
  return hn::BitCast(df, hn::Or(sign, mag));
}

// fp32 -> u32 lanes holding fp16 bits, round to nearest even (subnormals too), overflow to Inf.
// The rounding is done by one float addition with a magic bias (the FP16 library's method).
template <class DF>
HWY_INLINE hn::Vec<hn::RebindToUnsigned<DF>> F32ToF16Bits(DF df, hn::Vec<DF> f) {
  const hn::RebindToUnsigned<DF> du;
  const hn::RebindToSigned<DF> di;
  const auto w = hn::BitCast(du, f);
  const auto abs = hn::And(w, hn::Set(du, 0x7fffffffu));
  const auto sign16 = hn::ShiftRight<16>(hn::And(w, hn::Set(du, 0x80000000u)));
  // Scale so that values too large for fp16 become Inf and the exponent is in half range.
  auto base =
      hn::Mul(hn::Mul(hn::BitCast(df, abs), hn::Set(df, 0x1.0p+112f)), hn::Set(df, 0x1.0p-110f));
  const auto shl1_w = hn::Add(w, w);
  // bias = max(exponent, 0x71) in the exponent field, + 15 << 23 ... as in fp16_ieee_from_fp32.
  const auto exp8 = hn::BitCast(di, hn::ShiftRight<24>(shl1_w));
  const auto bias = hn::BitCast(du, hn::Max(exp8, hn::Set(di, 0x71)));
  base = hn::Add(hn::BitCast(df, hn::Add(hn::ShiftLeft<23>(bias), hn::Set(du, 0x07800000u))), base);
  const auto bits = hn::BitCast(du, base);
  const auto exp_bits = hn::And(hn::ShiftRight<13>(bits), hn::Set(du, 0x7c00u));
  const auto mant_bits = hn::And(bits, hn::Set(du, 0x0fffu));
  const auto nonsign = hn::Add(exp_bits, mant_bits);
  const auto is_nan = hn::RebindMask(du, hn::Gt(hn::BitCast(di, abs), hn::Set(di, 0x7f800000)));
  const auto nan =
      hn::Or(hn::Set(du, 0x7e00u), hn::And(hn::ShiftRight<13>(abs), hn::Set(du, 0x3ffu)));
  return hn::Or(sign16, hn::IfThenElse(is_nan, nan, nonsign));
}

// Loads 2 * Lanes(df) 16-bit values as two u32 vectors (low half first).
template <class DF>
HWY_INLINE void Load16x2(DF df, const uint16_t* HWY_RESTRICT p,
                         hn::Vec<hn::RebindToUnsigned<DF>>& lo,
                         hn::Vec<hn::RebindToUnsigned<DF>>& hi) {
  const hn::RebindToUnsigned<DF> du;
  const hn::Rebind<uint16_t, DF> dh;
  const size_t n = hn::Lanes(df);
  lo = hn::PromoteTo(du, hn::LoadU(dh, p));
  hi = hn::PromoteTo(du, hn::LoadU(dh, p + n));
}

// Stores two u16 vectors of Lanes(df) values each as 2 * Lanes(df) consecutive uint16_t, low half
// first; streaming (non-temporal) when `stream` (REQUIRES: p vector-aligned then).
template <class DF>
HWY_INLINE void StoreHalves16(DF df, hn::Vec<hn::Rebind<uint16_t, DF>> lo,
                              hn::Vec<hn::Rebind<uint16_t, DF>> hi, uint16_t* HWY_RESTRICT p,
                              bool stream) {
#if HWY_TARGET == HWY_SCALAR
  // One lane: no full u16 vector to form; two plain stores.
  (void)df;
  (void)stream;
  const hn::Rebind<uint16_t, DF> dh;
  hn::StoreU(lo, dh, p);
  hn::StoreU(hi, dh, p + 1);
#else
  const hn::Repartition<uint16_t, DF> d16;
  const auto v = hn::Combine(d16, hi, lo);
  if (stream) {
    hn::Stream(v, d16, p);
  } else {
    hn::StoreU(v, d16, p);
  }
#endif
}

// Stores two u32 vectors of 16-bit values (each <= 0xffff) as 2 * Lanes(df) consecutive uint16_t,
// low half first; streaming (non-temporal) when `stream` (REQUIRES: p vector-aligned then).
template <class DF>
HWY_INLINE void Store16x2(DF df, hn::Vec<hn::RebindToUnsigned<DF>> lo,
                          hn::Vec<hn::RebindToUnsigned<DF>> hi, uint16_t* HWY_RESTRICT p,
                          bool stream) {
  const hn::RebindToSigned<DF> di;
  const hn::Rebind<uint16_t, DF> dh;
  StoreHalves16(df, hn::DemoteTo(dh, hn::BitCast(di, lo)), hn::DemoteTo(dh, hn::BitCast(di, hi)), p,
                stream);
}

#if STRATA_KERNELS_HW_F16
// Lanes(df) fp16 values at p -> fp32 by vcvtph2ps. That sets the quiet bit (22) of a signaling
// NaN, which HalfToFloat keeps clear: clear it again in NaN lanes whose fp16 quiet bit (9) is 0.
template <class DF>
HWY_INLINE hn::Vec<DF> LoadF16AsF32(DF df, const uint16_t* HWY_RESTRICT p) {
  const hn::RebindToUnsigned<DF> du;
  const hn::Rebind<uint16_t, DF> dh;
  const hn::Rebind<hwy::float16_t, DF> df16;
  const auto h = hn::LoadU(dh, p);
  const hn::Vec<DF> f = hn::PromoteTo(df, hn::BitCast(df16, h));
  const auto signaling = hn::AndNot(hn::ShiftLeft<13>(hn::PromoteTo(du, h)), hn::Set(du, 1u << 22));
  const auto is_nan = hn::RebindMask(du, hn::IsNaN(f));
  return hn::BitCast(df, hn::Xor(hn::BitCast(du, f), hn::IfThenElseZero(is_nan, signaling)));
}
#endif

// Loads 2 * Lanes(df) bf16 (kBf16) or fp16 values and widens them exactly to fp32, low half first.
template <bool kBf16, class DF>
HWY_INLINE void Load16x2AsF32(DF df, const uint16_t* HWY_RESTRICT p, hn::Vec<DF>& lo,
                              hn::Vec<DF>& hi) {
  if constexpr (kBf16) {
    hn::Vec<hn::RebindToUnsigned<DF>> a, b;
    Load16x2(df, p, a, b);
    lo = Bf16BitsToF32(df, a);
    hi = Bf16BitsToF32(df, b);
  } else {
#if STRATA_KERNELS_HW_F16
    lo = LoadF16AsF32(df, p);
    hi = LoadF16AsF32(df, p + hn::Lanes(df));
#else
    hn::Vec<hn::RebindToUnsigned<DF>> a, b;
    Load16x2(df, p, a, b);
    lo = F16BitsToF32(df, a);
    hi = F16BitsToF32(df, b);
#endif
  }
}

// Rounds two fp32 vectors to bf16 (kBf16) or fp16 and stores them as 2 * Lanes(df) consecutive
// values, low half first; streaming (non-temporal) when `stream` (REQUIRES: p vector-aligned then).
template <bool kBf16, class DF>
HWY_INLINE void StoreF32As16x2(DF df, hn::Vec<DF> lo, hn::Vec<DF> hi, uint16_t* HWY_RESTRICT p,
                               bool stream) {
  if constexpr (kBf16) {
    Store16x2(df, F32ToBf16Bits(df, lo), F32ToBf16Bits(df, hi), p, stream);
  } else {
#if STRATA_KERNELS_HW_F16
    const hn::Rebind<uint16_t, DF> dh;
    const hn::Rebind<hwy::float16_t, DF> df16;
    StoreHalves16(df, hn::BitCast(dh, hn::DemoteTo(df16, lo)),
                  hn::BitCast(dh, hn::DemoteTo(df16, hi)), p, stream);
#else
    Store16x2(df, F32ToF16Bits(df, lo), F32ToF16Bits(df, hi), p, stream);
#endif
  }
}

// Stores a full vector, streaming (non-temporal) when `stream` (REQUIRES: p aligned then).
template <class D>
HWY_INLINE void StoreMaybeStream(D d, hn::Vec<D> v, hn::TFromD<D>* HWY_RESTRICT p, bool stream) {
  if (stream) {
    hn::Stream(v, d, p);
  } else {
    hn::StoreU(v, d, p);
  }
}

}  // namespace strata::kernels::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // STRATA_KERNELS_CONVERT_INL_H_
