#include "kernels/adam_bench.h"

#include <algorithm>
#include <chrono>
#include <thread>

#include "kernels/adam.h"
#include "kernels/buffer.h"
#include "kernels/casts.h"
#include "kernels/dram_bench.h"
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

Result<std::vector<AdamBenchResult>> MeasureAdam(const AdamBenchOptions& o) {
  if (o.params == 0) return Status::InvalidArgument("adam bench: params must be > 0");
  if (o.reps < 1) return Status::InvalidArgument("adam bench: reps must be >= 1");
  if (o.max_threads < 0) return Status::InvalidArgument("adam bench: max_threads must be >= 0");
  if (o.paths.empty()) return Status::InvalidArgument("adam bench: no dtype path to measure");
  const size_t n = o.params;
  STRATA_ASSIGN_OR_RETURN(HugeBuffer master, HugeBuffer::Allocate(n * 4));
  STRATA_ASSIGN_OR_RETURN(HugeBuffer m, HugeBuffer::Allocate(n * 4));
  STRATA_ASSIGN_OR_RETURN(HugeBuffer v, HugeBuffer::Allocate(n * 4));
  STRATA_ASSIGN_OR_RETURN(HugeBuffer grad32, HugeBuffer::Allocate(n * 4));
  STRATA_ASSIGN_OR_RETURN(HugeBuffer grad16, HugeBuffer::Allocate(n * 2));
  STRATA_ASSIGN_OR_RETURN(HugeBuffer out, HugeBuffer::Allocate(n * 2));

  std::vector<std::unique_ptr<KernelPool>> pools;
  for (int t : ThreadLadder(o.max_threads)) {
    STRATA_ASSIGN_OR_RETURN(auto pool,
                            KernelPool::Create({.threads = t, .bind_threads = o.bind_threads}));
    pools.push_back(std::move(pool));
  }
  KernelPool& all = *pools.back();
  {  // First touch by the threads that will use the memory; small, finite values.
    auto init = [&](int, size_t lo, size_t hi) {
      for (size_t i = lo; i < hi; ++i) {
        master.as<float>()[i] = 0.01f * static_cast<float>(i % 13) - 0.06f;
        grad32.as<float>()[i] = 1e-3f * static_cast<float>(static_cast<int>(i % 97) - 48);
      }
      simd::StreamFill(m.as<float>() + lo, 0.0f, hi - lo);
      simd::StreamFill(v.as<float>() + lo, 0.0f, hi - lo);
      simd::StreamFill(out.as<float>() + lo / 2, 0.0f, (hi - lo) / 2);
    };
    all.ForEachTile(n, 0, init);
  }

  std::vector<AdamBenchResult> results;
  int64_t step = 0;
  for (const AdamPath& path : o.paths) {
    AdamBenchResult res;
    res.path = path;
    res.bytes_per_param = AdamBytesPerParam(path.grad, path.out);
    const void* grad = grad32.data();
    if (path.grad != DType::kF32) {
      STRATA_RETURN_IF_ERROR(Cast(all, grad32.data(), DType::kF32, grad16.data(), path.grad, n));
      grad = grad16.data();
    }
    AdamShard shard{master.as<float>(),
                    m.as<float>(),
                    v.as<float>(),
                    grad,
                    path.grad,
                    path.out ? out.data() : nullptr,
                    path.out.value_or(DType::kBF16),
                    n};
    AdamHyper hyper;
    hyper.weight_decay = 0.01f;
    hyper.stream_state = o.stream_state;
    for (auto& pool : pools) {
      double best = 1e300;
      AdamBenchRow row;
      for (int r = 0; r <= o.reps; ++r) {  // r == 0 is a warm-up
        hyper.step = ++step;
        const auto t0 = std::chrono::steady_clock::now();
        STRATA_RETURN_IF_ERROR(AdamStep(*pool, hyper, shard));
        const double s =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (r > 0) best = std::min(best, s);
        if (r > 0 && o.reference != nullptr) {
          row.nt_triad_bytes_per_s =
              std::max(row.nt_triad_bytes_per_s, o.reference->MeasureNtTriad(*pool, 1));
        }
      }
      row.threads = pool->threads();
      row.params_per_s = static_cast<double>(n) / best;
      row.effective_bytes_per_s = row.params_per_s * static_cast<double>(res.bytes_per_param);
      res.rows.push_back(row);
      if (row.params_per_s > res.best.params_per_s) res.best = row;
    }
    results.push_back(std::move(res));
  }
  return results;
}

}  // namespace strata::kernels
