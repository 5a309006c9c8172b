// The tiered store: where every block (one shard of one model state) lives, and the engine that
// moves blocks between the three tiers (device HBM, pinned host DRAM, NVMe) asynchronously.
// This header is the store's vocabulary for the whole codebase: the one `Tier` enum used by the
// planner, the scheduler, the config and the CLI, the state kinds, and the `Store` contract.
//
// Contract (every implementation keeps it; `OpenTieredStore` returns the real one):
// - A block has a home tier where its authoritative copy always has space, and may have cached
//   copies on faster tiers. Per block and tier the store tracks a `Residency`.
// - Budgets per tier (bytes) are never exceeded: space is reserved before any transfer starts;
//   when a tier is full the store evicts clean, unleased, idle cached copies (least recently used
//   first), starts write-back evictions of dirty ones, and otherwise parks the operation until
//   in-flight work or a lease release frees space, or fails it with ResourceExhausted when
//   nothing ever can. The device may refuse room its budget has (CUDA: memory held outside the
//   store's pool): that is waited out the same way, and the final ResourceExhausted quotes the
//   device; any other refusal (a device fault) fails the operation at once with its own code.
// - Operations (Fetch, WriteBack, Evict) are asynchronous and return a `Ticket`. Operations on one
//   block run one at a time in issue order, so a read never sees a stale copy and writes to a
//   block apply in order; operations on different blocks overlap. A failed hop (IO error,
//   checksum failure) fails the operation with the block's name; the block is not marked valid.
//   When no Wait returned a failed fetch's error (a background prefetch whose ticket was
//   dropped), the error is kept and returned once to the next Fetch or Acquire of that block.
// - A block is used through a `Lease`: while any lease on a copy exists it is never evicted. A
//   write lease is exclusive: it waits until the block has no lease on any tier and no operation
//   running, new readers queue behind a waiting writer (writers cannot starve), and it holds the
//   block's operations back until released; MarkDirty() then makes the leased copy the newest.
// - Phases: register blocks, then use them. NVMe-homed blocks must be registered before the NVMe
//   tier opens (OpenNvme, or the first operation on an NVMe-homed block); a freshly registered
//   block reads as zeros until it is first written.
//
// Thread safety: every method of a Store may be called from any thread. A thread that holds
// leases filling a tier and then waits for another block on that tier gets DeadlineExceeded, not
// a hang. Tickets and leases may be used from any thread.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "strata/device.h"
#include "strata/dtype.h"
#include "strata/io.h"
#include "strata/status.h"

namespace strata {

// The storage tiers, fastest first. The one Tier enum of the codebase.
enum class Tier : uint8_t { kDevice = 0, kHost = 1, kNvme = 2 };
inline constexpr size_t kNumTiers = 3;
inline constexpr std::array<Tier, kNumTiers> kAllTiers = {Tier::kDevice, Tier::kHost, Tier::kNvme};

// "hbm", "host", "nvme" (the names `offloadctl plan` prints).
constexpr std::string_view TierName(Tier t) noexcept {
  switch (t) {
    case Tier::kDevice:
      return "hbm";
    case Tier::kHost:
      return "host";
    case Tier::kNvme:
      return "nvme";
  }
  return "?";
}

// Per-tier data, indexed by Tier (never by a bare 0/1/2).
template <class T>
struct PerTier {
  std::array<T, kNumTiers> values{};

