#include "nvme/io_progress.h"

#include <fcntl.h>

#include <cerrno>
#include <string>

namespace strata::nvme {

namespace {
std::string Where(const IoProgress& p, const std::string& file) {
  std::string s(IoOpName(p.request.op));
  s += " '" + file + "' offset " + std::to_string(p.next_offset()) + " length " +
       std::to_string(p.remaining_bytes());
  return s;
}
}  // namespace

IoProgress::Next IoProgress::Advance(int64_t res, const std::string& file, Status* error) {
  last_was_eagain = res == -EAGAIN;
  if (res > 0 && static_cast<size_t>(res) < remaining_bytes()) {
    if (res % static_cast<int64_t>(kIoAlignment) != 0) {
      // O_DIRECT cannot issue the rest from an unaligned offset (it would fail later as a
      // confusing EINVAL). Buffered files can: only those continue.
      const int flags = fcntl(request.fd, F_GETFL);
      if (flags < 0 || (flags & O_DIRECT) != 0) {
        *error = Status::IOError(Where(*this, file) + ": short transfer of " + std::to_string(res) +
                                 " bytes, not a multiple of 4096 (O_DIRECT cannot continue)");
        return Next::kFailed;
      }
    }
    done_bytes += static_cast<size_t>(res);
    retries = 0;  // progress: a new budget for the rest
    return Next::kReissue;
  }
  if (res == -EINTR || res == -EAGAIN) {
    if (++retries > kMaxIoRetries) {
      *error = Status::IOError(
          Where(*this, file) + ": gave up after " + std::to_string(kMaxIoRetries) +
          " retries in a row without progress (" + (res == -EAGAIN ? "EAGAIN" : "EINTR") + ")");
      return Next::kFailed;
    }
    return Next::kReissue;
  }
  if (res < 0) {
    *error = Status::FromErrno(static_cast<int>(-res), Where(*this, file));
    return Next::kFailed;
  }
  if (res == 0) {
    if (request.op == IoOp::kRead) {
      *error = Status::Corruption(Where(*this, file) +
                                  ": zero-length read (extent lies beyond end of file)");
    } else {
      *error = Status::IOError(Where(*this, file) + ": write made no progress (returned 0)");
    }
    return Next::kFailed;
  }
  if (static_cast<size_t>(res) > remaining_bytes()) {
    *error = Status::Internal(Where(*this, file) + ": kernel reported " + std::to_string(res) +
                              " bytes, more than requested");
    return Next::kFailed;
  }
  done_bytes += static_cast<size_t>(res);
  return Next::kDone;
}

}  // namespace strata::nvme
