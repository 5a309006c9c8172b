// TieredStore: where every block (one shard of one model state) lives, and the engine that moves
// blocks between the three tiers (Device HBM, pinned Host DRAM, NVMe) asynchronously.
//
// A block has a home tier (from the config) where its authoritative copy always has space, and
// may have cached copies on faster tiers. Per block and tier the store tracks a residency:
// absent, in flight, valid (same bytes as the newest), dirty (newer than home) or stale (the home
// copy while a faster copy is dirty). Budgets per tier (bytes) are never exceeded: space is
// reserved before any transfer starts; when a tier is full the store evicts clean, unleased,
// idle cached copies (least recently used first), starts write-back evictions of dirty ones, and
// otherwise parks the operation until in-flight work or a lease release frees space, or fails it
// with ResourceExhausted when nothing ever can.
//
// Operations (Fetch, WriteBack, Evict) are asynchronous and return a Ticket. Operations on one
// block run one at a time in issue order, so a read never sees a stale copy and writes to a block
// apply in order; operations on different blocks overlap. Each hop is its own async step:
// NVMe -> pinned host is an IoBackend read (checksum verified), host -> device a device copy.
// A failed hop (IO error, checksum failure) fails the operation with the block's name; the block
// is not marked valid. When no Wait returned a failed fetch's error (a background prefetch whose
// ticket was dropped), the error is kept and returned once to the next Fetch or Acquire of that
// block; the one after that fetches afresh.
//
// A block is used through a Lease: while any lease on a copy exists it is never evicted. A write
// lease (Access::kWrite) is exclusive: it waits until the block has no lease on any tier and no
// operation running, new readers queue behind a waiting writer (writers cannot starve), and it
// holds the block's operations back until released; MarkDirty() then makes the leased copy the
// newest one (other cached copies are dropped, the home copy becomes stale until WriteBack).
//
// Phases: Register blocks, then use them. The NVMe tier is opened (its swap files created and
// preallocated for every NVMe-homed block registered so far) by OpenNvme(), or implicitly by the
// first Fetch/WriteBack/Evict/Acquire of an NVMe-homed block. Registering an NVMe-homed block
// after that is FailedPrecondition (blocks on other tiers may be registered at any time). A
// freshly registered NVMe block reads as zeros without IO until it is first written back.
//
// Threads: one IO thread owns the IoBackend (submits, reaps); one mover thread runs completions
// (state updates and the next hop). Both sleep on condition variables when idle.
// Thread safety: every public method may be called from any thread. A thread that holds leases
// filling a tier and then waits for another block on that tier gets DeadlineExceeded, not a hang.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/range_allocator.h"
#include "strata/device.h"
#include "strata/dtype.h"
#include "strata/io.h"
#include "strata/status.h"

namespace strata::nvme {
class SwapSpace;
}  // namespace strata::nvme

namespace strata::cpu {
class PinnedPool;
class PinnedBuffer;
}  // namespace strata::cpu