  constexpr T& operator[](Tier t) noexcept { return values[static_cast<size_t>(t)]; }
  constexpr const T& operator[](Tier t) const noexcept { return values[static_cast<size_t>(t)]; }
  // Iterates the values in kAllTiers order.
  constexpr auto begin() noexcept { return values.begin(); }
  constexpr auto end() noexcept { return values.end(); }
  constexpr auto begin() const noexcept { return values.begin(); }
  constexpr auto end() const noexcept { return values.end(); }
  bool operator==(const PerTier&) const = default;
};

// The model states a block can hold (docs/design.md, "Vocabulary").
enum class StateKind : uint8_t { kParam16, kGrad, kMaster32, kExpAvg, kExpAvgSq };
constexpr std::string_view StateKindName(StateKind k) noexcept {
  switch (k) {
    case StateKind::kParam16:
      return "param16";
    case StateKind::kGrad:
      return "grad";
    case StateKind::kMaster32:
      return "master32";
    case StateKind::kExpAvg:
      return "exp_avg";
    case StateKind::kExpAvgSq:
      return "exp_avg_sq";
  }
  return "?";
}

// The state of one copy of a block on one tier: absent, in flight, valid (same bytes as the
// newest), dirty (newer than home) or stale (the home copy while a faster copy is newer).
enum class Residency : uint8_t { kAbsent, kInFlight, kValid, kDirty, kStale };
constexpr std::string_view ResidencyName(Residency r) noexcept {
  switch (r) {
    case Residency::kAbsent:
      return "absent";
    case Residency::kInFlight:
      return "in_flight";
    case Residency::kValid:
      return "valid";
    case Residency::kDirty:
      return "dirty";
    case Residency::kStale:
      return "stale";
  }
  return "?";
}

// A copy that holds the newest bytes and can be used (valid, or dirty: newer than home).
constexpr bool IsResident(Residency r) noexcept {
  return r == Residency::kValid || r == Residency::kDirty;
}

// kRead: shared, the copy holds the newest bytes. kWrite: exclusive, the copy holds the newest
// bytes (fetched first when absent). kOverwrite: exclusive like kWrite, for a caller that
// overwrites every byte and calls MarkDirty: an absent or stale copy is reserved but not filled
// (no NVMe read, no device copy of bytes about to be replaced: gradients at the first
// micro-step, zeroed gradients). Released without MarkDirty, such an unfilled copy is dropped
// (a non-home copy) or left stale (the home): its bytes are undefined. A valid copy is leased as
// with kWrite.
enum class Access : uint8_t { kRead, kWrite, kOverwrite };

using BlockId = uint32_t;

struct BlockSpec {
  std::string name;  // used in every error about the block, e.g. "layer3.param16[r0]"
  uint64_t size_bytes = 0;
  DType dtype = DType::kBF16;
  StateKind kind = StateKind::kParam16;
  Tier home = Tier::kHost;
};

namespace store {
struct TicketState;
}  // namespace store

// The outcome of one asynchronous operation. Copyable; all copies see the same result.
class Ticket {
 public:
  Ticket() = default;
  explicit Ticket(std::shared_ptr<store::TicketState> s) : s_(std::move(s)) {}
  // Blocks until the operation finished, then returns its Status (the block's name in any
  // error). DeadlineExceeded if it did not finish within `timeout` (the operation continues).
  // FailedPrecondition for an empty (default-constructed) ticket.
  Status Wait(std::chrono::nanoseconds timeout) const;
  bool ready() const;
  // An empty ticket is one no operation stands behind (default-constructed).
  bool empty() const { return s_ == nullptr; }
  // Runs `fn` with the result once the operation finished: right away on this thread when it
  // already has, otherwise on the thread that completed it, with the store's lock held: `fn`
  // must be short, must not block and must not call into the store (post work elsewhere).
  // A `fn` receiving an error counts as a Wait that returned it.
  void Then(std::function<void(Status)> fn) const;

 private:
  std::shared_ptr<store::TicketState> s_;
};

class Store;

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
  Access access() const { return access_; }
  bool dirty() const { return dirty_; }
  // REQUIRES: a write (or overwrite) lease. At release the leased copy becomes the newest.
  void MarkDirty() { dirty_ = true; }
  void Release();
  explicit operator bool() const { return store_ != nullptr; }

 private:
  friend class Store;
  Store* store_ = nullptr;
  BlockId block_ = 0;
  Tier tier_ = Tier::kHost;
  Access access_ = Access::kRead;
  void* data_ = nullptr;
  uint64_t size_bytes_ = 0;
  bool dirty_ = false;
};

struct StoreStats {
  PerTier<PerTier<uint64_t>> bytes_moved;  // [from][to]
  uint64_t stall_ns = 0;                   // time Acquire callers waited
  uint64_t acquires = 0;
  uint64_t acquire_hits = 0;  // the copy was already valid when asked for
  PerTier<uint64_t> used_bytes;
  PerTier<uint64_t> peak_bytes;
  PerTier<uint64_t> budget_bytes;
  uint64_t io_busy_ns = 0;  // time with IO in flight, counted up to the latest completion
  uint64_t io_bytes = 0;
  // The NVMe tier's checksums (XXH3 per stripe unit: computed for each write, verified on each
  // read) on the IO thread: time spent, bytes hashed, and the part of that time with no IO in
  // flight, in which the disk waited for the hashing (the rest overlaps the disk's work).
  uint64_t checksum_ns = 0;
  uint64_t checksum_bytes = 0;
  uint64_t checksum_idle_ns = 0;
  uint64_t copy_busy_ns = 0;  // time with a device copy in flight (either direction)
  uint64_t copy_bytes = 0;
  uint64_t evictions = 0;
  uint64_t errors = 0;
  uint64_t acquire_timeouts = 0;  // Acquire calls that returned DeadlineExceeded
  // Per tier: time in which some operation (an Acquire's or a background prefetch's) was parked
  // waiting for room on the tier, its budget full of copies that cannot be dropped yet (leased,
  // in flight, or dirty and being written behind); a wait in progress counts up to now.
  PerTier<uint64_t> room_wait_ns{};
  uint64_t cancelled_fetches = 0;  // of those, fetches cancelled before any hop of theirs ran
};

