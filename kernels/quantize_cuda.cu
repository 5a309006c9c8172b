// The CUDA block INT8 quantize / dequantize of cuda_kernels.h (format in kernels/quantize.h; the
// per-element code in quantize_math.h).
//
// Quantize: one thread block of kQuantThreads per quantization block (grid-stride over blocks).
// Pass 1: each thread takes the max of the magnitudes' bits over its strided elements; the block
// reduces them in shared memory (an integer max: the order does not matter, so the scale is the
// CPU's bit for bit). Thread 0 forms the scale (Int8BlockScale) and counts a non-finite block.
// Pass 2 rereads the block (from L2) and writes q. Dequantize: one element per thread, grid-stride.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "gpu/cuda_check.h"
#include "kernels/cuda_kernels.h"
#include "kernels/cuda_math.h"
#include "kernels/elem.h"
#include "kernels/quantize.h"
#include "kernels/quantize_math.h"
#include "kernels/simd.h"

namespace strata::kernels {
namespace {

namespace cm = cuda_math;
namespace qm = quantize_math;

constexpr int kQuantThreads = 256;
constexpr size_t kMaxGrid = 65536;

cudaStream_t AsStream(void* stream) { return static_cast<cudaStream_t>(stream); }

template <int kElem>
__global__ void QuantizeKernel(const void* src, size_t n, size_t block, size_t blocks, int8_t* q,
                               float* scales, unsigned long long* nonfinite) {
  __shared__ uint32_t part[kQuantThreads];
  __shared__ float block_scale;
  for (size_t b = blockIdx.x; b < blocks; b += gridDim.x) {
    const size_t begin = b * block;
    const size_t end = n - begin < block ? n : begin + block;
    uint32_t m = 0;
    for (size_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
      m = max(m, qm::AbsBits(cm::LoadElem<kElem>(src, i)));
    }
    part[threadIdx.x] = m;
    __syncthreads();
    for (int s = kQuantThreads / 2; s > 0; s /= 2) {
      if (static_cast<int>(threadIdx.x) < s) {
        part[threadIdx.x] = max(part[threadIdx.x], part[threadIdx.x + s]);
      }
      __syncthreads();
    }
    if (threadIdx.x == 0) {
      const uint32_t amax = part[0];
      const float scale = Int8BlockScale(amax);
      scales[b] = scale;
      block_scale = scale;
      if (amax >= 0x7f800000u && nonfinite != nullptr) atomicAdd(nonfinite, 1ull);
    }
    __syncthreads();
    const float scale = block_scale;
    for (size_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
      q[i] = qm::QuantizeElement(cm::LoadElem<kElem>(src, i), scale);
    }
    __syncthreads();  // part and block_scale are reused by the next block
  }
}

// kOut: the output element code; kAdd: acc += deq (fp32) instead.
template <int kOut, bool kAdd>
__global__ void DequantizeKernel(const int8_t* q, const float* scales, size_t n, size_t block,
                                 void* dst) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float v = qm::DequantizeElement(q[i], scales[i / block]);
    if constexpr (kAdd) {
      float* acc = static_cast<float*>(dst);
      acc[i] = qm::AccumulateElement(acc[i], v);
    } else if constexpr (kOut == simd::kElemF32) {
      static_cast<float*>(dst)[i] = v;
    } else {
      static_cast<uint16_t*>(dst)[i] = cm::Narrow<kOut>(v);
    }
  }
}

unsigned Grid(size_t units) {
  return static_cast<unsigned>(std::min(std::max<size_t>(units, 1), kMaxGrid));
}

Status Check(const char* op, int elem, DType t, size_t n, size_t block, const void* a,
             const void* b, const void* c) {
  if (elem < 0) {
    return Status::InvalidArgument(std::string(op) + ": dtype must be fp32, bf16 or fp16, not " +
                                   std::string(DTypeName(t)));
  }
  if (block == 0) return Status::InvalidArgument(std::string(op) + ": block must be > 0");
  if (n > 0 && (a == nullptr || b == nullptr || c == nullptr)) {
    return Status::InvalidArgument(std::string(op) + ": null pointer with n > 0");
  }
  return Status::OK();
}

template <bool kAdd>
Status LaunchDequantize(const int8_t* q, const float* scales, size_t n, size_t block, int elem,
                        void* dst, cudaStream_t s) {
  if (n == 0) return Status::OK();
  const unsigned grid = Grid((n + kQuantThreads - 1) / kQuantThreads);
  if constexpr (kAdd) {
    DequantizeKernel<simd::kElemF32, true><<<grid, kQuantThreads, 0, s>>>(q, scales, n, block, dst);
  } else if (elem == simd::kElemBF16) {
    DequantizeKernel<simd::kElemBF16, false>
        <<<grid, kQuantThreads, 0, s>>>(q, scales, n, block, dst);
  } else if (elem == simd::kElemF16) {
    DequantizeKernel<simd::kElemF16, false>
        <<<grid, kQuantThreads, 0, s>>>(q, scales, n, block, dst);
  } else {
    DequantizeKernel<simd::kElemF32, false>
        <<<grid, kQuantThreads, 0, s>>>(q, scales, n, block, dst);
  }
  STRATA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::OK();
}

}  // namespace

Status CudaQuantizeInt8(DType src_dtype, const void* src, size_t n, size_t block, int8_t* q,
                        float* scales, uint64_t* nonfinite_blocks_device, void* stream) {
  constexpr const char* kOp = "cuda quantize int8";
  const int elem = ElemOf(src_dtype);
  STRATA_RETURN_IF_ERROR(Check(kOp, elem, src_dtype, n, block, src, q, scales));
  const cudaStream_t s = AsStream(stream);
  static_assert(sizeof(uint64_t) == sizeof(unsigned long long));
  auto* counter = reinterpret_cast<unsigned long long*>(nonfinite_blocks_device);
  if (counter != nullptr) {
    STRATA_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(counter, 0, sizeof(*counter), s));
  }
  if (n == 0) return Status::OK();
  const size_t blocks = QuantBlocks(n, block);
  const unsigned grid = Grid(blocks);
  switch (elem) {
    case simd::kElemBF16:
      QuantizeKernel<simd::kElemBF16>
          <<<grid, kQuantThreads, 0, s>>>(src, n, block, blocks, q, scales, counter);
      break;
    case simd::kElemF16:
      QuantizeKernel<simd::kElemF16>
          <<<grid, kQuantThreads, 0, s>>>(src, n, block, blocks, q, scales, counter);
      break;
    default:
      QuantizeKernel<simd::kElemF32>
          <<<grid, kQuantThreads, 0, s>>>(src, n, block, blocks, q, scales, counter);
      break;
  }
  STRATA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::OK();
}

Status CudaDequantizeInt8(const int8_t* q, const float* scales, size_t n, size_t block,
                          DType dst_dtype, void* dst, void* stream) {
  const int elem = ElemOf(dst_dtype);
  STRATA_RETURN_IF_ERROR(Check("cuda dequantize int8", elem, dst_dtype, n, block, q, scales, dst));
  return LaunchDequantize<false>(q, scales, n, block, elem, dst, AsStream(stream));
}

Status CudaDequantizeAddInt8(const int8_t* q, const float* scales, size_t n, size_t block,
                             float* acc, void* stream) {
  STRATA_RETURN_IF_ERROR(
      Check("cuda dequantize-add int8", simd::kElemF32, DType::kF32, n, block, q, scales, acc));
  return LaunchDequantize<true>(q, scales, n, block, simd::kElemF32, acc, AsStream(stream));
}

}  // namespace strata::kernels
