// TieredStore's two threads: the IO thread (sole driver of the IoBackend) and the mover thread
// (runs hop completions under the store lock). See core/tiered_store.h.
#include <xxhash.h>

#include <chrono>
#include <unordered_map>

#include "core/store_internal.h"

namespace strata::core {
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

// The IO thread is the only caller of the IoBackend. It submits queued jobs while the backend
// has room, then blocks in Reap for at least one completion; new jobs wait at most one IO
// latency. Checksums are computed here (writes) and verified here (reads), off the store lock.
// Each completion is posted to the mover thread; a failed Submit completes its jobs with the
// error. All requests in flight are reaped before the thread exits.
void TieredStore::IoLoop() {
  IoBackend* io = options_.io.get();
  std::unordered_map<uint64_t, std::unique_ptr<IoJob>> inflight;
  uint64_t next_tag = 1;
  std::vector<IoCompletion> done(io ? io->queue_depth() : 1);
  auto busy_since = Clock::now();
  for (;;) {
    std::vector<std::unique_ptr<IoJob>> batch;
    {
      std::unique_lock<std::mutex> l(io_mu_);
      io_cv_.wait(l, [&] { return io_stop_ || !io_queue_.empty() || !inflight.empty(); });
      if (io_stop_ && io_queue_.empty() && inflight.empty()) return;
      while (!io_queue_.empty() && inflight.size() + batch.size() < io->queue_depth()) {
        batch.push_back(std::move(io_queue_.front()));
        io_queue_.pop_front();
      }
    }
    if (inflight.empty() && !batch.empty()) busy_since = Clock::now();
    std::vector<IoRequest> reqs;
    std::vector<uint64_t> tags;
    for (auto& job : batch) {
      if (job->op == IoOp::kWrite && job->verify) {
        job->checksum = XXH3_64bits(job->buffer, job->length_bytes);
      }
      const uint64_t tag = next_tag++;
      reqs.push_back(IoRequest{job->op, swap_fd_, job->offset, job->buffer,
                               static_cast<size_t>(job->length_bytes), tag});
      tags.push_back(tag);
    }
    if (!reqs.empty()) {
      Status s = io->Submit(reqs);
      for (size_t i = 0; i < batch.size(); ++i) {
        if (s.ok()) {
          inflight.emplace(tags[i], std::move(batch[i]));
        } else {
          IoJob* j = batch[i].release();
          Post([this, j, s] {
            std::unique_ptr<IoJob> job(j);
            std::lock_guard<std::mutex> l(mu_);
            Tier to = job->op == IoOp::kRead ? Tier::kHost : Tier::kNvme;
            Tier from = job->op == IoOp::kRead ? Tier::kNvme : Tier::kHost;
            OnHopDone(job->block, from, to, s, 0);
          });
        }
      }
    }
    if (inflight.empty()) continue;
    auto n = io->Reap(done, 1);
    if (!n.ok()) continue;  // Reap only fails on misuse; the jobs stay in flight
    for (size_t i = 0; i < *n; ++i) {
      auto it = inflight.find(done[i].user_data);
      if (it == inflight.end()) continue;
      std::unique_ptr<IoJob> job = std::move(it->second);
      inflight.erase(it);
      Status st = done[i].status;
      uint64_t sum = job->checksum;
      if (st.ok() && job->op == IoOp::kRead && job->verify) {
        uint64_t got = XXH3_64bits(job->buffer, job->length_bytes);
        if (got != job->checksum) {
          st = Status::Corruption("checksum mismatch reading '" + swap_path_ + "' at offset " +
                                  std::to_string(job->offset) + " (" +
                                  std::to_string(job->length_bytes) + " bytes)");
        }
      }
      {
        std::lock_guard<std::mutex> l(mu_);
        stats_.io_bytes += st.ok() ? job->length_bytes : 0;
        if (inflight.empty()) stats_.io_busy_ns += Ns(Clock::now() - busy_since);
      }
      const bool read = job->op == IoOp::kRead;
      const BlockId id = job->block;
      Post([this, id, read, st, sum] {
        std::lock_guard<std::mutex> l(mu_);
        OnHopDone(id, read ? Tier::kNvme : Tier::kHost, read ? Tier::kHost : Tier::kNvme, st, sum);
      });
    }
  }
}

}  // namespace strata::core
