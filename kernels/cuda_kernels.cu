// The CUDA kernels of cuda_kernels.h (STRATA_CUDA=ON). The arithmetic of each element is in
// cuda_math.h, shared with the host-side test; this file holds the launches.
//
// Layout: the elementwise kernels (Adam, accumulate, cast) run one element per thread in a
// grid-stride loop with plain coalesced loads; an element's result depends only on its inputs,
// never on the launch shape. The chunk-sum kernel gives each kStatsChunk chunk 16 threads (one
// per accumulator lane of the CPU AVX2 order, cuda_math.h), 8 chunks per 128-thread block; lane
// sums meet in shared memory and the chunk's first thread folds them in the fixed order.
//
// Errors: arguments are checked on the host before anything is enqueued; a launch error
// (cudaGetLastError right after the launch) becomes a Status through STRATA_CUDA_RETURN_IF_ERROR.
// Faults during execution are the stream's, seen by whoever synchronizes with it.
#include "kernels/cuda_kernels.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "gpu/cuda_check.h"
#include "kernels/adam_math.h"
#include "kernels/cuda_math.h"
#include "kernels/elem.h"
#include "kernels/simd.h"

namespace strata::kernels {
namespace {

namespace cm = cuda_math;

constexpr int kThreads = 256;
// Enough blocks to fill any current GPU several times over; larger n loops (grid stride).
constexpr size_t kMaxBlocks = 65536;

unsigned Blocks(size_t n) {
  return static_cast<unsigned>(std::min((n + kThreads - 1) / kThreads, kMaxBlocks));
}

cudaStream_t AsStream(void* stream) { return static_cast<cudaStream_t>(stream); }

__device__ __forceinline__ size_t FirstIndex() {
  return static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ size_t Stride() { return static_cast<size_t>(gridDim.x) * blockDim.x; }

// ---------------------------------------------------------------------------------------------
// Adam

template <int kGrad, int kOut, bool kL2>
__global__ void AdamKernel(simd::AdamArgs a, size_t n) {
  for (size_t i = FirstIndex(); i < n; i += Stride()) {
    float p = a.master[i], m = a.exp_avg[i], v = a.exp_avg_sq[i];
    adam_math::AdamElement<kL2>(a, cm::LoadElem<kGrad>(a.grad, i), p, m, v);
    a.master[i] = p;
    a.exp_avg[i] = m;
    a.exp_avg_sq[i] = v;
    if constexpr (kOut != simd::kElemNone) {
      static_cast<uint16_t*>(a.param_out)[i] = cm::Narrow<kOut>(p);
    }
  }
}

template <int kGrad, int kOut>
void LaunchAdamL2(const simd::AdamArgs& a, size_t n, cudaStream_t s) {
  if (a.l2) {
    AdamKernel<kGrad, kOut, true><<<Blocks(n), kThreads, 0, s>>>(a, n);
  } else {
    AdamKernel<kGrad, kOut, false><<<Blocks(n), kThreads, 0, s>>>(a, n);
  }
}

template <int kGrad>
void LaunchAdamOut(const simd::AdamArgs& a, size_t n, cudaStream_t s) {
  switch (a.out_elem) {
    case simd::kElemBF16:
      return LaunchAdamL2<kGrad, simd::kElemBF16>(a, n, s);
    case simd::kElemF16:
      return LaunchAdamL2<kGrad, simd::kElemF16>(a, n, s);
    default:
      return LaunchAdamL2<kGrad, simd::kElemNone>(a, n, s);
  }
}

// ---------------------------------------------------------------------------------------------
// Accumulate

template <int kGrad, bool kOverwrite>
__global__ void AccumulateKernel(float* acc, const void* grad, float scale, size_t n) {
  for (size_t i = FirstIndex(); i < n; i += Stride()) {
    const float g = cm::LoadElem<kGrad>(grad, i);
    acc[i] = kOverwrite ? cm::OverwriteElement(g, scale) : cm::AccumulateElement(acc[i], g, scale);
  }
}

template <int kGrad>
void LaunchAccumulate(float* acc, const void* grad, float scale, bool overwrite, size_t n,
                      cudaStream_t s) {
  if (overwrite) {
    AccumulateKernel<kGrad, true><<<Blocks(n), kThreads, 0, s>>>(acc, grad, scale, n);
  } else {
    AccumulateKernel<kGrad, false><<<Blocks(n), kThreads, 0, s>>>(acc, grad, scale, n);
  }
}

// ---------------------------------------------------------------------------------------------
// Chunk sums of squares

constexpr int kChunksPerBlock = 8;
constexpr int kChunkThreads = kChunksPerBlock * cm::kChunkLanes;  // 128

template <int kElem>
__global__ void ChunkSumKernel(const void* grad, size_t n, size_t chunks, double* sums,
                               bool* nonfinite) {
  __shared__ double lanes[kChunksPerBlock][cm::kChunkLanes];
  const int local = static_cast<int>(threadIdx.x) / cm::kChunkLanes;
  const int lane = static_cast<int>(threadIdx.x) % cm::kChunkLanes;
  const size_t chunk = static_cast<size_t>(blockIdx.x) * kChunksPerBlock + local;
  double lane_sum = 0.0;
  if (chunk < chunks) {
    const size_t begin = chunk * kStatsChunk;
    const size_t rest = n - begin;
    // Not std::min: it takes references, an odr-use of the host-only kStatsChunk.
    const size_t count = rest < kStatsChunk ? rest : kStatsChunk;
    lane_sum = cm::ChunkLaneSum<kElem>(grad, begin, count, lane);
  }
  lanes[local][lane] = lane_sum;
  __syncthreads();
  if (lane == 0 && chunk < chunks) {
    const double sum = cm::CombineChunkLanes(lanes[local]);
    sums[chunk] = sum;
    if (!isfinite(sum)) *nonfinite = true;  // every writer stores the same value
  }
}

// ---------------------------------------------------------------------------------------------
// Casts

template <int kOut>
__global__ void NarrowKernel(const float* in, uint16_t* out, size_t n) {
  for (size_t i = FirstIndex(); i < n; i += Stride()) out[i] = cm::Narrow<kOut>(in[i]);
}

template <int kIn>
__global__ void WidenKernel(const void* in, float* out, size_t n) {
  for (size_t i = FirstIndex(); i < n; i += Stride()) out[i] = cm::LoadElem<kIn>(in, i);
}

Status Bad(const char* op, const std::string& what) {
  return Status::InvalidArgument(std::string(op) + ": " + what);
}

std::string BadDTypeMessage(const char* what, DType t) {
  return std::string(what) + " must be fp32, bf16 or fp16, not " + std::string(DTypeName(t));
}

}  // namespace

bool CudaKernelsAvailable() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // leave no error behind for the caller's next check
    return false;
  }
  return count > 0;
}

