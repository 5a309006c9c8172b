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
// dirty on that tier could ever free space for it. Dirty idle copies that could free space are
// written behind by evictions that Reserve records and Pump starts after the current Advance
// returned, so an Advance never runs inside another (store_space.cc).
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

Ticket TieredStore::Enqueue(BlockId id, OpKind kind, Tier tier, std::optional<Access> lease,
                            std::shared_ptr<Op>* op_out) {
  Block& b = *blocks_[id];
  auto add_lease = [&](Op& op) {
    if (lease) ++(*lease == Access::kRead ? op.pending_read : op.pending_write);
  };
  // Join a queued fetch of the same tier, except that a writer gets an operation of its own
  // and readers never share one with a writer: leases granted together must not conflict. Only
  // operations behind the last waiting writer are joined, so a reader never overtakes a writer
  // that asked first (writers cannot starve).
  if (kind == OpKind::kFetch && lease != Access::kWrite && lease != Access::kOverwrite) {
    auto first = b.ops.begin();
    for (auto it = b.ops.begin(); it != b.ops.end(); ++it) {
      if ((*it)->pending_write > 0) first = std::next(it);
    }
    for (auto it = first; it != b.ops.end(); ++it) {
      auto& op = *it;
      if (op->kind == OpKind::kFetch && op->tier == tier && !op->done && op->pending_write == 0) {
        add_lease(*op);
        ++op->waiters;
        if (op_out) *op_out = op;
        return Ticket(op->ticket);
      }
    }
  }
  auto op = std::make_shared<Op>();
  op->kind = kind;
  op->tier = tier;
  op->waiters = 1;
  op->overwrite = lease == Access::kOverwrite;
  add_lease(*op);
  if (op_out) *op_out = op;
  Ticket t(op->ticket);
  if (Status refused = Admit(b); !refused.ok()) {
    op->done = true;
    op->status = refused;
    op->ticket->Complete(std::move(refused));
    return t;
  }
  ++queued_ops_;
  b.ops.push_back(std::move(op));
  Pump(id);
  return t;
}

Status TieredStore::Admit(const Block& b) const {
  if (shutting_down_) return Status::Aborted(Name(b) + ": the store is shutting down");
  if (queued_ops_ >= options_.max_queued_ops) {
    return Status::ResourceExhausted(Name(b) + ": more than " +
                                     std::to_string(options_.max_queued_ops) +
                                     " queued store operations");
  }
  if (b.io_lost) return nvme_status_.WithContext(Name(b));
  if (b.aside) {
    return Status::FailedPrecondition(Name(b) +
                                      ": set aside in host memory (the engine's states are "
                                      "offloaded); restore it first (RestoreAside)");
  }
  return Status::OK();
}

void TieredStore::Pump(BlockId id) {
  Advance(id);
  std::vector<BlockId> retry;
  std::vector<std::pair<BlockId, Tier>> started;  // write-behinds started by this Pump
  for (;;) {
    if (!write_behind_.empty()) {
      StartWriteBehind(&started);
      continue;
    }
    if (!space_freed_ || parked_.empty()) break;
    space_freed_ = false;
    retry.clear();
    retry.swap(parked_);
    for (BlockId p : retry) {
      blocks_[p]->parked = false;
      Advance(p);
    }
  }
  space_freed_ = false;
  NoteRoomWaits();
}

