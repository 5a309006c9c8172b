// PosixBackend: the fallback IoBackend, pread/pwrite on a fixed set of worker threads.
//
// Chosen when io_uring is unavailable (disabled by sysctl, filtered by seccomp, old kernel).
// Submit queues requests (bounded by queue_depth); each worker takes one, runs its raw transfers
// through IoProgress (EINTR/short IO re-issued, errors become IOError, zero-length reads
// Corruption) and posts exactly one completion; Reap waits for them.
//
// Thread safety: as IoBackend. The workers only touch the request queue, the completion queue
// (both under mu_) and the request's own buffer.
#pragma once

#include <condition_variable>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "nvme/io_progress.h"
#include "strata/io.h"

namespace strata::nvme {

class PosixBackend final : public IoBackend {
 public:
  PosixBackend(size_t queue_depth, size_t threads);
  ~PosixBackend() override;

  IoBackendKind kind() const noexcept override { return IoBackendKind::kPosix; }
  size_t queue_depth() const noexcept override { return queue_depth_; }
  size_t inflight() const noexcept override { return inflight_; }
  Status Submit(std::span<const IoRequest> batch) override;
  Result<size_t> Reap(std::span<IoCompletion> out, size_t min_complete) override;

  void set_note(std::string note) { note_ = std::move(note); }

 private:
  struct Work {
    IoProgress progress;
    std::string file;  // copied at submit: workers never read file_names_
  };
  void WorkerLoop();

  const size_t queue_depth_;
  size_t inflight_ = 0;  // owner thread only
  std::mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  std::deque<Work> queue_;         // guarded by mu_
  std::deque<IoCompletion> done_;  // guarded by mu_
  bool stop_ = false;              // guarded by mu_
  std::vector<std::thread> workers_;
};

}  // namespace strata::nvme
