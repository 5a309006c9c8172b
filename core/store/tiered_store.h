// TieredStore: the implementation of strata::Store (include/strata/store.h, which holds the
// contract) over a device, a pinned host slab and an NVMe swap space.
//
// Threads: one IO thread owns the IoBackend (submits, reaps); one mover thread runs completions
// (state updates and the next hop). Both sleep on condition variables when idle.
//
// Files: tiered_store.cc (setup, entry points), store_ops.cc (the per-block state machine and its
// hops), store_space.cc (budgets, reservations, eviction), store_threads.cc (the two threads),
// store_nvme.cc (opening the NVMe tier), store_api.cc (Ticket, Lease, the factory), store_aside.cc
// (blocks set aside in host memory while the device is lent out).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

#include "core/store/range_allocator.h"
#include "nvme/bounded_queue.h"
#include "strata/device.h"
#include "strata/dtype.h"
#include "strata/io.h"
#include "strata/status.h"
#include "strata/store.h"

namespace strata::nvme {
class SwapSpace;
}  // namespace strata::nvme

namespace strata::cpu {
class PinnedPool;
class PinnedBuffer;
}  // namespace strata::cpu

namespace strata::store {

// The kinds of queued per-block operations (OpKindName in store_internal.h).
enum class OpKind : uint8_t { kFetch, kWriteBack, kEvict };

class TieredStore final : public Store {
 public:
  // See OpenTieredStore (include/strata/store.h).
  static Result<std::unique_ptr<TieredStore>> Open(TieredStoreOptions options);
  // Waits for running hops, fails queued operations with Aborted, stops the threads.
  // REQUIRES: no lease is held.
  ~TieredStore() override;

  // The Store contract (include/strata/store.h).
  Result<BlockId> Register(const BlockSpec& spec) override;
  Status OpenNvme() override;
  bool nvme_open() const override;
  std::vector<std::string> nvme_files() const override;
  Ticket Fetch(BlockId id, Tier tier) override;
  Ticket WriteBack(BlockId id) override;
  Ticket Evict(BlockId id, Tier tier) override;
  Result<Lease> Acquire(BlockId id, Tier tier, Access access,
                        std::chrono::nanoseconds timeout) override;
  Status Flush(std::chrono::nanoseconds timeout) override;
  void Snapshot(std::span<const BlockId> ids, std::span<BlockView> out) const override;
  Residency residency(BlockId id, Tier tier) const override;
  const BlockSpec& spec(BlockId id) const override;
  size_t num_blocks() const override;
  StoreStats TakeStats(bool reset) override;
  std::string DebugString() const override;
  std::string note() const override;
  bool host_page_locked() const override;
  Status SetAside(std::span<const BlockId> ids, bool pin) override;  // store_aside.cc
  Status RestoreAside(std::span<const BlockId> ids) override;
  uint64_t aside_bytes() const override;
  uint64_t aside_kept_bytes() const override;

 private:
  struct Copy;
  struct Block;
  struct Op;
  struct IoJob;
  struct AsideArena;
  enum class Outcome : uint8_t { kReady, kIssued, kParked, kFailed };
  // What the IO thread hands to the mover thread about one block's IO (HandleIoEvent).
  struct IoEvent {
    enum class Kind : uint8_t {
      kDone,        // the IO completed; `status` is its outcome
      kReapFailed,  // reaping failed while this IO was in flight: fail the block's waiters
      kLost,        // reaping failed for longer than io_deadline: the IO is given up
    };
    BlockId block = 0;
    Kind kind = Kind::kDone;
    Status status;
  };

  explicit TieredStore(TieredStoreOptions options);
  Status Init();