namespace strata::core {

enum class Tier : uint8_t { kDevice = 0, kHost = 1, kNvme = 2 };
inline constexpr int kTiers = 3;
std::string_view TierName(Tier t) noexcept;

enum class StateKind : uint8_t { kParam16, kGrad, kMaster32, kExpAvg, kExpAvgSq };
std::string_view StateKindName(StateKind k) noexcept;

enum class Residency : uint8_t { kAbsent, kInFlight, kValid, kDirty, kStale };
std::string_view ResidencyName(Residency r) noexcept;

enum class Access : uint8_t { kRead, kWrite };

using BlockId = uint32_t;

struct BlockSpec {
  std::string name;  // used in every error about the block, e.g. "layer3.param16[r0]"
  uint64_t size_bytes = 0;
  DType dtype = DType::kBF16;
  StateKind kind = StateKind::kParam16;
  Tier home = Tier::kHost;
};

struct TieredStoreOptions {
  // Per-tier byte budgets; 0 disables the tier. Host is required (it stages every NVMe hop).
  uint64_t device_budget_bytes = 0;  // HBM the store may use
  uint64_t host_budget_bytes = 0;    // pinned DRAM, allocated once at Open
  // NVMe budget: the NVMe-homed blocks' extents (sizes rounded to 4 KiB) may not exceed it.
  // Their swap files (exactly those extents) are preallocated when the NVMe tier opens.
  uint64_t nvme_capacity_bytes = 0;
  // Not owned; must outlive the store. Required when device_budget_bytes > 0.
  Device* device = nullptr;
  // Owned; driven by the store's IO thread only. Required when nvme_capacity_bytes > 0.
  std::unique_ptr<IoBackend> io;
  // The NVMe tier is an nvme::SwapSpace (nvme/swap_space.h): one preallocated O_DIRECT file per
  // path for `rank`, every block striped over all paths in `stripe_unit_bytes` units (several
  // SSDs add their bandwidth), an XXH3 checksum per block verified on every read, a failed write
  // invalidating the block, and a swap file left by a crashed run refused (FailedPrecondition).
  // Required (existing directories, one per SSD) when nvme_capacity_bytes > 0.
  std::vector<std::string> nvme_paths;
  int rank = 0;
  size_t stripe_unit_bytes = size_t{1} << 20;
  // Buffered IO (noted) on a path whose filesystem refuses O_DIRECT; refused when false.
  bool allow_buffered_io = true;
  // NVMe block reads/writes in flight at once (each spans several stripe units).
  size_t max_inflight_ios = 64;
  // Queued operations across all blocks before Fetch/WriteBack/Evict fail ResourceExhausted.
  uint32_t max_queued_ops = 1u << 16;
  // Pinned host memory: from a PinnedPool (huge pages, locked, CUDA-registered) when true,
  // plain aligned memory otherwise (tests on machines that refuse mlock run either way).
  bool use_pinned_pool = true;
};

struct TicketState;

// The outcome of one asynchronous operation. Copyable; all copies see the same result.
class Ticket {
 public:
  Ticket() = default;
  explicit Ticket(std::shared_ptr<TicketState> s) : s_(std::move(s)) {}
  // Blocks until the operation finished, then returns its Status (the block's name in any
  // error). DeadlineExceeded if it did not finish within `timeout` (the operation continues).
  Status Wait(std::chrono::nanoseconds timeout) const;
  bool ready() const;
  // Runs `fn` with the result once the operation finished: right away on this thread when it
  // already has, otherwise on the thread that completed it, with the store's lock held: `fn`
  // must be short, must not block and must not call into the store (post work elsewhere).
  // A `fn` receiving an error counts as a Wait that returned it.
  void Then(std::function<void(Status)> fn) const;

 private:
  std::shared_ptr<TicketState> s_;
};

class TieredStore;

// Keeps one copy of one block resident and usable. Move-only; released on destruction.
class Lease {
 public:
  Lease() = default;
  Lease(Lease&& o) noexcept { *this = std::move(o); }
  Lease& operator=(Lease&& o) noexcept;
  ~Lease() { Release(); }
  // Device pointer for Tier::kDevice, host pointer for Tier::kHost. Valid while leased.
  void* data() const { return data_; }
  uint64_t size_bytes() const { return size_bytes_; }
  BlockId block() const { return block_; }
  Tier tier() const { return tier_; }
  // REQUIRES: a write lease. At release the leased copy becomes the newest.
  void MarkDirty() { dirty_ = true; }
  void Release();
  explicit operator bool() const { return store_ != nullptr; }

