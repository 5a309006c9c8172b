// Block-wise symmetric INT8 quantization for ZeRO++ (issue 14): the weight all-gather (qwZ) and
// the gradient reduce-scatter (qgZ) move INT8 values plus one fp32 scale per block instead of
// 16-bit values. CPU, SIMD with dynamic dispatch; the CUDA versions are in cuda_kernels.h and give
// the same bits.
//
// Format. n values are cut into blocks of `block` consecutive elements counted from element 0
// (the last block may be partial). For each block b:
//   amax      = max |x| over the block, x = float(src[i]) (exact widening of bf16/fp16)
//   scale[b]  = amax / 127                      (one fp32 division, rounded to nearest even;
//                                                Int8BlockScale)
//   q[i]      = round_half_even(clamp(x / scale, -127, 127))    (fp32 division; -128 unused)
//   deq(q)[i] = float(q[i]) * scale[b]          (one fp32 multiply; then rounded to the output
//                                                dtype, nearest even, as casts.h)
// Special blocks:
//   - amax == 0, or amax so small that amax / 127 underflows to 0 (amax < 2^-142): scale 0,
//     every q 0, so the block dequantizes to +0 (-0 becomes +0).
//   - any NaN or +-Inf in the block: scale is a quiet NaN (bits 0x7fc00000) and every q is 0, so
//     the whole dequantized block is NaN (0 * NaN). Never a silent zero: the NaN propagates into
//     the gathered weights or the reduced gradient, where the fp16 overflow check (grad_stats.h)
//     sees it and skips the step. QuantizeInt8 also returns the number of such blocks, so a
//     caller quantizing weights can fail with an error naming the tensor instead.
//
// Error bound (proved in the comment of quantize.cc, checked by tests/quantize_test.cc): for every
// element x of a finite block with scale s and amax,
//   fp32 output:   |x - deq| <= s/2 + 2^-22 * amax + 2^-142
// (s/2 from rounding to an integer step; 2^-22 * amax from the fp32 division and product; 2^-142
// from the subnormal grid when amax < 2^-119). Dequantized to a 16-bit dtype, add that dtype's
// rounding of the value: bf16 <= 2^-8 * amax + 2^-133; fp16 <= 2^-10 * amax + 2^-25 (and the
// 16-bit value is +-Inf where the source value itself is beyond that dtype's range, as Cast
// gives: only from an fp32 source). So the relative error per block is about 1/254 of the block's
// largest magnitude: an outlier costs precision to its whole block, which is why blocks are small.
//
// Wire layout (what one rank sends for n elements; Int8WireLayout): the n INT8 values, then padding
// to a multiple of 4 bytes, then ceil(n / block) fp32 scales in native byte order. Sender and
// receiver must use the same `block`: kQuantBlock everywhere in strata (not a config key, so ranks
// cannot disagree).
//
// Determinism: a block's output depends only on that block's input (amax is an exact integer max
// of the magnitudes' bits; the rest is per element), so results are bit-identical for any thread
// count, tile split and SIMD target, and equal to the *Reference functions below and to the CUDA
// kernels, which compute the same correctly rounded operations.
//
// Thread safety: pure functions over their arguments; distinct output ranges may be written
// concurrently. Nothing allocates (the pooled quantize uses the pool's scratch).
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "strata/dtype.h"
#include "strata/status.h"

