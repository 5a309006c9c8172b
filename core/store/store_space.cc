// TieredStore space management: budgets, reservations and eviction. Everything here runs with
// mu_ held.
//
// A reservation that does not fit evicts clean, unleased, idle cached copies (least recently
// used first). When that is not enough it parks, unless nothing on the tier could ever free
// space (then ResourceExhausted). Dirty idle copies are the one kind of space that needs work
// to free: Reserve only records them in write_behind_, and Pump starts their evictions (write
// back, then drop) once the Advance that called Reserve has returned. Starting them right here
// would run another block's Advance, and retry parked blocks, in the middle of this one.
#include <algorithm>

#include "core/store/store_internal.h"

namespace strata::store {

bool TieredStore::TryAllocate(Block& b, Tier tier, Status* refused) {
  Copy& c = b.copy[tier];
  if (used_[tier] + b.alloc_bytes > budget_[tier]) return false;
  if (tier == Tier::kHost) {
    auto off = host_alloc_->Allocate(b.alloc_bytes);
    if (!off) return false;
    c.offset = *off;
    c.ptr = host_base_ + *off;
  } else if (tier == Tier::kDevice) {
    auto p = options_.device->Allocate(b.alloc_bytes);
    if (!p.ok()) {
      if (refused != nullptr) *refused = p.status();
      return false;
    }
    c.ptr = *p;
  }  // NVMe: only home copies, laid out by the swap space when the tier opens; budget only
  c.reserved = true;
  used_[tier] += b.alloc_bytes;
  stats_.peak_bytes[tier] = std::max(stats_.peak_bytes[tier], used_[tier]);
  return true;
}

namespace {

// The device's refusal of a block's room, as the error that fails its operation: a fault as it is
// (no eviction or wait can cure it), named by the block.
Status DeviceRefusal(const std::string& block, uint64_t bytes, const Status& refused) {
  return Status(refused.code(), block + ": the device refused " + std::to_string(bytes) +
                                    " bytes on tier hbm: " + std::string(refused.message()));
}

}  // namespace

TieredStore::Outcome TieredStore::Reserve(Block& b, Tier tier, Status* err) {
  if (b.copy[tier].reserved) return Outcome::kReady;
  Status refused;
  auto fault = [&] {
    if (refused.ok() || refused.IsResourceExhausted()) return false;
    *err = DeviceRefusal(Name(b), b.alloc_bytes, refused);
    return true;
  };
  if (TryAllocate(b, tier, &refused)) return Outcome::kReady;
  if (fault()) return Outcome::kFailed;
  // Evict unleased, droppable cached copies of blocks with no hop running, least recently used
  // first. A block whose operation is parked may lose a copy: its steps are re-derived from
  // residency, so it re-fetches; keeping such copies would let two parked blocks wait on each
  // other's space.
  std::vector<std::pair<uint64_t, BlockId>> victims;
  for (auto& bp : blocks_) {
    Block& v = *bp;
    const Copy& c = v.copy[tier];
    if (v.id == b.id || c.state != Residency::kValid || c.leases() || v.hop_in_flight) continue;
    if (Droppable(v, tier)) victims.emplace_back(c.last_use, v.id);
  }
  std::sort(victims.begin(), victims.end());
  for (auto& [use, vid] : victims) {
    FreeCopy(*blocks_[vid], tier);
    ++stats_.evictions;
    if (TryAllocate(b, tier, &refused)) return Outcome::kReady;
    if (fault()) return Outcome::kFailed;
  }
  std::vector<BlockId> dirty_idle;
  if (CanEverFree(tier, b.id, &dirty_idle)) {
    for (BlockId v : dirty_idle) write_behind_.emplace_back(v, tier);
    b.parked_on = tier;
    return Outcome::kParked;
  }
  *err = Status::ResourceExhausted(
      Name(b) + " needs " + std::to_string(b.alloc_bytes) + " bytes on tier " +
      std::string(TierName(tier)) + " (budget " + std::to_string(budget_[tier]) + ", in use " +
      std::to_string(used_[tier]) + "): nothing in flight, leased or dirty there can free it" +
      (refused.ok() ? std::string()
                    : "; the device itself refused it within the budget (memory held outside "
                      "strata's pool, such as the trainer's own allocations): " +
                          std::string(refused.message())));
  return Outcome::kFailed;
}

bool TieredStore::WriteBehindCandidate(const Block& v, Tier tier) const {
  const Copy& c = v.copy[tier];
  return tier != v.spec.home && c.reserved && c.state == Residency::kValid && c.leases() == 0 &&
         v.ops.empty() && !v.hop_in_flight && !Droppable(v, tier);
}

bool TieredStore::CanEverFree(Tier tier, BlockId except, std::vector<BlockId>* dirty_idle) const {
  bool can = false;
  for (const auto& bp : blocks_) {
    const Block& v = *bp;
    const Copy& c = v.copy[tier];
    if (v.id == except || tier == v.spec.home || !c.reserved) continue;
    if (c.leases() || c.state == Residency::kInFlight || !v.ops.empty() || v.hop_in_flight) {
      can = true;  // released, completed or evicted later; retried then
    } else if (WriteBehindCandidate(v, tier)) {
      dirty_idle->push_back(v.id);
      can = true;
    }
  }
  return can;
}

void TieredStore::StartWriteBehind(std::vector<std::pair<BlockId, Tier>>* started) {
  std::vector<std::pair<BlockId, Tier>> todo;
  todo.swap(write_behind_);
  for (const auto& entry : todo) {
    const auto [vid, tier] = entry;
    Block& v = *blocks_[vid];
    // Re-checked: an earlier entry (the same copy asked for twice) or another block's progress
    // may have changed it. A copy that is busy now frees space (or wakes the parked) by itself.
    if (!WriteBehindCandidate(v, tier) || !Admit(v).ok()) continue;
    if (std::find(started->begin(), started->end(), entry) != started->end()) continue;
    started->push_back(entry);
    auto op = std::make_shared<Op>();  // no waiter: the parked reservations retry on space freed
    op->kind = OpKind::kEvict;
    op->tier = tier;
    ++queued_ops_;
    v.ops.push_back(std::move(op));
    Advance(vid);
  }
}

void TieredStore::FreeCopy(Block& b, Tier tier) {
  Copy& c = b.copy[tier];
  if (!c.reserved) return;
  if (tier == Tier::kDevice) {
    options_.device->Free(c.ptr).IgnoreError();  // only fails for unknown pointers (a bug)
  } else if (tier == Tier::kHost) {
    host_alloc_->Free(c.offset, b.alloc_bytes);
  }
  used_[tier] -= b.alloc_bytes;
  c = Copy{};
  space_freed_ = true;
}

}  // namespace strata::store
