// TieredStore::SetAside / RestoreAside (include/strata/store.h): device-homed blocks moved into
// host memory outside the tiers' budgets while the device is lent to other work, and back.
//
// Both run under mu_ with the device's copies waited for there (at most io_deadline), as
// Register's zero-fill does: they are called at rest (the engine has joined everything it
// started), so nothing else waits on the lock meanwhile.
#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include "core/store/store_internal.h"

namespace strata::store {

// Host memory holding the blocks one SetAside call set aside (freed when the last of them is
// restored), page-locked with the device when it accepted the registration.
struct TieredStore::AsideArena {
  AsideArena(const AsideArena&) = delete;
  AsideArena& operator=(const AsideArena&) = delete;
  AsideArena(Device* d, uint8_t* p, uint64_t n) : device(d), data(p), size(n) {}
  ~AsideArena() {
    if (registered) device->UnregisterHost(data).IgnoreError();
    std::free(data);
  }
  Device* device;
  uint8_t* data;
  uint64_t size;
  bool registered = false;
};

namespace {

constexpr uint64_t kArenaAlign = 4096;

// Waits for every copy queued in direction `dir` so far (at most `deadline`).
Status WaitCopies(Device* device, CopyDir dir, std::chrono::nanoseconds deadline) {
  auto ev = device->RecordEvent(dir);
  return ev.ok() ? (*ev)->Wait(deadline) : ev.status();
}

}  // namespace

Status TieredStore::SetAside(std::span<const BlockId> ids, bool pin) {
  std::lock_guard<std::mutex> l(mu_);
  uint64_t total = 0;
  std::vector<bool> seen(blocks_.size());
  for (BlockId id : ids) {
    if (id >= blocks_.size()) {
      return Status::InvalidArgument("SetAside: no block " + std::to_string(id));
    }
    const Block& b = *blocks_[id];
    const bool other_copy = b.copy[Tier::kHost].state != Residency::kAbsent ||
                            (b.spec.home != Tier::kNvme && b.copy[Tier::kNvme].reserved);
    const char* why = b.spec.home != Tier::kDevice                    ? "is not homed on the device"
                      : b.aside != nullptr                            ? "is set aside already"
                      : seen[id]                                      ? "is named twice"
                      : b.leases() > 0                                ? "is leased"
                      : !b.ops.empty() || b.hop_in_flight || b.parked ? "has operations queued"
                      : other_copy ? "has a copy on another tier (evict it first)"
                      : b.copy[Tier::kDevice].state != Residency::kValid
                          ? "has no valid device copy"
                          : nullptr;
    if (why != nullptr) return Status::FailedPrecondition("SetAside: " + Name(b) + " " + why);
    seen[id] = true;
    total += b.alloc_bytes;
  }
  if (total == 0) return Status::OK();
  const uint64_t size = (total + kArenaAlign - 1) / kArenaAlign * kArenaAlign;
  std::shared_ptr<AsideArena> arena;
  if (pin && kept_arena_ != nullptr && kept_arena_->size >= size) {
    arena = std::move(kept_arena_);  // page-locked already: no registration, no page faults
  } else {
    kept_arena_.reset();
    auto* data = static_cast<uint8_t*>(std::aligned_alloc(kArenaAlign, size));
    if (data == nullptr) {
      return Status::ResourceExhausted("SetAside: " + std::to_string(size) +
                                       " bytes of host memory for the blocks set aside");
    }
    arena = std::make_shared<AsideArena>(options_.device, data, size);
    if (pin) arena->registered = options_.device->RegisterHost(data, size).ok();
  }
  uint8_t* const data = arena->data;

  uint64_t off = 0;
  Status st;
  for (BlockId id : ids) {
    Block& b = *blocks_[id];
    st = options_.device->CopyAsync(CopyDir::kDeviceToHost, data + off, b.copy[Tier::kDevice].ptr,
                                    b.alloc_bytes, {});
    if (!st.ok()) break;
    off += b.alloc_bytes;
  }
  if (st.ok()) st = WaitCopies(options_.device, CopyDir::kDeviceToHost, options_.io_deadline);
  if (!st.ok()) {
    lost_arenas_.push_back(std::move(arena));  // a copy may still land in it
    return Status(st.code(),
                  "SetAside: copying the blocks to host memory: " + std::string(st.message()));
  }
  off = 0;
  for (BlockId id : ids) {
    Block& b = *blocks_[id];
    FreeCopy(b, Tier::kDevice);
    b.aside = arena;
    b.aside_offset = off;
    off += b.alloc_bytes;
    aside_bytes_ += b.alloc_bytes;
  }
  return Status::OK();
}

Status TieredStore::RestoreAside(std::span<const BlockId> ids) {
  std::lock_guard<std::mutex> l(mu_);
  std::vector<Block*> todo;
  std::vector<bool> seen(blocks_.size());
  for (BlockId id : ids) {
    if (id >= blocks_.size()) {
      return Status::InvalidArgument("RestoreAside: no block " + std::to_string(id));
    }
    if (blocks_[id]->aside != nullptr && !seen[id]) todo.push_back(blocks_[id].get());
    seen[id] = true;
  }
  // Room first: as many blocks as the device takes, in order.
  size_t n = 0;
  Status no_room;
  for (; n < todo.size(); ++n) {
    Block& b = *todo[n];
    Status refused;
    if (TryAllocate(b, Tier::kDevice, &refused)) continue;
    no_room = Status::ResourceExhausted(
        "RestoreAside: " + Name(b) + ": no room for " + std::to_string(b.alloc_bytes) +
        " bytes on tier hbm (" +
        (refused.ok() ? std::to_string(used_[Tier::kDevice]) + " of the budget's " +
                            std::to_string(budget_[Tier::kDevice]) + " bytes in use"
                      : "the device refused: " + std::string(refused.message())) +
        "); " + std::to_string(todo.size() - n) + " block(s) stay set aside");
    break;
  }
  Status st;
  for (size_t i = 0; i < n && st.ok(); ++i) {
    Block& b = *todo[i];
    st = options_.device->CopyAsync(CopyDir::kHostToDevice, b.copy[Tier::kDevice].ptr,
                                    b.aside->data + b.aside_offset, b.alloc_bytes, {});
  }
  if (st.ok() && n > 0) {
    st = WaitCopies(options_.device, CopyDir::kHostToDevice, options_.io_deadline);
  }
  if (!st.ok()) {
    for (size_t i = 0; i < n; ++i) {
      lost_arenas_.push_back(todo[i]->aside);  // a copy may still read it
      FreeCopy(*todo[i], Tier::kDevice);
    }
    return Status(st.code(),
                  "RestoreAside: copying the blocks to the device: " + std::string(st.message()));
  }
  std::vector<std::shared_ptr<AsideArena>> emptied;
  for (size_t i = 0; i < n; ++i) {
    Block& b = *todo[i];
    b.copy[Tier::kDevice].state = Residency::kValid;
    b.copy[Tier::kDevice].last_use = ++lru_clock_;
    if (std::find(emptied.begin(), emptied.end(), b.aside) == emptied.end()) {
      emptied.push_back(b.aside);
    }
    b.aside.reset();
    aside_bytes_ -= b.alloc_bytes;
  }
  // A page-locked arena no block uses any more is kept for the next SetAside (locking host
  // memory costs far more than copying it); the largest one, and only one.
  for (std::shared_ptr<AsideArena>& a : emptied) {
    if (a.use_count() == 1 && a->registered &&
        (kept_arena_ == nullptr || a->size > kept_arena_->size)) {
      kept_arena_ = std::move(a);
    }
  }
  return no_room;
}

uint64_t TieredStore::aside_kept_bytes() const {
  std::lock_guard<std::mutex> l(mu_);
  return kept_arena_ == nullptr ? 0 : kept_arena_->size;
}

uint64_t TieredStore::aside_bytes() const {
  std::lock_guard<std::mutex> l(mu_);
  return aside_bytes_;
}

}  // namespace strata::store
