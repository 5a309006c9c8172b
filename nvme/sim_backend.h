// SimBackend: a deterministic IoBackend for tests, with faults on demand.
//
// Requests do real pread/pwrite on their file descriptors (so data round-trips and files can be
// inspected or corrupted), but *when* each transfer finishes is decided by a virtual clock: every
// raw transfer gets a latency drawn from a seeded PRNG, so completions come back reordered, the
// same way for the same seed. Faults are injected per raw transfer, either scripted
// (InjectFault: "the next 2 writes to fd 7 fail with ENOSPC") or at random with per-kind
// probabilities; the raw results then go through the same IoProgress rules as io_uring's CQEs.
// Preallocation (Allocate) is real too, and can be failed on demand (InjectAllocateFault).
// A failing test should print seed() so the run can be replayed.
//
// Thread safety: as IoBackend (one caller at a time); no internal threads. InjectFault may also be
// called from another thread while IO runs (a test that faults a step running behind Step).
#pragma once

#include <cstdint>
#include <deque>
#include <mutex>
#include <queue>
#include <random>
#include <vector>

#include "nvme/io_progress.h"
#include "strata/io.h"

namespace strata::nvme {

enum class SimFault : uint8_t {
  kNone,
  kEio,       // -EIO, nothing transferred
  kEnospc,    // -ENOSPC, nothing transferred
  kShort,     // a 4 KiB-aligned prefix transferred, the rest re-issued (when length > 4 KiB)
  kTorn,      // write: the first half of the bytes land over the old contents, then -EIO
  kEintr,     // -EINTR, nothing transferred, re-issued
  kEagain,    // -EAGAIN, nothing transferred, re-issued
  kZeroRead,  // read returns 0 (as at end of file): Corruption
  kLost,      // write: the first half of the bytes land over the old contents, yet the write
              // reports success: a silent tear (a device that acknowledged what it did not keep).
              // Scripted only (InjectFault); only a later read or checksum can find it.
};

struct SimOptions {
  uint64_t seed = 1;
  size_t queue_depth = 32;
  // Virtual latency of each raw transfer, uniform in [min, max].
  uint64_t min_latency_ns = 10'000;
  uint64_t max_latency_ns = 500'000;
  // Probability that a raw transfer gets each fault (checked in this order; sum <= 1).
  double p_eio = 0, p_enospc = 0, p_short = 0, p_torn = 0, p_eintr = 0, p_eagain = 0,
         p_zero_read = 0;  // p_zero_read: reads only (a write picks kNone instead)
};

class SimBackend final : public IoBackend {
 public:
  explicit SimBackend(const SimOptions& options);
  ~SimBackend() override;

  IoBackendKind kind() const noexcept override { return IoBackendKind::kSimulated; }
  size_t queue_depth() const noexcept override { return options_.queue_depth; }
  size_t inflight() const noexcept override { return inflight_; }
  Status Submit(std::span<const IoRequest> batch) override;
  Result<size_t> Reap(std::span<IoCompletion> out, size_t min_complete) override;

  // The next `count` raw transfers of `op` (on `fd`, or any fd when fd < 0) get `fault`.
  // Scripted faults take precedence over random ones, first injected first used.
  void InjectFault(IoOp op, SimFault fault, int count = 1, int fd = -1);

  // After `skip` more Allocate calls succeed, the next `count` (any fd) fail with errno `err`
  // (e.g. ENOSPC: the disk filled up after a free-space check passed) and allocate nothing.
  void InjectAllocateFault(int err, int count = 1, int skip = 0);
  Status Allocate(int fd, uint64_t length_bytes) override;

  uint64_t seed() const noexcept { return options_.seed; }
  uint64_t now_ns() const noexcept { return now_ns_; }
  uint64_t faults_injected() const noexcept { return faults_injected_; }
  uint64_t reissues() const noexcept { return reissues_; }

 private:
  struct Slot {
    IoProgress progress;
    bool used = false;
  };
  struct Event {
    uint64_t at_ns;
    uint64_t seq;
    size_t slot;
    bool operator>(const Event& o) const {
      return at_ns != o.at_ns ? at_ns > o.at_ns : seq > o.seq;
    }
  };
  struct Scripted {
    IoOp op;
    SimFault fault;
    int count;
    int fd;
  };

  void Schedule(size_t slot);
  SimFault PickFault(const IoRequest& r);
  int64_t Transfer(const IoProgress& p, SimFault fault);
  void Finish(size_t slot_index);

  SimOptions options_;
  std::mt19937_64 rng_;
  std::vector<Slot> slots_;
  std::priority_queue<Event, std::vector<Event>, std::greater<Event>> events_;
  std::deque<IoCompletion> ready_;
  std::mutex scripted_mu_;  // InjectFault from a test's thread vs PickFault on the IO thread
  std::deque<Scripted> scripted_;
  size_t inflight_ = 0;
  uint64_t now_ns_ = 0;
  uint64_t seq_ = 0;
  uint64_t faults_injected_ = 0;
  uint64_t reissues_ = 0;
  int allocate_errno_ = 0;
  int allocate_faults_ = 0;
  int allocate_skip_ = 0;
};

}  // namespace strata::nvme