// What a scheduler needs to know about one block, read under one lock for many blocks at once.
struct BlockView {
  PerTier<Residency> residency;
  PerTier<uint32_t> leases;  // read + write leases held on each tier's copy
  uint64_t size_bytes = 0;
  Tier home = Tier::kHost;
};

class Store {
 public:
  virtual ~Store() = default;

  // Registers a block and reserves its home copy (zero-filled, valid). InvalidArgument for size
  // 0, a duplicate name or a disabled home tier; ResourceExhausted when the home tier's budget
  // cannot hold it; the device's own error when it refuses a device home; FailedPrecondition for an
  // NVMe-homed block once the NVMe tier is open.
  virtual Result<BlockId> Register(const BlockSpec& spec) = 0;

  // Opens the NVMe tier (its swap space for every NVMe-homed block registered so far).
  // Idempotent; the first call's result is returned by every later one and a failed open fails
  // every later operation on an NVMe-homed block with the same error. FailedPrecondition: the
  // NVMe tier is disabled, or a swap file a live process holds is in the way (named; one a
  // crashed run left is reclaimed, with a note). NotFound /
  // IOError (ENOSPC names the path and bytes).
  virtual Status OpenNvme() = 0;
  virtual bool nvme_open() const = 0;
  // The swap files of the open NVMe tier (one per nvme path); empty before OpenNvme.
  virtual std::vector<std::string> nvme_files() const = 0;

  // An unknown id gives a ticket failed with NotFound (Fetch, WriteBack, Evict, Acquire).
  // Makes a valid copy resident on `tier` (each hop async). The block must then be leased
  // (Acquire) to be used; until then it may be evicted for space.
  virtual Ticket Fetch(BlockId id, Tier tier) = 0;
  // Copies the newest copy to the home tier (no-op when home is already newest).
  virtual Ticket WriteBack(BlockId id) = 0;
  // Drops the cached copy on `tier`, writing it back first when it is the newest.
  // FailedPrecondition for the home tier or a leased copy.
  virtual Ticket Evict(BlockId id, Tier tier) = 0;

  // Fetches if needed and returns a lease on the copy on `tier`. DeadlineExceeded after
  // `timeout`; the block's fetch error otherwise. A read lease waits while a writer holds the
  // block or is queued for it; a write lease waits until no lease on any tier of the block is
  // held and no operation of it runs. On timeout the lease request is withdrawn; the fetch it
  // started is cancelled when nothing else waits on it (no other Acquire; no Fetch, which always
  // counts as waiting, asked for it) and it has not started a hop.
  virtual Result<Lease> Acquire(BlockId id, Tier tier, Access access,
                                std::chrono::nanoseconds timeout) = 0;

  // Writes back every dirty block and waits (blocks set aside have nothing to write). The first
  // error, or DeadlineExceeded.
  virtual Status Flush(std::chrono::nanoseconds timeout) = 0;

