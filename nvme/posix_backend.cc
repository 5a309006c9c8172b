#include "nvme/posix_backend.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>

namespace strata::nvme {

PosixBackend::PosixBackend(size_t queue_depth, size_t threads) : queue_depth_(queue_depth) {
  note_ = "posix backend (pread/pwrite on " + std::to_string(threads) + " threads)";
  workers_.reserve(threads);
  for (size_t i = 0; i < threads; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

PosixBackend::~PosixBackend() {
  {
    // Workers finish every queued request before they look at stop_, so buffers the caller lent
    // are never touched after the destructor returns.
    std::unique_lock<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (std::thread& t : workers_) t.join();
}

Status PosixBackend::Submit(std::span<const IoRequest> batch) {
  for (const IoRequest& r : batch) STRATA_RETURN_IF_ERROR(ValidateRequest(r));
  if (inflight_ + batch.size() > queue_depth_) {
    return Status::ResourceExhausted("posix backend: " + std::to_string(inflight_) +
                                     " in flight + " + std::to_string(batch.size()) +
                                     " submitted > queue depth " + std::to_string(queue_depth_));
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const IoRequest& r : batch) queue_.push_back(Work{IoProgress{r}, FileName(r.fd)});
  }
  inflight_ += batch.size();
  if (batch.size() == 1) {
    work_cv_.notify_one();
  } else {
    work_cv_.notify_all();
  }
  return Status::OK();
}

void PosixBackend::WorkerLoop() {
  for (;;) {
    Work w;
    {
      std::unique_lock<std::mutex> lock(mu_);
      work_cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and nothing left
      w = std::move(queue_.front());
      queue_.pop_front();
    }
    IoProgress& p = w.progress;
    Status error;
    IoProgress::Next next;
    do {
      const off_t off = static_cast<off_t>(p.next_offset());
      ssize_t res = p.request.op == IoOp::kRead
                        ? pread(p.request.fd, p.next_buffer(), p.remaining_bytes(), off)
                        : pwrite(p.request.fd, p.next_buffer(), p.remaining_bytes(), off);
      next = p.Advance(res < 0 ? -errno : res, w.file, &error);
      if (next == IoProgress::Next::kReissue && p.last_was_eagain) {
        std::this_thread::sleep_for(std::chrono::nanoseconds(RetryBackoffNs(p.retries)));
      }
    } while (next == IoProgress::Next::kReissue);
    IoCompletion c = p.Complete(next == IoProgress::Next::kDone ? Status::OK() : std::move(error));
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_.push_back(std::move(c));
    }
    done_cv_.notify_one();
  }
}

Result<size_t> PosixBackend::Reap(std::span<IoCompletion> out, size_t min_complete) {
  size_t want = std::min({min_complete, inflight_, out.size()});
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [&] { return done_.size() >= want; });
  size_t n = std::min(out.size(), done_.size());
  for (size_t i = 0; i < n; ++i) {
    out[i] = std::move(done_.front());
    done_.pop_front();
  }
  inflight_ -= n;
  return n;
}

}  // namespace strata::nvme
