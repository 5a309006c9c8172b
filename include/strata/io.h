// IoBackend: the one door through which strata reads and writes files (swap space, checkpoints).
//
// A backend accepts batches of aligned reads and writes, each tagged with caller-chosen
// `user_data`, and hands back one IoCompletion per request, in whatever order the device finished
// them. Every request ends in exactly one completion: OK with all of its bytes transferred, or a
// Status naming the operation, the file, the offset and errno. Short transfers, EINTR and EAGAIN
// are retried inside the backend (bounded); callers never see a partial success.
//
// Implementations (nvme/): io_uring (liburing, O_DIRECT, registered buffers and files), a posix
// fallback (pread/pwrite on worker threads) for kernels or sandboxes that refuse io_uring, and a
// simulated backend (seeded PRNG, virtual clock, reordered completions, injected faults) that
// every test can use. `OpenIoBackend` picks one; `Execute`, `Read` and `Write` are the
// synchronous default built on Submit/Reap, so wrappers and fakes stay simple.
//
// Alignment: offset, length and buffer address of every request are multiples of kIoAlignment
// (O_DIRECT's rule on the filesystems strata targets). A misaligned request is InvalidArgument.
//
// Thread safety: an IoBackend is NOT thread-safe. One thread at a time calls Submit/Reap/
// Execute/Register*; the owner serializes (the posix backend's workers are internal). Buffers
// and file descriptors named by a request must stay valid until its completion is reaped, and a
// backend must not be destroyed with IO in flight (its destructor drains what is in flight).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>

#include "strata/status.h"

namespace strata {

// Alignment of every request's offset, length and buffer address, in bytes.
inline constexpr size_t kIoAlignment = 4096;

enum class IoOp : uint8_t { kRead, kWrite };

std::string_view IoOpName(IoOp op) noexcept;

struct IoRequest {
  IoOp op = IoOp::kRead;
  // An open file descriptor (typically O_DIRECT). Owned by the caller; it stays open until the
  // request's completion has been reaped. Register it (RegisterFile) so errors name the path and
  // io_uring can use a fixed file slot.
  int fd = -1;
  // Byte offset in the file; a multiple of kIoAlignment.
  uint64_t offset = 0;
  // Caller-owned memory of length_bytes; address a multiple of kIoAlignment. Written by reads,
  // read by writes; untouched by the caller until the completion is reaped.
  void* buffer = nullptr;
  // Bytes to transfer: > 0 and a multiple of kIoAlignment.
  size_t length_bytes = 0;
  // Returned unchanged in the completion; the backend never interprets it.
  uint64_t user_data = 0;
};

struct IoCompletion {
  uint64_t user_data = 0;
  // OK: exactly length_bytes transferred. IOError: errno, operation, file and offset in the
  // message (ENOSPC on a full disk). Corruption: a read hit end of file inside the extent (a
  // zero-length read of a known extent). InvalidArgument: the request was malformed.
  Status status;
  // Bytes transferred before the outcome was decided (== length_bytes when OK).
  size_t bytes_transferred = 0;
};

enum class IoBackendKind : uint8_t {
  kAuto,       // io_uring when the kernel allows it, otherwise posix (with a one-line reason)
  kIoUring,    // io_uring or Unavailable
  kPosix,      // pread/pwrite on worker threads
  kSimulated,  // nvme/sim_backend.h: deterministic faults for tests (real IO on the fds)
};

std::string_view IoBackendKindName(IoBackendKind kind) noexcept;

struct IoBackendOptions {
  IoBackendKind kind = IoBackendKind::kAuto;
  // Most requests in flight at once (the ring / slot slab size). Default 32: deep enough for 1 MiB
  // O_DIRECT IO to saturate a typical NVMe or virtio disk; more costs memory and latency, less
  // bandwidth.
  size_t queue_depth = 32;
  // io_uring: set IORING_SETUP_SINGLE_ISSUER|DEFER_TASKRUN. Cheaper completions, but REQUIRES
  // that the thread creating the backend is the only one ever calling it. Default off, because
  // owners often create a backend on one thread and drive it from an IO thread.
  bool single_issuer = false;
  // io_uring: a kernel polling thread (SQPOLL). Burns a whole core: off by default.
  bool sqpoll = false;
  // io_uring: fixed-file and fixed-buffer tables, so RegisterFile/RegisterBuffer avoid per-IO
  // reference counting and page pinning. Degrades to plain IO (with a note) when refused.
  bool register_files_and_buffers = true;
  // posix: worker threads doing pread/pwrite (each handles one request at a time).
  size_t posix_threads = 4;
};

class IoBackend {
 public:
  virtual ~IoBackend() = default;
  IoBackend(const IoBackend&) = delete;
  IoBackend& operator=(const IoBackend&) = delete;

