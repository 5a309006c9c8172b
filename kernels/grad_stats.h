// Gradient statistics of one shard in one pass: the sum of squares (for the global gradient norm,
// sqrt of the all-reduced sum) and whether any element is NaN or Inf (fp16 loss-scale overflow:
// skip the step and lower the scale).
//
// Accuracy and determinism: each square and each chunk sum (kStatsChunk consecutive elements,
// counted from the start of the shard) is computed in double; chunk sums are then added into an
// exact fixed-point accumulator (a Kulisch-style long integer), which is rounded to double once.
// Integer addition is associative, so the result is bitwise identical for any thread count, tile
// size or scheduling. It can differ between SIMD targets only through the chunk sums' rounding
// (lane order), by a few ulp of double.
//
// Thread safety: pure functions over their input.
#pragma once

#include <cstddef>
#include <cstdint>

#include "strata/device_kernels.h"
#include "strata/dtype.h"
#include "strata/status.h"

namespace strata::kernels {

class KernelPool;

// kStatsChunk: include/strata/device_kernels.h (a device's ChunkSumSquares uses it too).

struct GradStats {
  // Sum of grad[i]^2 (before any grad_scale). +Inf when `nonfinite`.
  double sum_sq = 0.0;
  // Some element is NaN or +-Inf.
  bool nonfinite = false;
};

// InvalidArgument: dtype not fp32/bf16/fp16, or grad null with n > 0.
Result<GradStats> ComputeGradStats(const void* grad, DType dtype, size_t n);
// The same over the pool's tiles (rounded up to a multiple of kStatsChunk); same result, bit for
// bit. Allocates one small accumulator per pool thread.
Result<GradStats> ComputeGradStats(KernelPool& pool, const void* grad, DType dtype, size_t n);

// AccumulateGrad (kernels/casts.h) into acc, then ComputeGradStats of the result, in one walk over
// memory: each kStatsChunk chunk is accumulated and its squares summed while it is in cache (the
// second pass over a gradient shard cost the engine's backward an eighth of its CPU at 1B
// params). The same acc bits and the same GradStats bits as the two calls, for any pool.
// InvalidArgument as AccumulateGrad.
Result<GradStats> AccumulateGradWithStats(KernelPool& pool, float* acc, const void* grad,
                                          DType grad_dtype, float scale, bool overwrite, size_t n);

class ExactSum;

// AccumulateGradWithStats over one piece of a shard, its chunk sums added into `sum` instead of
// rounded: a shard walked in pieces that start on kStatsChunk boundaries (counted from the
// shard's start) gives, once every piece is in, sum->Value() equal bit for bit to the whole
// walk's sum_sq. InvalidArgument as AccumulateGrad, or sum null.
Status AccumulateGradAddStats(KernelPool& pool, float* acc, const void* grad, DType grad_dtype,
                              float scale, bool overwrite, size_t n, ExactSum* sum);

// The exact accumulator behind GradStats, exposed for tests and for callers that merge partial
// sums of several shards exactly. Holds non-negative finite doubles; values below 2^-352 are
// truncated to that grid (far below any fp32 square that matters), values of 2^300 and above are
// rejected as non-finite (no sum of 4096 fp32 squares reaches 2^269).
class ExactSum {
 public:
  // Adds x >= 0. A NaN, Inf, negative or too large x marks the sum non-finite.
  void Add(double x);
  void Merge(const ExactSum& other);
  bool nonfinite() const { return nonfinite_; }
  // The exact sum rounded to double (a pure function of the exact value); +Inf if non-finite.
  double Value() const;
  // As GradStats: {Value(), nonfinite()}.
  GradStats Stats() const { return {Value(), nonfinite_}; }

 private:
  static constexpr int kMinExp = -352;  // weight of bit 0
  static constexpr int kDigits = 21;    // 32-bit digits: bits [kMinExp, kMinExp + 672)
  static constexpr int kMaxExp = 300;   // x < 2^kMaxExp fits with room for carries
  void Normalize();
  uint64_t digit_[kDigits] = {};  // each holds a 32-bit digit plus pending carries
  uint32_t adds_ = 0;             // adds since the last Normalize (carry headroom)
  bool nonfinite_ = false;
};

}  // namespace strata::kernels
