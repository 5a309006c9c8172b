#include "kernels/dram_bench.h"

#include <algorithm>
#include <chrono>
#include <memory>
#include <thread>

#include "kernels/buffer.h"
#include "kernels/pool.h"
#include "kernels/simd.h"

namespace strata::kernels {
namespace {

using Clock = std::chrono::steady_clock;

// Fastest of `reps` runs of fn, in seconds.
template <class F>
double BestSeconds(int reps, F&& fn) {
  double best = 1e300;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = Clock::now();
    fn();
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    best = std::min(best, s);
  }
  return best;
}

}  // namespace

Result<DramReport> MeasureDram(const DramBenchOptions& o) {
  if (o.array_bytes < (size_t{1} << 20)) {
    return Status::InvalidArgument("dram bench: array_bytes must be >= 1 MiB");
  }
  if (o.reps < 1) return Status::InvalidArgument("dram bench: reps must be >= 1");
  if (o.max_threads < 0) return Status::InvalidArgument("dram bench: max_threads must be >= 0");
  const int max_threads =
      o.max_threads > 0 ? o.max_threads : static_cast<int>(std::thread::hardware_concurrency());
  const size_t n = o.array_bytes / sizeof(float);
  STRATA_ASSIGN_OR_RETURN(HugeBuffer a, HugeBuffer::Allocate(n * sizeof(float)));
  STRATA_ASSIGN_OR_RETURN(HugeBuffer b, HugeBuffer::Allocate(n * sizeof(float)));
  STRATA_ASSIGN_OR_RETURN(HugeBuffer c, HugeBuffer::Allocate(n * sizeof(float)));
  float* pa = a.as<float>();
  float* pb = b.as<float>();
  float* pc = c.as<float>();

  DramReport report;
  report.array_bytes = n * sizeof(float);
  const double bytes = static_cast<double>(n * sizeof(float));
  for (int t = 1; t <= max_threads; ++t) {
    STRATA_ASSIGN_OR_RETURN(auto pool,
                            KernelPool::Create({.threads = t, .bind_threads = o.bind_threads}));
    const size_t tile = RoundTile((n + t - 1) / t);  // one contiguous part per thread
    if (t == 1) {  // first touch (and a warm-up) before anything is timed
      auto fill = [&](int, size_t lo, size_t hi) {
        simd::StreamFill(pa + lo, 1.0f, hi - lo);
        simd::StreamFill(pb + lo, 2.0f, hi - lo);
        simd::StreamFill(pc + lo, 0.5f, hi - lo);
      };
      pool->ForEachTile(n, tile, fill);
    }
    auto copy = [&](int, size_t lo, size_t hi) { simd::StreamCopy(pa + lo, pb + lo, hi - lo); };
    auto triad = [&](int, size_t lo, size_t hi) {
      simd::StreamTriad(pa + lo, pb + lo, pc + lo, 3.0f, hi - lo, false);
    };
    auto nt_triad = [&](int, size_t lo, size_t hi) {
      simd::StreamTriad(pa + lo, pb + lo, pc + lo, 3.0f, hi - lo, true);
    };
    DramRow row;
    row.threads = t;
    row.copy_bytes_per_s = 2 * bytes / BestSeconds(o.reps, [&] { pool->ForEachTile(n, tile, copy); });
    row.triad_bytes_per_s =
        3 * bytes / BestSeconds(o.reps, [&] { pool->ForEachTile(n, tile, triad); });
    row.nt_triad_bytes_per_s =
        3 * bytes / BestSeconds(o.reps, [&] { pool->ForEachTile(n, tile, nt_triad); });
    report.rows.push_back(row);
    if (row.copy_bytes_per_s > report.best.copy_bytes_per_s) {
      report.best.copy_bytes_per_s = row.copy_bytes_per_s;
    }
    if (row.triad_bytes_per_s > report.best.triad_bytes_per_s) {
      report.best.triad_bytes_per_s = row.triad_bytes_per_s;
      report.best_triad_threads = t;
    }
    if (row.nt_triad_bytes_per_s > report.best.nt_triad_bytes_per_s) {
      report.best.nt_triad_bytes_per_s = row.nt_triad_bytes_per_s;
      report.best_nt_triad_threads = t;
      report.best.threads = t;
    }
  }
  return report;
}

}  // namespace strata::kernels
