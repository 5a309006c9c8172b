// Built when strata has CUDA: cudaHostRegister makes pool buffers DMA-able by the GPU, so the
// same bytes serve the disk (O_DIRECT) and the device (cudaMemcpyAsync at full PCIe speed).
#include <cuda_runtime_api.h>

#include "cpu/pinned_pool.h"

namespace strata::cpu {
namespace {

class CudaHostRegistrar final : public HostMemoryRegistrar {
 public:
  std::string_view name() const override { return "cudaHostRegister"; }
  Status Register(void* base, size_t size_bytes) override {
    cudaError_t e = cudaHostRegister(base, size_bytes, cudaHostRegisterDefault);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();  // clear the sticky-free error so later calls start clean
      return Status::Unavailable(std::string("cudaHostRegister: ") + cudaGetErrorName(e) + " (" +
                                 cudaGetErrorString(e) + ")");
    }
    return Status::OK();
  }
  void Unregister(void* base) override { (void)cudaHostUnregister(base); }
};

}  // namespace

std::unique_ptr<HostMemoryRegistrar> MakeCudaHostRegistrar() {
  return std::make_unique<CudaHostRegistrar>();
}
}  // namespace strata::cpu
