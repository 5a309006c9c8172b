// DeviceKernels: the kernels a device runs on model state in its own memory, in place, so that
// the engine never round-trips device-resident shards through the host. A device that the host
// cannot address offers them (Device::kernels(); CudaDevice: cuda_kernels.h's CUDA kernels on a
// compute stream of its own); HostDevice offers none, because the engine's CPU kernels run on its
// memory directly.
//
// Semantics: each call computes exactly what the cuda_kernels.h function of the same name
// computes (same formula, order of operations and roundings; the per-element code of
// kernels/cuda_math.h), and validates its arguments the same way. So on FMA CPU targets (AVX2,
// AVX-512) a shard's result is bit-identical whichever side computes it; cuda_kernels.h lists the
// exceptions (NaN payloads; chunk sums on AVX-512, which add in another lane order).
//
// Stream order: every pointer except `hyper`/`shard` themselves is device memory of this device
// (REQUIRES, not checked). A call validates on the host, enqueues the work on the device's compute
// stream and returns: OK means "enqueued". Kernels run in call order. The compute stream is
// ordered neither with the copy streams (device.h) nor with a communicator: the caller makes the
// inputs complete before the call (a waited copy, a waited collective, a held store lease) and
// calls Synchronize before anything else reads or frees the outputs (a copy, a collective, a
// lease release, DeviceBuffer destruction). A fault while a kernel runs is returned by the next
// Synchronize.
//
// Status codes: InvalidArgument names the bad argument (nothing is enqueued); Unavailable when the
// device cannot run kernels; Internal for another launch error; DeadlineExceeded from Synchronize.
//
// Thread safety: calls may come from several threads; each call's work is enqueued atomically,
// and concurrent kernels must not write overlapping memory. Nothing here allocates device memory.
#pragma once

#include <chrono>
#include <cstddef>

#include "kernels/adam.h"
#include "strata/dtype.h"
#include "strata/status.h"

namespace strata::kernels {

class DeviceKernels {
 public:
  virtual ~DeviceKernels() = default;

  // The fused Adam/AdamW step of kernels/adam.h over a shard in device memory (CudaAdamStep),
  // param_out included.
  virtual Status AdamStep(const AdamHyper& hyper, const AdamShard& shard) = 0;
  // acc = acc + float(grad) * scale, or acc = float(grad) * scale with `overwrite`
  // (CudaAccumulateGrad: a multiply, then an add, never an FMA).
  virtual Status AccumulateGrad(float* acc, const void* grad, DType grad_dtype, float scale,
                                bool overwrite, size_t n) = 0;
  // Per-kStatsChunk sums of squares into chunk_sums[0, ceil(n / kStatsChunk)) and the non-finite
  // flag into *nonfinite, both device memory (CudaChunkSumSquares; the caller merges the copied
  // sums with ExactSum, grad_stats.h).
  virtual Status ChunkSumSquares(const void* grad, DType dtype, size_t n, double* chunk_sums,
                                 bool* nonfinite) = 0;
  // casts.h's Cast between fp32 and bf16/fp16, or a same-dtype copy (CudaCast).
  virtual Status Cast(const void* in, DType in_dtype, void* out, DType out_dtype, size_t n) = 0;
  // Blocks until every kernel enqueued so far has completed; their first fault otherwise.
  // DeadlineExceeded after `timeout` (the kernels keep running).
  virtual Status Synchronize(std::chrono::nanoseconds timeout) = 0;
};

}  // namespace strata::kernels
