// UringBackend: the IoBackend on io_uring (liburing), the fast path for O_DIRECT swap IO.
//
// A fixed slab of queue_depth request slots; a request's slot index is its SQE user_data. Files
// and buffers may be registered (sparse fixed-file and fixed-buffer tables); a request whose
// buffer lies inside a registered buffer is issued as READ_FIXED/WRITE_FIXED, one on a
// registered fd with IOSQE_FIXED_FILE. Registration the kernel refuses (RLIMIT_MEMLOCK) leaves
// the backend working on plain SQEs, with the reason in note().
//
// Lifecycle and errors (Reap): CQEs are drained into IoProgress, which decides per raw result:
// -EINTR and short transfers re-issue the remainder on the same slot (bounded retries); -EAGAIN
// parks the slot until another completion arrives or its backoff (RetryBackoffNs) has passed, so
// a busy device is not hammered within one drain; other errors complete the request with
// IOError(errno, file, offset), a zero-length read is Corruption. A slot is freed only when its
// completion is queued for the caller, so at most queue_depth completions are ever buffered.
// Re-issued SQEs are submitted before Reap returns.
//
// Submit is all or nothing: when io_uring_submit fails hard (-ENOMEM, -EEXIST from a
// single-issuer ring driven by another thread) the batch's SQEs are taken back out of the SQ
// ring before the kernel saw them and their slots are freed, so nothing of the batch is issued
// later. (-EAGAIN/-EBUSY/-EINTR leave the SQEs queued and the batch accepted; Reap sends them.)
// The destructor waits for every request in flight before it closes the ring (DrainInflight):
// the kernel never writes into a buffer the caller has been told is free. If the ring cannot be
// driven at all any more it is leaked, not closed, with a line on stderr.
//
// Thread safety: as IoBackend. With options.single_issuer (SINGLE_ISSUER|DEFER_TASKRUN) only
// the creating thread may call it at all.
#pragma once

#include <liburing.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "nvme/bounded_queue.h"
#include "nvme/io_progress.h"
#include "strata/io.h"

namespace strata::nvme {

// The kernel's answers as the backend sees them, rewritten: a fault-injection layer handed to
// Open (as leveldb's fault-injection Env is handed to a DB), for tests that drive the real ring
// into errors it cannot be made to give on demand. Every member is optional; the caller keeps a
// handle and may change them between calls to the backend (not during one).
struct UringFaults {
  // Rewrites a CQE's raw result before IoProgress sees it (-EAGAIN, -EINTR, a short count, a hard
  // error). `done_bytes` is how much of the request had completed before this CQE.
  std::function<int(const IoRequest& request, size_t done_bytes, int res)> cqe_res = nullptr;
  // Consulted before each io_uring_submit in Submit; a negative errno is used as that submit's
  // result instead of entering the kernel, with the SQEs published to the ring exactly as a
  // failed io_uring_enter leaves them.
  std::function<int()> submit_result = nullptr;
  // Consulted before each kernel entry in Reap; a negative errno fails that entry.
  std::function<int()> enter_result = nullptr;
  // Called right before io_uring_queue_exit with the number of requests still in flight.
  std::function<void(size_t inflight)> before_queue_exit = nullptr;
};

class UringBackend final : public IoBackend {
 public:
  // Unavailable: the kernel refused io_uring_setup (errno in the message). `faults` (may be null)
  // rewrites what the kernel answers (UringFaults).
  static Result<std::unique_ptr<UringBackend>> Open(const IoBackendOptions& options,
                                                    std::shared_ptr<UringFaults> faults = nullptr);
  ~UringBackend() override;

  IoBackendKind kind() const noexcept override { return IoBackendKind::kIoUring; }
  size_t queue_depth() const noexcept override { return slots_.size(); }
  size_t inflight() const noexcept override { return inflight_; }
  Status Submit(std::span<const IoRequest> batch) override;
  Result<size_t> Reap(std::span<IoCompletion> out, size_t min_complete) override;
  Status RegisterFile(int fd, std::string_view path) override;
  void UnregisterFile(int fd) override;
  Status RegisterBuffer(void* base, size_t size_bytes) override;
  void UnregisterBuffer(void* base) override;

  // Ring setup flags in effect (for the bench report).
  unsigned setup_flags() const noexcept { return setup_flags_; }
  size_t registered_buffers() const noexcept { return buffers_.size(); }

 private:
  struct Slot {
    IoProgress progress;
    bool used = false;
  };
  struct RegisteredBuffer {
    size_t size_bytes;
    unsigned index;
    uintptr_t group_base;  // the base passed to RegisterBuffer (>1 GiB buffers have pieces)
  };
  struct Deferred {  // a slot parked after -EAGAIN
    size_t slot;
    uint64_t not_before_ns;
  };
  UringBackend() = default;
  void Prep(size_t slot);  // prepares the slot's remainder as one SQE
  io_uring_sqe* GetSqe();
  // Handles every CQE present; returns how many were not a new EAGAIN (progress of some kind).
  // Internal: a CQE for no slot.
  Result<size_t> DrainCqes();
  // Re-issues the first `first_n` parked slots and any other whose backoff has passed.
  void ReissueDeferred(size_t first_n);
  // Enters the kernel: submits prepared SQEs and waits for `wait_nr` completions.
  Status Enter(unsigned wait_nr);
  // Takes the last `n` SQEs back out of the SQ ring after a failed submit. False when the kernel
  // may already have consumed them (SQPOLL).
  bool RetractSqes(unsigned n);
  void AddNote(const std::string& line);

  io_uring ring_{};
  bool ring_open_ = false;
  unsigned setup_flags_ = 0;
  std::vector<Slot> slots_;
  std::vector<size_t> free_slots_;
  BoundedQueue<IoCompletion> ready_;
  std::vector<Deferred> deferred_;  // capacity queue_depth, reserved at Open
  size_t inflight_ = 0;
  size_t in_kernel_ = 0;  // SQEs prepared or submitted whose CQE has not been handled
  std::shared_ptr<UringFaults> faults_;  // may be null
  // Fixed files: fd -> table index; free indices.
  bool files_registered_ = false;
  std::unordered_map<int, unsigned> fixed_files_;
  std::vector<unsigned> free_file_slots_;
  // Fixed buffers: base address -> (size, table index); free indices.
  bool buffers_table_ = false;
  std::map<uintptr_t, RegisteredBuffer> buffers_;
  std::vector<unsigned> free_buffer_slots_;
};

}  // namespace strata::nvme
