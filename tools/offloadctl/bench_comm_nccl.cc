#include <cuda_runtime_api.h>

#include "gpu/nccl_comm.h"
#include "tools/offloadctl/bench_comm_backend.h"

namespace strata::cli {

Result<BenchBackend> MakeNcclBenchBackend(int rank, int world, KvStore* store) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    return Status::Unavailable(std::string("no CUDA device: ") + cudaGetErrorString(e));
  }
  if (world > count) {
    return Status::InvalidArgument("nccl bench: " + std::to_string(world) + " ranks but only " +
                                   std::to_string(count) + " GPUs (one rank per GPU)");
  }
  NcclCommOptions o;
  o.rank = rank;
  o.world_size = world;
  o.device = rank % count;
  o.store = store;
  BenchBackend b;
  STRATA_ASSIGN_OR_RETURN(b.comm, CreateNcclCommunicator(o));
  b.alloc = [](size_t bytes) -> void* {
    void* p = nullptr;
    return cudaMalloc(&p, bytes ? bytes : 1) == cudaSuccess ? p : nullptr;
  };
  b.free = [](void* p) { cudaFree(p); };
  b.upload = [](void* dst, const void* src, size_t bytes) {
    cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice);
  };
  return b;
}

}  // namespace strata::cli
