// DeviceKernels: the kernels a device runs on model state in its own memory, in place, so that
// the engine never round-trips device-resident shards through the host. A device that the host
// cannot address offers them through Device::kernels() (device.h); the engine then runs gradient
// accumulation, the gradient norm's chunk sums, the fused Adam step with its 16-bit param output
// and casts of device-homed state (offload_optimizer "none") with them. strata's CudaDevice
// implements them as CUDA kernels; HostDevice offers none, because the engine's CPU kernels run
// on its memory directly. A third-party device (another accelerator, or an emulator) implements
// Device and this interface from the installed headers alone.
//
// Semantics an implementation must compute (strata's CPU and CUDA kernels are the reference; to
// be bit-identical to a host run, compute in fp32 with the same operation order and roundings):
//   AdamStep, per element, t = hyper.step:
//     g  = float(grad) * grad_scale
//     Adam (decoupled_weight_decay false):  g = g + weight_decay * p
//     AdamW (decoupled_weight_decay true):  p = p * (1 - lr * weight_decay)
//     m  = beta1 * m + (1 - beta1) * g
//     v  = beta2 * v + (1 - beta2) * g * g
//     bc1 = 1 - beta1^t, bc2 = 1 - beta2^t       (both 1 when bias_correction is off)
//     p  = p - (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)
//     param_out = p rounded to nearest even in param_out_dtype, NaN kept (when param_out is set)
//   AccumulateGrad: acc = acc + float(grad) * scale (a multiply, then an add, never an FMA), or
//     acc = float(grad) * scale with `overwrite`.
//   ChunkSumSquares: for each chunk c of kStatsChunk consecutive elements (counted from `grad`),
//     chunk_sums[c] = the sum in double of double(grad[i])^2; *nonfinite = any element NaN/Inf.
//     The engine copies the sums back and merges them exactly, so their order never matters.
//   Cast: fp32 -> bf16/fp16 rounded to nearest even (a NaN stays a NaN), bf16/fp16 -> fp32 exact,
//   or
//     a copy when the dtypes are equal.
//
// Stream order: every pointer except `hyper`/`shard` themselves is device memory of this device
// (REQUIRES, not checked). A call validates on the host, enqueues the work on the device's compute
// stream and returns: OK means "enqueued". Kernels run in call order. The compute stream is
// ordered neither with the copy streams (device.h) nor with a communicator: the caller (the
// engine) makes the inputs complete before the call (a waited copy, a waited collective, a held
// store lease) and calls Synchronize before anything else reads the outputs (a copy, a
// collective, a lease release). Device::Free is ordered after the kernels enqueued before it, so
// an input or output may be freed (DeviceBuffer destruction) without a Synchronize. A fault while
// a kernel runs is returned by the next Synchronize.
//
// Status codes: InvalidArgument names the bad argument (nothing is enqueued); Unavailable when the
// device cannot run kernels; Internal for another launch error; DeadlineExceeded from Synchronize.
//
// Thread safety: calls may come from several threads; each call's work is enqueued atomically,
// and concurrent kernels must not write overlapping memory. Nothing here may allocate device
// memory (the engine's budget accounts for every byte).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>

#include "strata/dtype.h"
#include "strata/status.h"

namespace strata::kernels {

// Elements per chunk of ChunkSumSquares (and of the CPU gradient statistics).
inline constexpr size_t kStatsChunk = 4096;

// Hyper-parameters of one Adam step (the formula above).
struct AdamHyper {
  // Doubles, as torch.optim's Python floats: the step rounds them to fp32 where torch does
  // (kernels/adam.h), so 0.9 and 0.9f are different hyper-parameters.
  double lr = 1e-3;
  double beta1 = 0.9;         // in [0, 1)
  double beta2 = 0.999;       // in [0, 1)
  double eps = 1e-8;          // > 0
  double weight_decay = 0.0;  // >= 0
  // true: AdamW (decoupled decay, torch.optim.AdamW); false: Adam with L2 added to the gradient
  // (torch.optim.Adam's weight_decay).
  bool decoupled_weight_decay = true;
  bool bias_correction = true;
  int64_t step = 1;         // the step number this call makes, counting from 1
  float grad_scale = 1.0f;  // multiplies every gradient element first
  // Streaming (non-temporal) stores for p, m and v (a CPU hint; devices may ignore it). Off by
  // default: they were just read, so the lines are in cache anyway.
  bool stream_state = false;
};

// The arrays of one shard. master, exp_avg and exp_avg_sq are updated in place.
struct AdamShard {
  float* master = nullptr;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  const void* grad = nullptr;  // n elements of grad_dtype (bf16/fp16 as raw bits)
  DType grad_dtype = DType::kF32;
  void* param_out = nullptr;  // nullptr: no 16-bit copy; else n elements of param_out_dtype
  DType param_out_dtype = DType::kBF16;
  size_t n = 0;
};

class DeviceKernels {
 public:
  virtual ~DeviceKernels() = default;

  // The fused Adam/AdamW step over a shard in device memory, param_out included. InvalidArgument
  // (naming the field) for a null array with n > 0, a grad dtype not fp32/bf16/fp16, a
  // param_out dtype not bf16/fp16, step < 1, a beta outside [0, 1), eps <= 0, a negative or
  // non-finite lr or weight_decay, a non-finite grad_scale.
  virtual Status AdamStep(const AdamHyper& hyper, const AdamShard& shard) = 0;
  // acc = acc + float(grad) * scale, or acc = float(grad) * scale with `overwrite`.
  virtual Status AccumulateGrad(float* acc, const void* grad, DType grad_dtype, float scale,
                                bool overwrite, size_t n) = 0;
  // Per-kStatsChunk sums of squares into chunk_sums[0, ceil(n / kStatsChunk)) and the non-finite
  // flag into *nonfinite, both device memory.
  virtual Status ChunkSumSquares(const void* grad, DType dtype, size_t n, double* chunk_sums,
                                 bool* nonfinite) = 0;
  // Cast between fp32 and bf16/fp16, or a same-dtype copy.
  virtual Status Cast(const void* in, DType in_dtype, void* out, DType out_dtype, size_t n) = 0;
  // `bytes` zero bytes at ptr (device memory): how the engine clears gradient buffers without
  // moving zeros over the link.
  virtual Status Zero(void* ptr, uint64_t bytes) = 0;
  // Blocks until every kernel enqueued so far has completed; their first fault otherwise.
  // DeadlineExceeded after `timeout` (the kernels keep running).
  virtual Status Synchronize(std::chrono::nanoseconds timeout) = 0;
};

}  // namespace strata::kernels