namespace strata::kernels {

class KernelPool;

// Elements per quantization block. DeepSpeed's ZeRO++ weight quantizer (CUDAQuantizer,
// zero_quantized_weights) uses symmetric 8-bit groups of at most 8000 elements ("the optimal size
// is 4k"), choosing the group count per tensor; strata uses a fixed power of two of that size, so
// blocks never depend on a tensor's shape and the scales cost 4 / 4096 = 0.1 % of the payload.
// Trade-off: smaller blocks bound an outlier's damage to fewer values but send more scales.
inline constexpr size_t kQuantBlock = 4096;

// Largest INT8 magnitude used (symmetric: -128 is never produced).
inline constexpr int kQuantInt8Max = 127;

// The scale of a block from the bits of its largest magnitude (|x| as fp32 bits, an exact integer
// max; NaN and Inf are the bit patterns >= 0x7f800000): NaN (0x7fc00000) for a non-finite block,
// else amax / 127 rounded to nearest, stepped down one ulp in the one case where 127 * scale would
// overflow to Inf (amax within 2^-24 of FLT_MAX), so a finite block never dequantizes to Inf.
// Shared by the CPU and the CUDA kernels (constexpr, callable from device code).
constexpr float Int8BlockScale(uint32_t amax_bits) noexcept {
  if (amax_bits >= 0x7f800000u) return std::bit_cast<float>(uint32_t{0x7fc00000u});
  float scale = std::bit_cast<float>(amax_bits) / static_cast<float>(kQuantInt8Max);
  if (scale * static_cast<float>(kQuantInt8Max) > std::numeric_limits<float>::max()) {
    scale = std::bit_cast<float>(std::bit_cast<uint32_t>(scale) - 1);
  }
  return scale;
}

// Blocks (and scales) for n elements: ceil(n / block). REQUIRES: block > 0.
constexpr size_t QuantBlocks(size_t n, size_t block) noexcept { return (n + block - 1) / block; }

// Byte layout of one quantized buffer on the wire (see the top).
struct Int8Wire {
  size_t payload_bytes = 0;  // n INT8 values at offset 0
  size_t scales_offset = 0;  // payload rounded up to a multiple of 4
  size_t scale_count = 0;    // ceil(n / block) fp32 scales
  size_t total_bytes = 0;    // scales_offset + 4 * scale_count
};
// REQUIRES: block > 0.
constexpr Int8Wire Int8WireLayout(size_t n, size_t block) noexcept {
  Int8Wire w;
  w.payload_bytes = n;
  w.scales_offset = (n + 3) / 4 * 4;
  w.scale_count = QuantBlocks(n, block);
  w.total_bytes = w.scales_offset + 4 * w.scale_count;
  return w;
}

// Quantizes n values of src_dtype (fp32, bf16 or fp16) at `src` into q[0, n) and
// scales[0, ceil(n / block)). Returns the number of blocks that held a NaN or Inf (their scale is
// NaN, see the top); 0 when all is finite. InvalidArgument: src_dtype not fp32/bf16/fp16, block
// == 0, or a null pointer with n > 0. REQUIRES: outputs do not overlap the input or each other.
Result<size_t> QuantizeInt8(DType src_dtype, const void* src, size_t n, size_t block, int8_t* q,
                            float* scales);
// The same over the pool's tiles (each tile a whole number of blocks); same bits.
Result<size_t> QuantizeInt8(KernelPool& pool, DType src_dtype, const void* src, size_t n,
                            size_t block, int8_t* q, float* scales);

// Writes deq(q) for n elements to `dst` as dst_dtype (fp32, bf16 or fp16). InvalidArgument as
// above (dst_dtype for src_dtype). REQUIRES: dst does not overlap q or scales.
Status DequantizeInt8(const int8_t* q, const float* scales, size_t n, size_t block, DType dst_dtype,
                      void* dst);
Status DequantizeInt8(KernelPool& pool, const int8_t* q, const float* scales, size_t n,
                      size_t block, DType dst_dtype, void* dst);

// acc[i] = acc[i] + float(q[i]) * scale   (the product rounded, then the sum: two fp32 roundings,
// never an FMA). The qgZ reduce: each received rank's INT8 gradient is added in fp32, so the error
// is that of one quantization per hop, not one per rank. A NaN scale makes its acc block NaN.
// InvalidArgument: block == 0 or a null pointer with n > 0. REQUIRES: acc does not overlap q or
// scales.
Status DequantizeAddInt8(const int8_t* q, const float* scales, size_t n, size_t block, float* acc);
Status DequantizeAddInt8(KernelPool& pool, const int8_t* q, const float* scales, size_t n,
                         size_t block, float* acc);

// Scalar references (plain C++, one element at a time), the definition the SIMD and CUDA kernels
// are tested against. Same contract as above, arguments not checked (REQUIRES: valid).
size_t QuantizeInt8Reference(DType src_dtype, const void* src, size_t n, size_t block, int8_t* q,
                             float* scales);
void DequantizeInt8Reference(const int8_t* q, const float* scales, size_t n, size_t block,
                             DType dst_dtype, void* dst);
void DequantizeAddInt8Reference(const int8_t* q, const float* scales, size_t n, size_t block,
                                float* acc);

}  // namespace strata::kernels