  // All of these REQUIRE mu_ held (store_ops.cc, store_space.cc).
  // Queues an operation on block `id` (joining a queued fetch where allowed) and pumps it.
  // `lease`: the lease an Acquire waits for, granted when the operation succeeds.
  Ticket Enqueue(BlockId id, OpKind kind, Tier tier, std::optional<Access> lease,
                 std::shared_ptr<Op>* op_out);
  // Whether a new operation may be queued on `b`: OK, or why it fails at once.
  Status Admit(const Block& b) const;
  // Advance(id), then starts the write-behind evictions that reservations asked for and retries
  // parked blocks while space was freed. Never called from inside Advance.
  void Pump(BlockId id);
  void Advance(BlockId id);
  // Starts or ends each tier's room-wait clock from the parked blocks (end of every Pump).
  void NoteRoomWaits();
  Outcome MakeValid(Block& b, Tier tier, Status* err);
  // The step of an Access::kOverwrite fetch: a copy on `tier` reserved but not filled.
  Outcome MakeWritable(Block& b, Tier tier, Status* err);
  Outcome WriteBackStep(Block& b, Status* err);
  Outcome EvictStep(Block& b, Tier tier, Status* err);
  void Finish(Block& b, Status status);
  void FailOps(Block& b, const Status& status);  // finishes every queued op of `b` with it
  // Reserves space for b's copy on `tier`, evicting clean idle copies. When that is not enough
  // and dirty idle copies could be written behind, records them in write_behind_ (started by
  // Pump once the current Advance returned) and parks.
  Outcome Reserve(Block& b, Tier tier, Status* err);
  // Takes b's room on `tier`: false when it is over the tier's budget, or the device refused
  // (*refused, when given, set to the device's error: ResourceExhausted for memory it lacks
  // beyond what the budget counts, anything else a fault the caller must not wait out).
  bool TryAllocate(Block& b, Tier tier, Status* refused = nullptr);
  // Whether anything on `tier` (other than block `except`'s copy) could ever free space: a copy
  // that is leased, in flight or busy, or one that is dirty and idle (it can be written behind;
  // appended to *dirty_idle). Changes nothing.
  bool CanEverFree(Tier tier, BlockId except, std::vector<BlockId>* dirty_idle) const;
  bool WriteBehindCandidate(const Block& v, Tier tier) const;
  // Starts the recorded write-behind evictions, each (block, tier) at most once per Pump
  // (`started`): one that failed at once is not retried in a loop under the lock; the parked
  // reservations wait for the next event, as for any other failed write-back.
  void StartWriteBehind(std::vector<std::pair<BlockId, Tier>>* started);
  void FreeCopy(Block& b, Tier tier);
  bool Droppable(const Block& b, Tier tier) const;
  Status IssueCopy(Block& b, Tier from, Tier to);
  void IssueIo(Block& b, IoOp op);
  void OnHopDone(BlockId id, Tier from, Tier to, Status status);
  void HandleIoEvent(IoEvent& e);
  Status NvmeReadyFor(BlockId id);  // opens the NVMe tier for an NVMe-homed block
  // Zero-fills device memory from zero_extent_, waiting at most io_deadline. REQUIRES mu_.
  Status ZeroDevice(void* dst, uint64_t size_bytes);
  void ReleaseLease(Lease& lease) override;
  std::string Name(const Block& b) const;

  // The IO thread (store_threads.cc).
  struct IoThread;
  void IoLoop();
  bool IoTake(IoThread& io);  // waits for work; false once stopping with nothing left
  void IoSubmit(IoThread& io);
  void IoReap(IoThread& io);
  void IoReapFailed(IoThread& io, const Status& err);
  // What the IO thread adds to the stats, handed to the mover thread with its events.
  struct IoTally {
    uint64_t busy_ns = 0;
    uint64_t checksum_ns = 0;
    uint64_t checksum_bytes = 0;
    uint64_t checksum_idle_ns = 0;
  };
  void HandOver(std::vector<IoEvent>* events, const IoTally& tally);  // IO thread -> mover thread
  void MoverLoop();
  void Post(std::function<void()> fn);

  TieredStoreOptions options_;
  std::string note_;

  mutable std::mutex mu_;
  std::condition_variable idle_cv_;
  std::vector<std::unique_ptr<Block>> blocks_;
  std::unordered_set<std::string> names_;  // of blocks_, for the duplicate check (no O(n^2))
  PerTier<uint64_t> used_;
  PerTier<uint64_t> budget_;
  uint64_t lru_clock_ = 0;
  uint32_t queued_ops_ = 0;
  uint32_t running_hops_ = 0;
  uint32_t copies_in_flight_ = 0;
  std::chrono::steady_clock::time_point copy_busy_since_;
  std::vector<BlockId> parked_;
  // Per tier: whether an operation waits for room there, since when (StoreStats::room_wait_ns).
  PerTier<bool> room_waiting_{};
  PerTier<std::chrono::steady_clock::time_point> room_since_{};
  // (block, tier) copies to write behind and evict, recorded by Reserve, started by Pump.
  std::vector<std::pair<BlockId, Tier>> write_behind_;
  uint32_t lost_hops_ = 0;  // IO hops given up after Reap kept failing (never complete)
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

  // One IO job slot per block (index: BlockId), sized when the NVMe tier opens.
  std::vector<IoJob> io_jobs_;
  uint64_t aside_bytes_ = 0;  // guarded by mu_
  // Arenas a failed set-aside or restore copy may still touch: kept until the store goes.
  std::vector<std::shared_ptr<AsideArena>> lost_arenas_;  // guarded by mu_
  // The page-locked arena the last restore emptied, kept for the next SetAside with pin.
  std::shared_ptr<AsideArena> kept_arena_;  // guarded by mu_
  // Zeros for the device homes Register zero-fills (kZeroExtentBytes, allocated at Open when
  // the device tier is enabled; never written).
  void* zero_extent_ = nullptr;
  bool zero_extent_clean_ = true;  // no copy from it can still be queued (guarded by mu_)
  // IO thread state (guarded by io_mu_): blocks whose IO job waits to be submitted.
  std::mutex io_mu_;
  std::condition_variable io_cv_;
  nvme::BoundedQueue<BlockId> io_queue_;
  bool io_stop_ = false;
  std::thread io_thread_;
  // Mover thread state (guarded by mv_mu_).
  std::mutex mv_mu_;
  std::condition_variable mv_cv_;
  std::deque<std::function<void()>> mv_queue_;
  std::vector<IoEvent> io_events_;  // from the IO thread, handled in batches under one mu_
  IoTally io_pending_;
  bool mv_stop_ = false;
  std::thread mover_thread_;
};

}  // namespace strata::store
