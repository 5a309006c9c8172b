// DRAM bandwidth measurement (STREAM-like): copy, triad, and triad with non-temporal stores, for
// 1..N threads, over arrays far larger than the caches. It is the same-run reference that CPU
// kernel throughput is judged against (`offloadctl bench dram`, `offloadctl bench adam`).
//
// Bytes are counted the STREAM way: copy moves 2 x array bytes (read + write), triad
// a = b + s*c moves 3 x array bytes. A plain store also reads the line first (write allocate), so
// plain triad really moves 4 x; the non-temporal triad avoids that read, which is why it is the
// ceiling a streaming kernel can reach.
//
// Thread safety: one measurement at a time per process makes sense (they share the memory bus).
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "strata/status.h"

namespace strata::kernels {

struct DramBenchOptions {
  // Bytes of each of the three fp32 arrays (rounded up to 2 MiB). Should exceed the last-level
  // cache by far; 256 MiB by default.
  size_t array_bytes = size_t{256} << 20;
  // Measure ThreadLadder(max_threads) threads (1, 2, 4, ..., max); 0: one per logical CPU.
  int max_threads = 0;
  // Repetitions per kernel and thread count; the fastest counts (STREAM's convention).
  int reps = 5;
  bool bind_threads = false;
};

struct DramRow {
  int threads = 0;
  double copy_bytes_per_s = 0;
  double triad_bytes_per_s = 0;
  double nt_triad_bytes_per_s = 0;
};

struct DramReport {
  size_t array_bytes = 0;
  std::vector<DramRow> rows;  // one per ThreadLadder step (1, 2, 4, ..., max)
  // Each figure at its own best thread count.
  DramRow best;
  int best_triad_threads = 0;
  int best_nt_triad_threads = 0;
};

// InvalidArgument: array_bytes < 1 MiB, reps < 1, max_threads < 0. IOError: the arrays could not
// be mapped.
Result<DramReport> MeasureDram(const DramBenchOptions& options);

class KernelPool;

// The arrays of one DRAM measurement, kept so a benchmark can interleave reference measurements
// with its own (both then see the same contention on a shared machine). Move-only.
class DramProbe {
 public:
  // Maps three arrays of `array_bytes` (>= 1 MiB) and touches them from the pool's threads.
  static Result<DramProbe> Create(size_t array_bytes, KernelPool& pool);
  DramProbe(DramProbe&&) noexcept;
  DramProbe& operator=(DramProbe&&) noexcept;
  ~DramProbe();

  size_t array_bytes() const;
  // Copy, triad and non-temporal triad on the pool's threads, best of `reps` each (reps >= 1).
  DramRow Measure(KernelPool& pool, int reps);
  // Only the non-temporal triad (bytes/s, best of `reps`).
  double MeasureNtTriad(KernelPool& pool, int reps);

 private:
  struct Arrays;
  explicit DramProbe(std::unique_ptr<Arrays> a);
  std::unique_ptr<Arrays> a_;
};

}  // namespace strata::kernels
