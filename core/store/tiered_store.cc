// TieredStore: setup and teardown, and the public entry points (Register, Fetch, WriteBack,
// Evict, Acquire and its leases, Flush, the stats). The IO and mover threads are in
// store_threads.cc, the per-block state machine in store_ops.cc.
#include "core/store/tiered_store.h"

#include <algorithm>
#include <cstring>

#include "core/store/store_internal.h"
#include "cpu/pinned_pool.h"
#include "nvme/swap_space.h"  // SwapSpace is complete where swap_ is destroyed

namespace strata::store {
namespace {

using Clock = std::chrono::steady_clock;

}  // namespace

// ---------------------------------------------------------------------------
// Setup and teardown.
// ---------------------------------------------------------------------------
TieredStore::TieredStore(TieredStoreOptions options) : options_(std::move(options)) {}

Result<std::unique_ptr<TieredStore>> TieredStore::Open(TieredStoreOptions options) {
  if (options.host_budget_bytes == 0) {
    return Status::InvalidArgument("TieredStoreOptions.host_budget_bytes must be > 0");
  }
  if (options.device_budget_bytes > 0 && options.device == nullptr) {
    return Status::InvalidArgument("TieredStoreOptions: device_budget_bytes > 0 needs a device");
  }
  if (options.nvme_capacity_bytes > 0 && (!options.io || options.nvme_paths.empty())) {
    return Status::InvalidArgument(
        "TieredStoreOptions: nvme_capacity_bytes > 0 needs an IO backend and nvme_paths");
  }
  if (options.nvme_capacity_bytes > 0 &&
      (options.stripe_unit_bytes == 0 || options.stripe_unit_bytes % kIoAlignment != 0)) {
    return Status::InvalidArgument("TieredStoreOptions.stripe_unit_bytes " +
                                   std::to_string(options.stripe_unit_bytes) +
                                   " is not a positive multiple of 4096");
  }
  std::unique_ptr<TieredStore> s(new TieredStore(std::move(options)));
  STRATA_RETURN_IF_ERROR(s->Init());
  return s;
}

Status TieredStore::Init() {
  budget_[Tier::kDevice] = options_.device_budget_bytes;
  budget_[Tier::kHost] = options_.host_budget_bytes;
  budget_[Tier::kNvme] = options_.nvme_capacity_bytes;
  for (Tier t : kAllTiers) stats_.budget_bytes[t] = budget_[t];

  // Host tier: one slab, carved in IO-aligned ranges.
  const uint64_t host_bytes =
      (options_.host_budget_bytes + kIoAlignment - 1) / kIoAlignment * kIoAlignment;
  if (options_.use_pinned_pool) {
    cpu::PinnedPoolOptions po;
    po.budget_bytes =
        (host_bytes + cpu::kHugePageBytes - 1) / cpu::kHugePageBytes * cpu::kHugePageBytes;
    po.lock_memory = options_.lock_host_memory;
    po.register_with_cuda = options_.lock_host_memory;
    STRATA_ASSIGN_OR_RETURN(pool_, cpu::PinnedPool::Create(po));
    STRATA_ASSIGN_OR_RETURN(auto buf, pool_->Allocate(host_bytes));
    slab_ = std::make_unique<cpu::PinnedBuffer>(std::move(buf));
    host_base_ = static_cast<uint8_t*>(slab_->data());
    if (!pool_->note().empty()) note_ += pool_->note() + "\n";
  } else {
    plain_slab_ = std::aligned_alloc(kIoAlignment, host_bytes);
    if (!plain_slab_) return Status::ResourceExhausted("TieredStore: host slab allocation failed");
    host_base_ = static_cast<uint8_t*>(plain_slab_);
  }
  host_alloc_ = std::make_unique<RangeAllocator>(host_bytes, kIoAlignment);

  if (options_.device_budget_bytes > 0) {
    zero_extent_ = std::aligned_alloc(kIoAlignment, kZeroExtentBytes);
    if (!zero_extent_) return Status::ResourceExhausted("TieredStore: zero extent allocation");
    std::memset(zero_extent_, 0, kZeroExtentBytes);
    // Unavailable (memory not locked) only makes the copies synchronous; they still work.
    options_.device->RegisterHost(zero_extent_, kZeroExtentBytes).IgnoreError();
  }

  mover_thread_ = std::thread([this] { MoverLoop(); });
  return Status::OK();
}

TieredStore::~TieredStore() {
  {
    std::unique_lock<std::mutex> l(mu_);
    shutting_down_ = true;
    // Operations without a running hop are aborted (Advance sees shutting_down_); running
    // hops finish, and their operations are aborted when they complete.
    for (auto& bp : blocks_) Advance(bp->id);
    // Lost IO hops (Reap kept failing, see IoLoop) never complete.
    idle_cv_.wait(l, [&] { return running_hops_ == lost_hops_; });
  }
  {
    std::lock_guard<std::mutex> l(io_mu_);
    io_stop_ = true;
  }
  io_cv_.notify_all();
  if (io_thread_.joinable()) io_thread_.join();
  {
    std::lock_guard<std::mutex> l(mv_mu_);
    mv_stop_ = true;
  }
  mv_cv_.notify_all();
  if (mover_thread_.joinable()) mover_thread_.join();
  for (auto& bp : blocks_) {
    if (bp->copy[Tier::kDevice].reserved)
      options_.device->Free(bp->copy[Tier::kDevice].ptr).IgnoreError();
  }
  // Nothing is in flight unless IO was lost; then Close tries to drain it once more.
  const bool io_quiet = !swap_ || swap_->Close().ok();
  swap_.reset();
  if (!io_quiet) {
    // IO may still land in the host slab: leak it rather than free memory under IO in flight.
    (void)slab_.release();
    (void)pool_.release();
    plain_slab_ = nullptr;
  } else if (host_registered_) {
    options_.io->UnregisterBuffer(host_base_);
  }
  slab_.reset();
  pool_.reset();
  std::free(plain_slab_);
  if (zero_extent_ != nullptr && !zero_extent_clean_) {
    // A zero-fill timed out: its copies may still read the extent. Free it only once they are
    // done, as far as one more deadline tells; otherwise leak it.
    auto ev = options_.device->RecordEvent(CopyDir::kHostToDevice);
    zero_extent_clean_ = ev.ok() && (*ev)->Wait(options_.io_deadline).ok();
  }
  if (zero_extent_ != nullptr && zero_extent_clean_) {
    options_.device->UnregisterHost(zero_extent_).IgnoreError();
    std::free(zero_extent_);
  }
}

Status TieredStore::ZeroDevice(void* dst, uint64_t size_bytes) {
  uint8_t* p = static_cast<uint8_t*>(dst);
  Status s;
  for (uint64_t off = 0; off < size_bytes && s.ok(); off += kZeroExtentBytes) {
    s = options_.device->CopyAsync(CopyDir::kHostToDevice, p + off, zero_extent_,
                                   std::min(kZeroExtentBytes, size_bytes - off), {});
  }
  if (s.ok()) {
    auto ev = options_.device->RecordEvent(CopyDir::kHostToDevice);
    s = ev.ok() ? (*ev)->Wait(options_.io_deadline) : ev.status();
  }
  if (!s.ok()) zero_extent_clean_ = false;  // copies from it may still be queued
  return s;
}

// ---------------------------------------------------------------------------
// Public entry points.
// ---------------------------------------------------------------------------
Result<BlockId> TieredStore::Register(const BlockSpec& spec) {
  if (spec.size_bytes == 0) {
    return Status::InvalidArgument("TieredStore::Register: block '" + spec.name + "' has size 0");
  }
  std::unique_lock<std::mutex> l(mu_);
  if (names_.contains(spec.name)) {
    return Status::InvalidArgument("TieredStore::Register: duplicate block name '" + spec.name +
                                   "'");
  }
  const Tier h = spec.home;
  if (h == Tier::kNvme && nvme_state_ != NvmeState::kClosed) {
    return Status::FailedPrecondition(
        "TieredStore::Register: block '" + spec.name +
        "' is NVMe-homed but the NVMe tier is already open (its swap space is laid out for the "
        "blocks registered before OpenNvme or the first NVMe operation)");
  }
  if (budget_[h] == 0) {
    return Status::InvalidArgument("TieredStore::Register: block '" + spec.name +
                                   "' has home tier " + std::string(TierName(spec.home)) +
                                   ", which is disabled (budget 0)");
  }
  auto b = std::make_unique<Block>();
  b->id = static_cast<BlockId>(blocks_.size());
  b->spec = spec;
  b->alloc_bytes = (spec.size_bytes + kIoAlignment - 1) / kIoAlignment * kIoAlignment;
  if (Status refused; !TryAllocate(*b, spec.home, &refused)) {
    const std::string what = "TieredStore::Register: block '" + spec.name + "' (" +
                             std::to_string(b->alloc_bytes) + " bytes)";
    if (!refused.ok()) {
      return Status(refused.code(), what + ": the device refused its home on tier hbm (budget " +
                                        std::to_string(budget_[h]) + ", in use " +
                                        std::to_string(used_[h]) +
                                        "): " + std::string(refused.message()));
    }
    return Status::ResourceExhausted(
        what + " does not fit its home tier " + std::string(TierName(spec.home)) + " (budget " +
        std::to_string(budget_[h]) + ", in use " + std::to_string(used_[h]) + ")");
  }
  Copy& home = b->home();
  home.state = Residency::kValid;
  if (spec.home == Tier::kHost) {
    std::memset(home.ptr, 0, b->alloc_bytes);
  } else if (spec.home == Tier::kNvme) {
    // Zeros until first written back (nvme_written): nothing to do now.
  } else {
    // Held under the lock so a concurrent Register cannot take the same name; no completion
    // path needs this lock to finish the copies.
    Status s = ZeroDevice(home.ptr, b->alloc_bytes);
    if (!s.ok()) {
      FreeCopy(*b, Tier::kDevice);
      return s.WithContext("TieredStore::Register: zeroing block '" + spec.name + "'");
    }
  }
  names_.insert(spec.name);
  blocks_.push_back(std::move(b));
  return blocks_.back()->id;
}

namespace {
Ticket FailedTicket(Status s) {
  auto t = std::make_shared<TicketState>();
  t->Complete(std::move(s));
  return Ticket(t);
}
}  // namespace

Ticket TieredStore::Fetch(BlockId id, Tier tier) {
  if (Status n = NvmeReadyFor(id); !n.ok()) return FailedTicket(std::move(n));
  std::lock_guard<std::mutex> l(mu_);
  if (id >= blocks_.size())
    return FailedTicket(Status::NotFound("Fetch: no block " + std::to_string(id)));
  Block& b = *blocks_[id];
  if (b.copy[tier].state != Residency::kValid) {
    Status e = b.TakeFailedFetch();
    if (!e.ok()) return FailedTicket(std::move(e));
  }
  return Enqueue(id, OpKind::kFetch, tier, std::nullopt, nullptr);
}

Ticket TieredStore::WriteBack(BlockId id) {
  if (Status n = NvmeReadyFor(id); !n.ok()) return FailedTicket(std::move(n));
  std::lock_guard<std::mutex> l(mu_);
  if (id >= blocks_.size()) {
    return FailedTicket(Status::NotFound("WriteBack: no block " + std::to_string(id)));
  }
  return Enqueue(id, OpKind::kWriteBack, Tier::kHost, std::nullopt, nullptr);
}

Ticket TieredStore::Evict(BlockId id, Tier tier) {
  if (Status n = NvmeReadyFor(id); !n.ok()) return FailedTicket(std::move(n));
  std::lock_guard<std::mutex> l(mu_);
  if (id >= blocks_.size())
    return FailedTicket(Status::NotFound("Evict: no block " + std::to_string(id)));
  return Enqueue(id, OpKind::kEvict, tier, std::nullopt, nullptr);
}

Result<Lease> TieredStore::Acquire(BlockId id, Tier tier, Access access,
                                   std::chrono::nanoseconds timeout) {
  STRATA_RETURN_IF_ERROR(NvmeReadyFor(id));
  std::shared_ptr<Op> op;
  Ticket ticket;
  {
    std::lock_guard<std::mutex> l(mu_);
    if (id >= blocks_.size()) {
      return Status::NotFound("TieredStore::Acquire: no block " + std::to_string(id));
    }
    Block& b = *blocks_[id];
    ++stats_.acquires;
    Copy& c = b.copy[tier];
    if (c.state != Residency::kValid) {
      Status e = b.TakeFailedFetch();
      if (!e.ok()) {
        return e;
      }
    }
    // Readers share a valid copy unless a writer holds the block or waits for it (then they
    // queue behind it); a writer needs the block to itself: no lease, no operation running.
    const bool free_to_use =
        c.state == Residency::kValid && !b.write_leased() &&
        (access == Access::kRead ? !b.writer_waiting()
                                 : b.ops.empty() && !b.hop_in_flight && b.leases() == 0);
    if (free_to_use) {
      ++stats_.acquire_hits;
      ++(access == Access::kRead ? c.read_leases : c.write_leases);
      c.last_use = ++lru_clock_;
      return MakeLease(id, tier, access, c.ptr, b.spec.size_bytes);
    }
    ticket = Enqueue(id, OpKind::kFetch, tier, access, &op);
  }
  const auto t0 = Clock::now();
  Status s = ticket.Wait(timeout);
  std::lock_guard<std::mutex> l(mu_);
  stats_.stall_ns += Ns(Clock::now() - t0);
  Block& b = *blocks_[id];
  if (!op->done) {  // timed out: withdraw our lease request and our wait
    --(access == Access::kRead ? op->pending_read : op->pending_write);
    --op->waiters;
    ++stats_.acquire_timeouts;
    // Cancel the fetch when nobody waits for it any more (no other Acquire, no Fetch that asked
    // for it or joined it) and no hop of it is running. Otherwise it runs on: its copy stays
    // resident but unleased (evictable), and an error goes to the next waiter.
    const bool running = !b.ops.empty() && b.ops.front() == op && b.hop_in_flight;
    if (op->waiters == 0 && !running) {
      auto it = std::find(b.ops.begin(), b.ops.end(), op);
      if (it != b.ops.end()) {
        b.ops.erase(it);
        --queued_ops_;
        op->done = true;
        op->status = Status::Aborted(Name(b) + ": fetch cancelled, its Acquire timed out");
        op->ticket->Complete(op->status);
        ++stats_.cancelled_fetches;
        space_freed_ = true;
      }
    }
    Pump(id);  // a withdrawn writer may have held queued readers back
    return Status::DeadlineExceeded(Name(b) + ": not resident on tier " +
                                    std::string(TierName(tier)) + " within the timeout");
  }
  if (!op->status.ok()) {
    return op->status;
  }
  return MakeLease(id, tier, access, b.copy[tier].ptr, b.spec.size_bytes);
}

Status TieredStore::Flush(std::chrono::nanoseconds timeout) {
  std::vector<Ticket> tickets;
  {
    std::lock_guard<std::mutex> l(mu_);
    for (auto& bp : blocks_) {
      if (bp->aside) continue;  // no copy anywhere: nothing to write (store_aside.cc)
      if (bp->home().state != Residency::kValid || !bp->ops.empty()) {
        tickets.push_back(Enqueue(bp->id, OpKind::kWriteBack, Tier::kHost, std::nullopt, nullptr));
      }
    }
  }
  const auto deadline = Clock::now() + timeout;
  Status first;
  for (const Ticket& t : tickets) {
    Status s = t.Wait(std::max(Clock::duration::zero(), deadline - Clock::now()));
    if (!s.ok() && first.ok()) first = s;
  }
  return first;
}

Residency TieredStore::residency(BlockId id, Tier tier) const {
  std::lock_guard<std::mutex> l(mu_);
  const Block& b = *blocks_.at(id);
  Residency r = b.copy[tier].state;
  if (r == Residency::kValid && tier != b.spec.home &&
      b.copy[b.spec.home].state == Residency::kStale) {
    return Residency::kDirty;
  }
  return r;
}

void TieredStore::Snapshot(std::span<const BlockId> ids, std::span<BlockView> out) const {
  std::lock_guard<std::mutex> l(mu_);
  for (size_t i = 0; i < ids.size() && i < out.size(); ++i) {
    const Block& b = *blocks_.at(ids[i]);
    BlockView& v = out[i];
    v.size_bytes = b.spec.size_bytes;
    v.home = b.spec.home;
    const bool home_stale = b.copy[b.spec.home].state == Residency::kStale;
    for (Tier t : kAllTiers) {
      const Copy& c = b.copy[t];
      v.residency[t] = (c.state == Residency::kValid && t != b.spec.home && home_stale)
                           ? Residency::kDirty
                           : c.state;
      v.leases[t] = c.leases();
    }
  }
}

const BlockSpec& TieredStore::spec(BlockId id) const {
  std::lock_guard<std::mutex> l(mu_);
  return blocks_.at(id)->spec;
}

size_t TieredStore::num_blocks() const {
  std::lock_guard<std::mutex> l(mu_);
  return blocks_.size();
}

StoreStats TieredStore::TakeStats(bool reset) {
  std::lock_guard<std::mutex> l(mu_);
  StoreStats s = stats_;
  const auto now = std::chrono::steady_clock::now();
  for (Tier t : kAllTiers) {
    s.used_bytes[t] = used_[t];
    if (room_waiting_[t]) {  // a wait in progress counts up to now
      s.room_wait_ns[t] += Ns(now - room_since_[t]);
    }
  }
  if (reset) {
    stats_ = StoreStats{};
    for (Tier t : kAllTiers) {
      stats_.budget_bytes[t] = budget_[t];
      stats_.peak_bytes[t] = used_[t];
      room_since_[t] = now;
    }
  }
  return s;
}

bool TieredStore::host_page_locked() const {
  return slab_ && pool_ && pool_->registers_with_cuda() && slab_->locked() && slab_->registered();
}

std::string TieredStore::note() const {
  std::lock_guard<std::mutex> l(mu_);
  return note_;
}

std::string TieredStore::DebugString() const {
  std::lock_guard<std::mutex> l(mu_);
  std::string out;
  for (Tier t : kAllTiers) {
    out += std::string(TierName(t)) + ": " + std::to_string(used_[t]) + "/" +
           std::to_string(budget_[t]) + " bytes\n";
  }
  for (const auto& bp : blocks_) {
    const Block& b = *bp;
    out += b.spec.name + " home=" + std::string(TierName(b.spec.home));
    for (Tier t : kAllTiers) {
      const Copy& c = b.copy[t];
      out += " " + std::string(TierName(t)) + "=" + std::string(ResidencyName(c.state)) +
             (c.reserved ? "" : "(unreserved)") + "/r" + std::to_string(c.read_leases) + "w" +
             std::to_string(c.write_leases);
    }
    out += " ops=";
    for (const auto& op : b.ops) {
      out += std::string(OpKindName(op->kind)) + ":" + std::string(TierName(op->tier)) + ",";
    }
    out += b.hop_in_flight ? " hop" : "";
    out += b.parked ? " parked" : "";
    out += "\n";
  }
  return out;
}

}  // namespace strata::store
