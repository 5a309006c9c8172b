// IoBackend's shared parts: names, validation, file names, preallocation and the synchronous
// default.
#include <fcntl.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "nvme/io_drain.h"
#include "strata/io.h"

namespace strata {

std::string_view IoOpName(IoOp op) noexcept { return op == IoOp::kRead ? "read" : "write"; }

std::string_view IoBackendKindName(IoBackendKind kind) noexcept {
  switch (kind) {
    case IoBackendKind::kAuto:
      return "auto";
    case IoBackendKind::kIoUring:
      return "io_uring";
    case IoBackendKind::kPosix:
      return "posix";
    case IoBackendKind::kSimulated:
      return "simulated";
  }
  return "unknown";
}

Status IoBackend::RegisterFile(int fd, std::string_view path) {
  if (fd < 0) return Status::InvalidArgument("RegisterFile: negative fd " + std::to_string(fd));
  file_names_[fd] = std::string(path);
  return Status::OK();
}

void IoBackend::UnregisterFile(int fd) { file_names_.erase(fd); }

Status IoBackend::RegisterBuffer(void* base, size_t size_bytes) {
  return Status::Unavailable(std::string(IoBackendKindName(kind())) +
                             " backend has no registered buffers");
}

void IoBackend::UnregisterBuffer(void* base) {}

std::string IoBackend::FileName(int fd) const {
  auto it = file_names_.find(fd);
  if (it != file_names_.end()) return it->second;
  return "fd " + std::to_string(fd);
}

Status IoBackend::Allocate(int fd, uint64_t length_bytes) {
  if (length_bytes == 0) return Status::OK();
  const int err = posix_fallocate(fd, 0, static_cast<off_t>(length_bytes));
  return err == 0 ? Status::OK() : AllocateError(fd, length_bytes, err);
}

Status IoBackend::AllocateError(int fd, uint64_t length_bytes, int err) const {
  return Status::FromErrno(err, "preallocate " + std::to_string(length_bytes) + " bytes for",
                           FileName(fd));
}

Status IoBackend::ValidateRequest(const IoRequest& r) const {
  auto bad = [&](const char* what) {
    return Status::InvalidArgument(std::string(IoOpName(r.op)) + " '" + FileName(r.fd) +
                                   "' offset " + std::to_string(r.offset) + " length " +
                                   std::to_string(r.length_bytes) + ": " + what);
  };
  if (r.fd < 0) return bad("negative file descriptor");
  if (r.buffer == nullptr) return bad("null buffer");
  if (r.length_bytes == 0) return bad("zero length");
  if (r.length_bytes % kIoAlignment != 0) return bad("length is not a multiple of 4096");
  if (r.offset % kIoAlignment != 0) return bad("offset is not a multiple of 4096");
  if (reinterpret_cast<uintptr_t>(r.buffer) % kIoAlignment != 0) {
    return bad("buffer address is not 4096-aligned");
  }
  return Status::OK();
}

// Keeps the queue full: submits while slots are free, reaps at least one when none are, and
// remembers the first failure while letting every submitted request finish (buffers stay valid
// for the caller only once nothing is in flight).
Status IoBackend::Execute(std::span<const IoRequest> batch) {
  if (inflight() != 0) {
    return Status::FailedPrecondition("IoBackend::Execute called with " +
                                      std::to_string(inflight()) + " requests in flight");
  }
  Status first_error;
  std::vector<IoCompletion> done(queue_depth());
  size_t next = 0;
  while (next < batch.size() || inflight() > 0) {
    if (next < batch.size() && first_error.ok()) {
      size_t room = queue_depth() - inflight();
      size_t n = std::min(room, batch.size() - next);
      if (n > 0) {
        Status s = Submit(batch.subspan(next, n));
        if (!s.ok()) {
          if (first_error.ok()) first_error = s;
          next = batch.size();
        } else {
          next += n;
          continue;
        }
      }
    } else if (!first_error.ok()) {
      next = batch.size();  // stop issuing after a failure; drain what runs
    }
    if (inflight() == 0) break;
    Result<size_t> got = Reap(done, 1);
    if (!got.ok()) {
      // The requests in flight still own the caller's buffers: wait them out before returning.
      if (first_error.ok()) first_error = got.status();
      if (!nvme::DrainInflight(*this, done, &first_error)) {
        return first_error.WithContext("IoBackend::Execute could not drain " +
                                       std::to_string(inflight()) +
                                       " requests in flight; their buffers must not be freed");
      }
      break;
    }
    for (size_t i = 0; i < *got; ++i) {
      if (!done[i].status.ok() && first_error.ok()) first_error = done[i].status;
    }
  }
  return first_error;
}

Status IoBackend::Read(int fd, uint64_t offset, void* buffer, size_t length_bytes) {
  IoRequest r{IoOp::kRead, fd, offset, buffer, length_bytes, 0};
  return Execute(std::span<const IoRequest>(&r, 1));
}

Status IoBackend::Write(int fd, uint64_t offset, const void* buffer, size_t length_bytes) {
  IoRequest r{IoOp::kWrite, fd, offset, const_cast<void*>(buffer), length_bytes, 0};
  return Execute(std::span<const IoRequest>(&r, 1));
}

}  // namespace strata
