// Internal structures of the TieredStore (core/store/tiered_store.h), shared by its .cc files.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string_view>
#include <vector>

#include "core/store/tiered_store.h"

namespace strata::store {

// Nanoseconds in `d` (the stats' busy and wait clocks).
inline uint64_t Ns(std::chrono::steady_clock::duration d) {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(d).count());
}

// Size of the zero extent that device homes are zero-filled from (one copy per extent): a
// bounded, preallocated source instead of a block-sized buffer per Register.
inline constexpr uint64_t kZeroExtentBytes = uint64_t{1} << 20;

struct TicketState {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  bool delivered = false;  // a Wait returned the (error) status to someone
  Status status;

  // The error of a finished, failed operation that no Wait has returned yet; OK otherwise.
  // Marks it delivered.
  Status TakeUndelivered() {
    std::lock_guard<std::mutex> l(mu);
    if (!done || delivered || status.ok()) return Status::OK();
    delivered = true;
    return status;
  }

  std::vector<std::function<void(Status)>> then;  // run once at completion

  void Complete(Status s) {
    std::vector<std::function<void(Status)>> run;
    {
      std::lock_guard<std::mutex> l(mu);
      status = std::move(s);
      done = true;
      run.swap(then);
      if (!run.empty() && !status.ok()) delivered = true;
    }
    cv.notify_all();
    for (auto& fn : run) fn(status);  // status is immutable once done
  }
};

// One copy of a block on one tier. Non-home copies are kAbsent, kInFlight or kValid; the home
// copy is always reserved and kValid or kStale ("dirty" is derived: a valid non-home copy while
// home is stale). Every valid copy holds the newest bytes.
struct TieredStore::Copy {
  Residency state = Residency::kAbsent;
  bool reserved = false;  // holds budget (and memory / a file extent)
  uint64_t offset = 0;    // host slab offset
  void* ptr = nullptr;    // device or host address
  uint32_t read_leases = 0;
  uint32_t write_leases = 0;
  uint64_t last_use = 0;  // LRU clock
  // Reserved for an Access::kOverwrite lease and not filled: its bytes are undefined until that
  // lease is released dirty (then the newest); released clean, the copy is dropped.
  bool unfilled = false;
  uint32_t leases() const { return read_leases + write_leases; }
};

constexpr std::string_view OpKindName(OpKind k) noexcept {
  constexpr std::string_view kNames[] = {"fetch", "writeback", "evict"};
  return kNames[static_cast<size_t>(k)];
}

struct TieredStore::Op {
  OpKind kind = OpKind::kFetch;
  Tier tier = Tier::kHost;
  std::shared_ptr<TicketState> ticket = std::make_shared<TicketState>();
  uint32_t pending_read = 0;   // read leases to grant on success (Acquire waiters)
  uint32_t pending_write = 0;  // write leases to grant on success
  bool overwrite = false;      // its write lease is Access::kOverwrite: nothing is read
  // Callers that were handed this operation's ticket by Enqueue (Fetch, WriteBack, Evict and
  // Acquire calls, including those that joined it) and have not withdrawn: only an Acquire
  // withdraws, when it times out. A queued fetch with no waiter left is cancelled. Operations the
  // store starts itself (write-behind evictions) have none.
  uint32_t waiters = 0;
  bool done = false;
  Status status;
};

struct TieredStore::Block {
  BlockId id = 0;
  BlockSpec spec;
  uint64_t alloc_bytes = 0;  // size rounded to the IO alignment
  PerTier<Copy> copy;
  std::deque<std::shared_ptr<Op>> ops;  // front runs; one hop in flight at most
  bool hop_in_flight = false;
  bool parked = false;           // waiting for space
  Tier parked_on = Tier::kHost;  // the tier whose room it waits for (when parked)
  // An NVMe home never written back holds zeros (the registered value) and is read without IO
  // (the swap space refuses to read a block it never wrote).
  bool nvme_written = false;
  // Its IO was given up after Reap kept failing (TieredStore::IoLoop): its hop never completes,
  // its host buffer stays reserved, and every later operation on it fails with the error.
  bool io_lost = false;
  // Set aside (SetAside): the block's bytes are in `aside` at `aside_offset`, it has no copy on
  // any tier, and every operation on it fails until RestoreAside.
  std::shared_ptr<AsideArena> aside;
  uint64_t aside_offset = 0;
  // The last failed fetch nobody was waiting for (a background prefetch): its error goes to the
  // next Fetch or Acquire of the block unless a Wait on its ticket already returned it.
  std::shared_ptr<TicketState> failed_fetch;

  Status TakeFailedFetch() {
    if (!failed_fetch) return Status::OK();
    Status s = failed_fetch->TakeUndelivered();
    failed_fetch.reset();
    return s;
  }

  Copy& home() { return copy[spec.home]; }
  uint32_t leases() const {
    uint32_t n = 0;
    for (const Copy& c : copy) n += c.leases();
    return n;
  }
  // A queued operation will grant a write lease: new readers queue behind it.
  bool writer_waiting() const {
    for (const auto& op : ops) {
      if (op->pending_write > 0) return true;
    }
    return false;
  }
  bool write_leased() const {
    for (const Copy& c : copy) {
      if (c.write_leases) return true;
    }
    return false;
  }
};

// One block read or write of the swap space (checksums are computed and verified there). One
// preallocated slot per block, indexed by BlockId: a block has at most one hop in flight, so the
// block id is also the IO's tag (the swap op's user_data). The store fills op/buffer/length
// under mu_ before queueing the id to the IO thread; the IO thread fills `status` before handing
// the id back to the mover thread (the queues' mutexes order the two).
struct TieredStore::IoJob {
  IoOp op = IoOp::kRead;
  void* buffer = nullptr;  // the block's host copy
  uint64_t length_bytes = 0;
  Status status;  // the completion's
};

}  // namespace strata::store
