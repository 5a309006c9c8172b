// IoProgress: the one place that decides what a raw kernel result means for a request.
//
// Every backend (io_uring, posix, simulated) issues a request as one or more raw transfers and
// feeds each raw result (bytes >= 0 or -errno, as io_uring's cqe->res) to Advance(), which says
// whether the request is done, must be re-issued for its remaining bytes, or failed:
//   -EINTR / -EAGAIN        re-issue the same remainder (bounded by kMaxIoRetries in a row);
//                           EAGAIN is re-issued after a backoff (RetryBackoffNs), not at once;
//   0 < res < remaining     short transfer: re-issue the rest. Progress resets the retry count,
//                           so a slow but moving transfer never runs out of retries. On an
//                           O_DIRECT file a short count that is not a multiple of 4096 is
//                           IOError naming the count (the rest could not be issued aligned);
//   res == 0 on a read      Corruption: the extent lies beyond end of file;
//   res == 0 on a write     IOError: the device made no progress;
//   other negative          IOError(errno) naming the operation, file and offset.
// Thread safety: a value type; one owner at a time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "strata/io.h"
#include "strata/status.h"

namespace strata::nvme {

// Re-issues allowed per request without progress in between (EINTR/EAGAIN, or short transfers
// that each moved nothing new) before it fails as IOError. Any byte transferred resets the count.
inline constexpr int kMaxIoRetries = 64;

// How long to wait before re-issuing a request that got -EAGAIN for the `retries`-th time in a
// row: 50 us doubling up to 6.4 ms, so 64 retries span about 0.4 s instead of microseconds.
inline constexpr uint64_t RetryBackoffNs(int retries) {
  return uint64_t{50'000} << (retries < 1 ? 0 : (retries > 8 ? 7 : retries - 1));
}

struct IoProgress {
  IoRequest request;
  size_t done_bytes = 0;
  int retries = 0;               // re-issues in a row without progress
  bool last_was_eagain = false;  // the last Advance re-issued after -EAGAIN (back off first)

  enum class Next { kDone, kReissue, kFailed };

  // The remainder to issue next.
  uint64_t next_offset() const { return request.offset + done_bytes; }
  void* next_buffer() const { return static_cast<char*>(request.buffer) + done_bytes; }
  size_t remaining_bytes() const { return request.length_bytes - done_bytes; }

  // Applies one raw result; on kFailed, *error is set. `file` names the file in messages.
  Next Advance(int64_t res, const std::string& file, Status* error);

  // The completion for a request that reached kDone or kFailed.
  IoCompletion Complete(Status status) const {
    return IoCompletion{request.user_data, std::move(status), done_bytes};
  }
};

}  // namespace strata::nvme
