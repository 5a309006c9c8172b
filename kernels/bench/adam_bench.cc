#include "kernels/bench/adam_bench.h"

#include <algorithm>
#include <chrono>
#include <thread>

#include "kernels/adam.h"
#include "kernels/bench/dram_bench.h"
#include "kernels/buffer.h"
#include "kernels/casts.h"
#include "kernels/pool.h"
#include "kernels/simd.h"

namespace strata::kernels {

std::string AdamPath::Name() const {
  return "grad_" + std::string(DTypeName(grad)) + "_out_" +
         (out ? std::string(DTypeName(*out)) : std::string("none"));
}

std::vector<AdamPath> AllAdamPaths() {
  std::vector<AdamPath> v;
  for (DType g : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (std::optional<DType> o : {std::optional<DType>(), std::optional<DType>(DType::kBF16),
                                   std::optional<DType>(DType::kF16)}) {
      v.push_back({g, o});
    }
  }
  return v;
}

namespace {

// The arrays of the benchmark shard, sized for the widest path (fp32 grads, 16-bit out).
struct Arrays {
  HugeBuffer master, m, v, grad32, grad16, out;
};

Result<Arrays> MakeArrays(size_t n, KernelPool& pool) {
  Arrays a;
  STRATA_ASSIGN_OR_RETURN(a.master, HugeBuffer::Allocate(n * 4));
  STRATA_ASSIGN_OR_RETURN(a.m, HugeBuffer::Allocate(n * 4));
  STRATA_ASSIGN_OR_RETURN(a.v, HugeBuffer::Allocate(n * 4));
  STRATA_ASSIGN_OR_RETURN(a.grad32, HugeBuffer::Allocate(n * 4));
  STRATA_ASSIGN_OR_RETURN(a.grad16, HugeBuffer::Allocate(n * 2));
  STRATA_ASSIGN_OR_RETURN(a.out, HugeBuffer::Allocate(n * 2));
  // First touch by the threads that will use the memory; small, finite values.
  auto init = [&a](int, size_t lo, size_t hi) {
    for (size_t i = lo; i < hi; ++i) {
      a.master.as<float>()[i] = 0.01f * static_cast<float>(i % 13) - 0.06f;
      a.grad32.as<float>()[i] = 1e-3f * static_cast<float>(static_cast<int>(i % 97) - 48);
    }
    simd::StreamFill(a.m.as<float>() + lo, 0.0f, hi - lo);
    simd::StreamFill(a.v.as<float>() + lo, 0.0f, hi - lo);
    simd::StreamFill(a.out.as<float>() + lo / 2, 0.0f, (hi - lo) / 2);
  };
  pool.ForEachTile(n, 0, init);
  return a;
}

// Times `reps` steps (after one warm-up) on `pool`; the fastest counts. With a reference, one
// nt triad follows every timed step.
Result<AdamBenchRow> TimeSteps(KernelPool& pool, AdamHyper& hyper, const AdamShard& shard,
                               size_t bytes_per_param, const AdamBenchOptions& o) {
  double best = 1e300;
  AdamBenchRow row;
  for (int r = 0; r <= o.reps; ++r) {
    ++hyper.step;
    const auto t0 = std::chrono::steady_clock::now();
    STRATA_RETURN_IF_ERROR(AdamStep(pool, hyper, shard));
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (r == 0) continue;
    best = std::min(best, s);
    if (o.reference != nullptr) {
      row.nt_triad_bytes_per_s =
          std::max(row.nt_triad_bytes_per_s, o.reference->MeasureNtTriad(pool, 1));
    }
  }
  row.threads = pool.threads();
  row.params_per_s = static_cast<double>(shard.n) / best;
  row.effective_bytes_per_s = row.params_per_s * static_cast<double>(bytes_per_param);
  return row;
}

}  // namespace

Result<std::vector<AdamBenchResult>> MeasureAdam(const AdamBenchOptions& o) {
  if (o.params == 0) return Status::InvalidArgument("adam bench: params must be > 0");
  if (o.reps < 1) return Status::InvalidArgument("adam bench: reps must be >= 1");
  if (o.max_threads < 0) return Status::InvalidArgument("adam bench: max_threads must be >= 0");
  if (o.paths.empty()) return Status::InvalidArgument("adam bench: no dtype path to measure");
  const size_t n = o.params;
  std::vector<std::unique_ptr<KernelPool>> pools;
  for (int t : ThreadLadder(o.max_threads)) {
    STRATA_ASSIGN_OR_RETURN(auto pool,
                            KernelPool::Create({.threads = t, .bind_threads = o.bind_threads}));
    pools.push_back(std::move(pool));
  }
  KernelPool& all = *pools.back();
  STRATA_ASSIGN_OR_RETURN(Arrays a, MakeArrays(n, all));

  std::vector<AdamBenchResult> results;
  AdamHyper hyper;
  hyper.weight_decay = 0.01f;
  hyper.stream_state = o.stream_state;
  hyper.step = 0;  // TimeSteps counts up from 1
  for (const AdamPath& path : o.paths) {
    AdamBenchResult res;
    res.path = path;
    res.bytes_per_param = AdamBytesPerParam(path.grad, path.out);
    const void* grad = a.grad32.data();
    if (path.grad != DType::kF32) {
      STRATA_RETURN_IF_ERROR(
          Cast(all, a.grad32.data(), DType::kF32, a.grad16.data(), path.grad, n));
      grad = a.grad16.data();
    }
    const AdamShard shard{a.master.as<float>(),
                          a.m.as<float>(),
                          a.v.as<float>(),
                          grad,
                          path.grad,
                          path.out ? a.out.data() : nullptr,
                          path.out.value_or(DType::kBF16),
                          n};
    for (auto& pool : pools) {
      STRATA_ASSIGN_OR_RETURN(AdamBenchRow row,
                              TimeSteps(*pool, hyper, shard, res.bytes_per_param, o));
      res.rows.push_back(row);
      if (row.params_per_s > res.best.params_per_s) res.best = row;
    }
    results.push_back(std::move(res));
  }
  return results;
}

}  // namespace strata::kernels
