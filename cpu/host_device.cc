// HostDevice: the CPU stand-in for a GPU (see include/strata/device.h).
//
// Lifecycle: each CopyDir has one Stream: a bounded FIFO of copies and one worker thread that pops
// a copy, runs memcpy (then sleeps out the simulated link time when a bandwidth is set), runs the
// copy's callback, and only then advances `completed_seq`, so an event or Synchronize that sees a
// sequence number complete also sees its callback done. Producers block (condition variable, no
// spinning) while the queue is full. Destruction drains both queues before joining.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "strata/device.h"

namespace strata {
namespace {

constexpr uint64_t kAlign = 4096;

struct Copy {
  void* dst;
  const void* src;
  uint64_t size_bytes;
  CopyCallback done;
};

class Stream {
 public:
  Stream(uint64_t bandwidth, uint32_t max_queued, std::function<void()> on_progress)
      : bandwidth_(bandwidth), max_queued_(max_queued), on_progress_(std::move(on_progress)) {
    worker_ = std::thread([this] { Run(); });
  }
  ~Stream() {
    {
      std::lock_guard<std::mutex> l(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }

  Status Push(Copy c) {
    std::unique_lock<std::mutex> l(mu_);
    if (std::this_thread::get_id() == worker_.get_id()) {
      return Status::FailedPrecondition("HostDevice: CopyAsync called from a completion callback");
    }
    cv_.wait(l, [&] { return queue_.size() < max_queued_; });
    queue_.push_back(std::move(c));
    ++issued_seq_;
    cv_.notify_all();
    return Status::OK();
  }

  uint64_t issued() {
    std::lock_guard<std::mutex> l(mu_);
    return issued_seq_;
  }
  bool Done(uint64_t seq) {
    std::lock_guard<std::mutex> l(mu_);
    return completed_seq_ >= seq;
  }
  bool WaitFor(uint64_t seq, std::chrono::nanoseconds timeout) {
    std::unique_lock<std::mutex> l(mu_);
    return cv_.wait_for(l, timeout, [&] { return completed_seq_ >= seq; });
  }
  void WaitForever(uint64_t seq) {
    std::unique_lock<std::mutex> l(mu_);
    cv_.wait(l, [&] { return completed_seq_ >= seq; });
  }
  bool on_worker() const { return std::this_thread::get_id() == worker_.get_id(); }
  uint64_t bytes() const { return bytes_.load(std::memory_order_relaxed); }
  uint64_t copies() const { return copies_.load(std::memory_order_relaxed); }

 private:
  void Run() {
    std::unique_lock<std::mutex> l(mu_);
    for (;;) {
      cv_.wait(l, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and drained
      Copy c = std::move(queue_.front());
      queue_.pop_front();
      cv_.notify_all();  // room for a blocked producer
      l.unlock();
      auto start = std::chrono::steady_clock::now();
      if (c.size_bytes) std::memcpy(c.dst, c.src, c.size_bytes);
      if (bandwidth_ > 0) {
        auto link = std::chrono::nanoseconds(
            static_cast<int64_t>(static_cast<double>(c.size_bytes) * 1e9 / bandwidth_));
        std::this_thread::sleep_until(start + link);
      }
      bytes_.fetch_add(c.size_bytes, std::memory_order_relaxed);
      copies_.fetch_add(1, std::memory_order_relaxed);
      if (c.done) c.done(Status::OK());
      l.lock();
      ++completed_seq_;
      cv_.notify_all();
      l.unlock();
      on_progress_();  // reclaims deferred frees
      l.lock();
    }
  }

  const uint64_t bandwidth_;
  const size_t max_queued_;
  const std::function<void()> on_progress_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Copy> queue_;
  uint64_t issued_seq_ = 0;
  uint64_t completed_seq_ = 0;
  bool stop_ = false;
  std::atomic<uint64_t> bytes_{0};
  std::atomic<uint64_t> copies_{0};
  std::thread worker_;
};

class HostEvent final : public DeviceEvent {
 public:
  HostEvent(Stream* s, uint64_t seq) : stream_(s), seq_(seq) {}
  Result<bool> Query() override { return stream_->Done(seq_); }
  Status Wait(std::chrono::nanoseconds timeout) override {
    if (stream_->WaitFor(seq_, timeout)) return Status::OK();
    return Status::DeadlineExceeded("HostDevice: event wait timed out");
  }

 private:
  Stream* stream_;
  uint64_t seq_;
};

class HostDevice final : public Device {
 public:
  explicit HostDevice(const HostDeviceOptions& o) : options_(o) {
    for (auto& s : streams_) {
      s = std::make_unique<Stream>(o.copy_bandwidth_bytes_per_s, o.max_queued_copies,
                                   [this] { Reclaim(); });
    }
  }
  ~HostDevice() override {
    for (auto& s : streams_) s->WaitForever(s->issued());
    {
      std::lock_guard<std::mutex> l(mu_);
      closing_ = true;  // workers' Reclaim must not touch streams being destroyed
    }
    streams_[0].reset();
    streams_[1].reset();
    for (auto& [p, n] : live_) std::free(p);
    for (auto& d : deferred_) std::free(d.ptr);
    for (auto& [n, p] : cached_) std::free(p);
  }

  std::string name() const override { return "host-standin"; }
  bool host_addressable() const override { return true; }

  // Freed memory is cached by size (like a CUDA pool) so a steady step neither maps nor
  // page-faults; cached plus used bytes stay within the budget.
  Result<void*> Allocate(uint64_t size_bytes) override {
    if (size_bytes == 0) return Status::InvalidArgument("HostDevice::Allocate: size 0");
    const uint64_t rounded = (size_bytes + kAlign - 1) / kAlign * kAlign;
    std::lock_guard<std::mutex> l(mu_);
    if (used_ + rounded > options_.budget_bytes) {
      return Status::ResourceExhausted("HostDevice: allocating " + std::to_string(rounded) +
                                       " bytes would exceed the budget of " +
                                       std::to_string(options_.budget_bytes) + " (in use " +
                                       std::to_string(used_) + ")");
    }
    void* p = nullptr;
    if (auto it = cached_.find(rounded); it != cached_.end()) {
      p = it->second;
      cached_.erase(it);
      cached_bytes_ -= rounded;
    } else {
      while (!cached_.empty() && used_ + cached_bytes_ + rounded > options_.budget_bytes) {
        auto victim = std::prev(cached_.end());  // largest first
        std::free(victim->second);
        cached_bytes_ -= victim->first;
        cached_.erase(victim);
      }
      p = std::aligned_alloc(kAlign, rounded);
      if (p == nullptr) return Status::ResourceExhausted("HostDevice: host allocation failed");
    }
    used_ += rounded;
    peak_ = std::max(peak_, used_);
    live_.emplace(p, rounded);
    return p;
  }

  // REQUIRES: mu_ held.
  void Recycle(void* p, uint64_t n) {
    if (used_ + cached_bytes_ + n <= options_.budget_bytes) {
      cached_.emplace(n, p);
      cached_bytes_ += n;
    } else {
      std::free(p);
    }
  }

  // Stream-ordered like cudaFreeAsync: the budget is returned now; the memory itself once both
  // streams completed every copy issued before this call (checked by the workers).
  Status Free(void* ptr) override {
    uint64_t seq[2];
    for (int i = 0; i < 2; ++i) seq[i] = streams_[i]->issued();
    std::lock_guard<std::mutex> l(mu_);
    auto it = live_.find(ptr);
    if (it == live_.end()) return Status::InvalidArgument("HostDevice::Free: unknown pointer");
    const uint64_t n = it->second;
    used_ -= n;
    live_.erase(it);
    if (streams_[0]->Done(seq[0]) && streams_[1]->Done(seq[1])) {
      Recycle(ptr, n);
    } else {
      deferred_.push_back({ptr, n, {seq[0], seq[1]}});
    }
    return Status::OK();
  }

  Status CopyAsync(CopyDir dir, void* dst, const void* src, uint64_t size_bytes,
                   CopyCallback done) override {
    if ((dst == nullptr || src == nullptr) && size_bytes > 0) {
      return Status::InvalidArgument("HostDevice::CopyAsync: null pointer");
    }
    return streams_[static_cast<int>(dir)]->Push(Copy{dst, src, size_bytes, std::move(done)});
  }

  Result<std::unique_ptr<DeviceEvent>> RecordEvent(CopyDir dir) override {
    Stream* s = streams_[static_cast<int>(dir)].get();
    return std::unique_ptr<DeviceEvent>(std::make_unique<HostEvent>(s, s->issued()));
  }

  Status Synchronize() override {
    for (auto& s : streams_) {
      if (s->on_worker()) {
        return Status::FailedPrecondition("HostDevice: Synchronize from a completion callback");
      }
      s->WaitForever(s->issued());
    }
    return Status::OK();
  }

  Status RegisterHost(void*, uint64_t) override { return Status::OK(); }
  Status UnregisterHost(void*) override { return Status::OK(); }

  void Reclaim() {
    std::lock_guard<std::mutex> l(mu_);
    if (closing_) return;
    for (size_t i = 0; i < deferred_.size();) {
      if (streams_[0]->Done(deferred_[i].seq[0]) && streams_[1]->Done(deferred_[i].seq[1])) {
        Recycle(deferred_[i].ptr, deferred_[i].size_bytes);
        deferred_[i] = deferred_.back();
        deferred_.pop_back();
      } else {
        ++i;
      }
    }
  }

  DeviceStats stats() const override {
    DeviceStats st;
    {
      std::lock_guard<std::mutex> l(mu_);
      st.budget_bytes = options_.budget_bytes;
      st.used_bytes = used_;
      st.peak_used_bytes = peak_;
    }
    for (int i = 0; i < 2; ++i) {
      st.bytes_copied[i] = streams_[i]->bytes();
      st.copies[i] = streams_[i]->copies();
    }
    return st;
  }

 private:
  const HostDeviceOptions options_;
  mutable std::mutex mu_;
  uint64_t used_ = 0;
  uint64_t peak_ = 0;
  std::unordered_map<void*, uint64_t> live_;
  struct Deferred {
    void* ptr;
    uint64_t size_bytes;
    uint64_t seq[2];
  };
  std::multimap<uint64_t, void*> cached_;  // freed and reusable, by size
  uint64_t cached_bytes_ = 0;
  std::vector<Deferred> deferred_;  // freed, waiting for earlier copies to finish
  bool closing_ = false;
  std::unique_ptr<Stream> streams_[2];
};

}  // namespace

Result<std::unique_ptr<Device>> CreateHostDevice(const HostDeviceOptions& options) {
  if (options.budget_bytes == 0) {
    return Status::InvalidArgument("HostDeviceOptions.budget_bytes must be > 0");
  }
  if (options.max_queued_copies == 0) {
    return Status::InvalidArgument("HostDeviceOptions.max_queued_copies must be > 0");
  }
  return std::unique_ptr<Device>(std::make_unique<HostDevice>(options));
}

}  // namespace strata
