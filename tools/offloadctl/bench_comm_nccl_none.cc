#include "tools/offloadctl/bench_comm_backend.h"

namespace strata::cli {

Result<BenchBackend> MakeNcclBenchBackend(int, int, KvStore*) {
  return Status::Unavailable("this offloadctl was built without CUDA/NCCL (STRATA_CUDA=OFF)");
}

}  // namespace strata::cli
