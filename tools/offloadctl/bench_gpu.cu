// bench_gpu.h's GpuSpin: a kernel that spins every thread until the device's global timer has
// advanced by the asked time (CUDA builds).
#include <cstdint>
#include <memory>

#include <cuda_runtime_api.h>

#include "gpu/cuda_check.h"
#include "tools/offloadctl/bench_gpu.h"

namespace strata::cli {
namespace {

__device__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void SpinKernel(uint64_t ns) {
  const uint64_t start = GlobalTimerNs();
  while (GlobalTimerNs() - start < ns) {
  }
}

// Blocks per SM: enough resident blocks that no SM idles while the others spin.
constexpr int kBlocksPerSm = 4;
constexpr int kThreadsPerBlock = 256;

class CudaSpin final : public GpuSpin {
 public:
  CudaSpin(int ordinal, int sms) : ordinal_(ordinal), sms_(sms) {}
  ~CudaSpin() override {
    if (stream_) {
      cudaSetDevice(ordinal_);
      cudaStreamSynchronize(stream_);
      cudaStreamDestroy(stream_);
    }
  }
  Status Init() {
    STRATA_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal_));
    STRATA_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    return Status::OK();
  }
  Status Spin(double ms) override {
    if (ms <= 0) return Status::OK();
    STRATA_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal_));
    SpinKernel<<<sms_ * kBlocksPerSm, kThreadsPerBlock, 0, stream_>>>(
        static_cast<uint64_t>(ms * 1e6));
    STRATA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    STRATA_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    return Status::OK();
  }

 private:
  int ordinal_, sms_;
  cudaStream_t stream_ = nullptr;
};

}  // namespace

Result<std::unique_ptr<GpuSpin>> MakeGpuSpin(int ordinal) {
  int sms = 0;
  STRATA_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, ordinal));
  auto spin = std::make_unique<CudaSpin>(ordinal, sms > 0 ? sms : 1);
  STRATA_RETURN_IF_ERROR(spin->Init());
  return std::unique_ptr<GpuSpin>(std::move(spin));
}

}  // namespace strata::cli