Status CudaAdamStep(const AdamHyper& hyper, const AdamShard& shard, void* stream) {
  STRATA_RETURN_IF_ERROR(ValidateAdam(hyper, shard));
  if (shard.n == 0) return Status::OK();
  const simd::AdamArgs a = simd::FoldAdamArgs(hyper, shard);
  const cudaStream_t s = AsStream(stream);
  switch (a.grad_elem) {
    case simd::kElemBF16:
      LaunchAdamOut<simd::kElemBF16>(a, shard.n, s);
      break;
    case simd::kElemF16:
      LaunchAdamOut<simd::kElemF16>(a, shard.n, s);
      break;
    default:
      LaunchAdamOut<simd::kElemF32>(a, shard.n, s);
      break;
  }
  STRATA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::OK();
}

Status CudaAccumulateGrad(float* acc, const void* grad, DType grad_dtype, float scale,
                          bool overwrite, size_t n, void* stream) {
  constexpr const char* kOp = "cuda accumulate grad";
  const int elem = ElemOf(grad_dtype);
  if (elem < 0) return Bad(kOp, BadDTypeMessage("grad dtype", grad_dtype));
  if (!std::isfinite(scale)) return Bad(kOp, "scale must be finite");
  if (n > 0 && (acc == nullptr || grad == nullptr)) return Bad(kOp, "null acc or grad with n > 0");
  if (n == 0) return Status::OK();
  const cudaStream_t s = AsStream(stream);
  switch (elem) {
    case simd::kElemBF16:
      LaunchAccumulate<simd::kElemBF16>(acc, grad, scale, overwrite, n, s);
      break;
    case simd::kElemF16:
      LaunchAccumulate<simd::kElemF16>(acc, grad, scale, overwrite, n, s);
      break;
    default:
      LaunchAccumulate<simd::kElemF32>(acc, grad, scale, overwrite, n, s);
      break;
  }
  STRATA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::OK();
}

