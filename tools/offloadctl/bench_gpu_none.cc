#include "tools/offloadctl/bench_gpu.h"

namespace strata::cli {
namespace {

Status NoCuda() {
  return Status::Unavailable("this offloadctl was built without CUDA/NCCL (STRATA_CUDA=OFF)");
}

}  // namespace

Result<std::unique_ptr<Communicator>> MakeEngineNccl(int, int, int, KvStore*, const std::string&,
                                                     std::chrono::milliseconds) {
  return NoCuda();
}

Result<PcieReference> MeasurePcie(int, size_t, int) { return NoCuda(); }

Result<std::unique_ptr<GpuSpin>> MakeGpuSpin(int) { return NoCuda(); }

}  // namespace strata::cli
