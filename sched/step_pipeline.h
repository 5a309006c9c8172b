// StepPipeline: runs read -> compute -> write over a sequence of sub-groups (the optimizer step:
// NVMe -> Adam -> NVMe), with reads running ahead and writes running behind the compute, over a
// fixed number of buffers.
//
// Each sub-group holds one buffer from its read's issue to its write's completion. Reads run up
// to `read_ahead` sub-groups ahead of the one computing, writes up to `write_behind` in flight,
// both further limited by free buffers: with B buffers the depths that can actually overlap are
// read_ahead + 1 + write_behind <= B. DeepSpeed's pipeline is one deep each way; here depth is a
// parameter.
//
// Lifecycle: Run issues async reads and writes through the callbacks and computes on the calling
// thread, in order. It sleeps on a condition variable while waiting (no spinning). On the first
// error (a stage returning non-OK, or a `done` called with an error) it stops issuing, waits for
// everything outstanding, and returns that error naming the sub-group; no callback of that run
// fires after Run returns.
//
// Thread safety: one Run at a time per StepPipeline; `done` may be called from any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

#include "strata/status.h"

namespace strata::sched {

struct PipelineOptions {
  uint32_t read_ahead = 2;    // sub-groups read ahead of the compute (0 = read just in time)
  uint32_t write_behind = 2;  // writes in flight behind the compute (0 = write synchronously)
  uint32_t buffers = 5;       // buffer slots (>= 1); the caller owns buffers [0, buffers)
};

// Must be called exactly once per started stage, from any thread.
using StageDone = std::function<void(Status)>;

struct PipelineStages {
  // Starts reading sub-group `index` into buffer `slot`. Returns non-OK if it could not start
  // (then `done` must not be called).
  std::function<Status(size_t index, uint32_t slot, StageDone done)> read;
  // Computes sub-group `index` in buffer `slot`; runs on the calling thread, in index order.
  std::function<Status(size_t index, uint32_t slot)> compute;
  // Starts writing sub-group `index` from buffer `slot` (same contract as read).
  std::function<Status(size_t index, uint32_t slot, StageDone done)> write;
};

struct PipelineStats {
  uint64_t total_ns = 0;
  uint64_t compute_ns = 0;
  uint64_t wait_read_ns = 0;   // compute waited for its input
  uint64_t wait_write_ns = 0;  // waited for a write (depth or buffer)
  uint32_t max_reads_in_flight = 0;
  uint32_t max_writes_in_flight = 0;
};

class StepPipeline {
 public:
  explicit StepPipeline(const PipelineOptions& options) : options_(options) {}

  // InvalidArgument when buffers == 0 or a stage is empty.
  Status Run(size_t count, const PipelineStages& stages, PipelineStats* stats = nullptr);

 private:
  PipelineOptions options_;
};

}  // namespace strata::sched
