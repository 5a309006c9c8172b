// UringBackend: the IoBackend on io_uring (liburing), the fast path for O_DIRECT swap IO.
//
// A fixed slab of queue_depth request slots; a request's slot index is its SQE user_data. Files
// and buffers may be registered (sparse fixed-file and fixed-buffer tables); a request whose
// buffer lies inside a registered buffer is issued as READ_FIXED/WRITE_FIXED, one on a
// registered fd with IOSQE_FIXED_FILE. Registration the kernel refuses (RLIMIT_MEMLOCK) leaves
// the backend working on plain SQEs, with the reason in note().
//
// Lifecycle and errors (Reap): CQEs are drained into IoProgress, which decides per raw result:
// -EINTR/-EAGAIN and short transfers re-issue the remainder on the same slot (bounded retries),
// other errors complete the request with IOError(errno, file, offset), a zero-length read is
// Corruption. A slot is freed only when its completion is queued for the caller, so at most
// queue_depth completions are ever buffered. Re-issued SQEs are submitted before Reap returns.
// The destructor waits for every request in flight before it closes the ring: the kernel never
// writes into a buffer the caller has been told is free.
//
// Thread safety: as IoBackend. With options.single_issuer (SINGLE_ISSUER|DEFER_TASKRUN) only
// the creating thread may call it at all.
#pragma once

#include <liburing.h>

#include <deque>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "nvme/io_progress.h"
#include "strata/io.h"

namespace strata::nvme {

class UringBackend final : public IoBackend {
 public:
  // Unavailable: the kernel refused io_uring_setup (errno in the message).
  static Result<std::unique_ptr<UringBackend>> Open(const IoBackendOptions& options);
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
  UringBackend() = default;
  void Prep(size_t slot);  // prepares the slot's remainder as one SQE
  io_uring_sqe* GetSqe();
  Status DrainCqes();
  void AddNote(const std::string& line);

  io_uring ring_{};
  bool ring_open_ = false;
  unsigned setup_flags_ = 0;
  std::vector<Slot> slots_;
  std::vector<size_t> free_slots_;
  std::deque<IoCompletion> ready_;
  size_t inflight_ = 0;
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
