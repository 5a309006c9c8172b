// The device side of `offloadctl bench comm`: a communicator plus an allocator for its buffers.
// The NCCL variant (bench_comm_nccl.cc) is compiled only with CUDA; otherwise
// bench_comm_nccl_none.cc reports it unavailable. Chosen by CMake, not by #if.
#pragma once

#include <functional>
#include <memory>

#include "strata/comm.h"

namespace strata::cli {

struct BenchBackend {
  std::unique_ptr<Communicator> comm;
  std::function<void*(size_t)> alloc;  // returns nullptr on failure
  std::function<void(void*)> free;
  // Fills `bytes` at `dst` from host memory `src`.
  std::function<void(void* dst, const void* src, size_t bytes)> upload;
};

// Rank `rank` of `world` on GPU rank % device_count, rendezvous through `store`.
Result<BenchBackend> MakeNcclBenchBackend(int rank, int world, KvStore* store);

}  // namespace strata::cli
