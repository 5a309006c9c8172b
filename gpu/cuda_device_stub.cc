// CreateCudaDevice and the NCCL factories when strata is built without CUDA (STRATA_CUDA=OFF):
// each returns Unavailable, so callers (the Python binding, offloadctl) need no #if.
#include "gpu/nccl_comm.h"
#include "strata/device.h"

namespace strata {

Result<std::unique_ptr<Device>> CreateCudaDevice(const CudaDeviceOptions&) {
  return Status::Unavailable("CUDA device: strata was built without CUDA (STRATA_CUDA=OFF)");
}

Result<std::vector<uint8_t>> NewNcclUniqueId() {
  return Status::Unavailable("NCCL: strata was built without CUDA (STRATA_CUDA=OFF)");
}

Result<std::unique_ptr<Communicator>> CreateNcclCommunicator(const NcclCommOptions&) {
  return Status::Unavailable("NCCL: strata was built without CUDA (STRATA_CUDA=OFF)");
}

}  // namespace strata