 private:
  friend class TieredStore;
  TieredStore* store_ = nullptr;
  BlockId block_ = 0;
  Tier tier_ = Tier::kHost;
  Access access_ = Access::kRead;
  void* data_ = nullptr;
  uint64_t size_bytes_ = 0;
  bool dirty_ = false;
};

struct StoreStats {
  uint64_t bytes_moved[kTiers][kTiers] = {};  // [from][to]
  uint64_t stall_ns = 0;                      // time Acquire callers waited
  uint64_t acquires = 0;
  uint64_t acquire_hits = 0;  // the copy was already valid when asked for
  uint64_t used_bytes[kTiers] = {};
  uint64_t peak_bytes[kTiers] = {};
  uint64_t budget_bytes[kTiers] = {};
  uint64_t io_busy_ns = 0;  // time with IO in flight
  uint64_t io_bytes = 0;
  uint64_t copy_busy_ns = 0;  // time with a device copy in flight (either direction)
  uint64_t copy_bytes = 0;
  uint64_t evictions = 0;
  uint64_t errors = 0;
  uint64_t acquire_timeouts = 0;   // Acquire calls that returned DeadlineExceeded
  uint64_t cancelled_fetches = 0;  // of those, fetches cancelled before any hop of theirs ran
};

class TieredStore {
 public:
  // InvalidArgument for a missing host budget, device or IO backend; IOError when the swap
  // file cannot be created or sized; ResourceExhausted when host memory cannot be had.
  static Result<std::unique_ptr<TieredStore>> Open(TieredStoreOptions options);
  // Waits for running hops, fails queued operations with Aborted, stops the threads.
  // REQUIRES: no lease is held.
  ~TieredStore();

  // Registers a block and reserves its home copy (zero-filled, valid). InvalidArgument for size
  // 0, a duplicate name or a disabled home tier; ResourceExhausted when the home tier's budget
  // cannot hold it; FailedPrecondition for an NVMe-homed block once the NVMe tier is open.
  Result<BlockId> Register(const BlockSpec& spec);

  // Opens the NVMe tier: creates the swap space for every NVMe-homed block registered so far and
  // starts the IO thread. Idempotent; the first call's result is returned by every later one and
  // a failed open fails every later operation on an NVMe-homed block with the same error.
  // FailedPrecondition: the NVMe tier is disabled, or a swap file from a crashed run is in the
  // way (named). NotFound / IOError (ENOSPC names the path and bytes): see SwapSpace::Create.
  Status OpenNvme();
  bool nvme_open() const;
  // The swap files of the open NVMe tier (one per nvme path); empty before OpenNvme.
  std::vector<std::string> nvme_files() const;

  // An unknown id gives a ticket failed with NotFound (Fetch, WriteBack, Evict, Acquire).
  // Makes a valid copy resident on `tier` (each hop async). The block must then be leased
  // (Acquire) to be used; until then it may be evicted for space.
  Ticket Fetch(BlockId id, Tier tier);
  // Copies the newest copy to the home tier (no-op when home is already newest).
  Ticket WriteBack(BlockId id);
  // Drops the cached copy on `tier`, writing it back first when it is the newest.
  // FailedPrecondition for the home tier or a leased copy.
  Ticket Evict(BlockId id, Tier tier);

  // Fetches if needed and returns a lease on the copy on `tier`. DeadlineExceeded after
  // `timeout`; the block's fetch error otherwise. A read lease waits while a writer holds the
  // block or is queued for it (readers never overtake a waiting writer); a write lease waits
  // until no lease on any tier of the block is held and no operation of it runs (so a thread
  // holding a read lease that asks for a write lease on the same block gets DeadlineExceeded).
  // On timeout the lease request is withdrawn; the fetch it started is cancelled when nothing
  // else waits on it and it has not started a hop (stats: cancelled_fetches), otherwise it runs
  // to completion and leaves an unleased (evictable) copy (stats: acquire_timeouts).
  Result<Lease> Acquire(BlockId id, Tier tier, Access access, std::chrono::nanoseconds timeout);

  // Writes back every dirty block and waits. The first error, or DeadlineExceeded.
  Status Flush(std::chrono::nanoseconds timeout);

