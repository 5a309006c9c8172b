// TieredStore's two threads: the IO thread (sole driver of the IoBackend) and the mover thread
// (runs hop completions under the store lock). See core/store/tiered_store.h.
#include <algorithm>
#include <chrono>
#include <utility>

#include "core/store/store_internal.h"
#include "nvme/swap_space.h"

namespace strata::store {
namespace {

using Clock = std::chrono::steady_clock;

// Back-off between failed Reaps: 1 ms, doubling up to this.
constexpr auto kMaxReapBackoff = std::chrono::milliseconds(100);

}  // namespace

// ---------------------------------------------------------------------------
// Mover thread.
// ---------------------------------------------------------------------------
void TieredStore::Post(std::function<void()> fn) {
  // Notify under the lock: once the mover runs this completion the store may be destroyed, so
  // the poster must be done with mv_cv_ before the mover can see the item.
  std::lock_guard<std::mutex> l(mv_mu_);
  mv_queue_.push_back(std::move(fn));
  mv_cv_.notify_one();
}

void TieredStore::HandOver(std::vector<IoEvent>* events, const IoTally& tally) {
  std::lock_guard<std::mutex> l(mv_mu_);  // notify under the lock, as Post
  for (IoEvent& e : *events) io_events_.push_back(std::move(e));
  io_pending_.busy_ns += tally.busy_ns;
  io_pending_.checksum_ns += tally.checksum_ns;
  io_pending_.checksum_bytes += tally.checksum_bytes;
  io_pending_.checksum_idle_ns += tally.checksum_idle_ns;
  events->clear();
  mv_cv_.notify_one();
}

void TieredStore::MoverLoop() {
  std::vector<IoEvent> events;  // swapped with io_events_: the two buffers keep their capacity
  std::unique_lock<std::mutex> l(mv_mu_);
  for (;;) {
    mv_cv_.wait(l, [&] { return mv_stop_ || !mv_queue_.empty() || !io_events_.empty(); });
    if (!io_events_.empty()) {
      events.swap(io_events_);
      const IoTally tally = std::exchange(io_pending_, IoTally{});
      l.unlock();
      {
        std::lock_guard<std::mutex> store(mu_);  // once for the whole batch
        stats_.io_busy_ns += tally.busy_ns;
        stats_.checksum_ns += tally.checksum_ns;
        stats_.checksum_bytes += tally.checksum_bytes;
        stats_.checksum_idle_ns += tally.checksum_idle_ns;
        for (IoEvent& e : events) HandleIoEvent(e);
      }
      events.clear();
      l.lock();
      continue;
    }
    if (mv_queue_.empty()) return;
    auto fn = std::move(mv_queue_.front());
    mv_queue_.pop_front();
    l.unlock();
    fn();
    l.lock();
  }
}

// ---------------------------------------------------------------------------
// IO thread.
// ---------------------------------------------------------------------------
// The IO thread is the only user of the swap space (and, through it, of the IoBackend) once the
// NVMe tier is open. Lifecycle: it takes queued block ids (each names its block's preallocated
// IoJob and is the swap op's user_data) while the space has room for more ops in flight, submits
// them, then blocks in Reap for at least one completion; new jobs wait at most one IO latency.
// The swap space stripes each block over the nvme paths, checksums writes and verifies reads (off
// the store lock, on this thread). Completions are handed to the mover thread in one batch per
// Reap, which applies them under one store lock. A failed Submit completes its jobs with the
// error. Everything in flight is reaped before the thread exits.
//
// Errors: a failing Reap leaves its IOs in flight (their buffers stay reserved), fails the
// waiters of every in-flight block at once and backs off (1 ms doubling to 100 ms) before
// reaping again, never spinning. When Reap keeps failing for io_deadline the IO path is given
// up: the in-flight IOs are lost (their buffers are never freed), the NVMe tier is failed with
// the error, and later jobs complete with it without being submitted.
// The IO thread's own state (touched by no other thread).
struct TieredStore::IoThread {
  nvme::SwapSpace* swap = nullptr;
  size_t max_inflight = 1;
  std::vector<BlockId> inflight;  // blocks with an op in the swap space
  std::vector<nvme::SwapOp> ops;  // taken from io_queue_, to submit
  std::vector<nvme::SwapCompletion> done;
  std::vector<IoEvent> events;  // for the mover thread
  Status lost;                  // the IO path was given up
  int reap_failures = 0;        // in a row
  Clock::time_point failing_since, busy_since;
  IoTally tally;  // to hand over

