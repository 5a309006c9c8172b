// TieredStore: the implementation of strata::Store (include/strata/store.h, which holds the
// contract) over a device, a pinned host slab and an NVMe swap space.
//
// Threads: one IO thread owns the IoBackend (submits, reaps); one mover thread runs completions
// (state updates and the next hop). Both sleep on condition variables when idle.
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

#include "core/store/range_allocator.h"
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
  void ReleaseLease(Lease& lease) override;
  std::string Name(const Block& b) const;

  void IoLoop();
  void MoverLoop();
  void Post(std::function<void()> fn);

  TieredStoreOptions options_;
  std::string note_;

  mutable std::mutex mu_;
  std::condition_variable idle_cv_;
  std::vector<std::unique_ptr<Block>> blocks_;
  PerTier<uint64_t> used_;
  PerTier<uint64_t> budget_;
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
};

}  // namespace strata::store