  Residency residency(BlockId id, Tier tier) const;  // REQUIRES: a registered id
  const BlockSpec& spec(BlockId id) const;           // REQUIRES: a registered id
  size_t num_blocks() const;
  // Counters since Open or the last TakeStats(true); used/peak/budget are current.
  StoreStats TakeStats(bool reset);
  // One line per block (copies, leases, queued operations) and per tier: for diagnostics.
  std::string DebugString() const;
  // Setup notes (O_DIRECT refused, memory not locked, ...). Empty when nothing degraded.
  std::string note() const;

 private:
  struct Copy;
  struct Block;
  struct Op;
  struct IoJob;
  enum class Outcome : uint8_t { kReady, kIssued, kParked, kFailed };

  explicit TieredStore(TieredStoreOptions options);
  Status Init();

  // All of these REQUIRE mu_ held (store_ops.cc).
  Ticket Enqueue(BlockId id, int kind, Tier tier, Access lease, bool with_lease,
                 std::shared_ptr<Op>* op_out);
  void Pump(BlockId id);  // Advance(id), then retries parked blocks while space was freed
  void Advance(BlockId id);
  Outcome MakeValid(Block& b, Tier tier, Status* err);
  Outcome WriteBackStep(Block& b, Status* err);
  Outcome EvictStep(Block& b, Tier tier, Status* err);
  void Finish(Block& b, Status status);
  Outcome Reserve(Block& b, Tier tier, Status* err);
  bool TryAllocate(Block& b, Tier tier);
  bool CanEverFree(Tier tier, BlockId except);
  void FreeCopy(Block& b, Tier tier);
  bool Droppable(Block& b, Tier tier);
  Status IssueCopy(Block& b, Tier from, Tier to);
  void IssueIo(Block& b, IoOp op);
  void OnHopDone(BlockId id, Tier from, Tier to, Status status);
  Status NvmeReadyFor(BlockId id);  // opens the NVMe tier for an NVMe-homed block
  void ReleaseLease(Lease& lease);
  std::string Name(const Block& b) const;

  void IoLoop();
  void MoverLoop();
  void Post(std::function<void()> fn);

  TieredStoreOptions options_;
  std::string note_;

  mutable std::mutex mu_;
  std::condition_variable idle_cv_;
  std::vector<std::unique_ptr<Block>> blocks_;
  uint64_t used_[kTiers] = {};
  uint64_t budget_[kTiers] = {};
  uint64_t lru_clock_ = 0;
  uint32_t queued_ops_ = 0;
  uint32_t running_hops_ = 0;
  uint32_t copies_in_flight_ = 0;
  std::chrono::steady_clock::time_point copy_busy_since_;
  std::vector<BlockId> parked_;
  StoreStats stats_;
  bool shutting_down_ = false;
  bool space_freed_ = false;

  // Host tier: one slab carved by host_alloc_.
  std::unique_ptr<cpu::PinnedPool> pool_;
  std::unique_ptr<cpu::PinnedBuffer> slab_;
  void* plain_slab_ = nullptr;
  uint8_t* host_base_ = nullptr;
  std::unique_ptr<RangeAllocator> host_alloc_;
  // NVMe tier: the swap space, created by OpenNvme and then driven by the IO thread only.
  enum class NvmeState : uint8_t { kClosed, kOpening, kOpen };
  std::mutex nvme_open_mu_;                    // serializes OpenNvme
  NvmeState nvme_state_ = NvmeState::kClosed;  // guarded by mu_
  Status nvme_status_;                         // guarded by mu_; the open's result
  std::unique_ptr<nvme::SwapSpace> swap_;
  bool host_registered_ = false;  // host slab registered with the IO backend

  // IO thread state (guarded by io_mu_).
  std::mutex io_mu_;
  std::condition_variable io_cv_;
  std::deque<std::unique_ptr<IoJob>> io_queue_;
  bool io_stop_ = false;
  std::thread io_thread_;
  // Mover thread state (guarded by mv_mu_).
  std::mutex mv_mu_;
  std::condition_variable mv_cv_;
  std::deque<std::function<void()>> mv_queue_;
  bool mv_stop_ = false;
  std::thread mover_thread_;

  friend class Lease;
};

}  // namespace strata::core
