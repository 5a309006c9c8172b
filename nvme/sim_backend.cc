#include "nvme/sim_backend.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

namespace strata::nvme {

SimBackend::SimBackend(const SimOptions& options)
    : options_(options), rng_(options.seed), slots_(options.queue_depth) {
  if (options_.max_latency_ns < options_.min_latency_ns) {
    options_.max_latency_ns = options_.min_latency_ns;
  }
  note_ = "simulated backend, seed " + std::to_string(options_.seed);
}

SimBackend::~SimBackend() {
  // Drain so every buffer the caller lent is released in a known state.
  std::vector<IoCompletion> sink(std::max<size_t>(1, options_.queue_depth));
  while (inflight_ > 0) {
    if (!Reap(sink, 1).ok()) break;
  }
}

void SimBackend::InjectFault(IoOp op, SimFault fault, int count, int fd) {
  std::lock_guard<std::mutex> lock(scripted_mu_);
  scripted_.push_back(Scripted{op, fault, count, fd});
}

void SimBackend::InjectAllocateFault(int err, int count, int skip) {
  allocate_errno_ = err;
  allocate_faults_ = count;
  allocate_skip_ = skip;
}

Status SimBackend::Allocate(int fd, uint64_t length_bytes) {
  if (allocate_skip_ > 0) {
    --allocate_skip_;
  } else if (allocate_faults_ > 0) {
    --allocate_faults_;
    ++faults_injected_;
    return AllocateError(fd, length_bytes, allocate_errno_);
  }
  return IoBackend::Allocate(fd, length_bytes);
}

Status SimBackend::Submit(std::span<const IoRequest> batch) {
  for (const IoRequest& r : batch) STRATA_RETURN_IF_ERROR(ValidateRequest(r));
  if (inflight_ + batch.size() > options_.queue_depth) {
    return Status::ResourceExhausted("simulated backend: " + std::to_string(inflight_) +
                                     " in flight + " + std::to_string(batch.size()) +
                                     " submitted > queue depth " +
                                     std::to_string(options_.queue_depth));
  }
  size_t next_free = 0;
  for (const IoRequest& r : batch) {
    while (slots_[next_free].used) ++next_free;
    slots_[next_free].used = true;
    slots_[next_free].progress = IoProgress{r};
    Schedule(next_free);
  }
  inflight_ += batch.size();
  return Status::OK();
}

void SimBackend::Schedule(size_t slot) {
  std::uniform_int_distribution<uint64_t> lat(options_.min_latency_ns, options_.max_latency_ns);
  events_.push(Event{now_ns_ + lat(rng_), seq_++, slot});
}

SimFault SimBackend::PickFault(const IoRequest& r) {
  {
    std::lock_guard<std::mutex> lock(scripted_mu_);
    for (auto it = scripted_.begin(); it != scripted_.end(); ++it) {
      if (it->op != r.op || (it->fd >= 0 && it->fd != r.fd)) continue;
      SimFault f = it->fault;
      if (--it->count <= 0) scripted_.erase(it);
      return f;
    }
  }
  double u = std::uniform_real_distribution<double>(0.0, 1.0)(rng_);
  const double p[] = {options_.p_eio,   options_.p_enospc, options_.p_short,    options_.p_torn,
                      options_.p_eintr, options_.p_eagain, options_.p_zero_read};
  const SimFault f[] = {SimFault::kEio,   SimFault::kEnospc, SimFault::kShort,   SimFault::kTorn,
                        SimFault::kEintr, SimFault::kEagain, SimFault::kZeroRead};
  double acc = 0;
  for (int i = 0; i < 7; ++i) {
    acc += p[i];
    if (u < acc) return f[i] == SimFault::kZeroRead && r.op != IoOp::kRead ? SimFault::kNone : f[i];
  }
  return SimFault::kNone;
}

// One raw transfer of the request's remainder, shaped by `fault`; returns bytes or -errno.
int64_t SimBackend::Transfer(const IoProgress& p, SimFault fault) {
  const IoRequest& r = p.request;
  size_t len = p.remaining_bytes();
  switch (fault) {
    case SimFault::kEio:
      return -EIO;
    case SimFault::kEnospc:
      return -ENOSPC;
    case SimFault::kEintr:
      return -EINTR;
    case SimFault::kEagain:
      return -EAGAIN;
    case SimFault::kZeroRead:
      if (r.op == IoOp::kRead) return 0;
      break;
    case SimFault::kShort:
      if (len > kIoAlignment) len = (len / 2 + kIoAlignment - 1) / kIoAlignment * kIoAlignment;
      if (len >= p.remaining_bytes()) len = p.remaining_bytes() - kIoAlignment;
      if (len == 0) len = p.remaining_bytes();
      break;
    case SimFault::kTorn:
    case SimFault::kLost:
      if (r.op == IoOp::kWrite) {
        // Old contents with the first half of the new bytes over them: what a power cut mid-write
        // leaves behind. Read-modify-write through an aligned bounce buffer (O_DIRECT fds).
        size_t n = p.remaining_bytes();
        std::unique_ptr<char, decltype(&std::free)> bounce(
            static_cast<char*>(std::aligned_alloc(kIoAlignment, n)), &std::free);
        ssize_t got = pread(r.fd, bounce.get(), n, static_cast<off_t>(p.next_offset()));
        if (got < 0 && errno == EBADF) {
          // A write-only descriptor: read the old contents through another one of the same file.
          const std::string self = "/proc/self/fd/" + std::to_string(r.fd);
          const int rfd = ::open(self.c_str(), O_RDONLY | O_CLOEXEC);
          if (rfd < 0) return -errno;
          got = pread(rfd, bounce.get(), n, static_cast<off_t>(p.next_offset()));
          const int err = errno;
          ::close(rfd);
          errno = err;
        }
        if (got < 0) return -errno;
        if (static_cast<size_t>(got) < n) std::memset(bounce.get() + got, 0, n - got);
        std::memcpy(bounce.get(), p.next_buffer(), n / 2);
        if (pwrite(r.fd, bounce.get(), n, static_cast<off_t>(p.next_offset())) < 0) return -errno;
        return fault == SimFault::kLost ? static_cast<int64_t>(n) : -EIO;
      }
      break;
    case SimFault::kNone:
      break;
  }
  ssize_t res = r.op == IoOp::kRead
                    ? pread(r.fd, p.next_buffer(), len, static_cast<off_t>(p.next_offset()))
                    : pwrite(r.fd, p.next_buffer(), len, static_cast<off_t>(p.next_offset()));
  return res < 0 ? -errno : res;
}

void SimBackend::Finish(size_t slot_index) {
  Slot& slot = slots_[slot_index];
  SimFault fault = PickFault(slot.progress.request);
  if (fault != SimFault::kNone) ++faults_injected_;
  int64_t res = Transfer(slot.progress, fault);
  Status error;
  switch (slot.progress.Advance(res, FileName(slot.progress.request.fd), &error)) {
    case IoProgress::Next::kReissue:
      ++reissues_;
      Schedule(slot_index);
      return;
    case IoProgress::Next::kDone:
      ready_.push_back(slot.progress.Complete(Status::OK()));
      break;
    case IoProgress::Next::kFailed:
      ready_.push_back(slot.progress.Complete(std::move(error)));
      break;
  }
  slot.used = false;
}

Result<size_t> SimBackend::Reap(std::span<IoCompletion> out, size_t min_complete) {
  size_t want = std::min(min_complete, inflight_);
  // Polling advances virtual time a little, so a poll-only caller still makes progress.
  if (want == 0) now_ns_ += options_.min_latency_ns;
  while (!events_.empty() && (ready_.size() < want || events_.top().at_ns <= now_ns_)) {
    Event e = events_.top();
    events_.pop();
    now_ns_ = std::max(now_ns_, e.at_ns);
    Finish(e.slot);
  }
  size_t n = std::min(out.size(), ready_.size());
  for (size_t i = 0; i < n; ++i) {
    out[i] = std::move(ready_.front());
    ready_.pop_front();
  }
  inflight_ -= n;
  return n;
}

}  // namespace strata::nvme