  // The swap space's checksum time since the last call, into the tally.
  void TakeChecksumTime() {
    const nvme::SwapSpace::ChecksumTime t = swap->TakeChecksumTime();
    tally.checksum_ns += t.ns;
    tally.checksum_bytes += t.bytes;
    tally.checksum_idle_ns += t.idle_ns;
  }
};

void TieredStore::IoLoop() {
  IoThread io;
  io.swap = swap_.get();  // set before this thread starts, never changed after
  io.max_inflight = std::max<size_t>(1, options_.max_inflight_ios);
  io.inflight.reserve(io.max_inflight);
  io.ops.reserve(io.max_inflight);
  io.done.resize(io.max_inflight);
  io.events.reserve(io.max_inflight);
  while (IoTake(io)) {
    if (!io.ops.empty()) IoSubmit(io);
    if (!io.inflight.empty() && io.lost.ok()) IoReap(io);
    io.TakeChecksumTime();
    if (!io.events.empty() || io.tally.busy_ns > 0 || io.tally.checksum_ns > 0) {
      HandOver(&io.events, std::exchange(io.tally, IoTally{}));
    }
  }
}

bool TieredStore::IoTake(IoThread& io) {
  io.ops.clear();
  std::unique_lock<std::mutex> l(io_mu_);
  const bool reaping = !io.inflight.empty() && io.lost.ok();
  io_cv_.wait(l, [&] { return io_stop_ || !io_queue_.empty() || reaping; });
  if (io_stop_ && io_queue_.empty() && !reaping) return false;
  while (!io_queue_.empty() && io.inflight.size() + io.ops.size() < io.max_inflight) {
    const BlockId id = io_queue_.pop_front();
    const IoJob& job = io_jobs_[id];
    io.ops.push_back(nvme::SwapOp{job.op, id, job.buffer, id});
  }
  return true;
}

void TieredStore::IoSubmit(IoThread& io) {
  if (io.inflight.empty()) io.busy_since = Clock::now();
  Status s = io.lost.ok() ? io.swap->Submit(io.ops) : io.lost;  // all or nothing
  for (const nvme::SwapOp& op : io.ops) {
    const BlockId id = static_cast<BlockId>(op.user_data);
    if (s.ok()) {
      io.inflight.push_back(id);
    } else {
      io.events.push_back({id, IoEvent::Kind::kDone, s});
    }
  }
}

void TieredStore::IoReap(IoThread& io) {
  auto n = io.swap->Reap(io.done, 1);
  if (!n.ok()) {
    IoReapFailed(io, n.status().WithContext("reaping NVMe IO"));
    return;
  }
  io.reap_failures = 0;
  for (size_t i = 0; i < *n; ++i) {
    const BlockId id = static_cast<BlockId>(io.done[i].user_data);
    auto it = std::find(io.inflight.begin(), io.inflight.end(), id);
    if (it == io.inflight.end()) continue;
    *it = io.inflight.back();
    io.inflight.pop_back();
    // Corruption on a checksum mismatch.
    io.events.push_back({id, IoEvent::Kind::kDone, std::move(io.done[i].status)});
  }
  // Busy time up to this completion, also while more stay in flight: a reader of io_busy_ns
  // (a phase of a step) sees a long busy stretch as it goes, one IO latency behind at most.
  const auto now = Clock::now();
  io.tally.busy_ns += Ns(now - io.busy_since);
  io.busy_since = now;
}

void TieredStore::IoReapFailed(IoThread& io, const Status& err) {
  const auto now = Clock::now();
  if (io.reap_failures++ == 0) io.failing_since = now;
  const bool give_up = now - io.failing_since >= options_.io_deadline;
  if (give_up) {
    io.lost = Status::IOError("the NVMe IO path was given up: reaping failed " +
                              std::to_string(io.reap_failures) + " times in a row (" +
                              err.ToString() + ")");
  }
  for (BlockId id : io.inflight) {
    io.events.push_back(
        {id, give_up ? IoEvent::Kind::kLost : IoEvent::Kind::kReapFailed, give_up ? io.lost : err});
  }
  if (give_up) return;
  // Tell the waiters now, then back off (woken early only to stop).
  HandOver(&io.events, IoTally{});
  const auto backoff = std::min<Clock::duration>(
      std::chrono::milliseconds(1 << std::min(io.reap_failures - 1, 7)), kMaxReapBackoff);
  std::unique_lock<std::mutex> l(io_mu_);
  io_cv_.wait_for(l, backoff, [&] { return io_stop_; });
}

}  // namespace strata::store
