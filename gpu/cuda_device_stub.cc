// CreateCudaDevice when strata is built without CUDA (STRATA_CUDA=OFF).
#include "strata/device.h"

namespace strata {

Result<std::unique_ptr<Device>> CreateCudaDevice(const CudaDeviceOptions&) {
  return Status::Unavailable("CUDA device: strata was built without CUDA (STRATA_CUDA=OFF)");
}

}  // namespace strata