Status CudaChunkSumSquares(const void* grad, DType dtype, size_t n, double* chunk_sums_device,
                           bool* nonfinite_device, void* stream) {
  constexpr const char* kOp = "cuda chunk sum squares";
  const int elem = ElemOf(dtype);
  if (elem < 0) return Bad(kOp, BadDTypeMessage("dtype", dtype));
  if (nonfinite_device == nullptr) return Bad(kOp, "null nonfinite_device");
  if (n > 0 && (grad == nullptr || chunk_sums_device == nullptr)) {
    return Bad(kOp, "null grad or chunk_sums_device with n > 0");
  }
  const cudaStream_t s = AsStream(stream);
  STRATA_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(nonfinite_device, 0, sizeof(bool), s));
  if (n == 0) return Status::OK();
  const size_t chunks = (n + kStatsChunk - 1) / kStatsChunk;
  const auto blocks = static_cast<unsigned>((chunks + kChunksPerBlock - 1) / kChunksPerBlock);
  switch (elem) {
    case simd::kElemBF16:
      ChunkSumKernel<simd::kElemBF16>
          <<<blocks, kChunkThreads, 0, s>>>(grad, n, chunks, chunk_sums_device, nonfinite_device);
      break;
    case simd::kElemF16:
      ChunkSumKernel<simd::kElemF16>
          <<<blocks, kChunkThreads, 0, s>>>(grad, n, chunks, chunk_sums_device, nonfinite_device);
      break;
    default:
      ChunkSumKernel<simd::kElemF32>
          <<<blocks, kChunkThreads, 0, s>>>(grad, n, chunks, chunk_sums_device, nonfinite_device);
      break;
  }
  STRATA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::OK();
}

Status CudaCast(const void* in, DType in_dtype, void* out, DType out_dtype, size_t n,
                void* stream) {
  if (n > 0 && (in == nullptr || out == nullptr)) {
    return Status::InvalidArgument("cuda cast: null input or output with n > 0");
  }
  const cudaStream_t s = AsStream(stream);
  const auto* in16 = static_cast<const uint16_t*>(in);
  auto* out16 = static_cast<uint16_t*>(out);
  if (in_dtype == out_dtype) {
    if (n == 0) return Status::OK();
    STRATA_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(out, in, n * DTypeSize(in_dtype), cudaMemcpyDefault, s));
    return Status::OK();
  }
  const bool from_f32 = in_dtype == DType::kF32;
  const bool to_f32 = out_dtype == DType::kF32;
  const bool narrow = from_f32 && (out_dtype == DType::kBF16 || out_dtype == DType::kF16);
  const bool widen = to_f32 && (in_dtype == DType::kBF16 || in_dtype == DType::kF16);
  if (!narrow && !widen) {
    return Status::InvalidArgument("cuda cast: unsupported conversion " +
                                   std::string(DTypeName(in_dtype)) + " -> " +
                                   std::string(DTypeName(out_dtype)));
  }
  if (n == 0) return Status::OK();
  if (out_dtype == DType::kBF16) {
    NarrowKernel<simd::kElemBF16>
        <<<Blocks(n), kThreads, 0, s>>>(static_cast<const float*>(in), out16, n);
  } else if (out_dtype == DType::kF16) {
    NarrowKernel<simd::kElemF16>
        <<<Blocks(n), kThreads, 0, s>>>(static_cast<const float*>(in), out16, n);
  } else if (in_dtype == DType::kBF16) {
    WidenKernel<simd::kElemBF16><<<Blocks(n), kThreads, 0, s>>>(in16, static_cast<float*>(out), n);
  } else {
    WidenKernel<simd::kElemF16><<<Blocks(n), kThreads, 0, s>>>(in16, static_cast<float*>(out), n);
  }
  STRATA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::OK();
}

}  // namespace strata::kernels
