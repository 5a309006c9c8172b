// The GPU side of `offloadctl bench engine --device cuda`: the engine's NCCL communicator, the
// PCIe reference and the simulated compute as a kernel. bench_gpu.cc and bench_gpu.cu are
// compiled only with CUDA; otherwise bench_gpu_none.cc returns Unavailable from each. Chosen by
// CMake, not by #if.
//
// Thread safety: none; each object is used by the calling thread alone.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>

#include "strata/comm.h"
#include "strata/status.h"

namespace strata::cli {

// NCCL on GPU `ordinal`: at world 1 with a local unique id, above it through `store` under
// `store_key` (rank 0 publishes the id).
Result<std::unique_ptr<Communicator>> MakeEngineNccl(int rank, int world, int ordinal,
                                                     KvStore* store, const std::string& store_key,
                                                     std::chrono::milliseconds timeout);

// The host<->device link's copy rates: cudaMemcpyAsync of one pinned host buffer of `bytes` to
// and from device memory, the best of `repeats` each way, GB/s (1e9 bytes).
struct PcieReference {
  double h2d_gbps = 0, d2h_gbps = 0;
};
Result<PcieReference> MeasurePcie(int ordinal, size_t bytes, int repeats);

// Simulated compute on the GPU: a kernel that keeps every SM busy for the asked time, on a
// stream of its own, waited for before Spin returns (as a trainer's backward kernels finish
// before its gradients are reduced).
class GpuSpin {
 public:
  virtual ~GpuSpin() = default;
  virtual Status Spin(double ms) = 0;
};
Result<std::unique_ptr<GpuSpin>> MakeGpuSpin(int ordinal);

}  // namespace strata::cli
