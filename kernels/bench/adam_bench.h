// Throughput of the fused Adam step (kernels/adam.h) per dtype path and thread count, measured
// over one large shard. Used by `offloadctl bench adam` next to the same run's DRAM figures.
//
// Effective bandwidth = params/s x AdamBytesPerParam(path): the bytes the step must move at
// least (p, m, v read and written, grad read, param out written).
//
// Thread safety: one measurement at a time per process makes sense (they share the memory bus).
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <vector>

#include "strata/dtype.h"
#include "strata/status.h"

namespace strata::kernels {

class DramProbe;

struct AdamPath {
  DType grad = DType::kBF16;
  std::optional<DType> out;  // nullopt: no 16-bit parameter copy
  // "grad_bf16_out_bf16", "grad_fp32_out_none", ...
  std::string Name() const;
};

// Every gradient dtype (fp32, bf16, fp16) with every output (none, bf16, fp16).
std::vector<AdamPath> AllAdamPaths();

struct AdamBenchOptions {
  size_t params = size_t{64} << 20;  // shard size in parameters
  int max_threads = 0;  // measure ThreadLadder(max_threads): 1, 2, 4, ..., max; 0: all CPUs
  int reps = 5;         // steps timed per path and thread count; the fastest counts
  bool bind_threads = false;
  bool stream_state = false;  // AdamHyper::stream_state
  std::vector<AdamPath> paths = AllAdamPaths();
  // When set, every timed step is followed by one non-temporal triad on the same threads, so
  // each row carries a reference measured under the same load (shared machines drift).
  DramProbe* reference = nullptr;
};

struct AdamBenchRow {
  int threads = 0;
  double params_per_s = 0;
  double effective_bytes_per_s = 0;
  double nt_triad_bytes_per_s = 0;  // interleaved reference (0 without one)
};

struct AdamBenchResult {
  AdamPath path;
  size_t bytes_per_param = 0;
  std::vector<AdamBenchRow> rows;  // one per ThreadLadder step (1, 2, 4, ..., max)
  AdamBenchRow best;
};

// InvalidArgument: params == 0, reps < 1, max_threads < 0, empty paths. IOError: the shard
// (24 bytes per param + 4 for grads + 2 for the output) could not be mapped.
Result<std::vector<AdamBenchResult>> MeasureAdam(const AdamBenchOptions& options);

}  // namespace strata::kernels
