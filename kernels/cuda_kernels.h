// CUDA kernels for optimizer state and gradients that live in GPU memory: the fused Adam/AdamW
// step, gradient accumulation, per-chunk gradient sums of squares, fp32 <-> bf16/fp16 casts and
// the ZeRO++ block INT8 quantize / dequantize.
// Each computes exactly what its CPU counterpart in kernels/ computes (same formula, same order
// of operations, same roundings), so a shard's result does not depend on where it lives.
//
// Linking: target strata_kernels_cuda (kernels/CMakeLists.txt). With STRATA_CUDA=ON it is
// cuda_kernels.cu and brings the CUDA runtime (libcudart.so); with STRATA_CUDA=OFF it is
// cuda_kernels_stub.cc, whose calls all return Unavailable, so callers need no #if. strata_kernels
// itself never depends on CUDA. This header includes no CUDA header.
//
// Calling convention: every pointer except `hyper`/`shard` themselves is device-accessible
// memory (cudaMalloc, cudaMallocManaged or mapped pinned host memory; REQUIRES, not checked).
// `stream` is a cudaStream_t; nullptr is the legacy default stream. A call validates its
// arguments on the host, then enqueues work on `stream` and returns without waiting: OK means
// "enqueued". A fault while the kernel runs surfaces at the caller's next synchronization with
// the stream. n == 0 enqueues nothing (CudaChunkSumSquares still clears *nonfinite_device).
// Status codes: InvalidArgument names the bad argument (nothing is enqueued); Unavailable when the
// build has no CUDA or no usable device/driver; Internal for another CUDA launch error.
//
// Exactness, as designed and as tests/cuda_kernels_test.cc checks it: without a GPU it runs the
// kernels' per-element code (cuda_math.h) on the host against the CPU kernels on every CPU target
// present; with a GPU it runs the kernels themselves against both.
//   CudaAdamStep   bit-identical to AdamStep on the FMA targets (AVX2, AVX-512) for every
//                  element whose result is not NaN; where the CPU result is NaN the GPU's is NaN
//                  too, but NaN bits (sign, payload) may differ: GPU arithmetic returns a
//                  canonical NaN where x86 propagates an operand's payload or makes 0xffc00000
//                  (and the bf16/fp16 param_out of such a NaN differs accordingly). On the
//                  non-FMA CPU targets (SSE4, SSSE3, scalar), AdamStep itself rounds differently
//                  (separate multiply and add), by an ulp or so.
//   CudaAccumulateGrad  the formula below, bit for bit, as the CPU's AccumulateGrad (casts.h) on
//                  every target: a multiply, then an add, no FMA.
//   CudaChunkSumSquares  each chunk's double bit-identical to the AVX2 target's chunk sum (the
//                  same 16-lane order, Highway 1.0.3); the AVX-512 target sums in another order,
//                  so there a chunk may differ by a few ulp of double (relative difference at
//                  most 2 * 4095 * 2^-53 per chunk), as CPU targets differ among themselves.
//   CudaCast       bit-identical to Cast on every target, NaN payloads included (integer code:
//                  the same strata/dtype.h functions).
//   CudaQuantizeInt8 / CudaDequantizeInt8 / CudaDequantizeAddInt8  bit-identical to quantize.h's
//                  functions (and so to their references) on every target, NaN scales included:
//                  the block max is an integer max, the rest one correctly rounded operation
//                  per step (kernels/quantize_math.h, shared with the host test).
//
// Thread safety: the calls are reentrant; concurrent kernels must not write overlapping memory.
// Nothing here allocates device memory.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/adam.h"
#include "kernels/grad_stats.h"
#include "strata/dtype.h"
#include "strata/status.h"

