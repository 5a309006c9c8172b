// Internal entry points of the SIMD kernels (kernels/*_simd.cc). Each is defined once per
// compiled Highway target and picked at run time by HWY_DYNAMIC_DISPATCH, so one binary runs the
// best of AVX-512 / AVX2 / SSE4 / SSSE3 / portable code on the machine it lands on.
//
// This header exposes no Highway types: callers see plain pointers and sizes. Callers are the
// validated wrappers in kernels/adam.cc, casts.cc, grad_stats.cc and dram_bench.cc; nothing here
// checks its arguments.
//
// Determinism: every function computes element i (or the partial of one call) with the same
// operation sequence whether i falls in the vector body or in the tail, so splitting a range into
// tiles never changes a result. Results may differ between targets by rounding (FMA vs separate
// multiply and add), never between thread counts.
//
// Thread safety: pure functions over the given ranges; distinct ranges may run concurrently.
#pragma once

#include <cstddef>
#include <cstdint>

namespace strata::kernels {
struct AdamHyper;
struct AdamShard;
}  // namespace strata::kernels

namespace strata::kernels::simd {

// 16-bit element codes used by the kernels (bf16 and fp16 are both stored as uint16_t bits).
enum Elem : int { kElemF32 = 0, kElemBF16 = 1, kElemF16 = 2, kElemNone = 3 };

// One Adam/AdamW step, coefficients already folded (see kernels/adam.h for the formula).
struct AdamArgs {
  float* master = nullptr;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  const void* grad = nullptr;
  void* param_out = nullptr;
  int grad_elem = kElemF32;
  int out_elem = kElemNone;
  bool l2 = false;            // Adam with L2: g += weight_decay * p before the moments.
  bool stream_state = false;  // non-temporal stores for master/m/v when aligned.
  // fp32 roundings of torch's Python-double scalars (kernels/adam_math.h).
  float lerp_coeff = 0.1f;      // w = 1 - beta1 when |w| < 0.5, else w - 1
  bool lerp_from_end = false;   // |w| >= 0.5: lerp starts from the gradient
  float beta2 = 0.999f, one_minus_beta2 = 0.001f;
  float eps = 1e-8f;
  float bc2_sqrt = 1.0f;         // sqrt(bias_correction2), 1 without bias correction
  float neg_step_size = -1e-3f;  // -lr / bias_correction1
  float decay = 1.0f;            // AdamW: 1 - lr * weight_decay; else 1
  float l2_weight_decay = 0.0f;  // Adam with L2: weight_decay; else unused
  float grad_scale = 1.0f;
};

// The arguments of one validated (ValidateAdam) step: the shard's arrays and the hyper-parameters
// folded into per-call coefficients in double and rounded to fp32 as torch does. Shared
// by the CPU step (adam.cc) and the CUDA step (cuda_kernels.cu), so both use the same floats.
AdamArgs FoldAdamArgs(const AdamHyper& hyper, const AdamShard& shard);

// Updates elements [begin, end) of the arrays in `a`. Stores to param_out (and to master/m/v with
// stream_state) are non-temporal when the pointers are vector-aligned at `begin`; the function
// fences them before it returns.
void AdamRange(const AdamArgs& a, size_t begin, size_t end);

// Casts: n elements; 16-bit values are raw bits. fp32 -> 16-bit rounds to nearest even and keeps
// NaN a quiet NaN with its sign (exactly strata::FloatToBf16 / FloatToHalf).
void CastF32ToBf16(const float* in, uint16_t* out, size_t n);
void CastBf16ToF32(const uint16_t* in, float* out, size_t n);
void CastF32ToF16(const float* in, uint16_t* out, size_t n);
void CastF16ToF32(const uint16_t* in, float* out, size_t n);
// acc[i] = (overwrite ? grad[i] * scale : acc[i] + grad[i] * scale) for n elements, grad of type
// `elem` (F32, BF16 or F16) widened exactly: a multiply, then an add, never fused.
void AccumulateGrad(const void* grad, int elem, float* acc, float scale, bool overwrite,
                    size_t n);

// Sum of squares (each square and the sum in double) of grad[begin, begin + count), elements of
// type `elem` (F32, BF16 or F16). The lane order is fixed per target, so a given chunk always
// gives the same double. Non-finite inputs make the result non-finite (no finite fp32 square
// overflows a double).
double SumSquares(const void* grad, int elem, size_t begin, size_t count);

// Block INT8 quantization (kernels/quantize.h): quantizes src[begin, end) of type `elem`, writing
// q[begin, end) and scales[begin / block, ...); `begin` is a multiple of `block`. Returns the
// number of blocks holding a NaN or Inf.
size_t QuantizeInt8(const void* src, int elem, size_t begin, size_t end, size_t block, int8_t* q,
                    float* scales);
// Dequantizes q[begin, end) (any range) into dst of type `elem`, or adds it into the fp32 `dst`
// when `add`.
void DequantizeInt8(const int8_t* q, const float* scales, size_t begin, size_t end, size_t block,
                    int elem, void* dst, bool add);

// STREAM-like kernels over fp32 arrays (kernels/bench/dram_bench.h).
void StreamFill(float* a, float value, size_t n);
void StreamCopy(float* dst, const float* src, size_t n);
// a = b + scalar * c; `nontemporal` uses streaming stores when `a` is vector-aligned.
void StreamTriad(float* a, const float* b, const float* c, float scalar, size_t n,
                 bool nontemporal);

// Lanes of an fp32 vector on the target that dispatch picks now (for tests' size choice).
size_t LanesF32();

}  // namespace strata::kernels::simd
