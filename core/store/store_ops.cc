// TieredStore operations: the per-block state machine. Everything here runs with mu_ held.
//
// Lifecycle of an operation: Enqueue appends it to its block's FIFO and pumps the block.
// Advance runs the front operation's step function, which looks at the block's copies afresh
// and either finishes (kReady / kFailed), starts exactly one hop (kIssued: a device copy or an
// IO) or parks (kParked: no space yet). A hop's completion arrives on the mover thread
// (OnHopDone), updates the destination copy and pumps the block again, so a chain such as
// NVMe -> host -> device is re-derived step by step from residency, never from remembered
// progress. Space is reserved before a hop starts, so a budget is never exceeded by work in
// flight. Parked blocks are retried whenever space may have been freed (a copy freed, a lease
// released); a parked operation fails with ResourceExhausted once nothing in flight, leased or
// dirty on that tier could ever free space for it.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <iterator>

#include "core/store/store_internal.h"

namespace strata::store {
namespace {

bool IsValid(Residency r) { return r == Residency::kValid; }

}  // namespace

std::string TieredStore::Name(const Block& b) const { return "block '" + b.spec.name + "'"; }

Ticket TieredStore::Enqueue(BlockId id, int kind, Tier tier, Access lease, bool with_lease,
                            std::shared_ptr<Op>* op_out) {
  Block& b = *blocks_[id];
  // Join a queued fetch of the same tier, except that a writer gets an operation of its own
  // and readers never share one with a writer: leases granted together must not conflict. Only
  // operations behind the last waiting writer are joined, so a reader never overtakes a writer
  // that asked first (writers cannot starve).
  if (kind == kOpFetch && !(with_lease && lease == Access::kWrite)) {
    auto first = b.ops.begin();
    for (auto it = b.ops.begin(); it != b.ops.end(); ++it) {
      if ((*it)->pending_write > 0) first = std::next(it);
    }
    for (auto it = first; it != b.ops.end(); ++it) {
      auto& op = *it;
      if (op->kind == kOpFetch && op->tier == tier && !op->done && op->pending_write == 0) {
        if (with_lease) ++(lease == Access::kRead ? op->pending_read : op->pending_write);
        if (op_out) *op_out = op;
        return Ticket(op->ticket);
      }
    }
  }
  auto op = std::make_shared<Op>();
  op->kind = kind;
  op->tier = tier;
  if (with_lease) ++(lease == Access::kRead ? op->pending_read : op->pending_write);
  if (op_out) *op_out = op;
  Ticket t(op->ticket);
  if (shutting_down_) {
    op->done = true;
    op->status = Status::Aborted(Name(b) + ": the store is shutting down");
    op->ticket->Complete(op->status);
    return t;
  }
  if (queued_ops_ >= options_.max_queued_ops) {
    op->done = true;
    op->status = Status::ResourceExhausted(Name(b) + ": more than " +
                                           std::to_string(options_.max_queued_ops) +
                                           " queued store operations");
    op->ticket->Complete(op->status);
    return t;
  }
  ++queued_ops_;
  b.ops.push_back(std::move(op));
  Pump(id);
  return t;
}

void TieredStore::Pump(BlockId id) {
  Advance(id);
  while (space_freed_ && !parked_.empty()) {
    space_freed_ = false;
    std::vector<BlockId> retry;
    retry.swap(parked_);
    for (BlockId p : retry) {
      blocks_[p]->parked = false;
      Advance(p);
    }
  }
  space_freed_ = false;
}

void TieredStore::Advance(BlockId id) {
  Block& b = *blocks_[id];
  while (!b.ops.empty() && !b.hop_in_flight && !b.write_leased()) {
    if (shutting_down_) {
      Finish(b, Status::Aborted(Name(b) + ": the store is closing"));
      continue;
    }
    Op& op = *b.ops.front();
    Status err;
    Outcome o;
    switch (op.kind) {
      case kOpFetch:
        o = MakeValid(b, op.tier, &err);
        break;
      case kOpWriteBack:
        o = WriteBackStep(b, &err);
        break;
      default:
        o = EvictStep(b, op.tier, &err);
        break;
    }
    if (o == Outcome::kIssued) return;
    if (o == Outcome::kReady && op.kind == kOpFetch && op.pending_write > 0 && b.leases() > 0) {
      return;  // a write lease waits for every lease on the block (re-advanced on release)
    }
    if (o == Outcome::kParked) {
      if (!b.parked) {
        b.parked = true;
        parked_.push_back(id);
      }
      return;
    }
    Finish(b, o == Outcome::kReady ? Status::OK() : err);
  }
}

void TieredStore::Finish(Block& b, Status status) {
  std::shared_ptr<Op> op = std::move(b.ops.front());
  b.ops.pop_front();
  --queued_ops_;
  op->done = true;
  if (status.ok() && op->kind == kOpFetch) {
    Copy& c = b.copy[op->tier];
    c.read_leases += op->pending_read;
    c.write_leases += op->pending_write;
    c.last_use = ++lru_clock_;
  }
  if (!status.ok()) {
    ++stats_.errors;
    // No Acquire waits on it (a background prefetch): keep it for the next waiter.
    if (op->kind == kOpFetch && op->pending_read + op->pending_write == 0) {
      b.failed_fetch = op->ticket;
    }
  }
  op->status = status;
  op->ticket->Complete(std::move(status));
  space_freed_ = true;  // an idle block's copies become evictable: parked blocks retry
  idle_cv_.notify_all();
}

TieredStore::Outcome TieredStore::MakeValid(Block& b, Tier tier, Status* err) {
  Copy& c = b.copy[tier];
  if (IsValid(c.state)) {
    c.last_use = ++lru_clock_;
    return Outcome::kReady;
  }
  // A stale copy that readers still lease: overwriting it would tear their reads. Retried when
  // a lease is released.
  if (c.leases() > 0) return Outcome::kParked;
  if (budget_[tier] == 0) {
    *err = Status::InvalidArgument(Name(b) + ": tier " + std::string(TierName(tier)) +
                                   " is disabled (budget 0)");
    return Outcome::kFailed;
  }
  if (tier == Tier::kNvme) return WriteBackStep(b, err);  // only the home can be on NVMe
  Copy& dev = b.copy[Tier::kDevice];
  Copy& host = b.copy[Tier::kHost];
  Tier from;
  if (tier == Tier::kDevice) {
    Outcome o = MakeValid(b, Tier::kHost, err);
    if (o != Outcome::kReady) return o;
    from = Tier::kHost;
  } else if (IsValid(dev.state)) {
    from = Tier::kDevice;
  } else if (b.spec.home == Tier::kNvme && IsValid(b.copy[Tier::kNvme].state)) {
    from = Tier::kNvme;
  } else {
    *err = Status::Internal(Name(b) + ": no valid copy on any tier");
    return Outcome::kFailed;
  }
  Outcome o = Reserve(b, tier, err);
  if (o != Outcome::kReady) return o;
  if (from == Tier::kNvme && !b.nvme_written) {
    // The registered value (zeros); the swap holds nothing yet. Still an async hop (on the mover
    // thread): a copy that became valid synchronously could be evicted by another parked block
    // at once, and two parked blocks would take each other's space forever inside one Pump.
    host.state = Residency::kInFlight;
    b.hop_in_flight = true;
    ++running_hops_;
    const BlockId id = b.id;
    void* dst = host.ptr;
    const uint64_t n = b.alloc_bytes;
    Post([this, id, dst, n] {
      std::memset(dst, 0, n);  // reserved and in flight: no one else touches it
      std::lock_guard<std::mutex> l(mu_);
      OnHopDone(id, Tier::kNvme, Tier::kHost, Status::OK());
    });
    return Outcome::kIssued;
  }
  if (from == Tier::kNvme) {
    IssueIo(b, IoOp::kRead);
    return Outcome::kIssued;
  }
  *err = IssueCopy(b, from, tier);
  return err->ok() ? Outcome::kIssued : Outcome::kFailed;
}

TieredStore::Outcome TieredStore::WriteBackStep(Block& b, Status* err) {
  if (IsValid(b.home().state)) return Outcome::kReady;
  if (b.home().leases() > 0) return Outcome::kParked;  // readers of the stale home copy
  switch (b.spec.home) {
    case Tier::kHost:  // the newest is on the device
      *err = IssueCopy(b, Tier::kDevice, Tier::kHost);
      break;
    case Tier::kDevice:
      *err = IssueCopy(b, Tier::kHost, Tier::kDevice);
      break;
    case Tier::kNvme: {
      Outcome o = MakeValid(b, Tier::kHost, err);
      if (o != Outcome::kReady) return o;
      IssueIo(b, IoOp::kWrite);
      return Outcome::kIssued;
    }
  }
  return err->ok() ? Outcome::kIssued : Outcome::kFailed;
}

bool TieredStore::Droppable(Block& b, Tier tier) {
  if (tier == b.spec.home) return false;
  if (IsValid(b.home().state)) return true;
  for (Tier t : kAllTiers) {
    if (t != tier && t != b.spec.home && IsValid(b.copy[t].state)) {
      return true;  // another cached copy keeps the newest bytes
    }
  }
  return false;
}

TieredStore::Outcome TieredStore::EvictStep(Block& b, Tier tier, Status* err) {
  Copy& c = b.copy[tier];
  if (tier == b.spec.home) {
    *err = Status::FailedPrecondition(Name(b) + ": cannot evict the home copy (tier " +
                                      std::string(TierName(tier)) + ")");
    return Outcome::kFailed;
  }
  if (!c.reserved) return Outcome::kReady;
  if (c.leases() > 0) {
    *err = Status::FailedPrecondition(Name(b) + ": cannot evict a leased copy from tier " +
                                      std::string(TierName(tier)));
    return Outcome::kFailed;
  }
  if (!Droppable(b, tier)) {
    Outcome o = WriteBackStep(b, err);
    if (o != Outcome::kReady) return o;
  }
  FreeCopy(b, tier);
  ++stats_.evictions;
  return Outcome::kReady;
}

bool TieredStore::TryAllocate(Block& b, Tier tier) {
  const Tier t = tier;
  Copy& c = b.copy[t];
  if (used_[t] + b.alloc_bytes > budget_[t]) return false;
  if (tier == Tier::kHost) {
    auto off = host_alloc_->Allocate(b.alloc_bytes);
    if (!off) return false;
    c.offset = *off;
    c.ptr = host_base_ + *off;
  } else if (tier == Tier::kDevice) {
    auto p = options_.device->Allocate(b.alloc_bytes);
    if (!p.ok()) return false;
    c.ptr = *p;
  }  // NVMe: only home copies, laid out by the swap space when the tier opens; budget only
  c.reserved = true;
  used_[t] += b.alloc_bytes;
  stats_.peak_bytes[t] = std::max(stats_.peak_bytes[t], used_[t]);
  return true;
}

TieredStore::Outcome TieredStore::Reserve(Block& b, Tier tier, Status* err) {
  const Tier t = tier;
  if (b.copy[t].reserved) return Outcome::kReady;
  if (TryAllocate(b, tier)) return Outcome::kReady;
  // Evict unleased, droppable cached copies of blocks with no hop running, least recently used
  // first. A block whose operation is parked may lose a copy: its steps are re-derived from
  // residency, so it re-fetches; keeping such copies would let two parked blocks wait on each
  // other's space.
  std::vector<std::pair<uint64_t, BlockId>> victims;
  for (auto& bp : blocks_) {
    Block& v = *bp;
    const Copy& c = v.copy[t];
    if (v.id == b.id || !IsValid(c.state) || c.leases() || v.hop_in_flight) continue;
    if (Droppable(v, tier)) victims.emplace_back(c.last_use, v.id);
  }
  std::sort(victims.begin(), victims.end());
  for (auto& [use, vid] : victims) {
    FreeCopy(*blocks_[vid], tier);
    ++stats_.evictions;
    if (TryAllocate(b, tier)) return Outcome::kReady;
  }
  if (CanEverFree(tier, b.id)) return Outcome::kParked;
  *err = Status::ResourceExhausted(
      Name(b) + " needs " + std::to_string(b.alloc_bytes) + " bytes on tier " +
      std::string(TierName(tier)) + " (budget " + std::to_string(budget_[t]) + ", in use " +
      std::to_string(used_[t]) + "): nothing in flight, leased or dirty there can free it");
  return Outcome::kFailed;
}

bool TieredStore::CanEverFree(Tier tier, BlockId except) {
  const Tier t = tier;
  bool can = false;
  for (auto& bp : blocks_) {
    Block& v = *bp;
    const Copy& c = v.copy[t];
    if (v.id == except || tier == v.spec.home || !c.reserved) continue;
    if (c.leases() || c.state == Residency::kInFlight || !v.ops.empty() || v.hop_in_flight) {
      can = true;  // released, completed or evicted later; retried then
    } else if (IsValid(c.state) && !Droppable(v, tier)) {
      Enqueue(v.id, kOpEvict, tier, Access::kRead, false, nullptr);  // write-behind eviction
      can = true;
    }
  }
  return can;
}

void TieredStore::FreeCopy(Block& b, Tier tier) {
  const Tier t = tier;
  Copy& c = b.copy[t];
  if (!c.reserved) return;
  if (tier == Tier::kDevice) {
    options_.device->Free(c.ptr).IgnoreError();  // only fails for unknown pointers (a bug)
  } else if (tier == Tier::kHost) {
    host_alloc_->Free(c.offset, b.alloc_bytes);
  }
  used_[t] -= b.alloc_bytes;
  c = Copy{};
  space_freed_ = true;
}

Status TieredStore::IssueCopy(Block& b, Tier from, Tier to) {
  Copy& src = b.copy[from];
  Copy& dst = b.copy[to];
  const CopyDir dir = to == Tier::kDevice ? CopyDir::kHostToDevice : CopyDir::kDeviceToHost;
  if (to != b.spec.home) dst.state = Residency::kInFlight;
  b.hop_in_flight = true;
  ++running_hops_;
  if (copies_in_flight_++ == 0) copy_busy_since_ = std::chrono::steady_clock::now();
  const BlockId id = b.id;
  Status s = options_.device->CopyAsync(dir, dst.ptr, src.ptr, b.alloc_bytes,
                                        [this, id, from, to](Status st) {
                                          Post([this, id, from, to, st] {
                                            std::lock_guard<std::mutex> l(mu_);
                                            OnHopDone(id, from, to, st);
                                          });
                                        });
  if (!s.ok()) {
    b.hop_in_flight = false;
    --running_hops_;
    --copies_in_flight_;
    if (to != b.spec.home) FreeCopy(b, to);
    return s.WithContext(Name(b));
  }
  return Status::OK();
}

void TieredStore::IssueIo(Block& b, IoOp op) {
  auto job = std::make_unique<IoJob>();
  job->block = b.id;
  job->op = op;
  job->buffer = b.copy[Tier::kHost].ptr;
  job->length_bytes = b.alloc_bytes;
  if (op == IoOp::kRead) b.copy[Tier::kHost].state = Residency::kInFlight;
  b.hop_in_flight = true;
  ++running_hops_;
  if (!swap_) {  // not reached through the public entry points, which open the tier first
    const BlockId id = b.id;
    const bool read = op == IoOp::kRead;
    Post([this, id, read] {
      std::lock_guard<std::mutex> l(mu_);
      OnHopDone(id, read ? Tier::kNvme : Tier::kHost, read ? Tier::kHost : Tier::kNvme,
                Status::FailedPrecondition("the NVMe tier is not open"));
    });
    return;
  }
  std::lock_guard<std::mutex> l(io_mu_);
  io_queue_.push_back(std::move(job));
  io_cv_.notify_one();
}

void TieredStore::OnHopDone(BlockId id, Tier from, Tier to, Status status) {
  Block& b = *blocks_[id];
  b.hop_in_flight = false;
  --running_hops_;
  space_freed_ = true;  // parked blocks counted on this hop: let them re-check
  if (from != Tier::kNvme && to != Tier::kNvme) {  // a device copy
    if (--copies_in_flight_ == 0) {
      stats_.copy_busy_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(
                                 std::chrono::steady_clock::now() - copy_busy_since_)
                                 .count();
    }
    if (status.ok()) stats_.copy_bytes += b.alloc_bytes;
  }
  Copy& dst = b.copy[to];
  if (status.ok()) {
    dst.state = Residency::kValid;
    dst.last_use = ++lru_clock_;
    stats_.bytes_moved[from][to] += b.spec.size_bytes;
    if (to == Tier::kNvme) b.nvme_written = true;
  } else {
    // Never mark valid. A failed write leaves the home stale (possibly torn) and the cached
    // newest copy in place, so nothing is lost and a later WriteBack can retry.
    if (to != b.spec.home) FreeCopy(b, to);
    if (!b.ops.empty()) Finish(b, status.WithContext(Name(b)));
  }
  Pump(id);
  idle_cv_.notify_all();
}

void TieredStore::ReleaseLease(Lease& lease) {
  std::lock_guard<std::mutex> l(mu_);
  Block& b = *blocks_[lease.block()];
  Copy& c = b.copy[lease.tier()];
  if (lease.access() == Access::kWrite) {
    --c.write_leases;
  } else {
    --c.read_leases;
  }
  c.last_use = ++lru_clock_;
  if (lease.tier() != b.spec.home && c.state == Residency::kStale && c.leases() == 0) {
    FreeCopy(b, lease.tier());  // overwritten through another lease while we read it
  }
  if (lease.dirty()) {
    // The leased copy now holds the newest bytes: drop the other cached copies; the home is
    // stale unless it is the leased copy.
    for (Tier t : kAllTiers) {
      if (t == lease.tier()) continue;
      if (t == b.spec.home) {
        b.copy[t].state = Residency::kStale;
      } else if (b.copy[t].leases() == 0) {
        FreeCopy(b, static_cast<Tier>(t));
      } else {
        b.copy[t].state = Residency::kStale;  // a reader still holds it (REQUIRES broken)
      }
    }
    c.state = Residency::kValid;
  }
  space_freed_ = true;  // a released lease may unblock parked reservations
  Pump(lease.block());
}

}  // namespace strata::store
