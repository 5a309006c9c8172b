// TieredStore's two threads: the IO thread (sole driver of the IoBackend) and the mover thread
// (runs hop completions under the store lock). See core/tiered_store.h.
#include <algorithm>
#include <chrono>
#include <unordered_map>

#include "core/store/store_internal.h"
#include "nvme/swap_space.h"

namespace strata::store {
namespace {

using Clock = std::chrono::steady_clock;

uint64_t Ns(Clock::duration d) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(d).count();
}

}  // namespace

// ---------------------------------------------------------------------------
// Threads.
// ---------------------------------------------------------------------------
void TieredStore::Post(std::function<void()> fn) {
  // Notify under the lock: once the mover runs this completion the store may be destroyed, so
  // the poster must be done with mv_cv_ before the mover can see the item.
  std::lock_guard<std::mutex> l(mv_mu_);
  mv_queue_.push_back(std::move(fn));
  mv_cv_.notify_one();
}

void TieredStore::MoverLoop() {
  std::unique_lock<std::mutex> l(mv_mu_);
  for (;;) {
    mv_cv_.wait(l, [&] { return mv_stop_ || !mv_queue_.empty(); });
    if (mv_queue_.empty()) return;
    auto fn = std::move(mv_queue_.front());
    mv_queue_.pop_front();
    l.unlock();
    fn();
    l.lock();
  }
}

// The IO thread is the only user of the swap space (and, through it, of the IoBackend) once the
// NVMe tier is open. It submits queued jobs while the space has room for more ops in flight, then
// blocks in Reap for at least one completion; new jobs wait at most one IO latency. The swap
// space stripes each block over the nvme paths, checksums writes and verifies reads (off the
// store lock, on this thread). Each completion is posted to the mover thread; a failed Submit
// completes its jobs with the error. Everything in flight is reaped before the thread exits.
void TieredStore::IoLoop() {
  nvme::SwapSpace* swap = swap_.get();  // set before this thread starts, never changed after
  const size_t max_inflight = std::max<size_t>(1, options_.max_inflight_ios);
  std::unordered_map<uint64_t, std::unique_ptr<IoJob>> inflight;
  uint64_t next_tag = 1;
  std::vector<nvme::SwapCompletion> done(max_inflight);
  auto busy_since = Clock::now();
  auto post_done = [this](BlockId id, bool read, Status st) {
    Post([this, id, read, st] {
      std::lock_guard<std::mutex> l(mu_);
      OnHopDone(id, read ? Tier::kNvme : Tier::kHost, read ? Tier::kHost : Tier::kNvme, st);
    });
  };
  for (;;) {
    std::vector<std::unique_ptr<IoJob>> batch;
    {
      std::unique_lock<std::mutex> l(io_mu_);
      io_cv_.wait(l, [&] { return io_stop_ || !io_queue_.empty() || !inflight.empty(); });
      if (io_stop_ && io_queue_.empty() && inflight.empty()) return;
      while (!io_queue_.empty() && inflight.size() + batch.size() < max_inflight) {
        batch.push_back(std::move(io_queue_.front()));
        io_queue_.pop_front();
      }
    }
    if (inflight.empty() && !batch.empty()) busy_since = Clock::now();
    if (!batch.empty()) {
      std::vector<nvme::SwapOp> ops;
      std::vector<uint64_t> tags;
      for (auto& job : batch) {
        const uint64_t tag = next_tag++;
        ops.push_back(nvme::SwapOp{job->op, job->block, job->buffer, tag});
        tags.push_back(tag);
      }
      Status s = swap->Submit(ops);  // all or nothing
      for (size_t i = 0; i < batch.size(); ++i) {
        if (s.ok()) {
          inflight.emplace(tags[i], std::move(batch[i]));
        } else {
          post_done(batch[i]->block, batch[i]->op == IoOp::kRead, s);
        }
      }
    }
    if (inflight.empty()) continue;
    auto n = swap->Reap(done, 1);
    if (!n.ok()) continue;  // Reap only fails on misuse; the jobs stay in flight
    for (size_t i = 0; i < *n; ++i) {
      auto it = inflight.find(done[i].user_data);
      if (it == inflight.end()) continue;
      std::unique_ptr<IoJob> job = std::move(it->second);
      inflight.erase(it);
      Status st = std::move(done[i].status);  // Corruption on a checksum mismatch
      {
        std::lock_guard<std::mutex> l(mu_);
        stats_.io_bytes += st.ok() ? job->length_bytes : 0;
        if (inflight.empty()) stats_.io_busy_ns += Ns(Clock::now() - busy_since);
      }
      post_done(job->block, job->op == IoOp::kRead, std::move(st));
    }
  }
}

}  // namespace strata::store
