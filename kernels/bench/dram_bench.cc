#include "kernels/bench/dram_bench.h"

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

struct DramProbe::Arrays {
  HugeBuffer a, b, c;
  size_t n = 0;
};

DramProbe::DramProbe(std::unique_ptr<Arrays> a) : a_(std::move(a)) {}
DramProbe::DramProbe(DramProbe&&) noexcept = default;
DramProbe& DramProbe::operator=(DramProbe&&) noexcept = default;
DramProbe::~DramProbe() = default;

size_t DramProbe::array_bytes() const { return a_->n * sizeof(float); }

Result<DramProbe> DramProbe::Create(size_t array_bytes, KernelPool& pool) {
  if (array_bytes < (size_t{1} << 20)) {
    return Status::InvalidArgument("dram bench: array_bytes must be >= 1 MiB");
  }
  auto arrays = std::make_unique<Arrays>();
  arrays->n = array_bytes / sizeof(float);
  STRATA_ASSIGN_OR_RETURN(arrays->a, HugeBuffer::Allocate(arrays->n * sizeof(float)));
  STRATA_ASSIGN_OR_RETURN(arrays->b, HugeBuffer::Allocate(arrays->n * sizeof(float)));
  STRATA_ASSIGN_OR_RETURN(arrays->c, HugeBuffer::Allocate(arrays->n * sizeof(float)));
  Arrays* ar = arrays.get();
  auto fill = [ar](int, size_t lo, size_t hi) {  // first touch, by the threads that measure
    simd::StreamFill(ar->a.as<float>() + lo, 1.0f, hi - lo);
    simd::StreamFill(ar->b.as<float>() + lo, 2.0f, hi - lo);
    simd::StreamFill(ar->c.as<float>() + lo, 0.5f, hi - lo);
  };
  pool.ForEachTile(ar->n, RoundTile((ar->n + pool.threads() - 1) / pool.threads()), fill);
  return DramProbe(std::move(arrays));
}

namespace {

// One contiguous part per thread.
size_t PartTile(size_t n, const KernelPool& pool) {
  return RoundTile((n + pool.threads() - 1) / pool.threads());
}

double TriadSeconds(KernelPool& pool, float* a, const float* b, const float* c, size_t n, bool nt,
                    int reps) {
  auto triad = [&](int, size_t lo, size_t hi) {
    simd::StreamTriad(a + lo, b + lo, c + lo, 3.0f, hi - lo, nt);
  };
  const size_t tile = PartTile(n, pool);
  return BestSeconds(reps, [&] { pool.ForEachTile(n, tile, triad); });
}

}  // namespace

double DramProbe::MeasureNtTriad(KernelPool& pool, int reps) {
  const size_t n = a_->n;
  return 3.0 * static_cast<double>(n * sizeof(float)) /
         TriadSeconds(pool, a_->a.as<float>(), a_->b.as<float>(), a_->c.as<float>(), n, true, reps);
}

DramRow DramProbe::Measure(KernelPool& pool, int reps) {
  const size_t n = a_->n;
  float* pa = a_->a.as<float>();
  const float* pb = a_->b.as<float>();
  const float* pc = a_->c.as<float>();
  const double bytes = static_cast<double>(n * sizeof(float));
  auto copy = [&](int, size_t lo, size_t hi) { simd::StreamCopy(pa + lo, pb + lo, hi - lo); };
  const size_t tile = PartTile(n, pool);
  DramRow row;
  row.threads = pool.threads();
  row.copy_bytes_per_s = 2 * bytes / BestSeconds(reps, [&] { pool.ForEachTile(n, tile, copy); });
  row.triad_bytes_per_s = 3 * bytes / TriadSeconds(pool, pa, pb, pc, n, false, reps);
  row.nt_triad_bytes_per_s = 3 * bytes / TriadSeconds(pool, pa, pb, pc, n, true, reps);
  return row;
}

Result<DramReport> MeasureDram(const DramBenchOptions& o) {
  if (o.reps < 1) return Status::InvalidArgument("dram bench: reps must be >= 1");
  if (o.max_threads < 0) return Status::InvalidArgument("dram bench: max_threads must be >= 0");
  std::vector<std::unique_ptr<KernelPool>> pools;
  for (int t : ThreadLadder(o.max_threads)) {
    STRATA_ASSIGN_OR_RETURN(auto pool,
                            KernelPool::Create({.threads = t, .bind_threads = o.bind_threads}));
    pools.push_back(std::move(pool));
  }
  STRATA_ASSIGN_OR_RETURN(DramProbe probe, DramProbe::Create(o.array_bytes, *pools.back()));
  DramReport report;
  report.array_bytes = probe.array_bytes();
  for (auto& pool : pools) {
    const DramRow row = probe.Measure(*pool, o.reps);
    report.rows.push_back(row);
    const int t = row.threads;
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