namespace strata::kernels {

// True when this build has CUDA and the runtime sees at least one device (cudaGetDeviceCount).
// False in STRATA_CUDA=OFF builds, and without a driver or device.
bool CudaKernelsAvailable();

// One Adam/AdamW step over a shard in device memory: kernels/adam.h's formula, arguments and
// validation (ValidateAdam; InvalidArgument as there). The per-element operations are those of
// the CPU FMA path (adam_simd.cc), in its order, with single IEEE roundings and no flush to zero:
//   g = g * grad_scale;  [L2: g = fma(weight_decay, p, g)];  p = p * decay;
//   m = fma(1 - beta1, g, beta1 * m);  v = fma((1 - beta2) * g, g, beta2 * v);
//   p = fma(-step_size, m / fma(sqrt(v), 1 / sqrt(bc2), eps), p)
// with decay, step_size = lr / bc1 and 1 / sqrt(bc2) folded on the host in double and rounded to
// float once per call, exactly as the CPU step folds them (simd::FoldAdamArgs). param_out is
// rounded from the new p to nearest even, NaN kept NaN (strata::FloatToBf16 / FloatToHalf).
// hyper.stream_state is ignored. See the top for exactness.
// REQUIRES: the shard's arrays do not overlap each other.
Status CudaAdamStep(const AdamHyper& hyper, const AdamShard& shard, void* stream);

// Gradient accumulation into an fp32 buffer, element by element, g = float(grad[i]) (exact):
//   overwrite == false:  acc[i] = acc[i] + g * scale     (product rounded, then the sum rounded:
//                                                         two roundings, never an FMA)
//   overwrite == true:   acc[i] = g * scale              (acc is not read: it may hold garbage;
//                                                         a -0 product stays -0)
// NaN/Inf propagate. grad_dtype: fp32, bf16 or fp16. REQUIRES: acc and grad do not overlap.
// InvalidArgument: grad_dtype not fp32/bf16/fp16; scale not finite; acc or grad null with n > 0.
Status CudaAccumulateGrad(float* acc, const void* grad, DType grad_dtype, float scale,
                          bool overwrite, size_t n, void* stream);

// Per-chunk sums of squares of a gradient shard, for the host to merge exactly with ExactSum
// (grad_stats.h), as ComputeGradStats does with its own chunk sums: chunk c covers elements
// [c * kStatsChunk, min((c + 1) * kStatsChunk, n)) counted from `grad`, and its sum of grad[i]^2
// (squares exact in double, summed in double) goes to chunk_sums_device[c], for
// c < ceil(n / kStatsChunk). A chunk holding a NaN or Inf gets a non-finite sum (no finite fp32
// square sum overflows a double). *nonfinite_device is set to whether any element is NaN or Inf
// (always written, false for n == 0). Host merge, after copying the sums back:
//   ExactSum acc;
//   for (double s : chunk_sums) acc.Add(s);
//   GradStats stats{acc.Value(), acc.nonfinite()};
// InvalidArgument: dtype not fp32/bf16/fp16; grad or chunk_sums_device null with n > 0;
// nonfinite_device null.
Status CudaChunkSumSquares(const void* grad, DType dtype, size_t n, double* chunk_sums_device,
                           bool* nonfinite_device, void* stream);

// n elements from `in` (of in_dtype) to `out` (of out_dtype); casts.h's Cast on the GPU, same
// pairs and bits: fp32 -> bf16/fp16 (round to nearest even, NaN a quiet NaN with its sign, fp16
// overflow to Inf), bf16/fp16 -> fp32 (exact, NaN payloads kept), and same dtype (an async
// device copy). InvalidArgument for any other pair or a null pointer with n > 0.
// REQUIRES: in and out do not overlap.
Status CudaCast(const void* in, DType in_dtype, void* out, DType out_dtype, size_t n, void* stream);

// Block INT8 quantization on the GPU (kernels/quantize.h: format, error bound, NaN scale for a
// block with NaN/Inf; implemented in quantize_cuda.cu). QuantizeInt8 writes q[0, n) and
// scales[0, ceil(n / block)); when nonfinite_blocks_device is not null it is cleared and then
// receives the number of non-finite blocks (the CPU call's return value). InvalidArgument: dtype
// not fp32/bf16/fp16, block == 0, or a null array with n > 0.
Status CudaQuantizeInt8(DType src_dtype, const void* src, size_t n, size_t block, int8_t* q,
                        float* scales, uint64_t* nonfinite_blocks_device, void* stream);
Status CudaDequantizeInt8(const int8_t* q, const float* scales, size_t n, size_t block,
                          DType dst_dtype, void* dst, void* stream);
// acc[i] = acc[i] + float(q[i]) * scale (two roundings, no FMA), as DequantizeAddInt8.
Status CudaDequantizeAddInt8(const int8_t* q, const float* scales, size_t n, size_t block,
                             float* acc, void* stream);

}  // namespace strata::kernels