  virtual IoBackendKind kind() const noexcept = 0;
  // Most requests in flight at once.
  virtual size_t queue_depth() const noexcept = 0;
  // Requests submitted whose completions have not been reaped yet.
  virtual size_t inflight() const noexcept = 0;
  // One line saying how the backend was set up and what it degraded from (e.g. "io_uring refused
  // (...); posix with 4 threads", "buffer registration refused: ..."). Empty when nothing to say.
  virtual std::string note() const { return note_; }

  // Queues every request of `batch` and starts them. All or nothing: on a non-OK return nothing
  // was queued. InvalidArgument: a request is misaligned or empty (names which).
  // ResourceExhausted: inflight() + batch.size() > queue_depth(); reap first.
  virtual Status Submit(std::span<const IoRequest> batch) = 0;

  // Moves up to out.size() completions into `out`, blocking until at least
  // min(min_complete, inflight()) are available. Returns how many were written. Each submitted
  // request yields exactly one completion, in completion order (not submission order).
  virtual Result<size_t> Reap(std::span<IoCompletion> out, size_t min_complete) = 0;

  // Names `fd` as `path` in error messages and, where supported, puts it in a fixed-file slot.
  // The caller keeps owning fd. REQUIRES: UnregisterFile(fd) before closing it.
  virtual Status RegisterFile(int fd, std::string_view path);
  virtual void UnregisterFile(int fd);

  // Registers [base, base+size_bytes) for zero-pin IO (io_uring fixed buffers); requests whose
  // buffer lies inside it use it automatically. Unavailable: this backend has no such facility
  // or the kernel refused (callers carry on unregistered). ResourceExhausted: the table is full.
  // REQUIRES: UnregisterBuffer(base) with no IO in flight on it before the memory is freed.
  virtual Status RegisterBuffer(void* base, size_t size_bytes);
  virtual void UnregisterBuffer(void* base);

  // Reserves the first length_bytes of `fd` on disk (posix_fallocate), so that a disk too small
  // fails here, before any IO, rather than in the middle of a write. IOError with errno (ENOSPC:
  // the disk is full) naming the file and the bytes. The simulated backend injects failures here.
  virtual Status Allocate(int fd, uint64_t length_bytes);

  // Synchronous default: submits `batch` (keeping up to queue_depth in flight) and waits for all
  // of it. Returns OK, or the first failed request's Status; after a failure no further request
  // is issued, and the call returns only once nothing is in flight (buffers are free again).
  // FailedPrecondition: called with other IO in flight (its completions would be swallowed).
  Status Execute(std::span<const IoRequest> batch);
  Status Read(int fd, uint64_t offset, void* buffer, size_t length_bytes);
  Status Write(int fd, uint64_t offset, const void* buffer, size_t length_bytes);

  // "the path given to RegisterFile" or "fd N".
  std::string FileName(int fd) const;

 protected:
  IoBackend() = default;
  // Checks alignment and sizes of one request: InvalidArgument naming the problem, else OK.
  Status ValidateRequest(const IoRequest& r) const;
  // Allocate's error for errno `err`.
  Status AllocateError(int fd, uint64_t length_bytes, int err) const;

  std::string note_;
  std::unordered_map<int, std::string> file_names_;
};

// Opens the backend named by options.kind (kAuto: io_uring, falling back to posix with the reason
// in note()). InvalidArgument: queue_depth or posix_threads is 0 or queue_depth > 4096.
// Unavailable: kIoUring requested and the kernel refused it.
Result<std::unique_ptr<IoBackend>> OpenIoBackend(const IoBackendOptions& options);

}  // namespace strata