void TieredStore::NoteRoomWaits() {
  PerTier<bool> waiting{};
  for (BlockId p : parked_) {
    const Block& b = *blocks_[p];
    if (b.parked && !b.ops.empty()) waiting[b.parked_on] = true;
  }
  std::optional<std::chrono::steady_clock::time_point> now;
  for (Tier t : kAllTiers) {
    if (waiting[t] == room_waiting_[t]) continue;
    if (!now) now = std::chrono::steady_clock::now();
    if (waiting[t]) {
      room_since_[t] = *now;
    } else {
      stats_.room_wait_ns[t] += Ns(*now - room_since_[t]);
    }
    room_waiting_[t] = waiting[t];
  }
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
    Outcome o = Outcome::kFailed;
    switch (op.kind) {
      case OpKind::kFetch:
        o = op.overwrite ? MakeWritable(b, op.tier, &err) : MakeValid(b, op.tier, &err);
        break;
      case OpKind::kWriteBack:
        o = WriteBackStep(b, &err);
        break;
      case OpKind::kEvict:
        o = EvictStep(b, op.tier, &err);
        break;
    }
    if (o == Outcome::kIssued) return;
    if (o == Outcome::kReady && op.kind == OpKind::kFetch && op.pending_write > 0 &&
        b.leases() > 0) {
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
  if (status.ok() && op->kind == OpKind::kFetch) {
    Copy& c = b.copy[op->tier];
    c.read_leases += op->pending_read;
    c.write_leases += op->pending_write;
    c.last_use = ++lru_clock_;
  }
  if (!status.ok()) {
    ++stats_.errors;
    // No Acquire waits on it (a background prefetch): keep it for the next waiter.
    if (op->kind == OpKind::kFetch && op->pending_read + op->pending_write == 0) {
      b.failed_fetch = op->ticket;
    }
  }
  op->status = status;
  op->ticket->Complete(std::move(status));
  space_freed_ = true;  // an idle block's copies become evictable: parked blocks retry
  idle_cv_.notify_all();
}

void TieredStore::FailOps(Block& b, const Status& status) {
  while (!b.ops.empty()) Finish(b, status);
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

TieredStore::Outcome TieredStore::MakeWritable(Block& b, Tier tier, Status* err) {
  Copy& c = b.copy[tier];
  // A valid copy is leased as for kWrite; the lease waits for every other lease (Advance).
  if (IsValid(c.state) || tier == Tier::kNvme) return MakeValid(b, tier, err);
  // Nothing changes while leases are held: the write lease waits for them anyway (Advance
  // re-runs this step when they are released), and readers of a stale copy must not see it
  // change.
  if (b.leases() > 0) return Outcome::kReady;
  if (tier == b.spec.home) return Outcome::kReady;  // reserved, stale: overwritten in place
  if (budget_[tier] == 0) {
    *err = Status::InvalidArgument(Name(b) + ": tier " + std::string(TierName(tier)) +
                                   " is disabled (budget 0)");
    return Outcome::kFailed;
  }
  Outcome o = Reserve(b, tier, err);
  if (o != Outcome::kReady) return o;
  // Valid in name only: Finish grants the write lease in this same Advance, and a write-leased
  // block runs no operation, so nothing reads these bytes before the writer replaced them.
  c.state = Residency::kValid;
  c.unfilled = true;
  c.last_use = ++lru_clock_;
  return Outcome::kReady;
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

bool TieredStore::Droppable(const Block& b, Tier tier) const {
  if (tier == b.spec.home) return false;
  if (IsValid(b.copy[b.spec.home].state)) return true;
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
  IoJob& job = io_jobs_[b.id];  // every NVMe-homed block was registered before swap_ existed
  job.op = op;
  job.buffer = b.copy[Tier::kHost].ptr;
  job.length_bytes = b.alloc_bytes;
  std::lock_guard<std::mutex> l(io_mu_);
  io_queue_.push_back(b.id);  // sized for every block; a block has one hop in flight at most
  io_cv_.notify_one();
}

void TieredStore::OnHopDone(BlockId id, Tier from, Tier to, Status status) {
  Block& b = *blocks_[id];
  b.hop_in_flight = false;
  --running_hops_;
  space_freed_ = true;  // parked blocks counted on this hop: let them re-check
  if (from != Tier::kNvme && to != Tier::kNvme) {  // a device copy
    if (--copies_in_flight_ == 0) {
      stats_.copy_busy_ns += Ns(std::chrono::steady_clock::now() - copy_busy_since_);
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

void TieredStore::HandleIoEvent(IoEvent& e) {
  Block& b = *blocks_[e.block];
  const IoJob& job = io_jobs_[e.block];
  switch (e.kind) {
    case IoEvent::Kind::kDone: {
      if (e.status.ok()) stats_.io_bytes += job.length_bytes;
      const bool read = job.op == IoOp::kRead;
      OnHopDone(e.block, read ? Tier::kNvme : Tier::kHost, read ? Tier::kHost : Tier::kNvme,
                std::move(e.status));
      return;
    }
    case IoEvent::Kind::kReapFailed:
      // The IO may still complete (then OnHopDone runs as usual, with nobody waiting); its
      // waiters learn now that the IO path failed instead of hanging on it.
      FailOps(b, e.status.WithContext(Name(b)));
      return;
    case IoEvent::Kind::kLost:
      // Never completes: the hop stays "in flight" and its host buffer stays reserved (the
      // kernel may still write into it); every later operation on the block or the NVMe tier
      // fails with this error.
      b.io_lost = true;
      ++lost_hops_;
      if (nvme_status_.ok()) nvme_status_ = e.status;
      FailOps(b, e.status.WithContext(Name(b)));
      idle_cv_.notify_all();
      return;
  }
}

void TieredStore::ReleaseLease(Lease& lease) {
  std::lock_guard<std::mutex> l(mu_);
  Block& b = *blocks_[lease.block()];
  Copy& c = b.copy[lease.tier()];
  if (lease.access() != Access::kRead) {
    --c.write_leases;
  } else {
    --c.read_leases;
  }
  c.last_use = ++lru_clock_;
  if (lease.tier() != b.spec.home && c.state == Residency::kStale && c.leases() == 0) {
    FreeCopy(b, lease.tier());  // overwritten through another lease while we read it
  }
  if (c.unfilled && !lease.dirty()) {
    // An overwrite lease released without writing: the copy's bytes are undefined.
    c.unfilled = false;
    if (lease.tier() != b.spec.home) FreeCopy(b, lease.tier());
  }
  if (lease.dirty()) {
    c.unfilled = false;
    // The leased copy now holds the newest bytes: drop the other cached copies; the home is
    // stale unless it is the leased copy.
    for (Tier t : kAllTiers) {
      if (t == lease.tier()) continue;
      if (t == b.spec.home) {
        b.copy[t].state = Residency::kStale;
      } else if (b.copy[t].leases() == 0) {
        FreeCopy(b, t);
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