  // Fills out[i] with the state of ids[i], all under one lock (a consistent snapshot).
  // REQUIRES: out.size() == ids.size() and every id registered.
  virtual void Snapshot(std::span<const BlockId> ids, std::span<BlockView> out) const = 0;
  virtual Residency residency(BlockId id, Tier tier) const = 0;  // REQUIRES: a registered id
  virtual const BlockSpec& spec(BlockId id) const = 0;           // REQUIRES: a registered id
  virtual size_t num_blocks() const = 0;
  // Counters since Open or the last TakeStats(true); used/peak/budget are current.
  virtual StoreStats TakeStats(bool reset) = 0;
  // One line per block (copies, leases, queued operations) and per tier: for diagnostics.
  virtual std::string DebugString() const = 0;
  // Setup notes (O_DIRECT refused, memory not locked, ...). Empty when nothing degraded.
  virtual std::string note() const = 0;
  // Sets device-homed blocks aside: each block's bytes move into host memory outside every
  // tier's budget (one allocation per call, page-locked for the device's copies when `pin` and
  // the device accepts it) and its device memory is freed. A page-locked allocation that a
  // restore emptied is kept (aside_kept_bytes) and reused by the next call with `pin` that fits
  // in it, as DeepSpeed keeps its pinned buffers: locking memory costs more than copying it. Until
  // RestoreAside every operation on it (Fetch, WriteBack, Evict, Acquire) fails FailedPrecondition
  // naming it. For a trainer that lends the device to other work between steps
  // (Engine::OffloadStates). Checks every block first: InvalidArgument for an unknown id;
  // FailedPrecondition for one that is not device-homed, already aside, leased, busy (operations
  // queued) or cached on another tier (evict it first); nothing changed then. A copy that fails
  // leaves every block as it was.
  virtual Status SetAside(std::span<const BlockId> ids, bool pin) {
    (void)ids;
    (void)pin;
    return Status::FailedPrecondition("SetAside: not offered by this store");
  }
  // Brings blocks set aside back to the device (their homes again, the same bytes). A block not
  // aside is skipped. ResourceExhausted (naming the block and the device's refusal) when the
  // device's budget or the device itself has no room: the blocks restored before it stay
  // restored, the rest stay aside, and a later call may finish. REQUIRES: ids registered.
  virtual Status RestoreAside(std::span<const BlockId> ids) {
    (void)ids;
    return Status::FailedPrecondition("RestoreAside: not offered by this store");
  }
  // Bytes of the blocks set aside now (host memory outside the tiers' budgets).
  virtual uint64_t aside_bytes() const { return 0; }
  // Page-locked host memory kept for the next SetAside (0 when none); freed when a SetAside
  // needs more, or without `pin`, or with the store.
  virtual uint64_t aside_kept_bytes() const { return 0; }

  // True when the host tier's memory is page-locked and registered for CUDA's copies (the pinned
  // pool with lock_host_memory, and CUDA accepted it): a device copy may land in a host block
  // directly and stay asynchronous.
  virtual bool host_page_locked() const { return false; }

 protected:
  // For implementations: a lease that calls ReleaseLease on this store when released.
  Lease MakeLease(BlockId id, Tier tier, Access access, void* data, uint64_t size_bytes);
  // Called once per lease made by MakeLease, when it is released or destroyed.
  virtual void ReleaseLease(Lease& lease) = 0;

  friend class Lease;
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
  // The NVMe tier is a swap space (nvme/swap_space.h): one preallocated O_DIRECT file per path
  // for `rank`, every block striped over all paths in `stripe_unit_bytes` units (several SSDs
  // add their bandwidth), an XXH3 checksum per block verified on every read, a failed write
  // invalidating the block; a swap file left by a crashed run is reclaimed (a note), one a live
  // process holds refused (FailedPrecondition).
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
  // The bound on the few waits the store cannot make asynchronous, and on a failing IO path:
  // - Register zero-fills a device-homed block (copies from a preallocated 1 MiB zero extent,
  //   under the store lock) and fails DeadlineExceeded when they take longer.
  // - When reaping NVMe IO keeps failing for this long, the IO path is given up: the IOs in
  //   flight are abandoned (their buffers never reused) and every later operation on an
  //   NVMe-homed block fails with IOError. Each failed reap already fails the waiters of the
  //   blocks in flight; this only decides when to stop retrying.
  // Default 60 s: far beyond any healthy copy or IO; shorter fails faster on a sick device.
  std::chrono::nanoseconds io_deadline = std::chrono::seconds(60);
  // The host slab: from a PinnedPool (2 MiB-aligned, huge pages advised, populated at open) when
  // true, plain aligned memory otherwise (tests on machines that refuse mlock run either way).
  bool use_pinned_pool = true;
  // With the pool: also lock the slab (mlock) and register it with CUDA (DeepSpeed's
  // pin_memory). Unlocked, it stays on huge pages: a 1 MiB O_DIRECT IO from 4 KiB pages has 256
  // segments, more than a virtio disk takes per request (254), so the kernel splits it in two
  // and the disk sees twice the requests for the same bytes, which is markedly slower there.
  bool lock_host_memory = true;
};

// Opens the tiered store (core/store/). InvalidArgument for a missing host budget, device or IO
// backend; IOError when the swap file cannot be created or sized; ResourceExhausted when host
// memory cannot be had.
Result<std::unique_ptr<Store>> OpenTieredStore(TieredStoreOptions options);

}  // namespace strata
